// Log-depth allreduce for small buffers (small.cpp).
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>

#include "gloo/context.h"

namespace hpct {

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
