// hpct._gloo.Launcher, AbortFlag, Completer: the NCCL engine's per-op host path in one native call.
//
// The module links neither torch nor CUDA nor NCCL: every CUDA driver and NCCL function it calls
// comes as an address resolved once by the engine (ctypes on the real libraries, callbacks of the
// simulated ones in the nccl_sim tier), so the same code runs on a GPU and in CI.
//
// Launcher.launch runs, with the GIL released throughout: the capture check of the caller's stream,
// the engine stream following it through a pooled event, the NCCL group (start, the calls, end) and
// the op's end events; it returns one integer (the LAUNCH_* bits below).  The abort flag is the
// comm's (AbortFlag, raised beside NCCL's own flag by the engine's abort): raised before the group,
// nothing is called; raised while NCCL held the group, the result says so.  Every call the group
// made is answered by an end event whatever NCCL said, so the op keeps its tensors until whatever
// was launched has ended.  The engine holds the comm's lock around the call (hpct/distributed/nccl/comm.py).
//
// Completer: the thread that settles the futures DDP asks for once their kernels have ended.  The
// launching thread queues (work, event, sequence) without any Python lock; the completer's own
// Python thread waits here, without the GIL, for the newest queued op's event and hands the whole
// batch back to Python in one call.
#include <pybind11/pybind11.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "gil.h"

namespace py = pybind11;

namespace hpct {
namespace {

// ---- what launch() returns ------------------------------------------------------------------
// bits 0-7: NCCL's answer (the first op's error, else ncclGroupEnd's); bits 16-31: a CUDA driver
// error; bits 32-35: the step it came from.
constexpr uint64_t kResultMask = 0xff;
constexpr uint64_t kRefused = 1u << 8;       // an op's own call answered ncclInvalidArgument
constexpr uint64_t kCaptured = 1u << 9;      // the caller's stream is being captured
constexpr uint64_t kFlagBefore = 1u << 10;   // the abort flag was up before the group: nothing called
constexpr uint64_t kFlagDuring = 1u << 11;   // the flag went up while NCCL had the group
constexpr uint64_t kRecorded = 1u << 12;     // every end event was recorded after NCCL answered
constexpr int kCudaShift = 16;
constexpr int kStepShift = 32;
enum Step : uint64_t { kStepNone = 0, kStepCapture = 1, kStepFollowRecord = 2, kStepFollowWait = 3,
                       kStepEndRecord = 4 };
constexpr int kNcclInvalidArgument = 4;      // ncclResult_t, part of NCCL's ABI
constexpr size_t kMaxEndEvents = 4096;

// ---- the NCCL calls an op is made of --------------------------------------------------------
// Each call comes from Python as (kind, function address, arguments...), comm and stream appended.
enum Kind : int { kColl = 0, kRooted = 1, kGather = 2, kP2P = 3 };
using CollFn = int (*)(const void*, void*, size_t, int, int, void*, void*);        // all_reduce, broadcast, reduce_scatter
using RootedFn = int (*)(const void*, void*, size_t, int, int, int, void*, void*); // reduce
using GatherFn = int (*)(const void*, void*, size_t, int, void*, void*);           // all_gather
using P2PFn = int (*)(void*, size_t, int, int, void*, void*);                     // send, recv
constexpr int kArgs[] = {5, 6, 4, 4};

struct Call {
  int kind;
  uintptr_t fn;
  uint64_t a[6];
};

inline void* P(uint64_t v) { return reinterpret_cast<void*>(static_cast<uintptr_t>(v)); }
inline int I(uint64_t v) { return static_cast<int>(static_cast<int64_t>(v)); }

int invoke(const Call& c, void* comm, void* stream) {
  const uint64_t* a = c.a;
  switch (c.kind) {
    case kColl:
      return reinterpret_cast<CollFn>(c.fn)(P(a[0]), P(a[1]), a[2], I(a[3]), I(a[4]), comm, stream);
    case kRooted:
      return reinterpret_cast<RootedFn>(c.fn)(P(a[0]), P(a[1]), a[2], I(a[3]), I(a[4]), I(a[5]), comm, stream);
    case kGather:
      return reinterpret_cast<GatherFn>(c.fn)(P(a[0]), P(a[1]), a[2], I(a[3]), comm, stream);
    default:
      return reinterpret_cast<P2PFn>(c.fn)(P(a[0]), a[1], I(a[2]), I(a[3]), comm, stream);
  }
}

uint64_t as_u64(PyObject* o, const char* what) {
  uint64_t v = PyLong_AsUnsignedLongLongMask(o);
  if (v == static_cast<uint64_t>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    throw py::type_error(std::string("hpct launch: ") + what + " must be an int");
  }
  return v;
}

// calls: a list of tuples (kind, address, args...), checked whole before anything runs.
void parse_calls(PyObject* calls, std::vector<Call>& out) {
  if (!PyList_Check(calls)) {
    throw py::type_error("hpct launch: calls must be a list of (kind, address, args...) tuples");
  }
  Py_ssize_t n = PyList_GET_SIZE(calls);
  out.resize(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* t = PyList_GET_ITEM(calls, i);
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) < 2) {
      throw py::type_error("hpct launch: each call must be a (kind, address, args...) tuple");
    }
    Call& c = out[static_cast<size_t>(i)];
    uint64_t kind = as_u64(PyTuple_GET_ITEM(t, 0), "a call's kind");
    if (kind > kP2P) {
      throw py::value_error("hpct launch: unknown call kind " + std::to_string(kind));
    }
    c.kind = static_cast<int>(kind);
    if (PyTuple_GET_SIZE(t) != 2 + kArgs[kind]) {
      throw py::value_error("hpct launch: a call of kind " + std::to_string(kind) + " takes " +
                            std::to_string(kArgs[kind]) + " arguments, got " +
                            std::to_string(PyTuple_GET_SIZE(t) - 2));
    }
    c.fn = static_cast<uintptr_t>(as_u64(PyTuple_GET_ITEM(t, 1), "a call's function address"));
    if (c.fn == 0) {
      throw py::value_error("hpct launch: a call's function address is 0");
    }
    for (int k = 0; k < kArgs[kind]; ++k) {
      c.a[k] = as_u64(PyTuple_GET_ITEM(t, 2 + k), "a call's argument");
    }
  }
}

