/*
 * hpct: the hooks NCCL's bootstrap.cc calls so that a rootless communicator
 * gathers in log depth (hpct_exchange.h) instead of over NCCL's ring.
 *
 * The rootless branch of bootstrapInit forms the exchange where it formed the
 * ring (hpctBootstrapRootlessLog); bootstrapAllGather hands a comm that has an
 * exchange to it (every allgather of bootstrapInit, initTransportsRank, split,
 * lazy connect); bootstrapClose and bootstrapAbort release it.  A comm without
 * an exchange (root-based, split, grow, or NCCL_HPCT_BOOTSTRAP=ring) is never
 * looked at twice: its bootstrap runs exactly as upstream's.  One file for
 * every pinned NCCL (2.21.5, 2.30.7); the few differences are version-guarded.
 */
#ifndef HPCT_BOOTSTRAP_LOG_H_
#define HPCT_BOOTSTRAP_LOG_H_

#include "hpct_exchange.h"
#include "nccl.h"

/* "log" (the default) or "ring": how a rootless comm gathers.  The ring is NCCL's own
 * ring allgather over hpct's rootless ring, kept for comparison and as a fallback. */
#define HPCT_BOOTSTRAP_ENV "NCCL_HPCT_BOOTSTRAP"

struct ncclComm;
struct ncclSocket;

/* Non-zero unless NCCL_HPCT_BOOTSTRAP=ring (a bad value is refused by hpctBootstrapRootlessLog). */
int hpctBootstrapLogWanted(void);
/* bootstrapInit's rootless branch: fixed listen socket, then the log-depth exchange.  The
 * ring sockets are left initialised and unconnected (NCCL closes them as such). */
ncclResult_t hpctBootstrapRootlessLog(struct ncclComm* comm, struct ncclSocket* listenSock,
                                      struct ncclSocket* ringSend, struct ncclSocket* ringRecv);
/* Whether bootstrapAllGather's state belongs to a comm with an exchange. */
int hpctBootstrapLogActive(void* commState);
ncclResult_t hpctBootstrapLogAllGather(void* commState, void* allData, int size);
/* Close the exchange of commState, if it has one (bootstrapClose, bootstrapAbort). */
void hpctBootstrapLogRelease(void* commState);
/* The exchange's counters (for tests and benchmarks); 0 when commState has none. */
int hpctBootstrapLogStats(void* commState, hpctExchangeStats* stats);

#endif
