/*
 * hpct: the log-depth exchange's allgather (Bruck's) and what both halves share; forming
 * the exchange is hpct_exchange_form.cc.  See hpct_exchange.h.
 *
 * Round k of an allgather: rank r holds the 2^k blocks r .. r+2^k-1 (indices mod N); it
 * sends the first min(2^k, N-2^k) of them to rank r-2^k and receives as many, starting at
 * block r+2^k, from rank r+2^k.  After ceil(log2 N) rounds it holds all N, each written at
 * its own index, so the buffer is byte for byte what a ring allgather leaves.
 */
#include "hpct_exchange_wire.h"

#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

namespace hpctx {

double nowMs() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

bool aborted(volatile uint32_t* flag) { return flag && __atomic_load_n(flag, __ATOMIC_ACQUIRE) != 0; }

hpctRingStatus fail(hpctRingError* err, hpctRingStatus status, const char* fmt, ...) {
  if (err) {
    err->status = status;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof(err->message), fmt, ap);
    va_end(ap);
  }
  return status;
}

std::string format(const char* fmt, ...) {
  char buf[HPCT_RING_MESSAGE_BYTES];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  return buf;
}

void setNoDelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

int graceMs(int timeoutMs) {
  int g = timeoutMs / kGraceDivisor;
  return g < kGraceMinMs ? kGraceMinMs : g > kGraceMaxMs ? kGraceMaxMs : g;
}

void closeConn(Conn* c, bool reset) {
  if (c->fd < 0) return;
  if (reset) hpctRingCloseReset(c->fd);
  else close(c->fd);
  c->fd = -1;
}

static void notifyOne(Conn* c, const Failure& f) {
  if (c->fd < 0 || c->closed || c->midFrame) return;
  std::string text = f.originText.substr(0, kMaxNotice);
  Frame h = {kFrameNotice, (uint32_t)f.origin, (uint64_t)f.status, text.size()};
  std::string bytes((const char*)&h, sizeof(h));
  bytes += text;
  // Into an idle connection's empty send buffer: whole or not at all matters little, the
  // peer treats a cut notice as the connection's end.
  (void)!send(c->fd, bytes.data(), bytes.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
}

void notifyAll(std::vector<Conn>* a, std::vector<Conn>* b, const Failure& f, int /*self*/) {
  for (auto* v : {a, b})
    if (v)
      for (auto& c : *v) notifyOne(&c, f);
}

NoticeRead readNotice(Conn* c) {
  if (c->inGot < sizeof(Frame)) {
    ssize_t n = recv(c->fd, (char*)&c->in + c->inGot, sizeof(Frame) - c->inGot, 0);
    if (n == 0) return kNoticeClosed;
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? kNoticeNone : kNoticeClosed;
    c->inGot += n;
    if (c->inGot < sizeof(Frame)) return kNoticeNone;
    if (c->in.type != kFrameNotice || c->in.len > kMaxNotice) return kNoticeBad;
    c->inText.clear();
  }
  while (c->inText.size() < c->in.len) {
    char buf[kMaxNotice];
    ssize_t n = recv(c->fd, buf, c->in.len - c->inText.size(), 0);
    if (n == 0) return kNoticeClosed;
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR ? kNoticeNone : kNoticeClosed;
    c->inText.append(buf, n);
  }
  return kNoticeDone;
}

hpctRingStatus failFromNotice(hpctRingError* err, Failure* f, int self, int nranks, const Frame& h,
                              const std::string& text) {
  f->status = hpctRingPeerFailed;
  f->origin = (int)h.a;
  f->originText = text;
  f->message = format("rank %d of %d: the bootstrap exchange failed at rank %u: %s", self, nranks, h.a, text.c_str());
  return fail(err, f->status, "%s", f->message.c_str());
}

}  // namespace hpctx

using namespace hpctx;

namespace {

// One direction of one round: a frame header and up to two runs of blocks (the range wraps).
struct Transfer {
  Frame head;
  struct iovec iov[3];
  int count = 0;
  size_t total = 0, done = 0;

  void set(char* data, size_t size, int nranks, int first, int blocks) {
    iov[0] = {&head, sizeof(head)};
    count = 1;
    int run = blocks < nranks - first ? blocks : nranks - first;
    iov[count++] = {data + (size_t)first * size, (size_t)run * size};
    if (run < blocks) iov[count++] = {data, (size_t)(blocks - run) * size};
    total = done = 0;
    for (int i = 0; i < count; i++) total += iov[i].iov_len;
  }

