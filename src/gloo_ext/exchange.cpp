// Pairwise exchange for all_to_all, gather and scatter (small.h: exchange).
//
// Why no size header: a receive posted at once, of the size the caller expects, lets the
// sender's bytes go out as soon as it posts them: one message per pair, as in Gloo's own
// alltoall.  A size the two ranks disagree on must still fail this op only, never the
// pair (the group would be lost): patch 0020's reportSizeMismatch has Gloo drop such a
// message and fail its receive with SizeMismatchException, which names the sent size.
// (A header ahead of each message cost a round trip per op.)  Runs without the GIL.
#include <cstring>
#include <vector>

#include "small.h"
#include "gloo/common/error.h"
#include "gloo/transport/unbound_buffer.h"

namespace hpct {
namespace {

// A slot prefix no Gloo collective (0x01..0x08) and no other hpct message (0x20..0x22) uses.
constexpr uint64_t kDataSlot = uint64_t(0x24) << 56;

}  // namespace

std::vector<int64_t> exchange(const std::shared_ptr<gloo::Context>& ctx, const std::vector<Part>& sends,
                              const std::vector<Part>& recvs, std::chrono::milliseconds timeout) {
  const int n = ctx->size;
  const int me = ctx->rank;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<int64_t> sent(n, -1);
  char nothing = 0;     // where an empty part points: Gloo moves 0 bytes, but wants a buffer
  auto buffer = [&](const Part& p) {
    return ctx->createUnboundBuffer(p.nbytes ? p.ptr : &nothing, p.nbytes);
  };
  // Peers in the order me+1, me+2, ...: N ranks start on N different pairs, not all on rank 0.
  std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> ins, outs;
  std::vector<int> from;
  for (int i = 1; i < n; i++) {
    const int j = (me + i) % n;
    if (!recvs[j].present) continue;
    ins.push_back(buffer(recvs[j]));
    ins.back()->reportSizeMismatch = true;
    ins.back()->recv(j, kDataSlot, 0, recvs[j].nbytes);
    from.push_back(j);
  }
  for (int i = 1; i < n; i++) {
    const int j = (me + i) % n;
    if (!sends[j].present) continue;
    outs.push_back(buffer(sends[j]));
    outs.back()->send(j, kDataSlot, 0, sends[j].nbytes);
  }
  // This rank's own part: a local copy while the messages travel.
  if (sends[me].present && recvs[me].present) {
    if (sends[me].nbytes != recvs[me].nbytes) {
      sent[me] = static_cast<int64_t>(sends[me].nbytes);
    } else if (sends[me].nbytes && sends[me].ptr != recvs[me].ptr) {
      std::memmove(recvs[me].ptr, sends[me].ptr, sends[me].nbytes);
    }
  }
  for (size_t i = 0; i < ins.size(); i++) {
    try {
      ins[i]->waitRecv(left(deadline));
    } catch (const gloo::SizeMismatchException& err) {
      sent[from[i]] = static_cast<int64_t>(err.sentBytes);
    }
  }
  for (auto& b : outs) b->waitSend(left(deadline));
  return sent;
}

}  // namespace hpct
