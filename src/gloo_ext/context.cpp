// hpct._gloo.Context: a storeless, abortable Gloo context over the patched
// Gloo (patches/gloo/5354032).  Every rank gets the full peer table
// (host, port) from the port plan, binds its own entry and connects the full
// mesh directly: no store, no root.  Every blocking call releases the GIL so
// that abort() can be called from another Python thread while an op waits.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cerrno>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "gil.h"
#include "small.h"
#include "gloo/allgather.h"
#include "gloo/allreduce.h"
#include "gloo/barrier.h"
#include "gloo/broadcast.h"
#include "gloo/common/error.h"
#include "gloo/common/logging.h"
#include "gloo/math.h"
#include "gloo/rendezvous/context.h"
#include "gloo/transport/context.h"
#include "gloo/transport/tcp/device.h"
#include "gloo/transport/unbound_buffer.h"

namespace py = pybind11;

namespace hpct {
namespace {

// Python exception types (created once at import; never freed).
PyObject* g_gloo_error = nullptr;           // GlooError(hpct.errors.TransportError)
PyObject* g_aborted_error = nullptr;        // AbortedError(GlooError)
PyObject* g_connect_timeout_error = nullptr;  // ConnectTimeoutError(GlooError, TimeoutError)
PyObject* g_peer_error = nullptr;           // PeerError(GlooError, ConnectionError)
PyObject* g_op_timeout_error = nullptr;     // OpTimeoutError(PeerError, TimeoutError)
PyObject* g_address_in_use_error = nullptr; // AddressInUseError(GlooError, OSError)
PyObject* g_stale_generation_error = nullptr; // StaleGenerationError(GlooError)
PyObject* g_peer_left_error = nullptr;      // PeerLeftError(PeerError)

// A connection of a forming group failed before the connect's deadline: the peer died or gave
// this generation up (its own connect was aborted).  Not a deadline passed: the caller asks for
// the next membership instead of reporting a rank that never came.
struct PeerLeftException : public gloo::IoException {
  explicit PeerLeftException(const std::string& msg) : gloo::IoException(msg) {}
};

PyObject* make_exception(py::module_& m, const char* name, PyObject* bases, const char* doc) {
  std::string qualified = std::string("hpct._gloo.") + name;
  PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases, nullptr);
  if (type == nullptr) {
    throw py::error_already_set();
  }
  m.add_object(name, py::handle(type));  // add_object steals nothing; keep our ref
  Py_INCREF(type);
  return type;
}

// Raise type(what) with one more attribute on the instance (a number the caller
// acts on, so that it never has to parse the message).
void set_error_with(PyObject* type, const char* what, const char* name, long value) {
  PyObject* exc = PyObject_CallFunction(type, "s", what);
  PyObject* number = PyLong_FromLong(value);
  if (exc != nullptr && number != nullptr && PyObject_SetAttrString(exc, name, number) == 0) {
    PyErr_SetObject(type, exc);
  } else if (!PyErr_Occurred()) {
    PyErr_SetString(type, what);
  }
  Py_XDECREF(number);
  Py_XDECREF(exc);
}

// Translate Gloo's C++ exceptions into the module's Python types, by type and
// error code only: the patched Gloo (patch 0017) throws TimeoutException for an op
// timeout and BindException with the errno of a failed bind, so no message text is
// read here.  Most derived types first.
void translate(std::exception_ptr p) {
  try {
    if (p) {
      std::rethrow_exception(p);
    }
  } catch (const gloo::AbortedException& e) {
    PyErr_SetString(g_aborted_error, e.what());
  } catch (const gloo::ConnectTimeoutException& e) {
    PyErr_SetString(g_connect_timeout_error, e.what());
  } catch (const PeerLeftException& e) {
    PyErr_SetString(g_peer_left_error, e.what());
  } catch (const gloo::StaleGenerationException& e) {
    // The peer's generation travels as an attribute, for a caller that rejoins there.
    set_error_with(g_stale_generation_error, e.what(), "newer_generation",
                   static_cast<long>(e.newerGeneration));
  } catch (const gloo::TimeoutException& e) {
    PyErr_SetString(g_op_timeout_error, e.what());
  } catch (const gloo::IoException& e) {
    PyErr_SetString(g_peer_error, e.what());
  } catch (const gloo::BindException& e) {
    if (e.errnum == EADDRINUSE) {
      // An OSError whose errno is set, as the socket module's would be.
      set_error_with(g_address_in_use_error, e.what(), "errno", e.errnum);
    } else {
      PyErr_SetString(g_gloo_error, e.what());
    }
  } catch (const gloo::Exception& e) {
    PyErr_SetString(g_gloo_error, e.what());
  } catch (const gloo::EnforceNotMet& e) {
    PyErr_SetString(g_gloo_error, e.what());
  }
}

enum class DType { F32, F64, I32, I64 };

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "float32";
    case DType::F64: return "float64";
    case DType::I32: return "int32";
    case DType::I64: return "int64";
  }
  return "?";
}

size_t dtype_size(DType t) {
  return (t == DType::F32 || t == DType::I32) ? 4 : 8;
}

DType parse_dtype_name(const std::string& name) {
  if (name == "float32" || name == "f" || name == "float") return DType::F32;
  if (name == "float64" || name == "d" || name == "double") return DType::F64;
  if (name == "int32" || name == "i") return DType::I32;
  if (name == "int64" || name == "q") return DType::I64;
  throw py::value_error("unsupported dtype '" + name +
                        "'; use float32, float64, int32 or int64");
}

// A contiguous view of a Python buffer with its element type.
struct View {
  py::buffer_info info;
  DType dtype;
  void* ptr;
  size_t count;   // elements
  size_t nbytes;
};

