// The GIL released around a blocking C++ call, in every binding: pybind11's gil_scoped_release,
// except at exit. A daemon thread that comes back while the interpreter finalizes is ended inside
// PyEval_RestoreThread (pthread_exit: a forced unwind, Python 3.11 to 3.13). From a noexcept
// destructor, as gil_scoped_release's is, that unwind is std::terminate, and the whole process
// aborts at its exit (a data-loading thread, say); through the bindings' error handlers, it would
// run them without the GIL. Such a thread waits here instead, as Python 3.14 makes it wait, and
// the process exits around it; the main thread, which finalizes, takes the GIL back as always.
// Where finalizing begins between the check and the re-take, the unwind is let through
// (pybind11's dispatcher rethrows it) and the thread ends as Python ends it.
#pragma once

#include <Python.h>
#include <unistd.h>

#include <atomic>

namespace tensortier {

// The interpreter's main thread (PyThread_get_thread_ident), which finalizes it: set when the
// module is imported (RememberMainThread).
inline std::atomic<unsigned long> main_thread_ident{0};

class GilReleased {
 public:
  GilReleased() noexcept : state_(PyEval_SaveThread()) {}
  ~GilReleased() noexcept(false) {
    if (Finalizing() && PyThread_get_thread_ident() != main_thread_ident.load()) {
      for (;;) ::pause();
    }
    PyEval_RestoreThread(state_);
  }
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;

 private:
  static bool Finalizing() noexcept {
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing() != 0;
#else
    return _Py_IsFinalizing() != 0;
#endif
  }

  PyThreadState* state_;
};

}  // namespace tensortier
