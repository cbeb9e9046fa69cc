/*
 * hpct: forming the log-depth exchange (see hpct_exchange.h).
 *
 * Round k: rank r opens a connection to rank r + 2^k, whose address it learnt in round
 * k-1 (round 0: the next rank's, from the caller), and accepts one from rank r - 2^k.
 * The acceptor answers the handshake at once and sends the address of its own
 * rank + 2^k as soon as it knows it, which is what the opener dials in round k+1.  All
 * of it runs in one poll loop: a rank that waited for its own handshakes before accepting
 * would deadlock, since every answer depends on another rank's progress.
 */
#include "hpct_exchange_wire.h"

#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

using namespace hpctx;

namespace {

std::string peerName(const struct sockaddr_storage* ss) {
  char host[INET6_ADDRSTRLEN] = "?";
  if (ss->ss_family == AF_INET) {
    const struct sockaddr_in* a = (const struct sockaddr_in*)ss;
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    return std::string(host) + ":" + std::to_string(ntohs(a->sin_port));
  }
  const struct sockaddr_in6* a = (const struct sockaddr_in6*)ss;
  if (ss->ss_family == AF_INET6) inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
  return "[" + std::string(host) + "]:" + std::to_string(ss->ss_family == AF_INET6 ? ntohs(a->sin6_port) : 0);
}

// A connection this rank accepted whose Hello (and the opener's address after it) is not complete.
struct Incoming {
  int fd;
  double sinceMs;
  std::string peer;
  size_t got;
  char buf[sizeof(Hello) + kMaxAddr];
};

class Former {
 public:
  Former(int listenFd, const hpctRingConfig* cfg, hpctExchange* x) : cfg_(cfg), listenFd_(listenFd), x_(x) {
    n_ = cfg->nranks;
    r_ = cfg->rank;
    k_ = x->rounds;
    known_.assign(k_ + 1, std::string());
    known_[0] = cfg->nextAddr;
    ackTimeoutMs_ = cfg->ackTimeoutMs > 0 ? cfg->ackTimeoutMs : kDefaultAckTimeoutMs;
    seed_ = (unsigned)(getpid() * 2654435761u) ^ (unsigned)r_ ^ (unsigned)nowMs();
    outbox_.assign(k_, std::string());
    addrQueued_.assign(k_, false);
  }