View view_of(py::buffer obj, bool writable, const py::object& dtype_arg) {
  py::buffer_info info = obj.request(writable);
  // Contiguity: accept C-contiguous buffers only.
  ssize_t expect = info.itemsize;
  for (ssize_t d = info.ndim - 1; d >= 0; d--) {
    if (info.shape[d] > 1 && info.strides[d] != expect) {
      throw py::value_error("buffer must be C-contiguous");
    }
    expect *= info.shape[d];
  }
  const size_t nbytes = static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize);
  DType dtype;
  if (!dtype_arg.is_none()) {
    dtype = parse_dtype_name(py::str(dtype_arg));
  } else {
    std::string fmt = info.format;
    // Strip byte-order/alignment prefixes ('@', '=', '<').
    while (!fmt.empty() && (fmt[0] == '@' || fmt[0] == '=' || fmt[0] == '<')) {
      fmt.erase(0, 1);
    }
    const char c = fmt.size() == 1 ? fmt[0] : '\0';
    if (c == 'f' && info.itemsize == 4) dtype = DType::F32;
    else if (c == 'd' && info.itemsize == 8) dtype = DType::F64;
    else if ((c == 'i' || c == 'l') && info.itemsize == 4) dtype = DType::I32;
    else if ((c == 'q' || c == 'l') && info.itemsize == 8) dtype = DType::I64;
    else {
      throw py::value_error(
          "cannot infer the element type of a buffer with format '" + info.format +
          "'; pass dtype='float32'|'float64'|'int32'|'int64' (e.g. for a bytearray)");
    }
  }
  if (nbytes % dtype_size(dtype) != 0) {
    throw py::value_error("buffer size " + std::to_string(nbytes) +
                          " is not a multiple of the " + dtype_name(dtype) + " element size");
  }
  View v{std::move(info), dtype, nullptr, nbytes / dtype_size(dtype), nbytes};
  v.ptr = v.info.ptr;
  return v;
}

template <typename T>
gloo::AllreduceOptions::Func reduce_fn(const std::string& op) {
  using F = void (*)(void*, const void*, const void*, size_t);
  if (op == "sum") return static_cast<F>(&gloo::sum<T>);
  if (op == "product" || op == "prod") return static_cast<F>(&gloo::product<T>);
  if (op == "min") return static_cast<F>(&gloo::min<T>);
  if (op == "max") return static_cast<F>(&gloo::max<T>);
  throw py::value_error("unsupported reduce op '" + op + "'; use sum, product, min or max");
}

// Slots for point-to-point messages: a prefix no collective uses.
constexpr uint64_t kP2PSlotPrefix = 0x20;
// The lazy group's formation count (StorelessContext::form): its own slot.
constexpr uint64_t kFormSlot = uint64_t(0x21) << 56;
// What a wait of the formation count may take past the connect deadline: the last message
// in flight when the deadline passes (the whole connect fails within deadline + this).
constexpr std::chrono::milliseconds kFormSlack{250};
uint64_t p2p_slot(uint32_t tag) {
  return (kP2PSlotPrefix << 56) | static_cast<uint64_t>(tag);
}

std::chrono::milliseconds to_ms(double seconds, const char* what) {
  if (!(seconds > 0) || !std::isfinite(seconds)) {
    throw py::value_error(std::string(what) + " must be a positive number of seconds");
  }
  return std::chrono::milliseconds(static_cast<int64_t>(std::ceil(seconds * 1000.0)));
}

// One posted point-to-point message: the send or receive is under way on
// the device thread as soon as it is posted; wait() blocks (without the GIL)
// until it completed, failed or timed out.  Posting never waits for the peer,
// so any order of sends and receives on two ranks completes, as with
// ProcessGroupGloo.  wait() may be called again (or from several threads): the
// outcome of the first is kept.  The request keeps the transport context and
// the caller's buffer alive; the unbound buffer is released first (its
// destructor waits until the device thread no longer uses it), then the
// buffer.
class P2PRequest {
 public:
  // peer < 0 with sources: a receive from whichever of `sources` sends first (any source).
  P2PRequest(std::shared_ptr<gloo::Context> ctx, std::shared_ptr<std::atomic<int>> pending,
             py::buffer_info info, bool is_send, int peer, uint32_t tag,
             std::chrono::milliseconds timeout, std::vector<int> sources = {})
      : ctx_(std::move(ctx)), pending_(std::move(pending)), info_(std::move(info)),
        is_send_(is_send), peer_(peer), tag_(tag), timeout_(timeout), sources_(std::move(sources)),
        source_(peer) {
    (*pending_)++;
  }

  ~P2PRequest() {
    ubuf_.reset();
    if (!finished_) (*pending_)--;
  }

  // Post the operation (called once, right after construction, without the GIL).
  void post(void* ptr, size_t nbytes) {
    ubuf_ = ctx_->createUnboundBuffer(ptr, nbytes);
    if (is_send_) {
      ubuf_->send(peer_, p2p_slot(tag_));
    } else if (!sources_.empty()) {
      ubuf_->recv(sources_, p2p_slot(tag_));
    } else {
      ubuf_->recv(peer_, p2p_slot(tag_));
    }
  }

  // timeout: None waits for the context's op timeout; a shorter one that
  // expires fails the context, as any op timeout does (Gloo's semantics).
  void wait(const py::object& timeout) {
    std::chrono::milliseconds limit = timeout_;
    if (!timeout.is_none()) limit = to_ms(timeout.cast<double>(), "timeout");
    without_gil([&] {
      std::lock_guard<std::mutex> guard(m_);
      if (!finished_) {
        try {
          if (is_send_) {
            ubuf_->waitSend(limit);
          } else {
            int from = peer_;
            ubuf_->waitRecv(&from, limit);
            source_ = from;
          }
        } catch (...) {
          error_ = std::current_exception();
        }
        finished_ = true;
        (*pending_)--;
      }
      if (error_) std::rethrow_exception(error_);
    });
  }

  bool completed() {
    std::unique_lock<std::mutex> guard(m_, std::try_to_lock);
    return guard && finished_ && !error_;
  }
  bool is_send() const { return is_send_; }
  int peer() const { return peer_; }
  // The rank the message came from (a receive from any source knows it once waited for).
  int source() const { return source_; }
  uint32_t tag() const { return tag_; }
  size_t nbytes() const { return static_cast<size_t>(info_.size) * info_.itemsize; }

 private:
  const std::shared_ptr<gloo::Context> ctx_;
  const std::shared_ptr<std::atomic<int>> pending_;
  py::buffer_info info_;                       // released after ubuf_
  std::unique_ptr<gloo::transport::UnboundBuffer> ubuf_;
  const bool is_send_;
  const int peer_;
  const uint32_t tag_;
  const std::chrono::milliseconds timeout_;
  const std::vector<int> sources_;
  int source_;
  std::mutex m_;
  bool finished_ = false;
  std::exception_ptr error_;
};

