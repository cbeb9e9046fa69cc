/*
 * hpct: the rootless bootstrap ring, with nothing of NCCL in it.
 *
 * A rank listens on a fixed address, connects to the next rank's fixed address
 * and accepts the previous rank, all in one poll loop with a deadline and an
 * abort flag.  A small handshake (rank, nranks, generation, group, magic)
 * replaces the checks NCCL's root used to make.  The unit depends on POSIX
 * only, so hpct's tests build and run it without NCCL's source.
 */
#ifndef HPCT_RING_H_
#define HPCT_RING_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  hpctRingOk = 0,
  hpctRingAborted = 1,      /* the abort flag was raised */
  hpctRingTimeout = 2,      /* the deadline passed; the message names what is missing */
  hpctRingAddrInUse = 3,    /* the fixed listen port is taken */
  hpctRingMismatch = 4,     /* a neighbour disagrees on nranks or on who is whose neighbour */
  hpctRingStale = 5,        /* this rank belongs to an older generation than its neighbour */
  hpctRingBadAddress = 6,   /* an address string cannot be parsed or resolved */
  hpctRingSystem = 7,       /* a system call failed */
  hpctRingPeerFailed = 8    /* a peer failed and said why, or closed its connection (hpct_exchange) */
} hpctRingStatus;

#define HPCT_RING_MESSAGE_BYTES 1024

typedef struct {
  hpctRingStatus status;
  char message[HPCT_RING_MESSAGE_BYTES];
} hpctRingError;

typedef struct {
  int rank;
  int nranks;
  uint32_t generation;
  uint32_t group;
  uint64_t magic;              /* equal on all ranks of one communicator */
  const char* listenAddr;      /* this rank's address, for messages */
  const char* nextAddr;        /* "host:port" or "[v6]:port" of rank (rank + 1) % nranks */
  int timeoutMs;               /* deadline for the whole ring, connect and accept alike */
  int retryDelayMs;            /* longest pause between connect attempts (backoff cap) */
  int ackTimeoutMs;            /* a connection with no answer by then is dropped and retried; <= 0: 3000 */
  volatile uint32_t* abortFlag;  /* may be NULL */
} hpctRingConfig;

/* Counters of one hpctRingForm call (for tests, logs and benchmarks). */
typedef struct {
  int connectAttempts;
  int refusedConnections;      /* connections this rank's listener turned away */
  int droppedConnections;      /* connections that sent no valid handshake */
  double elapsedMs;
} hpctRingStats;

/* Parse "host:port" / "[v6]:port" (host names are resolved). */
hpctRingStatus hpctRingParseAddr(const char* hostport, void* sockaddrStorage, unsigned* len, hpctRingError* err);

/* Bind (SO_REUSEADDR only, never SO_REUSEPORT, so a clash fails at once) and listen, non-blocking. */
hpctRingStatus hpctRingListen(const char* hostport, int* listenFd, hpctRingError* err);

/* Form the ring: on success *sendFd is connected to the next rank and *recvFd to the
 * previous one, both non-blocking, the handshake done.  listenFd stays open and is
 * the caller's.  stats may be NULL. */
hpctRingStatus hpctRingForm(int listenFd, const hpctRingConfig* cfg, int* sendFd, int* recvFd,
                            hpctRingStats* stats, hpctRingError* err);

/* The socket magic of a communicator: a hash of everything that must agree. */
uint64_t hpctRingMagic(uint64_t jobKey, uint32_t generation, uint32_t group, int nranks);

/* Close a socket with a reset (no TIME_WAIT), for the abort path. */
void hpctRingCloseReset(int fd);

#ifdef __cplusplus
}
#endif

#endif
