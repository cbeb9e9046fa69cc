// NCCL's bootstrap layer (the patched 2.21.5 tree) in N forked processes, without a GPU;
// driven by tests/test_nccl_bootstrap.py and benchmarks/nccl_bootstrap.py.
//
//   --mode rootless  every rank calls ncclCommInitRankRootless (identity from
//                    ncclRootlessUniqueId, fixed listen address host:base+local); no root
//   --mode stock     the parent calls bootstrapGetUniqueId (NCCL's root thread lives in
//                    it), every rank calls bootstrapInit with that handle
//
// The ranks are forked before bootstrapGetUniqueId, and the parent hands them the handle
// through a pipe: forking after it would copy NCCL's root thread's locks in whatever state
// that thread had them (it reads NCCL parameters under ncclLoadParam's mutex while it
// starts), and a rank forked while the mutex was held blocked on it for ever.
//
// Each rank then runs bootstrapAllGather of its own rank number (the table must come back
// exact), allgathers of --payload-bytes sizes (a payload every rank computes for every other,
// reported as a digest of the whole gathered buffer, so ring and log-depth runs compare byte
// for byte), a bootstrapSend/Recv across the ring, bootstrapBarrier and bootstrapClose, and
// reports one JSON line; the parent prints them in rank order (plus lines for ranks that
// were absent or had to be killed) and exits 0 only when every started rank succeeded.
// NCCL's WARN lines are captured per rank (NCCL_DEBUG defaults to WARN here).
#include <errno.h>
#include <pthread.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "bootstrap.h"
#include "comm.h"
#include "debug.h"
#include "graph.h"
#include "hpct_bootstrap_log.h"
#include "nccl_rootless.h"
#include "payload.h"
#include "transport.h"

// bootstrap_stubs.cc: the abort flag of the comm its hpctCommInitRankDev made, and the
// no-spin switch of its socket shims.
extern volatile uint32_t* volatile hpctHarnessAbortFlag;
extern int hpctHarnessNoSpin;

namespace {

const int kSendRecvTag = 0x68637431;  // arbitrary, distinct from the barrier's
const int kBarrierTag = 0x68637432;
const size_t kWarningBytes = 8192;   // per rank, so one result always fits a pipe

struct Args {
  std::string mode;
  int nranks = 0, basePort = 0, perHost = 0;
  std::vector<std::string> hosts{"127.0.0.1"};
  std::vector<int> ranks;                 // run here; empty: all
  int lateRank = -1, lateMs = 0, missingRank = -1;
  int abortRank = -1, abortMs = 0, stallRank = -1, stallMs = 0;
  std::vector<size_t> payloads;            // --payload-bytes: extra allgathers, digests reported
  bool allSteps = true;                    // --steps allgather: stop after the measured allgather
  bool noSpin = false;
  int timeoutMs = 30000, retryMs = 0, killMs = -1;
  unsigned long long jobKey = 0x68706374ULL;
  unsigned generation = 0, group = 0;
};

double nowMs() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

std::string jsonString(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += (char)c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c >= 0x20) {
      out += (char)c;
    }
  }
  return out + "\"";
}

// This process's thread count (Linux /proc), -1 when it cannot be read.
int threadCount() {
  FILE* f = fopen("/proc/self/status", "r");
  if (f == NULL) return -1;
  char line[256];
  int n = -1;
  while (fgets(line, sizeof(line), f))
    if (sscanf(line, "Threads: %d", &n) == 1) break;
  fclose(f);
  return n;
}

std::string num(double v) {
  char buf[64];
  snprintf(buf, sizeof(buf), "%.3f", v);
  return buf;
}

const char* resultName(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "ncclSuccess";
    case ncclUnhandledCudaError: return "ncclUnhandledCudaError";
    case ncclSystemError: return "ncclSystemError";
    case ncclInternalError: return "ncclInternalError";
    case ncclInvalidArgument: return "ncclInvalidArgument";
    case ncclInvalidUsage: return "ncclInvalidUsage";
    case ncclRemoteError: return "ncclRemoteError";
    case ncclInProgress: return "ncclInProgress";
    default: return "ncclResult?";
  }
}

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  size_t start = 0;
  for (;;) {
    size_t at = s.find(sep, start);
    out.push_back(s.substr(start, at == std::string::npos ? std::string::npos : at - start));
    if (at == std::string::npos) return out;
    start = at + 1;
  }
}

