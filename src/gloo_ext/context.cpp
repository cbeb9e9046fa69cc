// Placeholder until the storeless-context bindings land (issue 3).
#include "bindings.h"

namespace hpct {
void bind_context(pybind11::module_& m) { (void)m; }
}  // namespace hpct
