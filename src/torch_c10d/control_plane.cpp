// The control plane's registry, as this module's compiled-in FlightRecorder sees it.
//
// FlightRecorder.cpp registers its trace dumps with torch's control plane when the library
// loads, under the names torch's own ProcessGroupNCCL registered already
// ("dump_nccl_trace_pickle", "dump_nccl_trace_json"): a second registration of a name throws,
// and a throw during dlopen ends the process.  This definition of registerHandler is local to
// the module (-Bsymbolic binds FlightRecorder.cpp's calls to it) and registers each handler with
// torch's registry under the name with "hpct_" in front, so the worker server of torch serves
// the recorder of hpct's ProcessGroupNCCL beside torch's own.
#include <dlfcn.h>

#include <stdexcept>
#include <string>

#include <torch/csrc/distributed/c10d/control_plane/Handlers.hpp>

namespace c10d::control_plane {

namespace {
// torch's registerHandler, by its mangled name: this module's own shadows it at link time.
#if _GLIBCXX_USE_CXX11_ABI
constexpr const char* kTorchRegisterHandler =
    "_ZN4c10d13control_plane15registerHandlerERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE"
    "St8functionIFvRKNS0_7RequestERNS0_8ResponseEEE";
#else
constexpr const char* kTorchRegisterHandler =
    "_ZN4c10d13control_plane15registerHandlerERKSsSt8functionIFvRKNS0_7RequestERNS0_8ResponseEEE";
#endif
constexpr const char* kPrefix = "hpct_";
}  // namespace

void registerHandler(const std::string& name, HandlerFunc f) {
  using Register = void (*)(const std::string&, HandlerFunc);
  static auto torchs = reinterpret_cast<Register>(dlsym(RTLD_DEFAULT, kTorchRegisterHandler));
  if (torchs == nullptr) {
    // A torch without a control plane: the handler is simply not served.
    return;
  }
  torchs(kPrefix + name, std::move(f));
}

}  // namespace c10d::control_plane
