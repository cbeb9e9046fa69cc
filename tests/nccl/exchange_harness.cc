// One rank of the log-depth bootstrap exchange, driven by tests/test_nccl_exchange.py.
//
// It links the exchange exactly as the NCCL series places it (hpct_ring.* and hpct_exchange*
// from src/nccl_rootless/), forms the exchange on a fixed listen address, runs allgathers of
// a payload every rank can compute for every other (so the result is checked byte for byte
// against what a ring allgather leaves) and prints one JSON line.
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <string>
#include <thread>
#include <vector>

#include "hpct_exchange.h"
#include "hpct_ring.h"
#include "payload.h"

namespace {

struct Args {
  int rank = 0, nranks = 1, timeoutMs = 5000, retryMs = 100, abortAfterMs = -1, holdMs = 0;
  int allgathers = 1, dieAfter = -1, stallMs = 0;
  size_t payload = 4;
  unsigned generation = 0, group = 0;
  unsigned long long key = 1;
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

bool parse(int argc, char** argv, Args* a) {
  for (int i = 1; i < argc; i++) {
    std::string k = argv[i];
    if (i + 1 >= argc) return false;
    const char* v = argv[++i];
    if (k == "--rank") a->rank = atoi(v);
    else if (k == "--nranks") a->nranks = atoi(v);
    else if (k == "--listen") a->listen = v;
    else if (k == "--next") a->next = v;
    else if (k == "--generation") a->generation = strtoul(v, NULL, 10);
    else if (k == "--group") a->group = strtoul(v, NULL, 10);
    else if (k == "--key") a->key = strtoull(v, NULL, 10);
    else if (k == "--timeout-ms") a->timeoutMs = atoi(v);
    else if (k == "--retry-ms") a->retryMs = atoi(v);
    else if (k == "--abort-after-ms") a->abortAfterMs = atoi(v);
    else if (k == "--hold-ms") a->holdMs = atoi(v);
    else if (k == "--payload-bytes") a->payload = strtoul(v, NULL, 10);
    else if (k == "--allgathers") a->allgathers = atoi(v);
    else if (k == "--die-after") a->dieAfter = atoi(v);     // _exit(9) after that many allgathers
    else if (k == "--stall-ms") a->stallMs = atoi(v);       // pause between forming and the allgathers
    else return false;
  }
  return !a->listen.empty() && !a->next.empty() && a->nranks >= 1;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  if (!parse(argc, argv, &a)) {
    fprintf(stderr, "usage: exchange_harness --rank R --nranks N --listen H:P --next H:P [options]\n");
    return 2;
  }
  double start = nowMs();
  hpctRingError err;
  memset(&err, 0, sizeof(err));
  int listenFd = -1;
  hpctExchange* x = NULL;
  volatile uint32_t abortFlag = 0;
  double abortedAt = 0, returnedAt = 0;
  hpctRingStatus s = hpctRingListen(a.listen.c_str(), &listenFd, &err);
  std::thread aborter;
  if (s == hpctRingOk && a.abortAfterMs >= 0)
    aborter = std::thread([&] {
      usleep(a.abortAfterMs * 1000);
      abortedAt = nowMs();
      __atomic_store_n(&abortFlag, 1, __ATOMIC_RELEASE);
    });
  if (s == hpctRingOk) {
    hpctRingConfig cfg = {a.rank, a.nranks, a.generation, a.group, hpctRingMagic(a.key, a.generation, a.group, a.nranks),
                          a.listen.c_str(), a.next.c_str(), a.timeoutMs, a.retryMs, 0, (volatile uint32_t*)&abortFlag};
    s = hpctExchangeForm(listenFd, &cfg, &x, &err);
  }
  double formed = nowMs();
  if (s != hpctRingOk) returnedAt = formed;
  std::vector<unsigned char> all(a.nranks * a.payload), expect(a.nranks * a.payload);
  std::string digests, times;
  bool exact = true;
  int done = 0;
  if (s == hpctRingOk && a.stallMs > 0) usleep(a.stallMs * 1000);
  for (int g = 0; s == hpctRingOk && g < a.allgathers; g++) {
    if (g == a.dieAfter) _exit(9);   // a process that dies between two allgathers, sockets closing with it
    memset(all.data(), 0xEE, all.size());
    for (int r = 0; r < a.nranks; r++) fill(&expect[r * a.payload], a.payload, r, g);
    memcpy(&all[a.rank * a.payload], &expect[a.rank * a.payload], a.payload);
    double t = nowMs();
    s = hpctExchangeAllGather(x, all.data(), a.payload, &err);
    if (s != hpctRingOk) {
      returnedAt = nowMs();
      break;
    }
    char buf[64];
    snprintf(buf, sizeof(buf), "%s\"%016llx\"", g ? ", " : "", (unsigned long long)fnv1a(all.data(), all.size()));
    digests += buf;
    snprintf(buf, sizeof(buf), "%s%.3f", g ? ", " : "", nowMs() - t);
    times += buf;
    exact = exact && all == expect;
    done++;
  }
  if (aborter.joinable()) aborter.join();
  hpctExchangeStats st;
  memset(&st, 0, sizeof(st));
  hpctExchangeStatsOf(x, &st);
  if (a.holdMs > 0) usleep(a.holdMs * 1000);
  hpctExchangeClose(x, 0);
  if (listenFd >= 0) close(listenFd);
  printf("{\"rank\": %d, \"status\": %d, \"message\": %s, \"form_ms\": %.3f, \"total_ms\": %.3f, "
         "\"abort_return_ms\": %.3f, \"rounds\": %d, \"opened\": %d, \"accepted\": %d, \"attempts\": %d, "
         "\"refused\": %d, \"dropped\": %d, \"allgathers\": %d, \"exact\": %s, \"digests\": [%s], "
         "\"allgather_ms\": [%s]}\n",
         a.rank, (int)s, jsonString(s == hpctRingOk ? "" : err.message).c_str(), formed - start, nowMs() - start,
         abortedAt > 0 && returnedAt > 0 ? returnedAt - abortedAt : -1.0, st.rounds, st.opened, st.accepted,
         st.connectAttempts, st.refusedConnections, st.droppedConnections, done,
         exact && done == a.allgathers ? "true" : "false", digests.c_str(), times.c_str());
  fflush(stdout);
  return s == hpctRingOk ? 0 : 1;
}