  hpctRingStatus run(hpctRingError* err) {
    double start = nowMs();
    double deadline = start + (cfg_->timeoutMs > 0 ? cfg_->timeoutMs : 300000);
    double lastCall = deadline + graceMs(cfg_->timeoutMs > 0 ? cfg_->timeoutMs : 300000);
    hpctRingStatus s = hpctRingOk;
    std::vector<struct pollfd> fds;
    for (;;) {
      double now = nowMs();
      if (aborted(cfg_->abortFlag)) {
        s = failHere(err, hpctRingAborted,
                     format("rank %d of %d: forming the log-depth bootstrap exchange was aborted in round %d of %d "
                            "(%s)", r_, n_, round_, k_, dialState().c_str()));
        break;
      }
      if (done()) break;
      // Past the deadline a rank whose own connection does not answer fails at once; one
      // that waits only on live peers gives their notice the grace to arrive.
      if ((now >= deadline && dialing()) || now >= lastCall) {
        s = failHere(err, hpctRingTimeout, timeoutMessage(now - start));
        break;
      }
      if (state_ == kIdle && round_ < k_ && now >= nextTryMs_ && (s = startConnect(now, err)) != hpctRingOk) break;
      queueAddresses();
      fds.clear();
      fds.push_back({listenFd_, POLLIN, 0});
      short dialEv = state_ == kConnecting || state_ == kSending ? POLLOUT : state_ >= kWaitAck ? POLLIN : 0;
      fds.push_back({dialEv ? fd_ : -1, dialEv, 0});
      for (auto& c : x_->accepted) {
        short ev = (short)((c.fd >= 0 && !c.closed ? POLLIN : 0) |
                           (c.fd >= 0 && !outbox_[&c - &x_->accepted[0]].empty() ? POLLOUT : 0));
        fds.push_back({ev ? c.fd : -1, ev, 0});
      }
      // Opened connections of finished rounds carry nothing in forming but a notice (or an
      // early allgather's data, which waits there): a peer's failure reaches this rank at once.
      for (int j = 0; j < k_; j++) {
        const Conn& c = x_->opened[j];
        bool watch = j < round_ && c.fd >= 0 && !c.closed && !c.dataWaiting;
        fds.push_back({watch ? c.fd : -1, POLLIN, 0});
      }
      for (auto& p : incoming_) fds.push_back({p.fd, POLLIN, 0});
      int wait = kPollSliceMs;
      if (state_ == kIdle && nextTryMs_ - now < wait) wait = nextTryMs_ > now ? (int)(nextTryMs_ - now) : 0;
      if (poll(fds.data(), fds.size(), wait) < 0 && errno != EINTR) {
        s = failHere(err, hpctRingSystem, format("rank %d: poll(): %s", r_, strerror(errno)));
        break;
      }
      now = nowMs();
      if ((s = progressDial(fds[1].revents, now, err)) != hpctRingOk) break;
      if ((s = progressAccepted(fds, 2, err)) != hpctRingOk) break;
      if ((s = progressOpened(fds, 2 + k_, err)) != hpctRingOk) break;
      if ((s = progressIncoming(fds, 2 + 2 * k_, now, err)) != hpctRingOk) break;
      if (fds[0].revents & POLLIN) acceptAll(now);
    }
    for (auto& p : incoming_) hpctRingCloseReset(p.fd);
    incoming_.clear();
    x_->stats.formMs = nowMs() - start;
    if (s != hpctRingOk) {
      if (state_ == kWaitAddr) x_->opened[round_] = makeConn(fd_, target(), known_[round_]);   // it may hear why
      else if (fd_ >= 0) hpctRingCloseReset(fd_);
      fd_ = -1;
      notifyAll(&x_->opened, &x_->accepted, x_->failure, r_);
    }
    return s;
  }

 private:
  enum State { kIdle, kConnecting, kSending, kWaitAck, kWaitAddr };
  const hpctRingConfig* cfg_;
  int listenFd_;
  hpctExchange* x_;
  int n_ = 1, r_ = 0, k_ = 0, ackTimeoutMs_ = 0;
  unsigned seed_ = 0;
  std::vector<std::string> known_;        // [j]: the address of rank + 2^j, once learnt
  std::vector<std::string> outbox_;       // [k]: what is still to be sent on accepted[k]
  std::vector<bool> addrQueued_;
  std::vector<Incoming> incoming_;
  std::vector<std::string> notes_;
  // The connection being opened (round round_).
  int round_ = 0;
  State state_ = kIdle;
  int fd_ = -1;
  struct sockaddr_storage addr_;
  unsigned addrLen_ = 0;
  std::string hello_;
  size_t offset_ = 0;
  char in_[sizeof(Ack) + sizeof(Frame) + kMaxNotice];
  size_t got_ = 0;
  double nextTryMs_ = 0, sentMs_ = 0;
  int attempts_ = 0, backoffMs_ = 1;
  std::string lastError_ = "no attempt yet";

  int target() const { return (r_ + (1 << round_)) % n_; }
  int source(int k) const { return (r_ - (1 << k) % n_ + n_) % n_; }
  bool dialing() const { return round_ < k_ && state_ != kWaitAddr; }

  bool done() const {
    if (round_ < k_) return false;
    for (int k = 0; k < k_; k++)
      if (x_->accepted[k].fd < 0 || !addrQueued_[k] || !outbox_[k].empty()) return false;
    return true;
  }

  void note(const std::string& s) {
    if ((int)notes_.size() < kNotesKept) notes_.push_back(s);
  }

