#pragma once
#include <pybind11/pybind11.h>

namespace hpct {
// info.cpp: build identity and the symbol-isolation probe.
void bind_info(pybind11::module_& m);
// context.cpp: storeless contexts, collectives, abort.
void bind_context(pybind11::module_& m);
// launch.cpp: the NCCL engine's native launch, abort flag and completer.
void bind_launch(pybind11::module_& m);
}  // namespace hpct
