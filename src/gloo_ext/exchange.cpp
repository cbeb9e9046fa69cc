// Pairwise exchange for all_to_all, gather and scatter (small.h: exchange).
//
// Why one round with a header: the receiver of a Gloo unbound buffer must post a
// receive of exactly the sender's size (patch 0010 fails the pair otherwise), so the
// sizes have to be known before data is received.  An allgather of a size table first
// cost N-1 ring hops and a second round; here each header travels right ahead of its
// data on the same pair, and the receiver, once it has read the header, receives the
// announced bytes (into scratch when they are not what it expects: the op reports the
// disagreement, the pair stays usable).  Everything runs without the GIL.
#include <algorithm>
#include <string>
#include <vector>

#include "small.h"
#include "gloo/transport/unbound_buffer.h"

namespace hpct {
namespace {

// Slot prefixes no Gloo collective (0x01..0x08) and no other hpct message (0x20..0x22) uses.
constexpr uint64_t kHeaderSlot = uint64_t(0x23) << 56;
constexpr uint64_t kDataSlot = uint64_t(0x24) << 56;

}  // namespace

std::vector<std::pair<int64_t, int64_t>> exchange(const std::shared_ptr<gloo::Context>& ctx,
                                                  const std::vector<Part>& sends,
                                                  const std::vector<Part>& recvs,
                                                  std::chrono::milliseconds timeout) {
  const int n = ctx->size;
  const int me = ctx->rank;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<std::pair<int64_t, int64_t>> theirs(n, {-1, -1});
  std::vector<int64_t> mine(2 * n, -1);
  std::vector<int64_t> got(2 * n, -1);
  std::vector<int> peers;
  for (int j = 0; j < n; j++) {
    if (j == me || !(sends[j].present || recvs[j].present)) continue;
    peers.push_back(j);
    mine[2 * j] = sends[j].present ? static_cast<int64_t>(sends[j].nbytes) : -1;
    mine[2 * j + 1] = recvs[j].present ? static_cast<int64_t>(recvs[j].nbytes) : -1;
  }
  if (peers.empty()) return theirs;
  const size_t header = 2 * sizeof(int64_t);
  auto out_headers = ctx->createUnboundBuffer(mine.data(), mine.size() * sizeof(int64_t));
  auto in_headers = ctx->createUnboundBuffer(got.data(), got.size() * sizeof(int64_t));
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> data_out;
  for (int j : peers) {
    in_headers->recv(j, kHeaderSlot, j * header, header);
  }
  for (int j : peers) {
    out_headers->send(j, kHeaderSlot, j * header, header);
    if (sends[j].present && sends[j].nbytes > 0) {   // right behind its header
      data_out.push_back(ctx->createUnboundBuffer(sends[j].ptr, sends[j].nbytes));
      data_out.back()->send(j, kDataSlot);
    }
  }
  // Headers first (any order), then the announced data.
  for (size_t i = 0; i < peers.size(); i++) in_headers->waitRecv(left(deadline));
  std::vector<std::vector<char>> scratch;
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> data_in;
  for (int j : peers) {
    theirs[j] = {got[2 * j], got[2 * j + 1]};
    const int64_t announced = got[2 * j];
    if (announced <= 0) continue;
    void* into;
    if (recvs[j].present && static_cast<int64_t>(recvs[j].nbytes) == announced) {
      into = recvs[j].ptr;
    } else {
      scratch.emplace_back(static_cast<size_t>(announced));
      into = scratch.back().data();
    }
    data_in.push_back(ctx->createUnboundBuffer(into, static_cast<size_t>(announced)));
    data_in.back()->recv(j, kDataSlot);
  }
  for (auto& b : data_in) b->waitRecv(left(deadline));
  for (auto& b : data_out) b->waitSend(left(deadline));
  for (size_t i = 0; i < peers.size(); i++) out_headers->waitSend(left(deadline));
  return theirs;
}

}  // namespace hpct
