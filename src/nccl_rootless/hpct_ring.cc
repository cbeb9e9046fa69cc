/*
 * hpct: the rootless bootstrap ring (see hpct_ring.h).
 *
 * Connecting to the next rank and accepting the previous one happen in the same
 * poll loop: a rank that waited for its own outgoing handshake before accepting
 * would deadlock the ring, since every rank's answer depends on its successor.
 */
#include "hpct_ring.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <string>
#include <vector>

namespace {

const uint64_t kProto = 0x31474e4952544348ULL;  // "HCTRING1" read as little-endian bytes
const int kPollSliceMs = 5;                      // bounds how late an abort is noticed
const int kDefaultAckTimeoutMs = 3000;
const int kNotesKept = 3;

struct Hello {
  uint64_t proto;
  uint64_t magic;
  uint32_t rank, nranks, generation, group;
};

enum AckCode : uint32_t {
  kAccepted = 0,
  kOtherJob = 1,       // magic differs: another job key or group index
  kYouAreOlder = 2,    // the connecting rank's generation is older than the listener's
  kYouAreNewer = 3,    // the listener is the older one; it is about to be replaced
  kNotMyPrevious = 4,  // the connecting rank is not the listener's previous rank
  kOtherSize = 5       // nranks differs
};

struct Ack {
  uint64_t proto;
  uint32_t code, rank, nranks, generation;
  uint64_t magic;
};

static_assert(sizeof(Hello) == 32 && sizeof(Ack) == 32, "wire structs are 32 bytes");

double nowMs() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

bool aborted(const hpctRingConfig* cfg) {
  return cfg->abortFlag && __atomic_load_n(cfg->abortFlag, __ATOMIC_ACQUIRE) != 0;
}

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

std::string peerName(const struct sockaddr_storage* ss) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (ss->ss_family == AF_INET) {
    const struct sockaddr_in* a = (const struct sockaddr_in*)ss;
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    port = ntohs(a->sin_port);
    return std::string(host) + ":" + std::to_string(port);
  }
  if (ss->ss_family == AF_INET6) {
    const struct sockaddr_in6* a = (const struct sockaddr_in6*)ss;
    inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
    port = ntohs(a->sin6_port);
  }
  return "[" + std::string(host) + "]:" + std::to_string(port);
}

void closeFd(int* fd, bool reset) {
  if (*fd < 0) return;
  if (reset) hpctRingCloseReset(*fd);
  else close(*fd);
  *fd = -1;
}