[[noreturn]] void usage(const char* why) {
  fprintf(stderr,
          "bootstrap_harness: %s\n"
          "usage: bootstrap_harness --mode rootless|stock --nranks N [--base-port P] [--hosts H0,H1,..]\n"
          "       [--per-host K] [--ranks R0,R1,..] [--late-rank R --late-ms X] [--missing-rank R]\n"
          "       [--timeout-ms T] [--retry-ms D] [--kill-ms K] [--job-key K] [--generation G] [--group I]\n"
          "       [--payload-bytes B0,B1,..] [--abort-rank R --abort-ms X] [--stall-rank R --stall-ms X]\n"
          "       [--steps all|allgather] [--no-spin 0|1]\n",
          why);
  exit(2);
}

int intArg(const char* name, const char* value) {
  char* end = NULL;
  long v = value ? strtol(value, &end, 0) : 0;
  if (value == NULL || *value == '\0' || *end != '\0') {
    std::string why = std::string(name) + " needs an integer";
    usage(why.c_str());
  }
  return (int)v;
}

// The two large allgathers of initTransportsRank, by the sizes this pin gives them: the peer
// info (struct ncclPeerInfo) and init.cc's allGatherInfo (a graphInfo of 8 ints or floats per
// algorithm, the topology ranks, and on 2.30 six more ints), so a benchmark gathers what NCCL's
// init gathers.  Any other token is a number of bytes.
size_t payloadSize(const std::string& token) {
  if (token == "peerinfo") return sizeof(struct ncclPeerInfo);
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 30, 0)
  if (token == "allgather3") return NCCL_NUM_ALGORITHMS * 8 * sizeof(int) + sizeof(struct ncclTopoRanks) + 6 * sizeof(int);
#else
  if (token == "allgather3") return NCCL_NUM_ALGORITHMS * 8 * sizeof(int) + sizeof(struct ncclTopoRanks);
#endif
  return (size_t)intArg("--payload-bytes", token.c_str());
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; i++) {
    std::string k = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : NULL;
    if (k == "--mode" && v) a.mode = v;
    else if (k == "--nranks") a.nranks = intArg("--nranks", v);
    else if (k == "--base-port") a.basePort = intArg("--base-port", v);
    else if (k == "--per-host") a.perHost = intArg("--per-host", v);
    else if (k == "--hosts" && v) a.hosts = split(v, ',');
    else if (k == "--ranks" && v) {
      for (auto& r : split(v, ',')) a.ranks.push_back(intArg("--ranks", r.c_str()));
    } else if (k == "--late-rank") a.lateRank = intArg("--late-rank", v);
    else if (k == "--late-ms") a.lateMs = intArg("--late-ms", v);
    else if (k == "--missing-rank") a.missingRank = intArg("--missing-rank", v);
    else if (k == "--timeout-ms") a.timeoutMs = intArg("--timeout-ms", v);
    else if (k == "--retry-ms") a.retryMs = intArg("--retry-ms", v);
    else if (k == "--kill-ms") a.killMs = intArg("--kill-ms", v);
    else if (k == "--job-key") a.jobKey = (unsigned long long)intArg("--job-key", v);
    else if (k == "--generation") a.generation = (unsigned)intArg("--generation", v);
    else if (k == "--group") a.group = (unsigned)intArg("--group", v);
    else if (k == "--abort-rank") a.abortRank = intArg("--abort-rank", v);
    else if (k == "--abort-ms") a.abortMs = intArg("--abort-ms", v);
    else if (k == "--stall-rank") a.stallRank = intArg("--stall-rank", v);
    else if (k == "--stall-ms") a.stallMs = intArg("--stall-ms", v);
    else if (k == "--no-spin") a.noSpin = intArg("--no-spin", v) != 0;
    else if (k == "--payload-bytes" && v) {
      for (auto& b : split(v, ',')) a.payloads.push_back(payloadSize(b));
    } else if (k == "--steps" && v && (std::string(v) == "all" || std::string(v) == "allgather")) {
      a.allSteps = std::string(v) == "all";
    }
    else usage(("unknown or incomplete option " + k).c_str());
    i++;
  }
  if (a.mode != "rootless" && a.mode != "stock") usage("--mode must be rootless or stock");
  if (a.nranks < 1) usage("--nranks must be at least 1");
  if (a.mode == "rootless" && (a.basePort < 1 || a.basePort > 65535)) usage("rootless needs --base-port 1..65535");
  if (a.perHost <= 0) a.perHost = (a.nranks + (int)a.hosts.size() - 1) / (int)a.hosts.size();
  if ((long)a.perHost * (long)a.hosts.size() < a.nranks) usage("--hosts x --per-host must cover --nranks");
  if (a.mode == "rootless" && a.basePort + a.perHost - 1 > 65535) usage("--base-port + --per-host exceeds 65535");
  if (a.mode == "stock" && !a.ranks.empty()) usage("stock mode runs all ranks in one invocation (its root is here)");
  if (a.ranks.empty())
    for (int r = 0; r < a.nranks; r++) a.ranks.push_back(r);
  for (int r : a.ranks)
    if (r < 0 || r >= a.nranks) usage("--ranks lists a rank outside 0..nranks-1");
  if (a.killMs < 0) a.killMs = a.timeoutMs + 15000;
  return a;
}

