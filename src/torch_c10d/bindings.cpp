// torch._hpct_c10d: the PyTorch series' ProcessGroupGloo and ProcessGroupNCCL, built out of
// tree against one pinned torch wheel (hpct-build wheel torch=2.6.0), for Python.
//
// The c10d units of the patched tree are compiled into this module beside the patched Gloo,
// every symbol hidden, the two classes renamed by the build (-DProcessGroupGloo=
// HpctProcessGroupGloo, ...): torch's own copies live on in libtorch_cpu/libtorch_cuda, and
// pybind11 tells the two apart by their type names.  This file gives the renamed classes the
// Python surface torch's own bindings give the stock ones (torch/_C/_distributed_c10d.pyi of
// 2.6.0), plus what the series adds there: a Gloo device's listening port, the storeless
// options, abort()/_shutdown()/_aborted, the rootless NCCL options and the libnccl probe.
// torch/distributed/_hpct_out_of_tree.py puts the classes in torch._C._distributed_c10d.
//
// Every type these bindings take or return that is not one of the two classes (Store, Work,
// Backend, Backend.Options, ncclConfig_t, gloo's Device) is torch's own registration: this
// module shares torch's pybind11 internals (same pybind11 headers and ABI id, set by the build).

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Utils.hpp>
#include <torch/csrc/utils/pybind.h>

#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/NCCLRootless.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace py = pybind11;

namespace {

// A holder that drops its reference with the GIL released: destroying a process group joins
// its worker threads, which may be waiting for the GIL themselves.  It is one intrusive_ptr,
// as torch's own holder for Backend is, because pybind11 hands a holder of a base type to a
// derived type's instance as raw bytes.
template <typename T>
class GilFreeHolder {
 public:
  GilFreeHolder() = default;
  GilFreeHolder(const GilFreeHolder&) = default;
  GilFreeHolder(GilFreeHolder&&) noexcept = default;
  GilFreeHolder& operator=(const GilFreeHolder&) = default;
  GilFreeHolder& operator=(GilFreeHolder&&) noexcept = default;
  /* implicit */ GilFreeHolder(c10::intrusive_ptr<T> p) : ptr_(std::move(p)) {}
  // pybind11 builds a holder from the raw pointer a factory returned (pybind11 issue 2957):
  // that object is new, so the holder takes its first reference.
  explicit GilFreeHolder(T* p) : ptr_(c10::intrusive_ptr<T>::unsafe_steal_from_new(p)) {}
  ~GilFreeHolder() {
    if (!ptr_) {
      return;
    }
    if (PyGILState_Check()) {
      py::gil_scoped_release unlocked;
      ptr_.reset();
    } else {
      ptr_.reset();
    }
  }
  T* get() const noexcept { return ptr_.get(); }
  T& operator*() const noexcept { return *ptr_; }
  T* operator->() const noexcept { return ptr_.get(); }
  void reset() noexcept { ptr_.reset(); }
  explicit operator bool() const noexcept { return static_cast<bool>(ptr_); }

 private:
  c10::intrusive_ptr<T> ptr_;
};

}  // namespace

PYBIND11_DECLARE_HOLDER_TYPE(T, GilFreeHolder<T>, true);