// One TCP device (one listening port, one event-loop thread) per process and
// listening address, shared by the contexts of every group that listens there:
// each context registers its group key on the device's listener, which routes
// connections by the key in their sequence number (patch 0018).  A device is
// created by the first context that needs it and shut down (its port freed) when
// the last context using it aborts or closes; a context aborted on a shared device
// closes only its own key.
class DeviceRegistry {
 public:
  using DevicePtr = std::shared_ptr<gloo::transport::tcp::Device>;

  static DeviceRegistry& get() {
    static DeviceRegistry* registry = new DeviceRegistry();  // never freed: used at exit
    return *registry;
  }

  // The device listening on attr's host and port, with `key` reserved on it.
  DevicePtr acquire(const gloo::transport::tcp::attr& attr, uint32_t key) {
    const auto id = std::make_pair(attr.hostname, attr.port);
    std::lock_guard<std::mutex> guard(mutex_);
    auto& entry = entries_[id];
    auto dev = entry.device.lock();
    if (dev && dev->isShutdown()) dev.reset();
    if (!dev) {
      entry.keys.clear();
      dev = std::static_pointer_cast<gloo::transport::tcp::Device>(
          gloo::transport::tcp::CreateDevice(attr));
      entry.device = dev;
    }
    if (!entry.keys.insert(key).second) {
      throw py::value_error(
          "group key " + std::to_string(key) + " is already used by a live group listening on " +
          attr.hostname + ":" + std::to_string(attr.port) + " (keys are group indexes modulo " +
          std::to_string(gloo::transport::tcp::kGroupKeys) + "); destroy that group first, or "
          "give this one another group_key");
    }
    return dev;
  }

  // Give `key` back; with no key left the device is shut down (port freed).
  void release(const DevicePtr& dev, const gloo::transport::tcp::attr& attr, uint32_t key) {
    if (!dev) return;
    bool last = false;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      auto it = entries_.find(std::make_pair(attr.hostname, attr.port));
      if (it == entries_.end() || it->second.device.lock() != dev) {
        last = true;  // already replaced: this device serves nobody else
      } else {
        it->second.keys.erase(key);
        last = it->second.keys.empty();
        if (last) entries_.erase(it);
      }
    }
    if (last) dev->shutdown();
  }

 private:
  struct Entry {
    std::weak_ptr<gloo::transport::tcp::Device> device;
    std::set<uint32_t> keys;
  };
  std::mutex mutex_;
  std::map<std::pair<std::string, int>, Entry> entries_;
};

class StorelessContext {
 public:
  StorelessContext(int rank, int size, uint32_t generation,
                   std::vector<std::pair<std::string, int>> peers, double timeout,
                   double connect_timeout, bool connect, double retry_delay_initial,
                   double retry_delay_max, double bind_retry_timeout, double ack_timeout,
                   double keepalive_idle, double keepalive_interval, int keepalive_count,
                   bool lazy, uint32_t group_key, bool float_doubling)
      : rank_(rank), size_(size), generation_(generation), peers_(std::move(peers)),
        group_key_(group_key % gloo::transport::tcp::kGroupKeys), float_doubling_(float_doubling) {
    if (size > static_cast<int>(gloo::transport::tcp::kMaxStorelessRanks)) {
      throw py::value_error("size " + std::to_string(size) + " is above the most ranks a "
                            "storeless group supports (2**20)");
    }
    if (size < 1) throw py::value_error("size must be at least 1");
    if (rank < 0 || rank >= size) {
      throw py::value_error("rank " + std::to_string(rank) + " is outside 0.." +
                            std::to_string(size - 1));
    }
    if (peers_.size() != static_cast<size_t>(size)) {
      throw py::value_error("peers has " + std::to_string(peers_.size()) +
                            " entries; expected one (host, port) per rank (" +
                            std::to_string(size) + ")");
    }
    if (generation > gloo::transport::tcp::kMaxGeneration) {
      throw py::value_error("generation must be below 2**31");
    }
    for (size_t i = 0; i < peers_.size(); i++) {
      if (peers_[i].second < 1 || peers_[i].second > 65535) {
        throw py::value_error("peers[" + std::to_string(i) + "] has invalid port " +
                              std::to_string(peers_[i].second));
      }
    }
    timeout_ms_ = to_ms(timeout, "timeout").count();
    options_.generation = generation;
    options_.groupKey = group_key_;
    options_.connectTimeout = to_ms(connect_timeout, "connect_timeout");
    // Retry delays may be 0 (retry at once); they are clamped to 1 ms so
    // that the active side never spins.
    if (!(retry_delay_initial >= 0) || !(retry_delay_max >= 0)) {
      throw py::value_error("retry delays must be non-negative numbers of seconds");
    }
    options_.retryDelayInitial =
        to_ms(std::max(retry_delay_initial, 0.001), "retry_delay_initial");
    options_.retryDelayMax = to_ms(std::max(retry_delay_max, 0.001), "retry_delay_max");
    options_.ackTimeout = to_ms(ack_timeout, "ack_timeout");
    options_.lazy = lazy;
    // keepalive_idle 0 turns the probes off; the kernel counts whole seconds.
    if (!(keepalive_idle >= 0) || !std::isfinite(keepalive_idle)) {
      throw py::value_error("keepalive_idle must be 0 (off) or a positive number of seconds");
    }
    if (keepalive_idle > 0) {
      options_.keepaliveIdle = to_ms(keepalive_idle, "keepalive_idle");
      options_.keepaliveInterval = to_ms(keepalive_interval, "keepalive_interval");
      if (keepalive_count < 1 || keepalive_count > 127) {
        throw py::value_error("keepalive_count must be between 1 and 127 (got " +
                              std::to_string(keepalive_count) + ")");
      }
      options_.keepaliveCount = keepalive_count;
    } else {
      options_.keepaliveIdle = std::chrono::milliseconds(0);
    }
    for (const auto& p : peers_) {
      gloo::transport::StorelessPeer sp;
      sp.host = p.first;
      sp.port = p.second;
      options_.peers.push_back(sp);
    }

    auto& attr = attr_;
    attr.hostname = peers_[rank].first;
    attr.port = peers_[rank].second;
    attr.bindRetryTimeoutMs =
        bind_retry_timeout <= 0 ? 0 : static_cast<int>(std::ceil(bind_retry_timeout * 1000.0));
    context_ = std::make_shared<gloo::rendezvous::Context>(rank, size);
    context_->setTimeout(op_timeout());
    without_gil([&] { device_ = DeviceRegistry::get().acquire(attr, group_key_); });
    if (connect) {
      this->connect();
    }
  }