// The port plan with one group slot: rank r on hosts[r / P], port base + r % P.
std::string addressOf(const Args& a, int rank) {
  const std::string& host = a.hosts[rank / a.perHost];
  std::string port = std::to_string(a.basePort + rank % a.perHost);
  return host.find(':') != std::string::npos ? "[" + host + "]:" + port : host + ":" + port;
}

struct Outcome {
  std::string stage = "init", result = "ncclSuccess";
  bool ok = false, tableOk = false, sendRecvOk = false;
  double initMs = -1, allgatherMs = -1, launchInitMs = -1, launchAllgatherMs = -1, endMs = -1, launchEndMs = -1;
  std::vector<int> table;
  int threadsAtFork = -1;   // the parent's, when it forked this rank; the tests require 1
  std::vector<std::string> digests;   // one per --payload-bytes size
  bool exchange = false;              // the comm gathered in log depth
  hpctExchangeStats stats = {};
  double abortReturnMs = -1;          // from raising the abort flag to the failed call's return
  double launchPayloadMs = -1;        // launch to the end of the --payload-bytes allgathers
};

std::string fnv1aHex(const std::vector<unsigned char>& v) {
  char buf[20];
  snprintf(buf, sizeof(buf), "%016llx", (unsigned long long)fnv1a(v.data(), v.size()));
  return buf;
}

// --abort-rank: raise the comm's abort flag (as ncclCommRaiseAbortFlag does) at a set time.
struct Aborter {
  double atMs = 0, raisedMs = 0;
  pthread_t thread;
  bool started = false;
  static void* run(void* self) {
    Aborter* a = (Aborter*)self;
    while (nowMs() < a->atMs || hpctHarnessAbortFlag == NULL) usleep(1000);
    a->raisedMs = nowMs();
    __atomic_store_n(hpctHarnessAbortFlag, 1u, __ATOMIC_RELEASE);
    return NULL;
  }
};

// The NCCL WARN texts this rank logged (ncclDebugFile points at a private file).
std::vector<std::string> warnings(FILE* log) {
  std::vector<std::string> out;
  fflush(log);
  rewind(log);
  char line[2048];
  size_t total = 0;
  const char* marker = "NCCL WARN ";
  while (fgets(line, sizeof(line), log)) {
    char* at = strstr(line, marker);
    if (at == NULL) continue;
    std::string text(at + strlen(marker));
    while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
    if (total + text.size() > kWarningBytes) break;
    total += text.size();
    out.push_back(text);
  }
  return out;
}