void setNoDelay(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// The outgoing half: connect to the next rank, send the hello, wait for its answer.
struct Outgoing {
  enum State { kIdle, kConnecting, kSending, kWaitAck, kDone } state = kIdle;
  int fd = -1;
  size_t offset = 0;
  double nextTryMs = 0, sentMs = 0;
  int attempts = 0;
  int backoffMs = 1;
  Hello hello;
  Ack ack;
  std::string lastError = "no attempt yet";
  std::string note;    // what the listener at the next address last said, if anything useful
};

// An accepted connection whose hello is not complete yet.
struct Pending {
  int fd;
  size_t offset;
  double sinceMs;
  std::string peer;
  Hello hello;
};

struct Ring {
  const hpctRingConfig* cfg;
  struct sockaddr_storage next;
  unsigned nextLen = 0;
  int listenFd;
  int prev;
  int nextRank;
  uint64_t magic;
  int ackTimeoutMs;
  unsigned seed;
  Outgoing out;
  std::vector<Pending> pending;
  int recvFd = -1;
  std::vector<std::string> notes;
  hpctRingStats stats = {0, 0, 0, 0.0};

  void note(const std::string& n) {
    if ((int)notes.size() < kNotesKept) notes.push_back(n);
  }

  // Exponential backoff with +/-50 % jitter, capped by retryDelayMs, so that many ranks
  // waiting for one late peer do not knock on its door in lock step.
  void retryLater(const std::string& why, double now) {
    closeFd(&out.fd, false);
    out.state = Outgoing::kIdle;
    out.lastError = why;
    int cap = cfg->retryDelayMs > 0 ? cfg->retryDelayMs : 100;
    if (out.backoffMs < cap) out.backoffMs = out.backoffMs * 2 > cap ? cap : out.backoffMs * 2;
    double jitter = 0.5 + (rand_r(&seed) % 1001) / 1000.0;
    out.nextTryMs = now + out.backoffMs * jitter;
  }

  hpctRingStatus startConnect(double now, hpctRingError* err) {
    out.attempts++;
    stats.connectAttempts++;
    out.fd = socket(next.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (out.fd < 0) return fail(err, hpctRingSystem, "rank %d: socket(): %s", cfg->rank, strerror(errno));
    setNoDelay(out.fd);
    out.offset = 0;
    if (connect(out.fd, (struct sockaddr*)&next, nextLen) == 0) {
      out.state = Outgoing::kSending;
    } else if (errno == EINPROGRESS) {
      out.state = Outgoing::kConnecting;
    } else {
      retryLater(strerror(errno), now);
    }
    return hpctRingOk;
  }

  hpctRingStatus onAck(double now, hpctRingError* err) {
    const Ack& a = out.ack;
    const char* next = cfg->nextAddr;
    if (a.proto != kProto) {
      retryLater("the process at the next address does not speak hpct's ring handshake", now);
      return hpctRingOk;
    }
    switch (a.code) {
      case kAccepted:
        if ((int)a.rank != nextRank || (int)a.nranks != cfg->nranks || a.generation != cfg->generation)
          return fail(err, hpctRingMismatch,
                      "rank %d: %s accepted as rank %u of %u at generation %u, expected rank %d of %d at "
                      "generation %u: the ranks' port plans differ",
                      cfg->rank, next, a.rank, a.nranks, a.generation, nextRank, cfg->nranks, cfg->generation);
        out.state = Outgoing::kDone;
        return hpctRingOk;
      case kYouAreOlder:
        return fail(err, hpctRingStale,
                    "rank %d is at generation %u, but rank %u at %s is at generation %u: this process belongs to "
                    "a membership that has been replaced; rejoin at generation %u",
                    cfg->rank, cfg->generation, a.rank, next, a.generation, a.generation);
      case kYouAreNewer: {
        char buf[256];
        snprintf(buf, sizeof(buf), "%s is held by rank %u of the older generation %u (expected %u)", next,
                 a.rank, a.generation, cfg->generation);
        out.note = buf;
        retryLater(buf, now);
        return hpctRingOk;
      }
      case kOtherJob: {
        char buf[256];
        snprintf(buf, sizeof(buf), "%s is held by a process of another job or group (rank %u there)", next, a.rank);
        out.note = buf;
        retryLater(buf, now);
        return hpctRingOk;
      }
      case kNotMyPrevious:
        return fail(err, hpctRingMismatch,
                    "rank %d connected to %s, which is rank %u and expects rank %d before it: two ranks share an "
                    "address or the port plans differ",
                    cfg->rank, next, a.rank, (int)((a.rank + a.nranks - 1) % (a.nranks ? a.nranks : 1)));
      case kOtherSize:
        return fail(err, hpctRingMismatch, "nranks mismatch: rank %u at %s has nranks %u, rank %d has %d",
                    a.rank, next, a.nranks, cfg->rank, cfg->nranks);
      default:
        retryLater("unknown answer from the next rank", now);
        return hpctRingOk;
    }
  }

  hpctRingStatus progressOut(short revents, double now, hpctRingError* err) {
    if (out.state == Outgoing::kConnecting && revents) {
      int soerr = 0;
      socklen_t len = sizeof(soerr);
      getsockopt(out.fd, SOL_SOCKET, SO_ERROR, &soerr, &len);
      if (soerr != 0) {
        retryLater(strerror(soerr), now);
        return hpctRingOk;
      }
      out.state = Outgoing::kSending;
    }
    if (out.state == Outgoing::kSending) {
      ssize_t n = send(out.fd, (char*)&out.hello + out.offset, sizeof(Hello) - out.offset, MSG_NOSIGNAL);
      if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
        retryLater(strerror(errno), now);
        return hpctRingOk;
      }
      if (n > 0) out.offset += n;
      if (out.offset == sizeof(Hello)) {
        out.state = Outgoing::kWaitAck;
        out.offset = 0;
        out.sentMs = now;
      }
      return hpctRingOk;
    }
    if (out.state == Outgoing::kWaitAck) {
      if (revents & (POLLIN | POLLHUP | POLLERR)) {
        ssize_t n = recv(out.fd, (char*)&out.ack + out.offset, sizeof(Ack) - out.offset, 0);
        if (n == 0) {
          retryLater("the next rank closed the connection before answering", now);
          return hpctRingOk;
        }
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
          retryLater(strerror(errno), now);
          return hpctRingOk;
        }
        if (n > 0) out.offset += n;
        if (out.offset == sizeof(Ack)) return onAck(now, err);
      }
      // A handshake queued at a listener that went away without a reset would wait forever.
      if (now - out.sentMs > ackTimeoutMs) retryLater("no answer to the handshake", now);
    }
    return hpctRingOk;
  }

  void answer(Pending* p, AckCode code) {
    Ack a = {kProto, code, (uint32_t)cfg->rank, (uint32_t)cfg->nranks, cfg->generation, magic};
    // 32 bytes into a fresh socket's empty send buffer: a short write means the peer is gone.
    if (send(p->fd, &a, sizeof(a), MSG_NOSIGNAL | MSG_DONTWAIT) != (ssize_t)sizeof(a)) closeFd(&p->fd, true);
  }

  // Judge one complete hello.  Returns non-Ok only for faults that no wait can mend.
  hpctRingStatus judge(Pending* p, hpctRingError* err) {
    const Hello& h = p->hello;
    char buf[320];
    if (h.proto != kProto) {
      stats.droppedConnections++;
      closeFd(&p->fd, true);
      return hpctRingOk;
    }
    if (h.generation < cfg->generation) {
      stats.refusedConnections++;
      snprintf(buf, sizeof(buf), "rank %u from %s with generation %u, expected %u", h.rank, p->peer.c_str(),
               h.generation, cfg->generation);
      note(buf);
      answer(p, kYouAreOlder);
      closeFd(&p->fd, false);
      return hpctRingOk;
    }
    if (h.generation > cfg->generation) {
      answer(p, kYouAreNewer);
      closeFd(&p->fd, false);
      return fail(err, hpctRingStale,
                  "rank %d is at generation %u, but rank %u connected from %s at generation %u: this process "
                  "belongs to a membership that has been replaced; rejoin at generation %u",
                  cfg->rank, cfg->generation, h.rank, p->peer.c_str(), h.generation, h.generation);
    }
    if ((int)h.nranks != cfg->nranks) {
      answer(p, kOtherSize);
      closeFd(&p->fd, false);
      return fail(err, hpctRingMismatch, "nranks mismatch: rank %u connected from %s with nranks %u, rank %d has %d",
                  h.rank, p->peer.c_str(), h.nranks, cfg->rank, cfg->nranks);
    }
    if (h.magic != magic) {
      stats.refusedConnections++;
      snprintf(buf, sizeof(buf), "rank %u from %s of another job or group (group index %u, expected %u)", h.rank,
               p->peer.c_str(), h.group, cfg->group);
      note(buf);
      answer(p, kOtherJob);
      closeFd(&p->fd, false);
      return hpctRingOk;
    }
    if ((int)h.rank != prev) {
      answer(p, kNotMyPrevious);
      closeFd(&p->fd, false);
      return fail(err, hpctRingMismatch,
                  "rank %u connected from %s, but rank %d expects rank %d before it: two ranks share an address "
                  "or the port plans differ",
                  h.rank, p->peer.c_str(), cfg->rank, prev);
    }
    answer(p, kAccepted);
    if (p->fd < 0) return hpctRingOk;
    // A previous rank that lost our answer reconnects: the newest connection is the live one.
    closeFd(&recvFd, true);
    recvFd = p->fd;
    p->fd = -1;
    setNoDelay(recvFd);
    return hpctRingOk;
  }

  void acceptAll(double now) {
    for (;;) {
      struct sockaddr_storage ss;
      socklen_t len = sizeof(ss);
      int fd = accept4(listenFd, (struct sockaddr*)&ss, &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) return;  // EAGAIN, or an aborted connection: nothing to take now
      pending.push_back(Pending{fd, 0, now, peerName(&ss), Hello()});
    }
  }

  hpctRingStatus progressPending(const std::vector<short>& revents, size_t first, double now, hpctRingError* err) {
    for (size_t i = 0; i < pending.size(); i++) {
      Pending* p = &pending[i];
      short ev = first + i < revents.size() ? revents[first + i] : 0;
      if (p->fd >= 0 && ev) {
        ssize_t n = recv(p->fd, (char*)&p->hello + p->offset, sizeof(Hello) - p->offset, 0);
        if (n > 0) p->offset += n;
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) {
          stats.droppedConnections++;
          closeFd(&p->fd, true);
        } else if (p->offset == sizeof(Hello)) {
          hpctRingStatus s = judge(p, err);
          if (s != hpctRingOk) return s;
        }
      }
      if (p->fd >= 0 && now - p->sinceMs > ackTimeoutMs) {  // connected, never said who it is
        stats.droppedConnections++;
        closeFd(&p->fd, true);
      }
    }
    size_t keep = 0;
    for (size_t i = 0; i < pending.size(); i++)
      if (pending[i].fd >= 0) pending[keep++] = pending[i];
    pending.resize(keep);
    return hpctRingOk;
  }

  void cleanup(bool ok) {
    for (auto& p : pending) closeFd(&p.fd, true);
    pending.clear();
    if (!ok) {
      closeFd(&out.fd, true);
      closeFd(&recvFd, true);
    }
  }

  hpctRingStatus timeoutError(double elapsed, hpctRingError* err) {
    std::string what;
    if (out.state != Outgoing::kDone) {
      char buf[512];
      snprintf(buf, sizeof(buf), "next rank %d at %s did not complete the handshake (%d connect attempts; last: %s)",
               nextRank, cfg->nextAddr, out.attempts, out.lastError.c_str());
      what += buf;
    }
    if (recvFd < 0) {
      char buf[256];
      snprintf(buf, sizeof(buf), "%sprevious rank %d never connected (this rank listens on %s)",
               what.empty() ? "" : "; ", prev, cfg->listenAddr ? cfg->listenAddr : "its fixed address");
      what += buf;
    }
    if (!notes.empty()) {
      what += "; refused " + std::to_string(stats.refusedConnections) + " connection(s): ";
      for (size_t i = 0; i < notes.size(); i++) what += (i ? ", " : "") + notes[i];
    }
    return fail(err, hpctRingTimeout, "rank %d of %d timed out after %.1f s forming the bootstrap ring: %s",
                cfg->rank, cfg->nranks, elapsed / 1e3, what.c_str());
  }

  hpctRingStatus run(int* sendFd, int* recvOut, hpctRingError* err) {
    double start = nowMs();
    double deadline = start + (cfg->timeoutMs > 0 ? cfg->timeoutMs : 300000);
    out.hello = Hello{kProto, magic, (uint32_t)cfg->rank, (uint32_t)cfg->nranks, cfg->generation, cfg->group};
    std::vector<struct pollfd> fds;
    std::vector<short> revents;
    hpctRingStatus status = hpctRingOk;
    for (;;) {
      double now = nowMs();
      if (aborted(cfg)) {
        status = fail(err, hpctRingAborted, "rank %d: forming the bootstrap ring was aborted", cfg->rank);
        break;
      }
      if (out.state == Outgoing::kDone && recvFd >= 0) break;
      if (now >= deadline) {
        status = timeoutError(now - start, err);
        break;
      }
      if (out.state == Outgoing::kIdle && now >= out.nextTryMs) {
        if ((status = startConnect(now, err)) != hpctRingOk) break;
      }
      fds.clear();
      fds.push_back({listenFd, POLLIN, 0});
      short outEvents = out.state == Outgoing::kConnecting || out.state == Outgoing::kSending ? POLLOUT
                        : out.state == Outgoing::kWaitAck                                    ? POLLIN
                                                                                             : 0;
      fds.push_back({outEvents ? out.fd : -1, outEvents, 0});
      for (auto& p : pending) fds.push_back({p.fd, POLLIN, 0});
      int wait = kPollSliceMs;
      if (out.state == Outgoing::kIdle && out.nextTryMs - now < wait) wait = out.nextTryMs > now ? (int)(out.nextTryMs - now) : 0;
      if (poll(fds.data(), fds.size(), wait) < 0 && errno != EINTR) {
        status = fail(err, hpctRingSystem, "rank %d: poll(): %s", cfg->rank, strerror(errno));
        break;
      }
      now = nowMs();
      revents.assign(fds.size(), 0);
      for (size_t i = 0; i < fds.size(); i++) revents[i] = fds[i].revents;
      if ((status = progressOut(revents[1], now, err)) != hpctRingOk) break;
      if ((status = progressPending(revents, 2, now, err)) != hpctRingOk) break;
      if (revents[0] & POLLIN) acceptAll(now);
    }
    cleanup(status == hpctRingOk);
    stats.elapsedMs = nowMs() - start;
    if (status == hpctRingOk) {
      *sendFd = out.fd;
      *recvOut = recvFd;
      out.fd = recvFd = -1;
    }
    return status;
  }
};

}  // namespace

