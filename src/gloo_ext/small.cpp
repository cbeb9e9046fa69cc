// Recursive-doubling allreduce for small buffers, over Gloo's unbound buffers.
//
// Why not Gloo's ring: a ring allreduce takes 2(N-1) message hops whatever the
// size, so a 4-byte allreduce at N = 16 waits for 30 hops (and, with lazy pairs,
// its first use connects only two neighbours but then serialises all of them).
// Recursive doubling takes log2(N) hops, each a full-buffer exchange with the
// partner rank ^ 2^k; for small buffers latency dominates, so that wins.
//
// Non-power-of-two N: with p the largest power of two <= N, each rank e >= p
// first folds its buffer into rank e - p, sits out the doubling among ranks
// 0..p-1, and receives the result from e - p at the end (two more hops).
//
// Same bits on every rank: at each step both partners combine the same two
// values in the same order, fn(value of the lower rank's block, value of the
// higher rank's block), so they hold identical bits afterwards; by induction
// every rank of 0..p-1 ends with one bit pattern, which the folded ranks receive.
#include "small.h"

#include <algorithm>
#include <vector>

#include "gloo/common/error.h"
#include "gloo/transport/unbound_buffer.h"

namespace hpct {
namespace {

// A slot prefix no Gloo collective (0x01..0x08) and no other hpct message
// (0x20 point to point, 0x21 the lazy group's formation) uses; the step number
// goes in the low bits, so each exchange has its own slot.
constexpr uint64_t kSmallAllreduceSlot = uint64_t(0x22) << 56;

}  // namespace

void small_allreduce(const std::shared_ptr<gloo::Context>& ctx, void* data, size_t count,
                     size_t elsize, const ReduceFn& fn, std::chrono::milliseconds timeout) {
  const int n = ctx->size;
  const int rank = ctx->rank;
  const size_t nbytes = count * elsize;
  if (n == 1 || nbytes == 0) return;
  const auto deadline = std::chrono::steady_clock::now() + timeout;

  int p = 1;
  while (p * 2 <= n) p *= 2;

  std::vector<char> incoming(nbytes);
  auto mine = ctx->createUnboundBuffer(data, nbytes);
  auto theirs = ctx->createUnboundBuffer(incoming.data(), nbytes);
  uint64_t step = 0;

  // Fold: rank e >= p hands its buffer to e - p and waits for the result.
  if (rank >= p) {
    mine->send(rank - p, kSmallAllreduceSlot | step);
    mine->waitSend(left(deadline));
    mine->recv(rank - p, kSmallAllreduceSlot | (step + 1));
    mine->waitRecv(left(deadline));
    return;
  }
  if (rank + p < n) {
    theirs->recv(rank + p, kSmallAllreduceSlot | step);
    theirs->waitRecv(left(deadline));
    fn(data, data, incoming.data(), count);        // lower rank's value first
  }
  step += 2;

  // Doubling among 0..p-1.  The send reads `data` until waitSend returns, so the
  // combine (which overwrites it) waits for both directions.
  for (int mask = 1; mask < p; mask <<= 1, step++) {
    const int peer = rank ^ mask;
    theirs->recv(peer, kSmallAllreduceSlot | step);
    mine->send(peer, kSmallAllreduceSlot | step);
    theirs->waitRecv(left(deadline));
    mine->waitSend(left(deadline));
    if (rank < peer) {
      fn(data, data, incoming.data(), count);
    } else {
      fn(data, incoming.data(), data, count);
    }
  }

  // Unfold: the folded partner receives the result (the fold's second slot).
  if (rank + p < n) {
    mine->send(rank + p, kSmallAllreduceSlot | 1);
    mine->waitSend(left(deadline));
  }
}

}  // namespace hpct