// end: one event (an int) or a tuple of events, one per Work of the launch.
void parse_events(PyObject* end, std::vector<uint64_t>& out) {
  out.clear();
  if (PyTuple_Check(end)) {
    Py_ssize_t n = PyTuple_GET_SIZE(end);
    if (n < 1 || static_cast<size_t>(n) > kMaxEndEvents) {
      throw py::value_error("hpct launch: between 1 and 4096 end events");
    }
    for (Py_ssize_t i = 0; i < n; ++i) {
      out.push_back(as_u64(PyTuple_GET_ITEM(end, i), "an end event"));
    }
  } else {
    out.push_back(as_u64(end, "the end event"));
  }
}

uint64_t address(const py::tuple& t, size_t i, const char* name) {
  uint64_t v = t[i].cast<uint64_t>();
  if (v == 0) {
    throw py::value_error(std::string("hpct Launcher: the address of ") + name + " is 0");
  }
  return v;
}

// ---- the comm's abort flag ------------------------------------------------------------------
class AbortFlag {
 public:
  void raise_flag() { up_.store(true, std::memory_order_release); }
  bool raised() const { return up_.load(std::memory_order_acquire); }

 private:
  std::atomic<bool> up_{false};
};

// ---- the launch -----------------------------------------------------------------------------
class Launcher {
 public:
  using RecordFn = int (*)(void*, void*);             // cuEventRecord(event, stream)
  using WaitFn = int (*)(void*, void*, unsigned);     // cuStreamWaitEvent(stream, event, flags)
  using CapturingFn = int (*)(void*, int*);           // cuStreamIsCapturing(stream, &status)
  using GroupFn = int (*)();                          // ncclGroupStart, ncclGroupEnd

  // cuda: (cuEventRecord, cuStreamWaitEvent, cuStreamIsCapturing); nccl: (ncclGroupStart, ncclGroupEnd)
  Launcher(const py::tuple& cuda, const py::tuple& nccl) {
    if (cuda.size() != 3 || nccl.size() != 2) {
      throw py::value_error("hpct Launcher: 3 CUDA addresses (record, wait, capturing) and 2 NCCL "
                            "addresses (group start, group end)");
    }
    record_ = reinterpret_cast<RecordFn>(address(cuda, 0, "cuEventRecord"));
    wait_ = reinterpret_cast<WaitFn>(address(cuda, 1, "cuStreamWaitEvent"));
    capturing_ = reinterpret_cast<CapturingFn>(address(cuda, 2, "cuStreamIsCapturing"));
    start_ = reinterpret_cast<GroupFn>(address(nccl, 0, "ncclGroupStart"));
    end_ = reinterpret_cast<GroupFn>(address(nccl, 1, "ncclGroupEnd"));
  }

