// Build identity of the extension, and a probe that shows which Gloo the
// module's own code calls into.
#include <dlfcn.h>

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include <pybind11/stl.h>

#include "bindings.h"
#include "gloo/config.h"
#include "gloo/transport/tcp/device.h"

namespace hpct {
namespace {

// The address of gloo::tcp::CreateDevice as the module resolved it at link time.
std::uintptr_t own_create_device() {
  return reinterpret_cast<std::uintptr_t>(&gloo::transport::tcp::CreateDevice);
}

// The same symbol as the dynamic linker's global scope resolves it (libtorch's
// copy when torch is loaded), or 0 when no loaded object exports it.
std::uintptr_t global_create_device() {
  void* sym = dlsym(RTLD_DEFAULT, "_ZN4gloo9transport3tcp12CreateDeviceERKNS1_4attrE");
  return reinterpret_cast<std::uintptr_t>(sym);
}

// Which loaded object holds an address (dladdr), for error messages and tests.
std::string object_of(std::uintptr_t addr) {
  Dl_info info{};
  if (addr == 0 || dladdr(reinterpret_cast<void*>(addr), &info) == 0 || info.dli_fname == nullptr) {
    return "";
  }
  return info.dli_fname;
}

}  // namespace

void bind_info(pybind11::module_& m) {
  m.def("series_id", [] { return std::string(HPCT_GLOO_SERIES_ID); },
        "Identity (sha256 prefix) of the Gloo patch series compiled into this module.");
  m.def("gloo_series", [] {
    std::vector<std::string> names;
    std::istringstream in(HPCT_GLOO_PATCHES);
    for (std::string name; std::getline(in, name, ',');) {
      if (!name.empty()) names.push_back(name);
    }
    return names;
  }, "The patch files of the series, in the order they were applied.");
  m.def("gloo_version", [] {
    std::ostringstream out;
    out << GLOO_VERSION_MAJOR << "." << GLOO_VERSION_MINOR << "." << GLOO_VERSION_PATCH;
    return out.str();
  });
  m.def("own_create_device", &own_create_device);
  m.def("global_create_device", &global_create_device);
  m.def("object_of", &object_of);
}

}  // namespace hpct
