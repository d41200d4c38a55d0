// The GIL released around a blocking C++ call, in every binding: pybind11's gil_scoped_release,
// except at exit. A daemon thread that comes back while the interpreter finalizes is ended inside
// PyEval_RestoreThread (pthread_exit: a forced unwind, Python 3.11 to 3.13). From a noexcept
// destructor, as gil_scoped_release's is, that unwind is std::terminate, and the whole process
// aborts at its exit (a data-loading thread, say). This destructor lets the unwind through
// (pybind11's dispatcher rethrows it), and the thread ends as Python ends it.
#pragma once

#include <Python.h>

namespace tensortier {

class GilReleased {
 public:
  GilReleased() noexcept : state_(PyEval_SaveThread()) {}
  ~GilReleased() noexcept(false) { PyEval_RestoreThread(state_); }
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;

 private:
  PyThreadState* state_;
};

}  // namespace tensortier
