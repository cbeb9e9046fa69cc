// Entry point of hpct._gloo.  Each binding file contributes one registration
// function so that files stay independent of each other.
#include <pybind11/pybind11.h>

#include "bindings.h"

PYBIND11_MODULE(_gloo, m) {
  m.doc() = "hpct's patched Gloo (symbols local to this module)";
  hpct::bind_info(m);
  hpct::bind_context(m);
  hpct::bind_launch(m);
}
