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

// Called before a thread takes the GIL back: while the interpreter finalizes, any thread but its
// main one waits here for the process to exit around it, rather than be ended by a forced unwind
// that a noexcept frame on its way (a destructor) turns into std::terminate. Also for callbacks
// that take the GIL with py::gil_scoped_acquire on a thread that released it (torch's own
// Gloo thread aborts a job's exit this way when a collective's work is released late).
inline void WaitHereIfFinalizing() noexcept {
#if PY_VERSION_HEX >= 0x030D0000
  const bool finalizing = Py_IsFinalizing() != 0;
#else
  const bool finalizing = _Py_IsFinalizing() != 0;
#endif
  if (finalizing && PyThread_get_thread_ident() != main_thread_ident.load()) {
    for (;;) ::pause();
  }
}

class GilReleased {
 public:
  GilReleased() noexcept : state_(PyEval_SaveThread()) {}
  ~GilReleased() noexcept(false) {
    WaitHereIfFinalizing();
    PyEval_RestoreThread(state_);
  }
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;

 private:
  PyThreadState* state_;
};

}  // namespace tensortier