  hpctRingStatus failHere(hpctRingError* err, hpctRingStatus status, const std::string& message) {
    Failure& f = x_->failure;
    f.status = status;
    f.origin = r_;
    f.originText = f.message = message;
    return fail(err, status, "%s", message.c_str());
  }

  std::string dialState() const {
    if (round_ >= k_) return "every connection of its own opened";
    if (state_ == kWaitAddr)
      return format("rank %d at %s accepted but has not sent the address of rank %d; it waits for its own peers",
                    target(), known_[round_].c_str(), (r_ + (2 << round_)) % n_);
    return format("rank %d at %s did not answer (%d connect attempts; last: %s)", target(), known_[round_].c_str(),
                  attempts_, lastError_.c_str());
  }

  std::string timeoutMessage(double elapsed) const {
    std::string what = round_ < k_ ? dialState() : std::string();
    for (int k = 0; k < k_; k++)
      if (x_->accepted[k].fd < 0)
        what += format("%srank %d never connected (round %d; this rank listens on %s)", what.empty() ? "" : "; ",
                       source(k), k, cfg_->listenAddr ? cfg_->listenAddr : "its fixed address");
    if (!notes_.empty()) {
      what += format("; refused %d connection(s): ", x_->stats.refusedConnections);
      for (size_t i = 0; i < notes_.size(); i++) what += (i ? ", " : "") + notes_[i];
    }
    return format("rank %d of %d timed out after %.1f s forming the log-depth bootstrap exchange (round %d of %d): %s",
                  r_, n_, elapsed / 1e3, round_ < k_ ? round_ : k_, k_, what.c_str());
  }

  // Exponential backoff with +/-50 % jitter, capped by retryDelayMs, so that the ranks
  // waiting for one late peer do not knock on its door in lock step.
  void retryLater(const std::string& why, double now) {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
    state_ = kIdle;
    lastError_ = why;
    int cap = cfg_->retryDelayMs > 0 ? cfg_->retryDelayMs : kDefaultRetryDelayMs;
    if (backoffMs_ < cap) backoffMs_ = backoffMs_ * 2 > cap ? cap : backoffMs_ * 2;
    double jitter = 0.5 + (rand_r(&seed_) % 1001) / 1000.0;
    nextTryMs_ = now + backoffMs_ * jitter;
  }

  hpctRingStatus startConnect(double now, hpctRingError* err) {
    if (attempts_ == 0) {
      hpctRingError perr;
      if (hpctRingParseAddr(known_[round_].c_str(), &addr_, &addrLen_, &perr) != hpctRingOk)
        return failHere(err, hpctRingBadAddress,
                        format("rank %d of %d, round %d: the address of rank %d: %s", r_, n_, round_, target(),
                               perr.message));
      Hello h = {kProto, cfg_->magic, (uint32_t)r_, (uint32_t)n_, cfg_->generation, cfg_->group, (uint32_t)round_, 0};
      std::string mine = cfg_->listenAddr ? std::string(cfg_->listenAddr).substr(0, kMaxAddr) : std::string();
      h.addrLen = (uint32_t)mine.size();
      hello_.assign((const char*)&h, sizeof(h));
      hello_ += mine;
    }
    attempts_++;
    x_->stats.connectAttempts++;
    fd_ = socket(addr_.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd_ < 0) return failHere(err, hpctRingSystem, format("rank %d: socket(): %s", r_, strerror(errno)));
    setNoDelay(fd_);
    offset_ = got_ = 0;
    if (connect(fd_, (struct sockaddr*)&addr_, addrLen_) == 0) state_ = kSending;
    else if (errno == EINPROGRESS) state_ = kConnecting;
    else retryLater(strerror(errno), now);
    return hpctRingOk;
  }