  // Move what the socket takes or gives now, up to limit bytes in all; false on end of
  // file or a socket error.
  bool progress(int fd, bool out, size_t limit, int* sysErr) {
    struct iovec rest[3];
    int n = 0;
    size_t skip = done, room = limit - done;
    for (int i = 0; i < count && room > 0; i++) {
      if (skip >= iov[i].iov_len) {
        skip -= iov[i].iov_len;
        continue;
      }
      size_t len = iov[i].iov_len - skip < room ? iov[i].iov_len - skip : room;
      rest[n].iov_base = (char*)iov[i].iov_base + skip;
      rest[n++].iov_len = len;
      room -= len;
      skip = 0;
    }
    if (n == 0) return true;
    struct msghdr msg;
    memset(&msg, 0, sizeof(msg));
    msg.msg_iov = rest;
    msg.msg_iovlen = n;
    ssize_t got = out ? sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT) : recvmsg(fd, &msg, MSG_DONTWAIT);
    if (got > 0) done += got;
    if (got == 0 && !out) {
      *sysErr = 0;
      return false;
    }
    if (got < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
      *sysErr = errno;
      return false;
    }
    return true;
  }
};

class Gather {
 public:
  Gather(hpctExchange* x, char* data, size_t size) : x_(x), data_(data), size_(size) {}

  hpctRingStatus run(hpctRingError* err) {
    double start = nowMs();
    seq_ = ++x_->sequence;
    deadline_ = start + (x_->timeoutMs > 0 ? x_->timeoutMs : 300000);
    for (round_ = 0; round_ < x_->rounds; round_++) {
      hpctRingStatus s = oneRound(err);
      if (s != hpctRingOk) return s;
    }
    double ms = nowMs() - start;
    x_->stats.allgathers++;
    x_->stats.allgatherMs += ms;
    x_->stats.lastAllgatherMs = ms;
    return hpctRingOk;
  }

 private:
  hpctExchange* x_;
  char* data_;
  size_t size_;
  uint64_t seq_ = 0;
  int round_ = 0;
  double deadline_ = 0;

  hpctRingStatus failHere(hpctRingError* err, hpctRingStatus status, const std::string& message) {
    Failure& f = x_->failure;
    f.status = status;
    f.origin = x_->rank;
    f.originText = f.message = message;
    return fail(err, status, "%s", message.c_str());
  }

  std::string where() const {
    return format("rank %d of %d, bootstrap allgather #%llu (%zu bytes per rank), round %d of %d", x_->rank,
                  x_->nranks, (unsigned long long)seq_, size_, round_, x_->rounds);
  }

  hpctRingStatus oneRound(hpctRingError* err) {
    int n = x_->nranks, r = x_->rank, step = 1 << round_;
    int blocks = step < n - step ? step : n - step;
    Conn& to = x_->accepted[round_];
    Conn& from = x_->opened[round_];
    Transfer out, in;
    out.set(data_, size_, n, r, blocks);
    out.head = Frame{kFrameData, (uint32_t)round_, seq_, (uint64_t)blocks * size_};
    in.set(data_, size_, n, (r + step) % n, blocks);
    const Frame want = out.head;
    bool headChecked = false;   // the payload is read only once its header is known to be this round's
    std::vector<struct pollfd> fds;
    for (;;) {
      bool sending = out.done < out.total, receiving = in.done < in.total;
      if (!sending && !receiving) {
        x_->stats.bytesReceived += in.total - sizeof(Frame);
        return hpctRingOk;
      }
      if (aborted(x_->abortFlag))
        return failHere(err, hpctRingAborted,
                        format("%s: aborted while %s", where().c_str(), waitingFor(sending, receiving, in, out).c_str()));
      if (nowMs() >= deadline_)
        return failHere(err, hpctRingTimeout,
                        format("%s: timed out after %.1f s %s", where().c_str(), x_->timeoutMs / 1e3,
                               waitingFor(sending, receiving, in, out).c_str()));
      fds.clear();
      fds.push_back({receiving ? from.fd : -1, POLLIN, 0});
      for (auto& c : x_->accepted) {
        short ev = (short)((c.closed ? 0 : POLLIN) | (&c == &to && sending ? POLLOUT : 0));
        fds.push_back({ev ? c.fd : -1, ev, 0});
      }
      if (poll(fds.data(), fds.size(), kPollSliceMs) < 0 && errno != EINTR)
        return failHere(err, hpctRingSystem, format("%s: poll(): %s", where().c_str(), strerror(errno)));
      int sysErr = 0;
      if (fds[0].revents) {
        if (!in.progress(from.fd, false, headChecked ? in.total : sizeof(Frame), &sysErr))
          return peerGone(err, from, sysErr, "before sending its data");
        if (!headChecked && in.done == sizeof(Frame)) {
          if (in.head.type == kFrameNotice) return noticeInstead(err, &from, in.head);
          if (in.head.type != want.type || in.head.a != want.a || in.head.b != want.b || in.head.len != want.len)
            return failHere(err, hpctRingMismatch,
                            format("%s: rank %d at %s sent frame type %u round %u allgather #%llu of %llu bytes, "
                                   "expected round %u of #%llu, %llu bytes: the ranks ran different bootstrap "
                                   "allgathers",
                                   where().c_str(), from.rank, from.addr.c_str(), in.head.type, in.head.a,
                                   (unsigned long long)in.head.b, (unsigned long long)in.head.len, want.a,
                                   (unsigned long long)want.b, (unsigned long long)want.len));
          headChecked = true;
        }
      }
      for (size_t i = 0; i < x_->accepted.size(); i++) {
        Conn& c = x_->accepted[i];
        short ev = fds[1 + i].revents;
        if (&c == &to && sending && (ev & (POLLOUT | POLLERR | POLLHUP))) {
          bool ok = out.progress(c.fd, true, out.total, &sysErr);
          c.midFrame = out.done > 0 && out.done < out.total;   // no notice may cut into it
          if (!ok) return peerGone(err, c, sysErr, "before taking this rank's data");
        }
        if (!(ev & (POLLIN | POLLHUP | POLLERR)) || c.closed) continue;
        NoticeRead got = readNotice(&c);
        if (got == kNoticeDone) return failFromNotice(err, &x_->failure, x_->rank, x_->nranks, c.in, c.inText);
        // A peer that is through with every allgather may close; one that still needed our
        // data fails and says so to someone, so an end here is no error by itself.
        if (got == kNoticeClosed) c.closed = true;
        if (got == kNoticeBad)
          return failHere(err, hpctRingMismatch,
                          format("%s: rank %d at %s sent bytes that are no notice on a connection that carries none",
                                 where().c_str(), c.rank, c.addr.c_str()));
      }
    }
  }

