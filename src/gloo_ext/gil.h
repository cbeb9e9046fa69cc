// Running code without the GIL, shared by the module's files.
#pragma once
#include <Python.h>

#include <cxxabi.h>

#include <exception>

namespace hpct {

// Run `body` without the GIL.  The GIL is taken back in a plain call, not in
// a destructor (py::gil_scoped_release): when the interpreter finalizes while
// a daemon thread is in here, taking the GIL back ends that thread by
// unwinding its stack, and an unwind through a destructor (noexcept) is
// std::terminate: the whole process dies at exit.  The same end can come from inside `body`, when
// it calls back into Python (the test doubles' ctypes callbacks): that unwind is let through, for a
// catch that swallowed it would be std::terminate too.
template <typename F>
void without_gil(F&& body) {
  PyThreadState* saved = PyEval_SaveThread();
  std::exception_ptr failure;
  try {
    body();
  } catch (abi::__forced_unwind&) {
    throw;
  } catch (...) {
    failure = std::current_exception();
  }
  PyEval_RestoreThread(saved);
  if (failure) {
    std::rethrow_exception(failure);
  }
}

}  // namespace hpct