namespace {

template <typename T, typename... Bases>
using backend_class = py::class_<T, Bases..., GilFreeHolder<T>>;
template <typename T, typename... Bases>
using options_class = py::class_<T, Bases..., c10::intrusive_ptr<T>>;

using GlooPG = ::c10d::ProcessGroupGloo;   // HpctProcessGroupGloo, by the build's rename

// The stock constructor with a timeout: one device per interface named in GLOO_SOCKET_IFNAME,
// else the device the host name resolves to; two threads per device.
c10::intrusive_ptr<GlooPG> glooWithTimeout(const c10::intrusive_ptr<::c10d::Store>& store, int rank,
                                           int size, std::chrono::milliseconds timeout) {
  auto options = GlooPG::Options::create();
  const char* ifnames = std::getenv("GLOO_SOCKET_IFNAME");
  if (ifnames != nullptr && std::strlen(ifnames) > 1) {
    for (const auto& iface : ::c10d::split(',', ifnames)) {
      options->devices.push_back(GlooPG::createDeviceForInterface(iface));
    }
  } else {
    options->devices.push_back(GlooPG::createDefaultDevice());
  }
  options->timeout = timeout;
  options->threads = static_cast<int>(options->devices.size() * 2);
  return c10::make_intrusive<GlooPG>(store, rank, size, options);
}

void bindGloo(py::module_& m) {
  backend_class<GlooPG, ::c10d::Backend> pg(m, "ProcessGroupGloo");

  // torch registered gloo's Device already; this module's copy of Gloo has a Device type of its
  // own name, which must stay private to this module.
  py::class_<::gloo::transport::Device, std::shared_ptr<::gloo::transport::Device>>(pg, "Device",
                                                                                  py::module_local());

  options_class<GlooPG::Options, ::c10d::Backend::Options>(pg, "_Options")
      .def(py::init<>())
      .def_readwrite("_devices", &GlooPG::Options::devices)
      .def_readwrite("_threads", &GlooPG::Options::threads)
      .def_readwrite("_storeless_hosts", &GlooPG::Options::storeless_hosts)
      .def_readwrite("_storeless_ports", &GlooPG::Options::storeless_ports)
      .def_readwrite("_generation", &GlooPG::Options::generation)
      .def_readwrite("_connect_timeout", &GlooPG::Options::connect_timeout);

  pg.def_static(
        "create_device",
        [](const std::string& hostname, const std::string& interface,
           int port) -> std::shared_ptr<::gloo::transport::Device> {
          if (!hostname.empty()) {
            return GlooPG::createDeviceForHostname(hostname, port);
          }
          if (!interface.empty()) {
            return GlooPG::createDeviceForInterface(interface, port);
          }
          throw std::invalid_argument("Specify either `hostname` or `interface` argument.");
        },
        py::arg("hostname") = "", py::arg("interface") = "", py::arg("port") = 0)
      .def_static("create_default_device", &GlooPG::createDefaultDevice);

  pg.def(py::init<const c10::intrusive_ptr<::c10d::Store>&, int, int, c10::intrusive_ptr<GlooPG::Options>>(),
         py::call_guard<py::gil_scoped_release>(), py::arg("store"), py::arg("rank"), py::arg("size"),
         py::arg("options"), "Create a new ProcessGroupGloo instance.")
      .def(py::init(&glooWithTimeout), py::arg("store"), py::arg("rank"), py::arg("size"),
           py::arg("timeout") = ::kProcessGroupDefaultTimeout, py::call_guard<py::gil_scoped_release>(),
           "Create a new ProcessGroupGloo instance.")
      .def(
          "_set_default_timeout",
          [](const c10::intrusive_ptr<GlooPG>& self, std::chrono::milliseconds timeout) {
            self->getOptions()->timeout = timeout;
          },
          py::arg("timeout"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("options", &GlooPG::getOptions,
                             "Return the options used to create this ProcessGroupGloo instance.")
      .def("abort", &GlooPG::abort, py::arg("reason") = "ProcessGroupGloo.abort() called",
           py::call_guard<py::gil_scoped_release>(),
           "Abort this group: pending and later operations fail, the workers stop within a bound "
           "and the listening port is released. Idempotent.")
      .def("_shutdown", &GlooPG::shutdown, py::call_guard<py::gil_scoped_release>(),
           "Shut this group down (abort for destroy_process_group).")
      .def_property_readonly("_aborted", &GlooPG::isAborted);
}

#ifdef USE_C10D_NCCL
using NcclPG = ::c10d::ProcessGroupNCCL;   // HpctProcessGroupNCCL, by the build's rename

// The watchdog asks whether the GIL can be taken when it reports a hang; torch registers its
// checker with its own copy of ProcessGroupNCCL, so this module registers one with its copy.
bool gilIsFree() {
  if (!Py_IsInitialized()) {
    return false;
  }
  py::gil_scoped_acquire gil;
  return true;
}

void bindNccl(py::module_& m) {
  ::c10d::get_gil_checker() = &gilIsFree;
  backend_class<NcclPG, ::c10d::Backend> pg(m, "ProcessGroupNCCL");
  pg.def(py::init<const c10::intrusive_ptr<::c10d::Store>&, int, int, c10::intrusive_ptr<NcclPG::Options>>(),
         py::call_guard<py::gil_scoped_release>(), py::arg("store"), py::arg("rank"), py::arg("size"),
         py::arg("options"), "Create a new ProcessGroupNCCL instance.")
      .def(py::init([](const c10::intrusive_ptr<::c10d::Store>& store, int rank, int size,
                       const std::chrono::milliseconds& timeout) {
             auto options = NcclPG::Options::create();
             options->is_high_priority_stream = false;
             options->timeout = timeout;
             return c10::make_intrusive<NcclPG>(store, rank, size, options);
           }),
           py::arg("store"), py::arg("rank"), py::arg("size"),
           py::arg("timeout") = ::c10d::kProcessGroupNCCLDefaultTimeout, py::call_guard<py::gil_scoped_release>(),
           "Create a new ProcessGroupNCCL instance.")
      .def(
          "_shutdown", [](const c10::intrusive_ptr<NcclPG>& self) { self->shutdown(); },
          py::call_guard<py::gil_scoped_release>())
      .def("_group_start", &NcclPG::groupStart)
      .def("_group_end", &NcclPG::groupEnd)
      .def("comm_split_count", &NcclPG::getCommSplitCounter)
      .def(
          "_set_default_timeout",
          [](const c10::intrusive_ptr<NcclPG>& self, std::chrono::milliseconds timeout) {
            self->getOptions()->timeout = timeout;
          },
          py::arg("timeout"), py::call_guard<py::gil_scoped_release>())
      .def(
          "_add_ephemeral_timeout",
          [](const c10::intrusive_ptr<NcclPG>& self, const std::chrono::milliseconds& timeout) {
            self->addEphemeralTimeout(timeout);
          },
          py::arg("timeout"))
      .def(
          "_verify_work_timeout",
          [](const c10::intrusive_ptr<NcclPG>& self, const c10::intrusive_ptr<::c10d::Work>& work,
             const std::chrono::milliseconds& timeout) { return self->verifyWorkTimeoutForTest(work, timeout); },
          py::arg("work"), py::arg("timeout"))
      .def_property_readonly("options", &NcclPG::getOptions,
                             "Return the options used to create this ProcessGroupNCCL instance.")
      .def_property_readonly("uid", &NcclPG::getUid, "Return the uid.")
      .def_property("bound_device_id", &NcclPG::getBoundDeviceId, &NcclPG::setBoundDeviceId,
                    "Return the bound device id.")
      .def("perform_nocolor_split", &NcclPG::performNocolorSplit)
      .def("register_mem_pool", &NcclPG::registerMemPool)
      .def("deregister_mem_pool", &NcclPG::deregisterMemPool)
      .def("abort", &NcclPG::abort, py::call_guard<py::gil_scoped_release>(), "Abort the process group.")
      .def("_is_initialized", &NcclPG::isInitialized, py::call_guard<py::gil_scoped_release>());

  auto options = options_class<NcclPG::Options, ::c10d::Backend::Options>(
      pg, "Options", "ProcessGroup options for the NCCL backend (see torch's ProcessGroupNCCL.Options).");
  options.def(py::init<bool>(), py::arg("is_high_priority_stream") = false)
#ifdef NCCL_HAS_COMM_CTA_CGA
      .def_readwrite("config", &NcclPG::Options::config)
#endif
      .def_readwrite("is_high_priority_stream", &NcclPG::Options::is_high_priority_stream)
      .def_readwrite("split_from", &NcclPG::Options::split_from)
      .def_readwrite("split_color", &NcclPG::Options::split_color)
      .def_readwrite("global_ranks_in_group", &NcclPG::Options::global_ranks_in_group)
      .def_readwrite("group_name", &NcclPG::Options::group_name)
      .def_readwrite("_rootless_listen_addr", &NcclPG::Options::rootless_listen_addr)
      .def_readwrite("_rootless_next_addr", &NcclPG::Options::rootless_next_addr)
      .def_readwrite("_rootless_job_key", &NcclPG::Options::rootless_job_key)
      .def_readwrite("_rootless_generation", &NcclPG::Options::rootless_generation)
      .def_readwrite("_rootless_group_index", &NcclPG::Options::rootless_group_index)
      .def_readwrite("_rootless_connect_timeout", &NcclPG::Options::rootless_connect_timeout)
      .def_readwrite("_rootless_retry_delay_ms", &NcclPG::Options::rootless_retry_delay_ms);

  // (library path, problem, fix) of the libnccl this process calls; problem empty when it has
  // ncclCommInitRankRootless.  distributed_c10d asks before it forms a rootless NCCL group.
  m.def("_hpct_nccl_rootless_probe", []() {
    const auto& p = ::c10d::hpct_rootless::probe();
    return py::make_tuple(p.library, p.problem, p.fix);
  });
}
#endif

}  // namespace

PYBIND11_MODULE(_hpct_c10d, m) {
  m.doc() = "hpct's patched ProcessGroupGloo/ProcessGroupNCCL, built out of tree (torch/distributed/_hpct_out_of_tree.py)";
  // Torch's registrations come first: the base types (Backend, Backend.Options, Store, Work)
  // are found in the internals this module shares with torch.
  py::module_::import("torch._C._distributed_c10d");
  bindGloo(m);
#ifdef USE_C10D_NCCL
  bindNccl(m);
  m.attr("has_nccl") = true;
#else
  m.attr("has_nccl") = false;
#endif
  m.attr("pybind11_internals_id") = PYBIND11_INTERNALS_ID;
}