  hpctRingStatus onAck(double now, hpctRingError* err) {
    Ack a;
    memcpy(&a, in_, sizeof(a));
    const char* where = known_[round_].c_str();
    if (a.proto != kProto) {
      retryLater("the process at that address does not speak hpct's exchange handshake", now);
      return hpctRingOk;
    }
    switch (a.code) {
      case kAccepted:
        if ((int)a.rank != target() || (int)a.nranks != n_ || a.generation != cfg_->generation)
          return failHere(err, hpctRingMismatch,
                          format("rank %d: %s accepted as rank %u of %u at generation %u, expected rank %d of %d at "
                                 "generation %u: the ranks' port plans differ",
                                 r_, where, a.rank, a.nranks, a.generation, target(), n_, cfg_->generation));
        state_ = kWaitAddr;
        got_ = 0;
        return hpctRingOk;
      case kYouAreOlder:
        return failHere(err, hpctRingStale,
                        format("rank %d is at generation %u, but rank %u at %s is at generation %u: this process "
                               "belongs to a membership that has been replaced; rejoin at generation %u",
                               r_, cfg_->generation, a.rank, where, a.generation, a.generation));
      case kYouAreNewer:
        retryLater(format("%s is held by rank %u of the older generation %u (expected %u)", where, a.rank,
                          a.generation, cfg_->generation),
                   now);
        return hpctRingOk;
      case kOtherJob:
        retryLater(format("%s is held by a process of another job or group (rank %u there)", where, a.rank), now);
        return hpctRingOk;
      case kWrongPeer:
        return failHere(err, hpctRingMismatch,
                        format("rank %d connected to %s in round %d, which is rank %u and expects another rank there: "
                               "two ranks share an address or the port plans differ",
                               r_, where, round_, a.rank));
      case kOtherSize:
        return failHere(err, hpctRingMismatch, format("nranks mismatch: rank %u at %s has nranks %u, rank %d has %d",
                                                      a.rank, where, a.nranks, r_, n_));
      default:
        retryLater("unknown answer to the handshake", now);
        return hpctRingOk;
    }
  }

  // The Addr frame (or a notice) after the Ack: the next round's address.
  hpctRingStatus onFrame(double now, bool* complete, hpctRingError* err) {
    Frame f;
    memcpy(&f, in_, sizeof(f));
    *complete = false;
    if ((f.type != kFrameAddr && f.type != kFrameNotice) || f.len > (f.type == kFrameAddr ? kMaxAddr : kMaxNotice))
      return failHere(err, hpctRingMismatch,
                      format("rank %d of %d, round %d: rank %d at %s sent a frame of type %u and %llu bytes where the "
                             "next address was due",
                             r_, n_, round_, target(), known_[round_].c_str(), f.type, (unsigned long long)f.len));
    if (got_ < sizeof(Frame) + f.len) return hpctRingOk;
    std::string text(in_ + sizeof(Frame), f.len);
    if (f.type == kFrameNotice) {
      x_->opened[round_] = makeConn(fd_, target(), known_[round_]);
      fd_ = -1;
      return failFromNotice(err, &x_->failure, r_, n_, f, text);
    }
    if (f.a != (uint32_t)round_)
      return failHere(err, hpctRingMismatch, format("rank %d: rank %d sent the address of round %u in round %d", r_,
                                                    target(), f.a, round_));
    known_[round_ + 1] = text;
    x_->opened[round_] = makeConn(fd_, target(), known_[round_]);
    fd_ = -1;
    round_++;
    state_ = kIdle;
    attempts_ = 0;
    backoffMs_ = 1;
    nextTryMs_ = now;
    *complete = true;
    return hpctRingOk;
  }