ncclResult_t runMeasured(const Args& a, int rank, const ncclBootstrapHandle* stockHandle, double startMs,
                         double launchMs, Outcome* o);

ncclResult_t runSteps(const Args& a, int rank, const ncclBootstrapHandle* stockHandle, double startMs,
                      double launchMs, Outcome* o) {
  if (rank == a.lateRank && a.lateMs > 0) usleep((useconds_t)a.lateMs * 1000);
  Aborter aborter;
  if (rank == a.abortRank) {
    aborter.atMs = startMs + a.abortMs;
    aborter.started = pthread_create(&aborter.thread, NULL, Aborter::run, &aborter) == 0;
  }
  ncclResult_t res = runMeasured(a, rank, stockHandle, startMs, launchMs, o);
  if (aborter.started) {
    pthread_join(aborter.thread, NULL);
    if (res != ncclSuccess) o->abortReturnMs = nowMs() - aborter.raisedMs;
  }
  return res;
}

ncclResult_t runMeasured(const Args& a, int rank, const ncclBootstrapHandle* stockHandle, double startMs,
                         double launchMs, Outcome* o) {
  int n = a.nranks;
  ncclComm_t comm = NULL;
  if (a.mode == "rootless") {
    std::string listen = addressOf(a, rank), next = addressOf(a, (rank + 1) % n);
    ncclRootlessInfo_t info = NCCL_ROOTLESS_INFO_INIT;
    info.listenAddr = listen.c_str();
    info.nextAddr = next.c_str();
    info.jobKey = a.jobKey;
    info.generation = a.generation;
    info.groupIndex = a.group;
    info.connectTimeoutMs = a.timeoutMs;
    info.retryDelayMs = a.retryMs;
    NCCLCHECK(ncclCommInitRankRootless(&comm, n, rank, &info, NULL));
  } else {
    comm = (ncclComm_t)calloc(1, sizeof(struct ncclComm));
    uint32_t* abortFlag = (uint32_t*)calloc(1, sizeof(uint32_t));
    if (comm == NULL || abortFlag == NULL) return ncclSystemError;
    comm->rank = rank;
    comm->nRanks = n;
    comm->abortFlag = abortFlag;
    ncclBootstrapHandle handle = *stockHandle;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 23, 0)
    NCCLCHECK(bootstrapInit(1, &handle, comm, NULL));   // 2.23+: several roots' handles, a parent
#else
    NCCLCHECK(bootstrapInit(&handle, comm));
#endif
  }
  double t = nowMs();
  o->initMs = t - startMs;
  o->launchInitMs = t - launchMs;

  o->exchange = hpctBootstrapLogStats(comm->bootstrap, &o->stats) != 0;
  if (rank == a.stallRank && a.stallMs > 0) usleep((useconds_t)a.stallMs * 1000);
  o->stage = "allgather";
  o->table.assign(n, -1);
  o->table[rank] = rank;
  NCCLCHECK(bootstrapAllGather(comm->bootstrap, o->table.data(), sizeof(int)));
  t = nowMs();
  o->allgatherMs = t - startMs;
  o->launchAllgatherMs = t - launchMs;
  o->tableOk = true;
  for (int i = 0; i < n; i++) o->tableOk = o->tableOk && o->table[i] == i;
  if (!o->tableOk) {
    o->stage = "allgather-check";
    return ncclInternalError;
  }
  o->stage = "payload";
  // Filled before and checked after, so the allgathers run back to back: a rank still filling
  // would make its peers' allgather wait for it.
  std::vector<std::vector<unsigned char>> all(a.payloads.size());
  for (size_t i = 0; i < a.payloads.size(); i++) {
    size_t size = a.payloads[i];
    all[i].assign(n * size, 0xEE);
    fill(&all[i][rank * size], size, rank, (int)i);
  }
  for (size_t i = 0; i < a.payloads.size(); i++)
    NCCLCHECK(bootstrapAllGather(comm->bootstrap, all[i].data(), (int)a.payloads[i]));
  t = nowMs();
  o->launchPayloadMs = t - launchMs;
  if (o->exchange) hpctBootstrapLogStats(comm->bootstrap, &o->stats);
  for (auto& v : all) o->digests.push_back(fnv1aHex(v));
  if (!a.allSteps) {   // a benchmark's rank: through; NCCL's spinning sockets would slow the rest
    o->stage = "done";
    return ncclSuccess;
  }

  o->stage = "sendrecv";   // to the rank half a ring away, so it is no ring neighbour when n > 3
  int to = (rank + n / 2) % n, from = (rank - n / 2 + n) % n;
  int sent = 1000003 * (rank + 1), got = -1;
  NCCLCHECK(bootstrapSend(comm->bootstrap, to, kSendRecvTag, &sent, sizeof(sent)));
  NCCLCHECK(bootstrapRecv(comm->bootstrap, from, kSendRecvTag, &got, sizeof(got)));
  o->sendRecvOk = got == 1000003 * (from + 1);
  if (!o->sendRecvOk) {
    o->stage = "sendrecv-check";
    return ncclInternalError;
  }
  o->stage = "barrier";
  NCCLCHECK(bootstrapBarrier(comm->bootstrap, rank, n, kBarrierTag));
  o->stage = "close";
  NCCLCHECK(bootstrapClose(comm->bootstrap));
  o->stage = "done";
  return ncclSuccess;
}

