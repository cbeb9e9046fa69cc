/*
 * hpct: rootless communicator creation for NCCL (one header for every pinned
 * version: 2.21.5 and 2.30.7 export the same API and build the same identity).
 *
 * Every rank derives the communicator's identity locally (no ncclGetUniqueId,
 * no broadcast, no store) and connects its bootstrap ring directly: it listens
 * on a fixed address and connects to the next rank's fixed address.  The
 * identity, and the socket magic derived from it, depend on the job key, the
 * recovery generation, the group index and nranks, so a process from another
 * job, group or generation is refused at the handshake.
 *
 * Callers that must also run on a stock libnccl resolve the entry point at run
 * time: dlsym(handle, NCCL_ROOTLESS_SYMBOL) is NULL there.
 */
#ifndef NCCL_ROOTLESS_H_
#define NCCL_ROOTLESS_H_

#include <stddef.h>
#include <stdint.h>
#include "nccl.h"

#ifdef __cplusplus
extern "C" {
#endif

#define NCCL_ROOTLESS_API_VERSION 1
#define NCCL_ROOTLESS_SYMBOL "ncclCommInitRankRootless"
#define NCCL_ROOTLESS_ID_SYMBOL "ncclRootlessUniqueId"
#define NCCL_RAISE_ABORT_FLAG_SYMBOL "ncclCommRaiseAbortFlag"
/* Default for connectTimeoutMs <= 0: five minutes, hpct's HPCT_CONNECT_TIMEOUT default. */
#define NCCL_ROOTLESS_DEFAULT_TIMEOUT_MS 300000

typedef struct {
  size_t size;             /* sizeof(ncclRootlessInfo_t) as the caller was compiled */
  const char* listenAddr;  /* "host:port" or "[v6]:port" this rank listens on */
  const char* nextAddr;    /* the same for rank (rank + 1) % nranks */
  uint64_t jobKey;         /* equal on every rank of the job */
  uint32_t generation;     /* in-process recovery generation */
  uint32_t groupIndex;     /* the group's index from the global group counter */
  int connectTimeoutMs;    /* deadline for the ring's connect and accept */
  int retryDelayMs;        /* largest pause between connect attempts; <= 0: 100 */
} ncclRootlessInfo_t;

#define NCCL_ROOTLESS_INFO_INIT { sizeof(ncclRootlessInfo_t), NULL, NULL, 0, 0, 0, 0, 0 }

/* The 128 identity bytes every rank computes alike; commHash is their hash. */
ncclResult_t  ncclRootlessUniqueId(const ncclRootlessInfo_t* info, int nranks, ncclUniqueId* id);
ncclResult_t pncclRootlessUniqueId(const ncclRootlessInfo_t* info, int nranks, ncclUniqueId* id);

/* ncclCommInitRankConfig without a root: config may be NULL (blocking). */
ncclResult_t  ncclCommInitRankRootless(ncclComm_t* comm, int nranks, int rank,
                                       const ncclRootlessInfo_t* info, ncclConfig_t* config);
ncclResult_t pncclCommInitRankRootless(ncclComm_t* comm, int nranks, int rank,
                                       const ncclRootlessInfo_t* info, ncclConfig_t* config);

/* Raise comm's abort flags and nothing else (no lock, no teardown, no CUDA call): a thread held
 * inside a blocking call on comm returns, after which ncclCommAbort may run without a call beside
 * it, as NCCL's fault-tolerance contract asks.  The comm stays allocated until ncclCommAbort. */
ncclResult_t  ncclCommRaiseAbortFlag(ncclComm_t comm);
ncclResult_t pncclCommRaiseAbortFlag(ncclComm_t comm);

typedef ncclResult_t (*ncclCommInitRankRootless_t)(ncclComm_t*, int, int, const ncclRootlessInfo_t*, ncclConfig_t*);
typedef ncclResult_t (*ncclRootlessUniqueId_t)(const ncclRootlessInfo_t*, int, ncclUniqueId*);
typedef ncclResult_t (*ncclCommRaiseAbortFlag_t)(ncclComm_t);

#ifdef __cplusplus
}
#endif

#endif
