/*
 * hpct: NCCL's side of the log-depth bootstrap (see hpct_bootstrap_log.h).
 *
 * bootstrapAllGather knows only the bootstrap's private state, not the comm, so each
 * exchange is registered under that state's address when bootstrapInit forms it and
 * looked up by every allgather; a comm that never formed one is not in the registry.
 */
#include "hpct_bootstrap_log.h"

#include <string.h>
#include <sys/socket.h>

#include <mutex>
#include <vector>

#include "comm.h"
#include "debug.h"
#include "hpct_ring.h"
#include "hpct_rootless_comm.h"
#include "param.h"
#include "socket.h"

namespace {

struct Entry {
  void* state;
  hpctExchange* exchange;
};

std::mutex registryLock;
std::vector<Entry> registry;   // a handful of live rootless comms per process

hpctExchange* find(void* state) {
  std::lock_guard<std::mutex> hold(registryLock);
  for (auto& e : registry)
    if (e.state == state) return e.exchange;
  return nullptr;
}

ncclResult_t resultOf(hpctRingStatus s) {
  switch (s) {
    case hpctRingOk: return ncclSuccess;
    case hpctRingAborted: return ncclInternalError;   // what NCCL's sockets return on abort
    case hpctRingTimeout:
    case hpctRingPeerFailed: return ncclRemoteError;  // a peer did not come, failed or exited
    case hpctRingMismatch:
    case hpctRingStale: return ncclInvalidUsage;      // the ranks disagree on the job
    case hpctRingBadAddress: return ncclInvalidArgument;
    default: return ncclSystemError;
  }
}

// The listen fd in an ncclSocket, as NCCL's own listen leaves one: NCCL's p2p bootstrap
// (bootstrapSend/Recv) accepts on it after the exchange, and bootstrapClose closes it.
void adoptListen(struct ncclSocket* sock, int fd, struct ncclComm* comm) {
  ncclSocketInit(sock, NULL, comm->magic, ncclSocketTypeBootstrap, comm->abortFlag, 0);
  socklen_t len = sizeof(sock->addr);
  getsockname(fd, &sock->addr.sa, &len);
  sock->salen = sock->addr.sa.sa_family == AF_INET6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in);
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 30, 0)
  sock->socketDescriptor = fd;
#else
  sock->fd = fd;
#endif
  sock->state = ncclSocketStateReady;
}

}  // namespace

int hpctBootstrapLogWanted(void) {
  const char* mode = ncclGetEnv(HPCT_BOOTSTRAP_ENV);
  return !(mode != NULL && strcmp(mode, "ring") == 0);
}

ncclResult_t hpctBootstrapRootlessLog(struct ncclComm* comm, struct ncclSocket* listenSock,
                                      struct ncclSocket* ringSend, struct ncclSocket* ringRecv) {
  struct hpctRootlessComm* r = &comm->hpctRootless;
  // Closed as they are: nothing connects them, and an uninitialised one would close fd 0.
  ncclSocketInit(ringSend);
  ncclSocketInit(ringRecv);
  ncclSocketInit(listenSock);
  const char* mode = ncclGetEnv(HPCT_BOOTSTRAP_ENV);
  if (mode != NULL && strcmp(mode, "log") != 0 && strcmp(mode, "ring") != 0) {
    WARN("hpct rootless bootstrap: %s=%s is not a bootstrap: set it to log (the default, log depth) or ring "
         "(NCCL's ring allgathers), or unset it", HPCT_BOOTSTRAP_ENV, mode);
    return ncclInvalidUsage;
  }
  hpctRingError err;
  int listenFd = -1;
  hpctRingStatus s = hpctRingListen(r->listenAddr, &listenFd, &err);
  if (s != hpctRingOk) {
    WARN("hpct rootless bootstrap: rank %d: %s", comm->rank, err.message);
    return resultOf(s);
  }
  adoptListen(listenSock, listenFd, comm);
  hpctRingConfig cfg = {comm->rank, comm->nRanks, r->generation, r->group, comm->magic, r->listenAddr, r->nextAddr,
                        r->timeoutMs, r->retryDelayMs, 0, comm->abortFlag};
  hpctExchange* x = nullptr;
  s = hpctExchangeForm(listenFd, &cfg, &x, &err);
  if (s != hpctRingOk) {
    WARN("hpct rootless bootstrap: %s", err.message);
    ncclSocketClose(listenSock);   // free the fixed port now, not when the comm is reclaimed
    return resultOf(s);
  }
  {
    std::lock_guard<std::mutex> hold(registryLock);
    registry.push_back(Entry{comm->bootstrap, x});
  }
  hpctExchangeStats st;
  hpctExchangeStatsOf(x, &st);
  INFO(NCCL_INIT | NCCL_BOOTSTRAP,
       "hpct rootless bootstrap: rank %d of %d listening on %s, log-depth exchange formed in %.1f ms (%d rounds, "
       "%d connections opened and %d accepted, %d connect attempts, %d connections refused)",
       comm->rank, comm->nRanks, r->listenAddr, st.formMs, st.rounds, st.opened, st.accepted, st.connectAttempts,
       st.refusedConnections);
  return ncclSuccess;
}

int hpctBootstrapLogActive(void* commState) { return commState != nullptr && find(commState) != nullptr; }

ncclResult_t hpctBootstrapLogAllGather(void* commState, void* allData, int size) {
  hpctExchange* x = find(commState);
  if (x == nullptr || size < 0) return ncclInternalError;
  hpctRingError err;
  hpctRingStatus s = hpctExchangeAllGather(x, allData, (size_t)size, &err);
  if (s != hpctRingOk) {
    WARN("hpct rootless bootstrap: %s", err.message);
    return resultOf(s);
  }
  hpctExchangeStats st;
  hpctExchangeStatsOf(x, &st);
  TRACE(NCCL_BOOTSTRAP, "hpct rootless bootstrap: allgather #%d of %d bytes per rank in %.3f ms (%d rounds)",
        st.allgathers, size, st.lastAllgatherMs, st.rounds);
  return ncclSuccess;
}

void hpctBootstrapLogRelease(void* commState) {
  hpctExchange* x = nullptr;
  {
    std::lock_guard<std::mutex> hold(registryLock);
    for (size_t i = 0; i < registry.size(); i++)
      if (registry[i].state == commState) {
        x = registry[i].exchange;
        registry.erase(registry.begin() + i);
        break;
      }
  }
  if (x == nullptr) return;
  hpctExchangeStats st;
  hpctExchangeStatsOf(x, &st);
  INFO(NCCL_INIT | NCCL_BOOTSTRAP, "hpct rootless bootstrap: %d log-depth allgathers in %.1f ms, %llu bytes received",
       st.allgathers, st.allgatherMs, (unsigned long long)st.bytesReceived);
  hpctExchangeClose(x, 0);
}

int hpctBootstrapLogStats(void* commState, hpctExchangeStats* stats) {
  hpctExchange* x = find(commState);
  if (x == nullptr || stats == nullptr) return 0;
  hpctExchangeStatsOf(x, stats);
  return 1;
}
