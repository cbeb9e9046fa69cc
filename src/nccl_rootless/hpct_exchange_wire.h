/*
 * hpct: what the two halves of the log-depth exchange share (hpct_exchange_form.cc forms
 * it, hpct_exchange.cc runs its allgathers): the wire formats, one connection's state and
 * the exchange itself.  C++ only, internal to the exchange.
 *
 * A connection of round k joins rank r (which opened it) and rank r + 2^k (which accepted
 * it).  Opening: Hello from r, Ack from r + 2^k, then an Addr frame carrying the address
 * of rank r + 2^(k+1), which r opens in round k+1.  Afterwards data flows one way only,
 * from the acceptor to the opener (Bruck's round k), so anything an opener sends later is
 * a Notice: the reason it failed.
 */
#ifndef HPCT_EXCHANGE_WIRE_H_
#define HPCT_EXCHANGE_WIRE_H_

#include <stddef.h>
#include <stdint.h>

#include <string>
#include <vector>

#include "hpct_exchange.h"
#include "hpct_ring.h"

namespace hpctx {

const uint64_t kProto = 0x3158474f4c544348ULL;  // "HCTLOGX1" read as little-endian bytes
const int kPollSliceMs = 10;       // bounds how late an abort is noticed
const int kDefaultAckTimeoutMs = 3000;
const int kDefaultRetryDelayMs = 100;
const size_t kMaxAddr = 512;        // a "host:port" in a Hello or an Addr frame
const size_t kMaxNotice = 800;      // a notice's text (a peer's error message)
const int kNotesKept = 3;
// After the deadline, a rank that waits only on peers that are alive (it reached them) waits
// this much longer for their notice: the ranks that wait on the missing one directly give up
// at their deadline and say who it is; the others then fail with that cause, not a bystander.
const int kGraceMinMs = 500, kGraceMaxMs = 5000, kGraceDivisor = 4;

struct Hello {
  uint64_t proto;
  uint64_t magic;
  uint32_t rank, nranks, generation, group, round, addrLen;  // then addrLen bytes: the opener's address
};

enum AckCode : uint32_t {
  kAccepted = 0,
  kOtherJob = 1,       // magic differs: another job key or group index
  kYouAreOlder = 2,    // the opener's generation is older than the acceptor's
  kYouAreNewer = 3,    // the acceptor is the older one; it is about to be replaced
  kWrongPeer = 4,      // the opener is not the acceptor's peer of that round
  kOtherSize = 5       // nranks differs
};

struct Ack {
  uint64_t proto;
  uint32_t code, rank, nranks, generation;
  uint64_t magic;
};

enum FrameType : uint32_t { kFrameAddr = 1, kFrameData = 2, kFrameNotice = 3 };

// Addr: a = round.  Data: a = round, b = allgather sequence number.  Notice: a = the rank
// where the failure began, b = its status; the payload is that rank's message.
struct Frame {
  uint32_t type, a;
  uint64_t b, len;
};

static_assert(sizeof(Hello) == 40 && sizeof(Ack) == 32 && sizeof(Frame) == 24, "wire structs");

// One established connection, as either end sees it.
struct Conn {
  int fd = -1;
  int rank = -1;
  std::string addr;          // the peer's listen address
  bool closed = false;       // the peer closed its end (seen as end of file)
  bool midFrame = false;     // a frame of ours is partly sent: a notice may not follow it
  Frame in;                  // an inbound notice being read (accepted connections)
  size_t inGot = 0;
  std::string inText;
  bool dataWaiting = false;  // (forming) an early allgather's data waits on this opened connection
};

inline Conn makeConn(int fd, int rank, const std::string& addr) {
  Conn c;
  c.fd = fd;
  c.rank = rank;
  c.addr = addr;
  return c;
}

// Why an exchange failed, kept for every later call and passed on to the peers.
struct Failure {
  hpctRingStatus status = hpctRingOk;
  int origin = -1;           // the rank where it began
  std::string originText;    // that rank's message
  std::string message;       // this rank's message
};

enum NoticeRead { kNoticeNone, kNoticeDone, kNoticeClosed, kNoticeBad };

double nowMs();
bool aborted(volatile uint32_t* flag);
hpctRingStatus fail(hpctRingError* err, hpctRingStatus status, const char* fmt, ...)
    __attribute__((format(printf, 3, 4)));
std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void setNoDelay(int fd);
int graceMs(int timeoutMs);
// Best effort: tell every connected peer why this rank fails (never blocks, never splits a frame).
void notifyAll(std::vector<Conn>* a, std::vector<Conn>* b, const Failure& f, int self);
// Read what an opener may send on an accepted connection: nothing but a notice, or its end.
NoticeRead readNotice(Conn* c);
// "the bootstrap exchange failed at rank R: <R's message>", as a rank that got a notice says it.
hpctRingStatus failFromNotice(hpctRingError* err, Failure* f, int self, int nranks, const Frame& h,
                              const std::string& text);
void closeConn(Conn* c, bool reset);

}  // namespace hpctx

struct hpctExchange {
  int rank = 0, nranks = 1, rounds = 0;
  int timeoutMs = 0;
  volatile uint32_t* abortFlag = nullptr;
  std::string listenAddr;
  std::vector<hpctx::Conn> opened;     // [k]: to rank + 2^k; round k's data comes from it
  std::vector<hpctx::Conn> accepted;   // [k]: from rank - 2^k; round k's data goes to it
  uint64_t sequence = 0;
  hpctExchangeStats stats = {};
  hpctx::Failure failure;
};

#endif