extern "C" {

hpctRingStatus hpctRingParseAddr(const char* hostport, void* storage, unsigned* len, hpctRingError* err) {
  if (hostport == NULL || *hostport == '\0')
    return fail(err, hpctRingBadAddress, "empty address: expected host:port or [v6]:port");
  std::string s(hostport), host, port;
  if (s[0] == '[') {
    size_t close = s.find(']');
    if (close == std::string::npos || close + 1 >= s.size() || s[close + 1] != ':')
      return fail(err, hpctRingBadAddress, "address '%s': expected [v6]:port", hostport);
    host = s.substr(1, close - 1);
    port = s.substr(close + 2);
  } else {
    size_t colon = s.rfind(':');
    if (colon == std::string::npos || s.find(':') != colon)
      return fail(err, hpctRingBadAddress, "address '%s': expected host:port (write IPv6 as [v6]:port)", hostport);
    host = s.substr(0, colon);
    port = s.substr(colon + 1);
  }
  char* end = NULL;
  long p = strtol(port.c_str(), &end, 10);
  if (port.empty() || *end != '\0' || p < 1 || p > 65535)
    return fail(err, hpctRingBadAddress, "address '%s': the port must be 1..65535", hostport);
  struct addrinfo hints, *res = NULL;
  memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0 || res == NULL)
    return fail(err, hpctRingBadAddress, "address '%s': cannot resolve '%s': %s", hostport, host.c_str(),
                gai_strerror(rc));
  memcpy(storage, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  freeaddrinfo(res);
  return hpctRingOk;
}

hpctRingStatus hpctRingListen(const char* hostport, int* listenFd, hpctRingError* err) {
  struct sockaddr_storage ss;
  unsigned len = 0;
  hpctRingStatus s = hpctRingParseAddr(hostport, &ss, &len, err);
  if (s != hpctRingOk) return s;
  int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return fail(err, hpctRingSystem, "listen on %s: socket(): %s", hostport, strerror(errno));
  // SO_REUSEADDR lets a rebuilt group bind over its predecessor's TIME_WAIT connections;
  // SO_REUSEPORT is left off so that a live listener on the port is an immediate error.
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(fd, (struct sockaddr*)&ss, len) != 0) {
    int e = errno;
    close(fd);
    if (e == EADDRINUSE)
      return fail(err, hpctRingAddrInUse,
                  "listen on %s: the port is already in use (another process, or a group that was not closed, "
                  "holds it); stop that process or choose another port block",
                  hostport);
    if (e == EADDRNOTAVAIL)
      return fail(err, hpctRingBadAddress, "listen on %s: the host is not an address of this machine", hostport);
    return fail(err, hpctRingSystem, "listen on %s: bind(): %s", hostport, strerror(e));
  }
  if (listen(fd, SOMAXCONN) != 0) {
    int e = errno;
    close(fd);
    return fail(err, hpctRingSystem, "listen on %s: listen(): %s", hostport, strerror(e));
  }
  *listenFd = fd;
  return hpctRingOk;
}