std::string report(const Args& a, int rank, const Outcome& o, const std::vector<std::string>& warns) {
  std::string s = "{\"rank\": " + std::to_string(rank) + ", \"mode\": " + jsonString(a.mode) +
                  ", \"nranks\": " + std::to_string(a.nranks) + ", \"pid\": " + std::to_string(getpid()) +
                  ", \"status\": " + jsonString(o.ok ? "ok" : "error") + ", \"stage\": " + jsonString(o.stage) +
                  ", \"result\": " + jsonString(o.result);
  if (a.mode == "rootless") s += ", \"listen\": " + jsonString(addressOf(a, rank));
  s += ", \"error\": " + jsonString(warns.empty() ? std::string() : warns.back());
  s += ", \"warnings\": [";
  for (size_t i = 0; i < warns.size(); i++) s += (i ? ", " : "") + jsonString(warns[i]);
  s += "]";
  auto ms = [](double v) { return v < 0 ? std::string("null") : num(v); };
  s += ", \"init_ms\": " + ms(o.initMs) + ", \"allgather_ms\": " + ms(o.allgatherMs);
  s += ", \"launch_init_ms\": " + ms(o.launchInitMs) + ", \"launch_allgather_ms\": " + ms(o.launchAllgatherMs);
  s += ", \"end_ms\": " + ms(o.endMs) + ", \"launch_end_ms\": " + ms(o.launchEndMs);
  s += ", \"threads_at_fork\": " + std::to_string(o.threadsAtFork);
  s += std::string(", \"table_ok\": ") + (o.tableOk ? "true" : "false");
  s += std::string(", \"sendrecv_ok\": ") + (o.sendRecvOk ? "true" : "false");
  s += ", \"digests\": [";
  for (size_t i = 0; i < o.digests.size(); i++) s += (i ? ", " : "") + jsonString(o.digests[i]);
  s += "], \"abort_return_ms\": " + ms(o.abortReturnMs) + ", \"launch_payload_ms\": " + ms(o.launchPayloadMs);
  s += ", \"payload_bytes\": [";
  for (size_t i = 0; i < a.payloads.size(); i++) s += (i ? ", " : "") + std::to_string(a.payloads[i]);
  s += "]";
  if (o.exchange)
    s += ", \"exchange\": {\"rounds\": " + std::to_string(o.stats.rounds) + ", \"opened\": " +
         std::to_string(o.stats.opened) + ", \"accepted\": " + std::to_string(o.stats.accepted) +
         ", \"attempts\": " + std::to_string(o.stats.connectAttempts) + ", \"refused\": " +
         std::to_string(o.stats.refusedConnections) + ", \"form_ms\": " + num(o.stats.formMs) +
         ", \"allgathers\": " + std::to_string(o.stats.allgathers) + ", \"allgather_ms\": " +
         num(o.stats.allgatherMs) + ", \"last_allgather_ms\": " + num(o.stats.lastAllgatherMs) +
         ", \"bytes\": " + std::to_string(o.stats.bytesReceived) + "}";
  else
    s += ", \"exchange\": null";
  if (!o.tableOk && o.allgatherMs >= 0) {
    s += ", \"table\": [";
    for (size_t i = 0; i < o.table.size() && i < 64; i++) s += (i ? ", " : "") + std::to_string(o.table[i]);
    s += "]";
  }
  return s + "}\n";
}