  // The engine stream follows the caller's: capture check, record on the caller's, wait on ours.
  uint64_t follow_nogil(uint64_t caller, uint64_t stream, uint64_t ev) const {
    int status = 0;
    int rc = capturing_(P(caller), &status);
    if (rc) {
      return cuda_error(rc, kStepCapture);
    }
    uint64_t out = status ? kCaptured : 0;
    if ((rc = record_(P(ev), P(caller)))) {
      return out | cuda_error(rc, kStepFollowRecord);
    }
    if ((rc = wait_(P(stream), P(ev), 0))) {
      return out | cuda_error(rc, kStepFollowWait);
    }
    return out;
  }

  uint64_t follow(uint64_t caller, uint64_t stream, uint64_t ev) const {
    uint64_t out = 0;
    without_gil([&] { out = follow_nogil(caller, stream, ev); });
    return out;
  }

  // follow_ev 0: the works followed the caller's stream when they were issued (deferred ops).
  uint64_t launch(const AbortFlag& flag, uint64_t comm, uint64_t caller, uint64_t stream, uint64_t follow_ev,
                  py::handle end, py::handle calls) const {
    thread_local std::vector<Call> parsed;
    thread_local std::vector<uint64_t> events;
    parse_calls(calls.ptr(), parsed);
    parse_events(end.ptr(), events);
    uint64_t out = 0;
    without_gil([&] { out = launch_nogil(flag, P(comm), caller, stream, follow_ev, parsed, events); });
    return out;
  }

  // An end event recorded again, after host-enqueued work (copies out of staging buffers) or once a
  // non-blocking comm's group was taken: the event then stands for everything before it.
  int record(uint64_t ev, uint64_t stream) const {
    int rc = 0;
    without_gil([&] { rc = record_(P(ev), P(stream)); });
    return rc;
  }

  int stream_wait(uint64_t stream, uint64_t ev) const {
    int rc = 0;
    without_gil([&] { rc = wait_(P(stream), P(ev), 0); });
    return rc;
  }

 private:
  static uint64_t cuda_error(int rc, Step step) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(rc) & 0xffff) << kCudaShift) |
           (static_cast<uint64_t>(step) << kStepShift);
  }

  uint64_t launch_nogil(const AbortFlag& flag, void* comm, uint64_t caller, uint64_t stream, uint64_t follow_ev,
                        const std::vector<Call>& calls, const std::vector<uint64_t>& events) const {
    uint64_t out = 0;
    if (follow_ev) {
      out = follow_nogil(caller, stream, follow_ev);
      if (out >> kCudaShift) {
        return out;                      // nothing reached NCCL
      }
    }
    if (flag.raised()) {
      return out | kFlagBefore;
    }
    int first = start_();
    bool refused = false;
    int end = first;
    if (first == 0) {
      for (const Call& c : calls) {
        int rc = invoke(c, comm, P(stream));
        if (rc && !first) {
          first = rc;
          refused = rc == kNcclInvalidArgument;
        }
      }
      end = end_();                      // the group is ended even after an op refused
    }
    int result = first ? first : end;
    out |= static_cast<uint64_t>(static_cast<uint32_t>(result)) & kResultMask;
    if (refused) {
      out |= kRefused;
    }
    if (flag.raised()) {
      out |= kFlagDuring;
    }
    for (uint64_t ev : events) {
      if (int rc = record_(P(ev), P(stream))) {
        return out | cuda_error(rc, kStepEndRecord);
      }
    }
    return out | kRecorded;
  }

  RecordFn record_;
  WaitFn wait_;
  CapturingFn capturing_;
  GroupFn start_;
  GroupFn end_;
};

// ---- the completer --------------------------------------------------------------------------
class Completer {
 public:
  using SyncFn = int (*)(void*);         // cuEventSynchronize(event)

  explicit Completer(uint64_t sync) : sync_(reinterpret_cast<SyncFn>(static_cast<uintptr_t>(sync))) {
    if (sync == 0) {
      throw py::value_error("hpct Completer: the address of cuEventSynchronize is 0");
    }
  }

  // With the GIL: the queue holds a reference to the work until the batch is handed back.
  void add(py::handle work, uint64_t ev, uint64_t seq) {
    Py_INCREF(work.ptr());
    {
      std::lock_guard<std::mutex> lk(mu_);
      queue_.push_back(Item{work.ptr(), ev, seq});
    }
    cv_.notify_one();
  }

