/*
 * hpct: the rootless bootstrap's log-depth exchange, with nothing of NCCL in it.
 *
 * NCCL's bootstrap gathers what every rank must know (listen, proxy and UDS
 * addresses, peer info, topology) with ring allgathers: N-1 hops one after the
 * other, 3(N-1) or more per communicator.  This exchange gives the same bytes
 * in ceil(log2 N) rounds (Bruck's allgather: in round k a rank receives from
 * rank + 2^k the blocks it lacks and sends its own to rank - 2^k).
 *
 * Forming it needs no address table: a rank knows only the next rank's
 * address (as the ring does), and learns the address of rank + 2^(k+1) from
 * rank + 2^k when it connects to it in round k (pointer doubling).  So a rank
 * opens ceil(log2 N) connections and accepts as many; each handshake carries
 * the ring's checks (job, group, nranks, generation, who is whose peer).
 *
 * Every round, of forming and of each allgather, polls the abort flag and keeps
 * the deadline.  A rank that fails tells every peer it is connected to why
 * (a notice), so the cause, e.g. "rank 3 at host:port never answered",
 * reaches ranks that only waited behind it.  POSIX only: hpct's tests build
 * and run it without NCCL's source.
 */
#ifndef HPCT_EXCHANGE_H_
#define HPCT_EXCHANGE_H_

#include <stddef.h>
#include <stdint.h>

#include "hpct_ring.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct hpctExchange hpctExchange;

typedef struct {
  int rounds;                  /* ceil(log2 nranks): rounds of forming and of every allgather */
  int opened;                  /* connections this rank opened (one per round) */
  int accepted;                /* connections it accepted (one per round) */
  int connectAttempts;
  int refusedConnections;      /* handshakes refused: another job or group, an older generation */
  int droppedConnections;      /* connections that sent no valid handshake */
  double formMs;               /* forming: from the call to every connection ready */
  int allgathers;              /* allgathers completed */
  double allgatherMs;          /* their total time */
  double lastAllgatherMs;
  uint64_t bytesReceived;      /* payload bytes received by the allgathers */
} hpctExchangeStats;

/* ceil(log2 nranks), 0 for one rank. */
int hpctExchangeRounds(int nranks);

/* Form the exchange on listenFd (hpctRingListen's; it stays the caller's).  cfg is the
 * ring's configuration: rank, nranks, generation, group, magic, this rank's and the next
 * rank's addresses, the deadline, the backoff cap, the abort flag.  On success *out is
 * the caller's until hpctExchangeClose; on failure nothing is left open and every peer
 * this rank had reached has been told why (a notice, then a graceful close). */
hpctRingStatus hpctExchangeForm(int listenFd, const hpctRingConfig* cfg, hpctExchange** out, hpctRingError* err);

/* Allgather: data holds nranks blocks of size bytes; this rank's own block is read, the
 * others are written, exactly as a ring allgather leaves them.  Every rank must call the
 * same allgathers in the same order.  The deadline (cfg->timeoutMs) counts from the call.
 * A failure is final: later calls return it again. */
hpctRingStatus hpctExchangeAllGather(hpctExchange* x, void* data, size_t size, hpctRingError* err);

void hpctExchangeStatsOf(const hpctExchange* x, hpctExchangeStats* stats);

/* Close every connection (gracefully after success, with a reset after a failure or when
 * reset is non-zero) and free x.  NULL is ignored. */
void hpctExchangeClose(hpctExchange* x, int reset);

#ifdef __cplusplus
}
#endif

#endif