hpctRingStatus hpctRingForm(int listenFd, const hpctRingConfig* cfg, int* sendFd, int* recvFd,
                            hpctRingStats* stats, hpctRingError* err) {
  if (cfg == NULL || sendFd == NULL || recvFd == NULL || listenFd < 0)
    return fail(err, hpctRingSystem, "hpctRingForm: missing argument");
  if (cfg->nranks < 1 || cfg->rank < 0 || cfg->rank >= cfg->nranks)
    return fail(err, hpctRingMismatch, "rank %d is outside 0..%d", cfg->rank, cfg->nranks - 1);
  Ring ring;
  ring.cfg = cfg;
  ring.listenFd = listenFd;
  ring.prev = (cfg->rank + cfg->nranks - 1) % cfg->nranks;
  ring.nextRank = (cfg->rank + 1) % cfg->nranks;
  ring.magic = cfg->magic;
  ring.ackTimeoutMs = cfg->ackTimeoutMs > 0 ? cfg->ackTimeoutMs : kDefaultAckTimeoutMs;
  ring.seed = (unsigned)(getpid() * 2654435761u) ^ (unsigned)cfg->rank ^ (unsigned)nowMs();
  hpctRingStatus s = hpctRingParseAddr(cfg->nextAddr, &ring.next, &ring.nextLen, err);
  if (s != hpctRingOk) return s;
  s = ring.run(sendFd, recvFd, err);
  if (stats) *stats = ring.stats;
  if (s == hpctRingOk && err) {
    err->status = hpctRingOk;
    err->message[0] = '\0';
  }
  return s;
}

uint64_t hpctRingMagic(uint64_t jobKey, uint32_t generation, uint32_t group, int nranks) {
  // splitmix64 over the fields in turn: any field that differs changes every bit.
  uint64_t fields[4] = {jobKey, generation, group, (uint64_t)(uint32_t)nranks};
  uint64_t h = 0x6870637472696e67ULL;
  for (uint64_t f : fields) {
    h ^= f + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    h ^= h >> 30;
    h *= 0xbf58476d1ce4e5b9ULL;
    h ^= h >> 27;
    h *= 0x94d049bb133111ebULL;
    h ^= h >> 31;
  }
  return h;
}

void hpctRingCloseReset(int fd) {
  if (fd < 0) return;
  struct linger lg = {1, 0};
  setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg));
  close(fd);
}

}  // extern "C"
