// Log-depth allreduce for small buffers (small.cpp).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <utility>
#include <vector>
#include <cstdint>

#include "gloo/context.h"

namespace hpct {

// The time left until `deadline`, at least 1 ms (a zero timeout would mean "unset");
// the small allreduce and the exchange bound each wait by it.
inline std::chrono::milliseconds left(std::chrono::steady_clock::time_point deadline) {
  auto rest = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline - std::chrono::steady_clock::now());
  return std::max(rest, std::chrono::milliseconds(1));
}

// c = a (op) b, elementwise over n elements (Gloo's reduce-function shape).
using ReduceFn = std::function<void(void*, const void*, const void*, size_t)>;

// Buffers up to this many bytes take small_allreduce; larger ones Gloo's ring,
// whose 2(N-1) hops then cost less than log2(N) full-buffer exchanges.
constexpr size_t kSmallAllreduceBytes = 64 * 1024;

// In-place allreduce of `count` elements of `elsize` bytes at `data`, in
// ceil(log2 N) exchange steps (+2 when N is not a power of two).  Every rank ends
// with the same bits.  `timeout` bounds the whole op.
void small_allreduce(const std::shared_ptr<gloo::Context>& ctx, void* data, size_t count,
                     size_t elsize, const ReduceFn& fn, std::chrono::milliseconds timeout);

}  // namespace hpct

namespace hpct {

// One side of a pairwise exchange: a buffer for a peer, or absent (nothing either way).
struct Part {
  void* ptr = nullptr;
  size_t nbytes = 0;
  bool present = false;
};

// Send sends[j] to rank j and receive recvs[j] from rank j, every pair at once, one
// message per pair and direction: a rank posts a send where its part is present and a
// receive of exactly its part's size where it expects one (the same pairs on both sides,
// as every rank makes the same call).  Returns, per rank, the bytes that rank sent where
// it disagreed with the size this rank expects (the message was dropped, nothing failed
// at the transport), else -1.  This rank's own part (sends[rank] to recvs[rank]) is a
// local copy, or reported the same way when its sizes disagree.  `timeout` bounds the
// whole exchange.
std::vector<int64_t> exchange(const std::shared_ptr<gloo::Context>& ctx, const std::vector<Part>& sends,
                              const std::vector<Part>& recvs, std::chrono::milliseconds timeout);

}  // namespace hpct