  std::string waitingFor(bool sending, bool receiving, const Transfer& in, const Transfer& out) const {
    std::string what;
    const Conn& from = x_->opened[round_];
    const Conn& to = x_->accepted[round_];
    if (receiving)
      what += format("waiting for rank %d at %s (%zu of %zu bytes received)", from.rank, from.addr.c_str(), in.done,
                     in.total);
    if (sending)
      what += format("%ssending to rank %d at %s (%zu of %zu bytes taken)", receiving ? "; " : "", to.rank,
                     to.addr.c_str(), out.done, out.total);
    return what;
  }

  hpctRingStatus peerGone(hpctRingError* err, Conn& c, int sysErr, const char* when) {
    c.closed = true;
    return failHere(err, hpctRingPeerFailed,
                    format("%s: rank %d at %s closed the connection %s (%s): that process failed or exited",
                           where().c_str(), c.rank, c.addr.c_str(), when, sysErr ? strerror(sysErr) : "end of file"));
  }

  // The peer sent a notice where this round's data was due: read its text to the end.
  hpctRingStatus noticeInstead(hpctRingError* err, Conn* from, const Frame& head) {
    from->in = head;
    from->inGot = sizeof(Frame);
    from->inText.clear();
    NoticeRead got = head.len <= kMaxNotice ? kNoticeNone : kNoticeBad;
    double until = nowMs() + 1000;  // the rest of a short message from a peer that wrote it at once
    while (got == kNoticeNone && (got = readNotice(from)) == kNoticeNone && nowMs() < until) {
      struct pollfd p = {from->fd, POLLIN, 0};
      poll(&p, 1, kPollSliceMs);
    }
    if (got != kNoticeDone) from->inText += " (cut short)";
    return failFromNotice(err, &x_->failure, x_->rank, x_->nranks, from->in, from->inText);
  }
};

}  // namespace

extern "C" {

int hpctExchangeRounds(int nranks) {
  int k = 0;
  while (k < 31 && (1 << k) < nranks) k++;
  return k;
}

hpctRingStatus hpctExchangeAllGather(hpctExchange* x, void* data, size_t size, hpctRingError* err) {
  if (x == NULL || (data == NULL && size > 0)) return fail(err, hpctRingSystem, "hpctExchangeAllGather: missing argument");
  if (x->failure.status != hpctRingOk) return fail(err, x->failure.status, "%s", x->failure.message.c_str());
  Gather g(x, (char*)data, size);
  hpctRingStatus s = g.run(err);
  if (s != hpctRingOk) {
    if (x->failure.status == hpctRingOk) {  // a failure with no message kept: keep this one
      x->failure.status = s;
      x->failure.origin = x->rank;
      x->failure.originText = x->failure.message = err ? err->message : "bootstrap allgather failed";
    }
    notifyAll(&x->opened, &x->accepted, x->failure, x->rank);
  } else if (err) {
    err->status = hpctRingOk;
    err->message[0] = '\0';
  }
  return s;
}

void hpctExchangeStatsOf(const hpctExchange* x, hpctExchangeStats* stats) {
  if (x && stats) *stats = x->stats;
}

void hpctExchangeClose(hpctExchange* x, int reset) {
  if (x == NULL) return;
  // Gracefully by default, also after a failure: a reset could discard the notice just sent.
  for (auto* v : {&x->opened, &x->accepted})
    for (auto& c : *v) closeConn(&c, reset != 0);
  delete x;
}

}  // extern "C"