  ~StorelessContext() {
    try {
      py::gil_scoped_release nogil;
      shutdown("context destroyed", true);
    } catch (...) {
    }
  }

  void connect() {
    std::shared_ptr<gloo::rendezvous::Context> ctx;
    std::shared_ptr<gloo::transport::Device> dev;
    {
      std::lock_guard<std::mutex> guard(state_);
      if (closed_) throw_closed();
      if (connect_started_) {
        throw py::value_error("connect() was already called on this context");
      }
      connect_started_ = true;
      ctx = context_;
      dev = device_;
    }
    without_gil([&] {
      std::lock_guard<std::mutex> op(op_);
      // One deadline for the whole connect, the count that follows the mesh (or tree) included.
      const auto deadline = std::chrono::steady_clock::now() + options_.connectTimeout;
      ctx->connectFullMeshStoreless(options_, dev);
      if (options_.lazy && size_ > 1) form(ctx, deadline);
      connected_ = true;
    });
  }

  // Lazy pairs connect on first use.  The group forms by counting its members up a
  // binomial tree to rank 0 and sending the total back down: it proves every rank is
  // there at this generation in 2*log2(N) message hops (a ring allreduce takes 2(N-1)),
  // and leaves each rank connected to its tree parent and children only (at most
  // log2(N)+1 peers), under the connect deadline rather than the op timeout.  Whatever
  // fails it is a failed connect.  Each wait gets what is left of the connect's deadline, not
  // a deadline of its own: a member stopped after it connected (SIGSTOP, a hung host) costs
  // the others the connect deadline, not the deadline again per hop.
  void form(const std::shared_ptr<gloo::rendezvous::Context>& ctx,
            std::chrono::steady_clock::time_point deadline) {
    int64_t count = 1;
    auto limit = [&deadline] {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                            deadline - std::chrono::steady_clock::now()) + kFormSlack;
      return std::max(left, std::chrono::milliseconds(1));
    };
    // The peer each wait is for: a failed wait names it (a stopped peer's recv timeout says nothing).
    int peer = -1;
    const char* step = "";
    try {
      auto buf = ctx->createUnboundBuffer(&count, sizeof(count));
      int64_t part = 0;
      auto in = ctx->createUnboundBuffer(&part, sizeof(part));
      int low = 1;                        // the lowest set bit of the rank (size for rank 0)
      while (low < size_ && !(rank_ & low)) low <<= 1;
      for (int mask = 1; mask < low; mask <<= 1) {     // children: rank + 1, 2, 4, .. below low
        if (rank_ + mask >= size_) break;
        peer = rank_ + mask, step = "its count of the ranks below it";
        in->recv(peer, kFormSlot);
        in->waitRecv(limit());
        count += part;
      }
      if (rank_ != 0) {
        peer = rank_ - low, step = "it to take this rank's count";
        buf->send(peer, kFormSlot);
        buf->waitSend(limit());
        step = "the group's total";
        buf->recv(peer, kFormSlot);
        buf->waitRecv(limit());
      }
      for (int mask = low >> 1; mask >= 1; mask >>= 1) {
        if (rank_ + mask >= size_) continue;
        peer = rank_ + mask, step = "it to take the group's total";
        buf->send(peer, kFormSlot);
        buf->waitSend(limit());
      }
    } catch (const gloo::AbortedException&) {
      throw;
    } catch (const gloo::StaleGenerationException&) {
      throw;
    } catch (const gloo::ConnectTimeoutException&) {
      throw;
    } catch (const gloo::IoException& e) {
      ctx->abort("the storeless connect failed");
      const std::string who = "Storeless connect of rank " + std::to_string(rank_) + " (of " +
                              std::to_string(size_) + ", generation " +
                              std::to_string(generation_) + ")";
      const std::string waited =
          peer < 0 ? std::string()
                   : " waiting for rank " + std::to_string(peer) + " (" + peers_[peer].first + ":" +
                         std::to_string(peers_[peer].second) + ", " + step + ")";
      // A wait that ran out is the deadline; any other failure came from a peer before it.
      if (dynamic_cast<const gloo::TimeoutException*>(&e) != nullptr) {
        throw gloo::ConnectTimeoutException(who + " did not form within the connect deadline" +
                                            waited + ": " + e.what());
      }
      throw PeerLeftException(who + " failed before the group formed" + waited +
                              ": a peer left (it died or gave generation " +
                              std::to_string(generation_) + " up): " + e.what());
    }
    if (count != size_) {
      ctx->abort("the storeless connect counted the wrong ranks");
      throw gloo::IoException("Storeless connect of rank " + std::to_string(rank_) +
                              " counted " + std::to_string(count) + " ranks, expected " +
                              std::to_string(size_));
    }
  }

  // Pairs connected now: with lazy pairs, only those operations have used.
  int connections() {
    auto transport = connected_context()->getTransportContext();
    return transport ? transport->connectedPairs() : 0;
  }

  void abort(const std::string& reason) {
    without_gil([&] {
      std::shared_ptr<gloo::rendezvous::Context> ctx;
      std::shared_ptr<gloo::transport::Device> dev;
      {
        std::lock_guard<std::mutex> guard(state_);
        ctx = context_;
        dev = device_;
      }
      if (ctx) ctx->abort(reason);
      // Close this group's key (even if connect never started); the port is
      // freed once no other group of the process uses it.
      release_device(dev);
    });
  }

  // Close: when no operation is running, close the connections gracefully
  // (peers still receive what was sent, then end-of-file); otherwise abort
  // first.  Then release the device (frees the port, joins its event-loop
  // thread).
  void close() {
    without_gil([&] { shutdown("context closed", true); });
  }

  // The TCP device, read under the state lock (null once closed or before connect).
  std::shared_ptr<gloo::transport::tcp::Device> tcp_device() {
    std::lock_guard<std::mutex> guard(state_);
    return std::static_pointer_cast<gloo::transport::tcp::Device>(device_);
  }

  bool aborted() {
    std::lock_guard<std::mutex> guard(state_);
    return closed_ || (context_ && context_->isAborted());
  }

  size_t rejected_connections() {
    auto dev = tcp_device();
    if (!dev) return rejected_at_close_;
    return dev->rejectedConnections(group_key_);
  }

  // Connections refused for another generation, by initiator rank:
  // {rank: (last generation, count, host)}.
  py::dict refusals() {
    auto dev = tcp_device();
    auto records = dev ? dev->refusals(group_key_)
                       : refusals_at_close_;
    py::dict out;
    for (const auto& r : records) {
      out[py::int_(r.first)] = py::make_tuple(r.second.lastGeneration, r.second.count,
                                              r.second.from);
    }
    return out;
  }

  size_t dropped_connections() {
    auto dev = tcp_device();
    if (!dev) return dropped_at_close_;
    return dev->droppedConnections();
  }

  // algorithm: "auto", "doubling" or "ring" (tests and benchmarks compare them).
  // "auto" takes recursive doubling up to kSmallAllreduceBytes where its result is the
  // ring's, bit for bit: integers (exact in any order), min and max, and any type at
  // N = 2 (one commutative combine).  A float sum or product of 3+ ranks associates
  // differently ((a+b)+(c+d) against the ring's running sum), so it keeps the ring, as
  // stock Gloo (DDP stays bit-identical to stock), unless float_doubling was asked for.
  void allreduce(py::buffer buf, const std::string& op, const py::object& dtype,
                 const std::string& algorithm) {
    if (algorithm != "auto" && algorithm != "doubling" && algorithm != "ring") {
      throw py::value_error("unknown allreduce algorithm '" + algorithm +
                            "'; use auto, doubling or ring");
    }
    View v = view_of(buf, true, dtype);
    gloo::AllreduceOptions::Func fn;
    switch (v.dtype) {
      case DType::F32: fn = reduce_fn<float>(op); break;
      case DType::F64: fn = reduce_fn<double>(op); break;
      case DType::I32: fn = reduce_fn<int32_t>(op); break;
      case DType::I64: fn = reduce_fn<int64_t>(op); break;
    }
    run([&](const std::shared_ptr<gloo::Context>& ctx) {
      if (v.count == 0) return;
      const bool exact = v.dtype == DType::I32 || v.dtype == DType::I64 || op == "min" ||
                         op == "max" || size_ == 2 || float_doubling_;
      if (algorithm == "doubling" ||
          (algorithm == "auto" && exact && v.nbytes <= kSmallAllreduceBytes)) {
        small_allreduce(ctx, v.ptr, v.count, dtype_size(v.dtype), fn, op_timeout());
        return;
      }
      gloo::AllreduceOptions opts(ctx);
      switch (v.dtype) {
        case DType::F32: opts.setOutput(static_cast<float*>(v.ptr), v.count); break;
        case DType::F64: opts.setOutput(static_cast<double*>(v.ptr), v.count); break;
        case DType::I32: opts.setOutput(static_cast<int32_t*>(v.ptr), v.count); break;
        case DType::I64: opts.setOutput(static_cast<int64_t*>(v.ptr), v.count); break;
      }
      opts.setReduceFunction(fn);
      opts.setTimeout(op_timeout());
      gloo::allreduce(opts);
    });
  }

  void broadcast_bytes(py::buffer buf, int root) {
    check_rank(root, "root");
    py::buffer_info info = buf.request(true);
    void* ptr = info.ptr;
    const size_t nbytes = static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize);
    run([&](const std::shared_ptr<gloo::Context>& ctx) {
      if (nbytes == 0) return;
      gloo::BroadcastOptions opts(ctx);
      opts.setOutput(static_cast<uint8_t*>(ptr), nbytes);
      opts.setRoot(root);
      opts.setTimeout(op_timeout());
      gloo::broadcast(opts);
    });
  }

  void allgather(py::buffer input, py::buffer output) {
    py::buffer_info in = input.request(false);
    py::buffer_info out = output.request(true);
    const size_t in_bytes = static_cast<size_t>(in.size) * static_cast<size_t>(in.itemsize);
    const size_t out_bytes = static_cast<size_t>(out.size) * static_cast<size_t>(out.itemsize);
    if (out_bytes != in_bytes * static_cast<size_t>(size_)) {
      throw py::value_error("allgather output has " + std::to_string(out_bytes) +
                            " bytes; expected size * input = " +
                            std::to_string(in_bytes * size_));
    }
    void* in_ptr = in.ptr;
    void* out_ptr = out.ptr;
    run([&](const std::shared_ptr<gloo::Context>& ctx) {
      if (in_bytes == 0) return;
      gloo::AllgatherOptions opts(ctx);
      opts.setInput(static_cast<uint8_t*>(in_ptr), in_bytes);
      opts.setOutput(static_cast<uint8_t*>(out_ptr), out_bytes);
      opts.setTimeout(op_timeout());
      gloo::allgather(opts);
    });
  }

  // Rank j's parts: send_bytes[j] bytes at send_addrs[j] go to rank j, recv_bytes[j] bytes
  // from rank j land at recv_addrs[j]; a negative size means no part.  Addresses, not buffers:
  // a buffer object per part cost the Python caller more than a 4-byte message takes to
  // travel (ops.py keeps the tensors alive for the call).  See small.h exchange.
  std::vector<int64_t> exchange_at(const std::vector<uintptr_t>& send_addrs,
                                   const std::vector<int64_t>& send_bytes,
                                   const std::vector<uintptr_t>& recv_addrs,
                                   const std::vector<int64_t>& recv_bytes) {
    const size_t n = static_cast<size_t>(size_);
    if (send_addrs.size() != n || send_bytes.size() != n || recv_addrs.size() != n ||
        recv_bytes.size() != n) {
      throw py::value_error("exchange needs one address and one size per rank (size -1 for none) "
                            "in sends and recvs");
    }
    auto parts = [&](const std::vector<uintptr_t>& addrs, const std::vector<int64_t>& bytes) {
      std::vector<Part> out(n);
      for (size_t j = 0; j < n; j++) {
        if (bytes[j] < 0) continue;
        if (bytes[j] > 0 && addrs[j] == 0) {
          throw py::value_error("exchange: part " + std::to_string(j) + " has " +
                                std::to_string(bytes[j]) + " bytes at address 0");
        }
        out[j] = {reinterpret_cast<void*>(addrs[j]), static_cast<size_t>(bytes[j]), true};
      }
      return out;
    };
    auto send_parts = parts(send_addrs, send_bytes);
    auto recv_parts = parts(recv_addrs, recv_bytes);
    std::vector<int64_t> result;
    run([&](const std::shared_ptr<gloo::Context>& ctx) {
      result = exchange(ctx, send_parts, recv_parts, op_timeout());
    });
    return result;
  }

  void barrier() {
    run([&](const std::shared_ptr<gloo::Context>& ctx) {
      gloo::BarrierOptions opts(ctx);
      opts.setTimeout(op_timeout());
      gloo::barrier(opts);
    });
  }

  // Post a send (recv) and return at once; the request's wait() completes it.
  std::unique_ptr<P2PRequest> isend(py::buffer buf, int dst, uint32_t tag) {
    return post(std::move(buf), dst, tag, true);
  }

  std::unique_ptr<P2PRequest> irecv(py::buffer buf, int src, uint32_t tag) {
    return post(std::move(buf), src, tag, false);
  }

  // Any source: every other rank may send it (ProcessGroupGloo's recvAnysource).
  std::unique_ptr<P2PRequest> irecv_any(py::buffer buf, uint32_t tag) {
    std::vector<int> sources;
    for (int r = 0; r < size_; r++) {
      if (r != rank_) sources.push_back(r);
    }
    if (sources.empty()) throw py::value_error("a receive from any source needs another rank");
    return post(std::move(buf), -1, tag, false, std::move(sources));
  }

  void send(py::buffer buf, int dst, uint32_t tag) {
    isend(std::move(buf), dst, tag)->wait(py::none());
  }

  void recv(py::buffer buf, int src, uint32_t tag) {
    irecv(std::move(buf), src, tag)->wait(py::none());
  }

  int pending_p2p() const { return pending_->load(); }

  int rank() const { return rank_; }
  int size() const { return size_; }
  uint32_t generation() const { return generation_; }
  const std::vector<std::pair<std::string, int>>& peers() const { return peers_; }
  double timeout() const { return timeout_ms_.load() / 1000.0; }
  // The op timeout of ops posted from now on (ProcessGroupGloo's setTimeout); any thread.
  void set_timeout(double seconds) { timeout_ms_ = to_ms(seconds, "timeout").count(); }
  std::chrono::milliseconds op_timeout() const { return std::chrono::milliseconds(timeout_ms_.load()); }
  double connect_timeout() const { return options_.connectTimeout.count() / 1000.0; }
  bool connected() const { return connected_; }

 private:
  [[noreturn]] void throw_closed() {
    throw gloo::AbortedException("hpct context is closed (rank " + std::to_string(rank_) +
                                 ", generation " + std::to_string(generation_) + ")");
  }

  void check_rank(int r, const char* what) const {
    if (r < 0 || r >= size_) {
      throw py::value_error(std::string(what) + "=" + std::to_string(r) + " is outside 0.." +
                            std::to_string(size_ - 1));
    }
  }

  void check_peer(int r, const char* what) const {
    check_rank(r, what);
    if (r == rank_) {
      throw py::value_error(std::string(what) + " must be another rank than this one (" +
                            std::to_string(rank_) + ")");
    }
  }

  // The connected context, read under the state lock; a closed or unconnected one raises.
  std::shared_ptr<gloo::rendezvous::Context> connected_context() {
    std::lock_guard<std::mutex> guard(state_);
    if (closed_) throw_closed();
    if (!connected_) {
      throw py::value_error("the context is not connected; call connect() first");
    }
    return context_;
  }

  // Point-to-point operations do not take the one-op-at-a-time lock: they
  // only post to the device thread, which runs them beside a collective
  // (their slots never meet a collective's), and are waited on later.
  std::unique_ptr<P2PRequest> post(py::buffer buf, int peer, uint32_t tag, bool is_send,
                                   std::vector<int> sources = {}) {
    if (sources.empty()) check_peer(peer, is_send ? "dst" : "src");
    py::buffer_info info = buf.request(!is_send);
    void* ptr = info.ptr;
    const size_t nbytes = static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize);
    auto ctx = connected_context();
    auto req = std::make_unique<P2PRequest>(ctx, pending_, std::move(info), is_send, peer, tag,
                                            op_timeout(), std::move(sources));
    without_gil([&] { req->post(ptr, nbytes); });
    return req;
  }

  // Run one blocking operation without the GIL, one at a time.
  template <typename F>
  void run(F&& body) {
    auto ctx = connected_context();
    without_gil([&] {
      std::lock_guard<std::mutex> op(op_);
      std::shared_ptr<gloo::Context> base = ctx;
      body(base);
    });
  }

  void shutdown(const std::string& reason, bool graceful) {
    std::shared_ptr<gloo::rendezvous::Context> ctx;
    std::shared_ptr<gloo::transport::Device> dev;
    {
      std::lock_guard<std::mutex> guard(state_);
      if (closed_) return;
      closed_ = true;
      ctx = context_;
      dev = device_;
    }
    std::unique_lock<std::mutex> op(op_, std::defer_lock);
    const bool idle = graceful && op.try_lock();
    if (!idle || pending_->load() > 0) {
      // An operation (or the connect) is running, or a point-to-point
      // message is still under way: abort it, then wait for it to return.
      // (A request keeps the transport context alive; the abort wakes its
      // waiter and frees the port.)
      if (ctx) ctx->abort(reason);
      release_device(dev);
      if (!idle) op.lock();
    }
    if (dev) {
      auto tcp = std::static_pointer_cast<gloo::transport::tcp::Device>(dev);
      rejected_at_close_ = tcp->rejectedConnections(group_key_);
      refusals_at_close_ = tcp->refusals(group_key_);
      dropped_at_close_ = tcp->droppedConnections();
    }
    std::lock_guard<std::mutex> guard(state_);
    ctx.reset();
    dev.reset();
    context_.reset();  // destroys pairs, closes the key
    release_device(device_);  // the last group on the device frees the port
    device_.reset();
  }

  // Close this group's key on the shared device, and give the key back to the
  // registry (the last key shuts the device down).  Idempotent.
  void release_device(const std::shared_ptr<gloo::transport::Device>& dev) {
    if (!dev) return;
    auto tcp = std::static_pointer_cast<gloo::transport::tcp::Device>(dev);
    if (released_.exchange(true)) return;
    tcp->closeKey(group_key_, 0);
    DeviceRegistry::get().release(tcp, attr_, group_key_);
  }

  const int rank_;
  const int size_;
  const uint32_t generation_;
  const std::vector<std::pair<std::string, int>> peers_;
  const uint32_t group_key_;
  const bool float_doubling_;          // "auto" allreduce: small float sums in log depth too
  gloo::transport::tcp::attr attr_;
  std::atomic<bool> released_{false};
  std::atomic<int64_t> timeout_ms_{0};   // read by ops on other threads; set_timeout may change it
  gloo::transport::StorelessOptions options_;

  std::mutex state_;  // guards the fields below (never held while blocking)
  std::shared_ptr<gloo::rendezvous::Context> context_;
  std::shared_ptr<gloo::transport::Device> device_;
  bool closed_ = false;
  bool connect_started_ = false;
  std::atomic<bool> connected_{false};
  size_t rejected_at_close_ = 0;
  std::map<uint32_t, gloo::transport::tcp::Listener::Refusals> refusals_at_close_;
  size_t dropped_at_close_ = 0;

  std::mutex op_;  // serialises blocking operations (not point-to-point ones)
  // Point-to-point requests posted and not yet finished (shared with them).
  std::shared_ptr<std::atomic<int>> pending_ = std::make_shared<std::atomic<int>>(0);
};

}  // namespace

