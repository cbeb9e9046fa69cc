// One rank of the rootless bootstrap ring, driven by tests/test_nccl_ring.py.
//
// It links the ring core exactly as the NCCL series adds it (the test extracts
// hpct_ring.{h,cc} from the patch), forms the ring, checks it with a ring
// allgather of every rank's number (what NCCL runs next over the same sockets)
// and prints one JSON line per cycle.
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <string>
#include <thread>
#include <vector>

#include "hpct_ring.h"

namespace {

struct Args {
  int rank = 0, nranks = 1, cycles = 1, timeoutMs = 5000, retryMs = 100, abortAfterMs = -1, holdMs = 0;
  unsigned generation = 0, group = 0;
  unsigned long long key = 1;
  bool generationPerCycle = false, allgather = true;
  std::string listen, next;
};

double nowMs() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

std::string jsonString(const char* s) {
  std::string out = "\"";
  for (; *s; s++) {
    if (*s == '"' || *s == '\\') out += '\\';
    if ((unsigned char)*s < 0x20) continue;
    out += *s;
  }
  return out + "\"";
}

// Move len bytes in both directions at once (send to next, receive from prev) before the deadline.
bool exchange(int sendFd, const char* out, int recvFd, char* in, size_t len, double deadline, std::string* why) {
  size_t sent = 0, got = 0;
  while (sent < len || got < len) {
    if (nowMs() > deadline) { *why = "allgather timed out"; return false; }
    struct pollfd fds[2] = {{sent < len ? sendFd : -1, POLLOUT, 0}, {got < len ? recvFd : -1, POLLIN, 0}};
    if (poll(fds, 2, 10) < 0 && errno != EINTR) { *why = strerror(errno); return false; }
    if (fds[0].revents) {
      ssize_t n = send(sendFd, out + sent, len - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n < 0 && errno != EAGAIN) { *why = std::string("send to next: ") + strerror(errno); return false; }
      if (n > 0) sent += n;
    }
    if (fds[1].revents) {
      ssize_t n = recv(recvFd, in + got, len - got, MSG_DONTWAIT);
      if (n == 0) { *why = "previous rank closed the ring"; return false; }
      if (n < 0 && errno != EAGAIN) { *why = std::string("recv from previous: ") + strerror(errno); return false; }
      if (n > 0) got += n;
    }
  }
  return true;
}

// The ring allgather NCCL's bootstrap runs: N-1 steps, each forwarding the slice just received.
bool ringAllgather(const Args& a, int sendFd, int recvFd, std::vector<int>* all, std::string* why) {
  all->assign(a.nranks, -1);
  (*all)[a.rank] = a.rank;
  double deadline = nowMs() + a.timeoutMs;
  for (int i = 0; i < a.nranks - 1; i++) {
    int sendSlice = (a.rank - i + a.nranks) % a.nranks;
    int recvSlice = (a.rank - i - 1 + a.nranks) % a.nranks;
    if (!exchange(sendFd, (const char*)&(*all)[sendSlice], recvFd, (char*)&(*all)[recvSlice], sizeof(int),
                  deadline, why))
      return false;
  }
  for (int r = 0; r < a.nranks; r++)
    if ((*all)[r] != r) { *why = "allgather returned a wrong value"; return false; }
  return true;
}

bool parse(int argc, char** argv, Args* a) {
  for (int i = 1; i < argc; i++) {
    std::string k = argv[i];
    if (k == "--generation-per-cycle") { a->generationPerCycle = true; continue; }
    if (k == "--no-allgather") { a->allgather = false; continue; }
    if (i + 1 >= argc) return false;
    const char* v = argv[++i];
    if (k == "--rank") a->rank = atoi(v);
    else if (k == "--nranks") a->nranks = atoi(v);
    else if (k == "--listen") a->listen = v;
    else if (k == "--next") a->next = v;
    else if (k == "--generation") a->generation = strtoul(v, NULL, 10);
    else if (k == "--group") a->group = strtoul(v, NULL, 10);
    else if (k == "--key") a->key = strtoull(v, NULL, 10);
    else if (k == "--cycles") a->cycles = atoi(v);
    else if (k == "--timeout-ms") a->timeoutMs = atoi(v);
    else if (k == "--retry-ms") a->retryMs = atoi(v);
    else if (k == "--abort-after-ms") a->abortAfterMs = atoi(v);
    else if (k == "--hold-ms") a->holdMs = atoi(v);
    else return false;
  }
  return !a->listen.empty() && !a->next.empty();
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  if (!parse(argc, argv, &a)) {
    fprintf(stderr, "usage: ring_harness --rank R --nranks N --listen H:P --next H:P [options]\n");
    return 2;
  }
  int failures = 0;
  for (int cycle = 0; cycle < a.cycles; cycle++) {
    double start = nowMs();
    unsigned gen = a.generation + (a.generationPerCycle ? cycle : 0);
    hpctRingError err;
    int listenFd = -1, sendFd = -1, recvFd = -1;
    hpctRingStats stats = {0, 0, 0, 0.0};
    hpctRingStatus s = hpctRingListen(a.listen.c_str(), &listenFd, &err);
    volatile uint32_t abortFlag = 0;
    double abortedAt = 0;
    std::thread aborter;
    if (s == hpctRingOk) {
      if (a.abortAfterMs >= 0)
        aborter = std::thread([&] {
          usleep(a.abortAfterMs * 1000);
          abortedAt = nowMs();
          __atomic_store_n(&abortFlag, 1, __ATOMIC_RELEASE);
        });
      hpctRingConfig cfg = {a.rank, a.nranks, gen, a.group, hpctRingMagic(a.key, gen, a.group, a.nranks),
                            a.listen.c_str(), a.next.c_str(), a.timeoutMs, a.retryMs, 0,
                            (volatile uint32_t*)&abortFlag};
      s = hpctRingForm(listenFd, &cfg, &sendFd, &recvFd, &stats, &err);
    }
    double formed = nowMs();
    if (aborter.joinable()) aborter.join();
    std::string agWhy;
    bool agOk = true;
    std::vector<int> all;
    if (s == hpctRingOk && a.allgather) agOk = ringAllgather(a, sendFd, recvFd, &all, &agWhy);
    if (a.holdMs > 0) usleep(a.holdMs * 1000);
    // A reset would discard what the neighbour has not read yet: close gracefully unless failed.
    bool ok = s == hpctRingOk && agOk;
    for (int fd : {sendFd, recvFd}) {
      if (fd < 0) continue;
      if (ok) close(fd);
      else hpctRingCloseReset(fd);
    }
    if (listenFd >= 0) close(listenFd);
    if (s != hpctRingOk || !agOk) failures++;
    printf("{\"cycle\": %d, \"rank\": %d, \"status\": %d, \"message\": %s, \"form_ms\": %.3f, \"total_ms\": %.3f, "
           "\"abort_return_ms\": %.3f, \"attempts\": %d, \"refused\": %d, \"dropped\": %d, \"allgather_ok\": %s, "
           "\"allgather_error\": %s}\n",
           cycle, a.rank, (int)s, jsonString(s == hpctRingOk ? "" : err.message).c_str(), formed - start,
           nowMs() - start, abortedAt > 0 ? formed - abortedAt : -1.0, stats.connectAttempts,
           stats.refusedConnections, stats.droppedConnections, agOk ? "true" : "false",
           jsonString(agWhy.c_str()).c_str());
    fflush(stdout);
  }
  return failures ? 1 : 0;
}