// Stock mode: the root's handle, written by the parent once its root thread listens.  False
// when the parent closed the pipe without it (bootstrapGetUniqueId failed) or by the deadline.
bool readHandle(int fd, double deadlineMs, ncclBootstrapHandle* handle) {
  size_t got = 0;
  char* at = (char*)handle;
  while (got < sizeof(*handle)) {
    double left = deadlineMs - nowMs();
    if (left <= 0) return false;
    struct pollfd pfd = {fd, POLLIN, 0};
    int ready = poll(&pfd, 1, left > 1000 ? 1000 : (int)left + 1);
    if (ready < 0 && errno != EINTR) return false;
    if (ready <= 0) continue;
    ssize_t n = read(fd, at + got, sizeof(*handle) - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    got += (size_t)n;
  }
  return true;
}

[[noreturn]] void child(const Args& a, int rank, int handleFd, int threadsAtFork, double launchMs, int outFd) {
  ncclBootstrapHandle handle;
  memset(&handle, 0, sizeof(handle));
  // Without the handle there is no stock run to report: the parent says why and exits 3.
  if (a.mode == "stock" && !readHandle(handleFd, launchMs + a.killMs, &handle)) _exit(3);
  if (handleFd >= 0) close(handleFd);
  double startMs = nowMs();
  FILE* log = tmpfile();
  if (log) ncclDebugFile = log;
  Outcome o;
  o.threadsAtFork = threadsAtFork;
  ncclResult_t r = runSteps(a, rank, &handle, startMs, launchMs, &o);
  double endMs = nowMs();   // success or failure: when this rank was through
  o.endMs = endMs - startMs;
  o.launchEndMs = endMs - launchMs;
  o.result = resultName(r);
  o.ok = r == ncclSuccess;
  std::vector<std::string> warns = log ? warnings(log) : std::vector<std::string>();
  std::string line = report(a, rank, o, warns);
  size_t off = 0;
  while (off < line.size()) {
    ssize_t w = write(outFd, line.data() + off, line.size() - off);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) break;
    off += (size_t)w;
  }
  _exit(o.ok ? 0 : 1);
}

struct Child {
  int rank;
  pid_t pid;
  int fd;
  int handleFd;   // stock mode: the write end of this rank's handle pipe, else -1
  std::string out;
  bool done;
};

}  // namespace