void bind_context(py::module_& m) {
  // hpct has one exception hierarchy (hpct/errors.py): the extension's root joins it
  // under TransportError (an HpctError, hence a RuntimeError as before).
  py::object transport_error = py::module_::import("hpct.errors").attr("TransportError");
  py::tuple gloo_bases = py::make_tuple(transport_error);
  g_gloo_error = make_exception(m, "GlooError", gloo_bases.ptr(),
                                "Base class of every error raised by hpct._gloo "
                                "(an hpct.errors.TransportError).");
  g_aborted_error = make_exception(m, "AbortedError", g_gloo_error,
                                   "The context was aborted (Context.abort or close); "
                                   "the message carries the reason.");
  {
    py::tuple bases = py::make_tuple(py::handle(g_gloo_error), py::handle(PyExc_TimeoutError));
    g_connect_timeout_error = make_exception(
        m, "ConnectTimeoutError", bases.ptr(),
        "The storeless connect did not complete by its deadline; the message names the "
        "ranks still missing.");
  }
  {
    py::tuple bases = py::make_tuple(py::handle(g_gloo_error), py::handle(PyExc_ConnectionError));
    g_peer_error = make_exception(
        m, "PeerError", bases.ptr(),
        "A connection to a peer failed (peer died, reset, closed); the message names the peer "
        "rank.");
  }
  m.attr("IoError") = py::handle(g_peer_error);
  {
    py::tuple bases = py::make_tuple(py::handle(g_peer_error), py::handle(PyExc_TimeoutError));
    g_op_timeout_error = make_exception(m, "OpTimeoutError", bases.ptr(),
                                        "An operation did not complete within the op timeout "
                                        "(or a later op of the context that timeout failed).");
  }
  {
    py::tuple bases = py::make_tuple(py::handle(g_gloo_error), py::handle(PyExc_OSError));
    g_address_in_use_error = make_exception(
        m, "AddressInUseError", bases.ptr(),
        "The listening port stayed in use for the whole bind retry window; errno is "
        "errno.EADDRINUSE.");
  }
  g_peer_left_error = make_exception(
      m, "PeerLeftError", g_peer_error,
      "A peer's connection failed while the storeless connect formed the group, before its "
      "deadline: the peer died or gave the generation up.  The group never formed; the "
      "message names the rank waited for.");
  g_stale_generation_error = make_exception(
      m, "StaleGenerationError", g_gloo_error,
      "This process's generation is older than its peers': a peer refused its connection "
      "or connected with a newer generation.  It can never join; the message names the "
      "peer and both generations, and newer_generation holds the peer's.");
  py::register_exception_translator(&translate);
  // Group keys repeat modulo this (the group_key argument of Context).
  m.attr("GROUP_KEYS") = py::int_(gloo::transport::tcp::kGroupKeys);
  // allreduce(algorithm="auto") takes recursive doubling up to this many bytes.
  m.attr("SMALL_ALLREDUCE_BYTES") = py::int_(kSmallAllreduceBytes);

  py::class_<P2PRequest>(m, "Request", R"doc(
A posted send or receive (Context.isend / Context.irecv).

wait(timeout=None) blocks until the message went through (a receive's buffer then holds
it); it raises PeerError, OpTimeoutError or AbortedError as an op would.  timeout
defaults to the context's op timeout; a timeout that expires fails the context (as any
op timeout does).  wait() may be called again: it repeats the first outcome.
)doc")
      .def("wait", &P2PRequest::wait, py::arg("timeout") = py::none())
      .def_property_readonly("completed", &P2PRequest::completed,
                             "True once wait() returned successfully.")
      .def_property_readonly("is_send", &P2PRequest::is_send)
      .def_property_readonly("peer", &P2PRequest::peer)
      .def_property_readonly("source", &P2PRequest::source,
                             "The sender's rank (for a receive from any source: once waited for).")
      .def_property_readonly("tag", &P2PRequest::tag)
      .def_property_readonly("nbytes", &P2PRequest::nbytes);

  py::class_<StorelessContext>(m, "Context", R"doc(
A storeless Gloo context: full mesh over TCP, no store, no root.

Context(rank, size, generation, peers, timeout=30.0, connect_timeout=60.0,
        connect=True, retry_delay_initial=0.01, retry_delay_max=0.5,
        bind_retry_timeout=2.0, ack_timeout=1.0, keepalive_idle=5.0,
        keepalive_interval=1.0, keepalive_count=5)

peers[i] is (host, port) where rank i listens; peers[rank] is this process's own
listening address (bound exactly).  The generation (< 2**31) is carried in every
connection handshake: connections of another generation are refused (the refusal
names this generation; a process that learns it is older fails at once with
StaleGenerationError).  timeout is the op timeout in seconds; connect_timeout the
deadline for the whole connect.  ack_timeout bounds one connect attempt until the
peer acknowledges it (doubling per peer after each expiry, up to 8x); an attempt
past it is retried, so a listener that vanished with its reset lost costs about
that long.  Established connections are probed after keepalive_idle seconds of
silence, every keepalive_interval seconds, and fail after keepalive_count
unanswered probes (the same bound applies to unacknowledged data); 0 turns it off.
With lazy=True, connect() counts the members up and down a binomial tree (at most
log2(size)+1 peers each), and every other pair is connected the first time an operation uses it,
within connect_timeout of that use (the higher rank dials; a lower rank rings the
higher one's doorbell so it dials at once, whatever the order the ranks arrive in).
Every group of a process that listens on the same (host, port) shares one listener:
group_key (taken modulo 1024; hpct passes the group's index) is carried in every
handshake and routes each connection to its own group, so live groups on one port
need distinct keys (ValueError otherwise).  abort() and close() close only this
group's key; the port is freed when the last group on it is gone.
With connect=False call connect() later (e.g. in a thread, to abort it).
Every blocking method releases the GIL; abort() may be called from any thread.
)doc")
      .def(py::init<int, int, uint32_t, std::vector<std::pair<std::string, int>>, double, double,
                    bool, double, double, double, double, double, double, int, bool, uint32_t,
                    bool>(),
           py::arg("rank"), py::arg("size"), py::arg("generation"), py::arg("peers"),
           py::arg("timeout") = 30.0, py::arg("connect_timeout") = 60.0,
           py::arg("connect") = true, py::arg("retry_delay_initial") = 0.01,
           py::arg("retry_delay_max") = 0.5, py::arg("bind_retry_timeout") = 2.0,
           py::arg("ack_timeout") = 1.0, py::arg("keepalive_idle") = 5.0,
           py::arg("keepalive_interval") = 1.0, py::arg("keepalive_count") = 5,
           py::arg("lazy") = false, py::arg("group_key") = 0, py::arg("float_doubling") = false)
      .def("connect", &StorelessContext::connect,
           "Connect the full mesh, or with lazy=True a binomial tree of pairs (blocks "
           "until connected or the connect deadline passes: ConnectTimeoutError naming "
           "the missing ranks; PeerLeftError when a peer's connection fails before it).")
      .def("connections", &StorelessContext::connections,
           "Number of peers connected now (lazy=True: only the pairs operations have used).")
      .def("abort", &StorelessContext::abort, py::arg("reason") = "aborted by the application",
           "Abort: every waiting and later op raises AbortedError; connections are reset; "
           "the listening port is freed (once no other group uses it). Idempotent; bounded; "
           "callable from any thread.")
      .def("close", &StorelessContext::close,
           "Abort if needed, wait for a running op to return, release the device.")
      .def("allreduce", &StorelessContext::allreduce, py::arg("buffer"), py::arg("op") = "sum",
           py::arg("dtype") = py::none(), py::arg("algorithm") = "auto",
           "In-place allreduce of a writable buffer (float32/float64/int32/int64, inferred from "
           "the buffer format or given as dtype); op is sum, product, min or max.  algorithm "
           "'auto' takes recursive doubling (log2 N hops, the same bits on every rank) up to "
           "SMALL_ALLREDUCE_BYTES where it gives the ring's bits (integers, min, max, N = 2; "
           "float sums and products too with float_doubling=True) and Gloo's ring otherwise; "
           "'doubling' or 'ring' forces one.")
      .def("broadcast", &StorelessContext::broadcast_bytes, py::arg("buffer"), py::arg("root"),
           "In-place broadcast of a writable buffer from rank root.")
      .def("allgather", &StorelessContext::allgather, py::arg("input"), py::arg("output"),
           "Gather every rank's input into output (size * len(input) bytes), in rank order.")
      .def("barrier", &StorelessContext::barrier)
      .def("exchange", &StorelessContext::exchange_at, py::arg("send_addrs"), py::arg("send_bytes"),
           py::arg("recv_addrs"), py::arg("recv_bytes"),
           "Send send_bytes[j] bytes at address send_addrs[j] to rank j and receive recv_bytes[j] "
           "bytes from rank j at recv_addrs[j] (size -1: no part), every pair at once, one "
           "message each way; this rank's own part is a local copy.  A message of another size "
           "than the receive's is dropped (the pair stays usable).  Returns, per rank, the bytes "
           "rank j sent where the sizes disagreed, else -1.  The caller keeps the memory alive.")
      .def("send", &StorelessContext::send, py::arg("buffer"), py::arg("dst"),
           py::arg("tag") = 0,
           "Send a buffer to rank dst; blocks until the peer received it (isend + wait).")
      .def("recv", &StorelessContext::recv, py::arg("buffer"), py::arg("src"),
           py::arg("tag") = 0, "Receive into a writable buffer from rank src (irecv + wait).")
      .def("isend", &StorelessContext::isend, py::arg("buffer"), py::arg("dst"),
           py::arg("tag") = 0,
           "Post a send of a buffer to rank dst and return a Request at once; the buffer must "
           "stay unchanged until Request.wait() returns.")
      .def("irecv", &StorelessContext::irecv, py::arg("buffer"), py::arg("src"),
           py::arg("tag") = 0,
           "Post a receive into a writable buffer from rank src and return a Request at once.")
      .def("irecv_any", &StorelessContext::irecv_any, py::arg("buffer"), py::arg("tag") = 0,
           "Post a receive from whichever other rank sends with this tag first; the Request's "
           "source names it once waited for.")
      .def_property_readonly("pending_p2p", &StorelessContext::pending_p2p,
                             "Point-to-point requests posted and not yet waited for.")
      .def_property_readonly("rank", &StorelessContext::rank)
      .def_property_readonly("size", &StorelessContext::size)
      .def_property_readonly("generation", &StorelessContext::generation)
      .def_property_readonly("peers", &StorelessContext::peers)
      .def_property_readonly("timeout", &StorelessContext::timeout)
      .def("set_timeout", &StorelessContext::set_timeout, py::arg("seconds"),
           "Op timeout, in seconds, of every op posted from now on (an op in flight keeps its own).")
      .def_property_readonly("connect_timeout", &StorelessContext::connect_timeout)
      .def_property_readonly("connected", &StorelessContext::connected)
      .def_property_readonly("aborted", &StorelessContext::aborted)
      .def_property_readonly("rejected_connections", &StorelessContext::rejected_connections,
                             "Connections of another generation refused by this listener.")
      .def_property_readonly("refusals", &StorelessContext::refusals,
                             "Connections refused for another generation, by the initiator's "
                             "rank: {rank: (its generation, count, its host)}.")
      .def_property_readonly("dropped_connections", &StorelessContext::dropped_connections,
                             "Incoming connections this listener closed because they failed or "
                             "their peer had gone before a pair took them (a peer that gave up, "
                             "or a client that is not a rank).")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](StorelessContext& self, py::args) {
        self.close();
        return false;
      });
}

}  // namespace hpct
