#pragma once
#include <pybind11/pybind11.h>

namespace hpct {
// info.cpp: build identity and the symbol-isolation probe.
void bind_info(pybind11::module_& m);
// context.cpp: storeless contexts, collectives, abort.
void bind_context(pybind11::module_& m);
}  // namespace hpct