int main(int argc, char** argv) {
  double launchMs = nowMs();
  Args a = parse(argc, argv);
  setenv("NCCL_DEBUG", "WARN", 0);
  hpctHarnessNoSpin = a.noSpin;
  signal(SIGPIPE, SIG_IGN);

  if (bootstrapNetInit() != ncclSuccess) {
    fprintf(stderr, "bootstrap_harness: bootstrapNetInit failed (set NCCL_SOCKET_IFNAME to an interface with an address): %s\n",
            ncclLastError);
    return 3;
  }
  fflush(stdout);
  fflush(stderr);

  // Every rank is forked while this process still has one thread (see the top of the file).
  bool stock = a.mode == "stock";
  std::vector<Child> kids;
  for (int rank : a.ranks) {
    if (rank == a.missingRank) continue;
    int fds[2], hfds[2] = {-1, -1};
    if (pipe(fds) != 0 || (stock && pipe(hfds) != 0)) {
      perror("bootstrap_harness: pipe");
      break;
    }
    int threads = threadCount();
    pid_t pid = fork();
    if (pid == 0) {
      close(fds[0]);
      if (stock) close(hfds[1]);
      for (auto& k : kids) {
        close(k.fd);
        if (k.handleFd >= 0) close(k.handleFd);
      }
      child(a, rank, hfds[0], threads, launchMs, fds[1]);
    }
    close(fds[1]);
    if (stock) close(hfds[0]);
    if (pid < 0) {
      perror("bootstrap_harness: fork");
      close(fds[0]);
      if (stock) close(hfds[1]);
      break;
    }
    kids.push_back(Child{rank, pid, fds[0], hfds[1], std::string(), false});
  }

  if (stock) {
    ncclBootstrapHandle handle;
    memset(&handle, 0, sizeof(handle));
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 23, 0)
    ncclResult_t got = bootstrapGetUniqueId(&handle, NULL);   // NULL: not a grow
#else
    ncclResult_t got = bootstrapGetUniqueId(&handle);
#endif
    for (auto& k : kids) {
      // One handle is far below PIPE_BUF, so the write is whole; a rank that already died
      // gets EPIPE (ignored: its exit status is reported below).
      if (got == ncclSuccess && write(k.handleFd, &handle, sizeof(handle)) != (ssize_t)sizeof(handle) &&
          errno != EPIPE)
        perror("bootstrap_harness: handing a rank the root's handle");
      close(k.handleFd);
      k.handleFd = -1;
    }
    if (got != ncclSuccess) {
      for (auto& k : kids) {
        int status = 0;
        waitpid(k.pid, &status, 0);   // each exits at once: its handle pipe closed empty
        close(k.fd);
      }
      fprintf(stderr, "bootstrap_harness: bootstrapGetUniqueId failed: %s\n", ncclLastError);
      return 3;
    }
  }

  // Collect every result; a rank still silent at the deadline is killed and reported so.
  double deadline = launchMs + a.killMs;
  for (;;) {
    std::vector<struct pollfd> pfds;
    std::vector<Child*> open;
    for (auto& k : kids)
      if (!k.done) {
        pfds.push_back({k.fd, POLLIN, 0});
        open.push_back(&k);
      }
    if (open.empty()) break;
    double left = deadline - nowMs();
    if (left <= 0) break;
    if (poll(pfds.data(), pfds.size(), left > 1000 ? 1000 : (int)left + 1) < 0 && errno != EINTR) break;
    for (size_t i = 0; i < pfds.size(); i++) {
      if (!pfds[i].revents) continue;
      char buf[4096];
      ssize_t n = read(open[i]->fd, buf, sizeof(buf));
      if (n > 0) open[i]->out.append(buf, (size_t)n);
      else if (n == 0 || errno != EINTR) open[i]->done = true;
    }
  }
  bool allOk = true;
  for (auto& k : kids) {
    if (!k.done) kill(k.pid, SIGKILL);
    int status = 0;
    waitpid(k.pid, &status, 0);
    close(k.fd);
    bool exitedOk = k.done && WIFEXITED(status) && WEXITSTATUS(status) == 0;
    allOk = allOk && exitedOk;
    if (!k.done) {
      k.out = "{\"rank\": " + std::to_string(k.rank) + ", \"mode\": " + jsonString(a.mode) +
              ", \"status\": \"killed\", \"error\": " +
              jsonString("no result within " + std::to_string(a.killMs) + " ms of launch; killed") + "}\n";
    } else if (k.out.empty()) {
      k.out = "{\"rank\": " + std::to_string(k.rank) + ", \"mode\": " + jsonString(a.mode) +
              ", \"status\": \"crashed\", \"error\": " +
              jsonString("exited without a result, wait status " + std::to_string(status)) + "}\n";
    }
  }
  for (int rank : a.ranks) {
    if (rank == a.missingRank) {
      printf("{\"rank\": %d, \"mode\": %s, \"status\": \"absent\"}\n", rank, jsonString(a.mode).c_str());
      continue;
    }
    for (auto& k : kids)
      if (k.rank == rank) fputs(k.out.c_str(), stdout);
  }
  fflush(stdout);
  size_t expected = 0;
  for (int rank : a.ranks) expected += rank != a.missingRank;
  return allOk && kids.size() == expected ? 0 : 1;
}