  // On the completer's Python thread: until stop(), wait for work, then for the event of the
  // newest op queued (ops end in launch order on the one engine stream), then finish(works, rc)
  // once per batch.  stop(exiting=True) leaves at once, without touching Python again.
  void run(const py::function& finish) {
    for (;;) {
      std::vector<Item> batch;
      int rc = 0;
      bool leave = false;
      without_gil([&] {
        std::unique_lock<std::mutex> lk(mu_);
        for (;;) {
          if (exiting_ || (queue_.empty() && stop_)) {
            leave = true;
            return;
          }
          if (!queue_.empty()) {
            break;
          }
          cv_.wait_for(lk, std::chrono::milliseconds(50));
        }
        batch.swap(queue_);
        lk.unlock();
        const Item* newest = &batch.front();
        for (const Item& it : batch) {
          if (it.seq > newest->seq) {
            newest = &it;
          }
        }
        rc = sync_(P(newest->ev));
      });
      if (leave) {
        return;
      }
      py::list works(batch.size());
      for (size_t i = 0; i < batch.size(); ++i) {
        PyList_SET_ITEM(works.ptr(), static_cast<Py_ssize_t>(i), batch[i].work);   // the queue's reference
      }
      finish(works, rc);
    }
  }

  void stop(bool exiting) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
      exiting_ = exiting_ || exiting;
    }
    cv_.notify_all();
  }

  void wake() { cv_.notify_all(); }

  size_t pending() {
    std::lock_guard<std::mutex> lk(mu_);
    return queue_.size();
  }

 private:
  struct Item {
    PyObject* work;
    uint64_t ev;
    uint64_t seq;
  };
  SyncFn sync_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Item> queue_;
  bool stop_ = false;
  bool exiting_ = false;
};

}  // namespace

void bind_launch(py::module_& m) {
  m.attr("CALL_COLL") = static_cast<int>(kColl);
  m.attr("CALL_ROOTED") = static_cast<int>(kRooted);
  m.attr("CALL_GATHER") = static_cast<int>(kGather);
  m.attr("CALL_P2P") = static_cast<int>(kP2P);
  m.attr("LAUNCH_RESULT_MASK") = kResultMask;
  m.attr("LAUNCH_REFUSED") = kRefused;
  m.attr("LAUNCH_CAPTURED") = kCaptured;
  m.attr("LAUNCH_FLAG_BEFORE") = kFlagBefore;
  m.attr("LAUNCH_FLAG_DURING") = kFlagDuring;
  m.attr("LAUNCH_RECORDED") = kRecorded;
  m.attr("LAUNCH_CUDA_SHIFT") = kCudaShift;
  m.attr("LAUNCH_STEP_SHIFT") = kStepShift;

  py::class_<AbortFlag>(m, "AbortFlag", R"doc(
A communicator's abort flag as the native launch sees it: raised by the engine's abort beside
NCCL's own flag (ncclCommRaiseAbortFlag), from any thread, with or without the GIL.)doc")
      .def(py::init<>())
      .def("raise_flag", &AbortFlag::raise_flag)
      .def_property_readonly("raised", &AbortFlag::raised);

  py::class_<Launcher>(m, "Launcher", R"doc(
One native launch per op (see launch.cpp).  Launcher((cuEventRecord, cuStreamWaitEvent,
cuStreamIsCapturing), (ncclGroupStart, ncclGroupEnd)): function addresses resolved once.)doc")
      .def(py::init<const py::tuple&, const py::tuple&>(), py::arg("cuda"), py::arg("nccl"))
      .def("launch", &Launcher::launch, py::arg("flag"), py::arg("comm"), py::arg("caller"), py::arg("stream"),
           py::arg("follow_event"), py::arg("end_events"), py::arg("calls"))
      .def("follow", &Launcher::follow, py::arg("caller"), py::arg("stream"), py::arg("event"))
      .def("record", &Launcher::record, py::arg("event"), py::arg("stream"))
      .def("stream_wait", &Launcher::stream_wait, py::arg("stream"), py::arg("event"));

  py::class_<Completer>(m, "Completer", R"doc(
The futures' completer (see launch.cpp).  Completer(cuEventSynchronize's address).)doc")
      .def(py::init<uint64_t>(), py::arg("sync"))
      .def("add", &Completer::add, py::arg("work"), py::arg("event"), py::arg("seq"))
      .def("run", &Completer::run, py::arg("finish"))
      .def("stop", &Completer::stop, py::arg("exiting") = false)
      .def("wake", &Completer::wake)
      .def_property_readonly("pending", &Completer::pending);
}

}  // namespace hpct