  hpctRingStatus progressDial(short revents, double now, hpctRingError* err) {
    if (state_ == kConnecting && revents) {
      int soerr = 0;
      socklen_t len = sizeof(soerr);
      getsockopt(fd_, SOL_SOCKET, SO_ERROR, &soerr, &len);
      if (soerr != 0) {
        retryLater(strerror(soerr), now);
        return hpctRingOk;
      }
      state_ = kSending;
    }
    if (state_ == kSending) {
      ssize_t n = send(fd_, hello_.data() + offset_, hello_.size() - offset_, MSG_NOSIGNAL);
      if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) retryLater(strerror(errno), now);
      if (n > 0) offset_ += n;
      if (fd_ >= 0 && offset_ == hello_.size()) {
        state_ = kWaitAck;
        got_ = 0;
        sentMs_ = now;
      }
      return hpctRingOk;
    }
    if (state_ != kWaitAck && state_ != kWaitAddr) return hpctRingOk;
    if (revents & (POLLIN | POLLHUP | POLLERR)) {
      // Read exactly what is due: the Ack, then a frame header, then its payload.
      size_t want = state_ == kWaitAck ? sizeof(Ack) : got_ < sizeof(Frame) ? sizeof(Frame) : 0;
      if (want == 0) {
        Frame f;
        memcpy(&f, in_, sizeof(f));
        want = sizeof(Frame) + (f.len < sizeof(in_) - sizeof(Frame) ? f.len : sizeof(in_) - sizeof(Frame));
      }
      ssize_t n = want > got_ ? recv(fd_, in_ + got_, want - got_, 0) : 0;
      if (n == 0 && want > got_) {
        retryLater(state_ == kWaitAck ? "the peer closed the connection before answering"
                                      : "the peer closed the connection after accepting it",
                   now);
        return hpctRingOk;
      }
      if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
        retryLater(strerror(errno), now);
        return hpctRingOk;
      }
      if (n > 0) got_ += n;
      if (state_ == kWaitAck && got_ == sizeof(Ack)) return onAck(now, err);
      if (state_ == kWaitAddr && got_ >= sizeof(Frame)) {
        bool complete = false;
        return onFrame(now, &complete, err);
      }
    }
    // A handshake queued at a listener that went away without a reset would wait forever.
    if (state_ == kWaitAck && now - sentMs_ > ackTimeoutMs_) retryLater("no answer to the handshake", now);
    return hpctRingOk;
  }

  void queueAddresses() {
    for (int k = 0; k < k_; k++) {
      if (addrQueued_[k] || x_->accepted[k].fd < 0 || known_[k].empty()) continue;
      Frame f = {kFrameAddr, (uint32_t)k, 0, known_[k].size()};
      outbox_[k].append((const char*)&f, sizeof(f));
      outbox_[k] += known_[k];
      addrQueued_[k] = true;
    }
  }

  hpctRingStatus progressAccepted(const std::vector<struct pollfd>& fds, size_t first, hpctRingError* err) {
    for (int k = 0; k < k_; k++) {
      Conn& c = x_->accepted[k];
      short ev = fds[first + k].revents;
      if (c.fd < 0 || !ev) continue;
      if ((ev & POLLOUT) && !outbox_[k].empty()) {
        ssize_t n = send(c.fd, outbox_[k].data(), outbox_[k].size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) outbox_[k].erase(0, n);
        c.midFrame = !outbox_[k].empty();
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {   // the opener is gone; it will come again
          closeConn(&c, true);
          outbox_[k].clear();
          addrQueued_[k] = false;
          c.midFrame = false;
          continue;
        }
      }
      if (!(ev & (POLLIN | POLLHUP | POLLERR)) || c.closed) continue;
      NoticeRead got = readNotice(&c);
      if (got == kNoticeDone) return failFromNotice(err, &x_->failure, r_, n_, c.in, c.inText);
      if (got == kNoticeClosed || got == kNoticeBad) {   // gone before it was through: take its next try
        closeConn(&c, true);
        outbox_[k].clear();
        addrQueued_[k] = false;
        c = Conn();
      }
    }
    return hpctRingOk;
  }

  hpctRingStatus progressOpened(const std::vector<struct pollfd>& fds, size_t first, hpctRingError* err) {
    for (int j = 0; j < k_; j++) {
      Conn& c = x_->opened[j];
      if (!fds[first + j].revents || c.fd < 0) continue;
      if (c.inGot == 0) {   // look before taking: it may be data for the first allgather
        Frame f;
        ssize_t n = recv(c.fd, &f, sizeof(f), MSG_PEEK);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
          c.closed = true;   // the allgather that needs this peer will say so
          continue;
        }
        if (n < (ssize_t)sizeof(f)) continue;
        if (f.type != kFrameNotice) {
          c.dataWaiting = true;
          continue;
        }
      }
      NoticeRead got = readNotice(&c);
      if (got == kNoticeDone) return failFromNotice(err, &x_->failure, r_, n_, c.in, c.inText);
      if (got == kNoticeClosed || got == kNoticeBad) c.closed = true;
    }
    return hpctRingOk;
  }

  void acceptAll(double now) {
    for (;;) {
      struct sockaddr_storage ss;
      socklen_t len = sizeof(ss);
      int fd = accept4(listenFd_, (struct sockaddr*)&ss, &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;  // EAGAIN, or an aborted connection: nothing to take now
      Incoming p;
      p.fd = fd;
      p.sinceMs = now;
      p.peer = peerName(&ss);
      p.got = 0;
      incoming_.push_back(p);
    }
  }

  void answer(int fd, AckCode code) {
    Ack a = {kProto, code, (uint32_t)r_, (uint32_t)n_, cfg_->generation, cfg_->magic};
    // 32 bytes into a fresh socket's empty send buffer: a short write means the peer is gone.
    (void)!send(fd, &a, sizeof(a), MSG_NOSIGNAL | MSG_DONTWAIT);
  }

  // Judge a complete Hello.  Non-Ok only for faults that no wait can mend.
  hpctRingStatus judge(Incoming* p, hpctRingError* err) {
    Hello h;
    memcpy(&h, p->buf, sizeof(h));
    std::string from = p->peer;
    int fd = p->fd;
    p->fd = -1;
    if (h.generation < cfg_->generation) {
      x_->stats.refusedConnections++;
      note(format("rank %u from %s with generation %u, expected %u", h.rank, from.c_str(), h.generation,
                  cfg_->generation));
      answer(fd, kYouAreOlder);
      close(fd);
      return hpctRingOk;
    }
    if (h.generation > cfg_->generation) {
      answer(fd, kYouAreNewer);
      close(fd);
      return failHere(err, hpctRingStale,
                      format("rank %d is at generation %u, but rank %u connected from %s at generation %u: this "
                             "process belongs to a membership that has been replaced; rejoin at generation %u",
                             r_, cfg_->generation, h.rank, from.c_str(), h.generation, h.generation));
    }
    if ((int)h.nranks != n_) {
      answer(fd, kOtherSize);
      close(fd);
      return failHere(err, hpctRingMismatch,
                      format("nranks mismatch: rank %u connected from %s with nranks %u, rank %d has %d", h.rank,
                             from.c_str(), h.nranks, r_, n_));
    }
    if (h.magic != cfg_->magic) {
      x_->stats.refusedConnections++;
      note(format("rank %u from %s of another job or group (group index %u, expected %u)", h.rank, from.c_str(),
                  h.group, cfg_->group));
      answer(fd, kOtherJob);
      close(fd);
      return hpctRingOk;
    }
    if ((int)h.round >= k_ || (int)h.rank != source((int)h.round)) {
      answer(fd, kWrongPeer);
      close(fd);
      return failHere(err, hpctRingMismatch,
                      format("rank %u connected from %s as rank %d's peer of round %u, which is rank %d: two ranks "
                             "share an address or the port plans differ",
                             h.rank, from.c_str(), r_, h.round, (int)h.round < k_ ? source((int)h.round) : -1));
    }
    Conn& c = x_->accepted[h.round];
    // An opener that lost our answer comes again: the newest connection is the live one.
    closeConn(&c, true);
    c = Conn();
    c.fd = fd;
    c.rank = (int)h.rank;
    c.addr.assign(p->buf + sizeof(Hello), h.addrLen);
    setNoDelay(fd);
    Ack a = {kProto, kAccepted, (uint32_t)r_, (uint32_t)n_, cfg_->generation, cfg_->magic};
    outbox_[h.round].assign((const char*)&a, sizeof(a));
    addrQueued_[h.round] = false;
    return hpctRingOk;
  }

  hpctRingStatus progressIncoming(const std::vector<struct pollfd>& fds, size_t first, double now,
                                  hpctRingError* err) {
    for (size_t i = 0; i < incoming_.size(); i++) {
      Incoming* p = &incoming_[i];
      short ev = first + i < fds.size() ? fds[first + i].revents : 0;
      if (p->fd >= 0 && ev) {
        Hello h;
        size_t want = sizeof(Hello);
        if (p->got >= sizeof(Hello)) {
          memcpy(&h, p->buf, sizeof(h));
          want += h.addrLen;
        }
        ssize_t n = recv(p->fd, p->buf + p->got, want - p->got, 0);
        if (n > 0) p->got += n;
        if (p->got == sizeof(Hello)) {
          memcpy(&h, p->buf, sizeof(h));
          if (h.proto != kProto || h.addrLen > kMaxAddr) n = 0;   // not our handshake: drop it
        }
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) {
          x_->stats.droppedConnections++;
          hpctRingCloseReset(p->fd);
          p->fd = -1;
        } else if (p->got >= sizeof(Hello)) {
          memcpy(&h, p->buf, sizeof(h));
          if (p->got == sizeof(Hello) + h.addrLen) {
            hpctRingStatus s = judge(p, err);
            if (s != hpctRingOk) return s;
          }
        }
      }
      if (p->fd >= 0 && now - p->sinceMs > ackTimeoutMs_) {  // connected, never said who it is
        x_->stats.droppedConnections++;
        hpctRingCloseReset(p->fd);
        p->fd = -1;
      }
    }
    size_t keep = 0;
    for (size_t i = 0; i < incoming_.size(); i++)
      if (incoming_[i].fd >= 0) incoming_[keep++] = incoming_[i];
    incoming_.resize(keep);
    return hpctRingOk;
  }
};

}  // namespace

extern "C" hpctRingStatus hpctExchangeForm(int listenFd, const hpctRingConfig* cfg, hpctExchange** out,
                                           hpctRingError* err) {
  if (cfg == NULL || out == NULL || listenFd < 0) return fail(err, hpctRingSystem, "hpctExchangeForm: missing argument");
  *out = NULL;
  if (cfg->nranks < 1 || cfg->rank < 0 || cfg->rank >= cfg->nranks)
    return fail(err, hpctRingMismatch, "rank %d is outside 0..%d", cfg->rank, cfg->nranks - 1);
  if (cfg->nranks > 1 && (cfg->nextAddr == NULL || *cfg->nextAddr == '\0'))
    return fail(err, hpctRingBadAddress, "rank %d of %d: no address for the next rank", cfg->rank, cfg->nranks);
  hpctExchange* x = new hpctExchange();
  x->rank = cfg->rank;
  x->nranks = cfg->nranks;
  x->rounds = hpctExchangeRounds(cfg->nranks);
  x->timeoutMs = cfg->timeoutMs;
  x->abortFlag = cfg->abortFlag;
  x->listenAddr = cfg->listenAddr ? cfg->listenAddr : "";
  x->opened.resize(x->rounds);
  x->accepted.resize(x->rounds);
  x->stats.rounds = x->rounds;
  Former f(listenFd, cfg, x);
  hpctRingStatus s = f.run(err);
  if (s != hpctRingOk) {
    hpctExchangeClose(x, 0);
    return s;
  }
  x->stats.opened = x->stats.accepted = x->rounds;
  if (err) {
    err->status = hpctRingOk;
    err->message[0] = '\0';
  }
  *out = x;
  return hpctRingOk;
}
