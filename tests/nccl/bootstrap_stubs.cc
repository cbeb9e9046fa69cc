// What NCCL's bootstrap layer and the hpct series reference outside the files the bootstrap
// harness compiles (bootstrap.cc, misc/socket.cc, misc/utils.cc, misc/param.cc, debug.cc and
// the series' misc/hpct_*.cc; NCCL_FILES in benchmarks/nccl_bootstrap.py).  Written for hpct's tests; the
// harness runs without a GPU, a CUDA runtime or the rest of NCCL.
//
// One stub is more than a placeholder: hpctCommInitRankDev stands in for init.cc's comm
// creation, so that ncclCommInitRankRootless runs for real (argument checks, identity,
// group bracket, the thread-local hand-over to hpctRootlessAttach) up to bootstrapInit.
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "bootstrap.h"
#include "comm.h"
#include "cudawrap.h"
#include "group.h"
#include "hpct_rootless_comm.h"
#include "proxy.h"
#include "socket.h"
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 30, 0)
#include <mutex>
#include "env.h"
#include "ras.h"
#endif

// ---- CUDA runtime: debug.cc asks for the device of every log line; the rootless entry point
// asks once.  There is no device: report device 0 and refuse everything else.
extern "C" {
cudaError_t cudaGetDevice(int* device) {
  if (device) *device = 0;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr, int) {
  if (value) *value = 0;
  return cudaErrorNoDevice;
}
cudaError_t cudaDeviceGetPCIBusId(char* busId, int len, int) {
  if (busId && len > 0) busId[0] = '\0';
  return cudaErrorNoDevice;
}
const char* cudaGetErrorString(cudaError_t) { return "no CUDA runtime in hpct's bootstrap harness"; }
}

ncclResult_t ncclCudaLibraryInit(void) { return ncclSuccess; }

// ---- The harness's own: the abort flag of the comm hpctCommInitRankDev made (--abort-rank
// raises it, as ncclCommRaiseAbortFlag would), and the no-spin switch below.
volatile uint32_t* volatile hpctHarnessAbortFlag = NULL;
int hpctHarnessNoSpin = 0;

// ---- --no-spin: NCCL's socket loops retry a non-blocking recv, send or accept at once when it
// would block.  A rank with its own CPU loses nothing by that; N ranks on 2 CPUs take each
// other's time, and a ring step then waits for the whole machine's time slice (64 ranks took
// 79 s here).  With the switch on, a call that would block first waits up to 10 ms in poll()
// for the socket to be ready, then says "would block" as before: NCCL's code and results are
// unchanged, only the spinning stops.  These definitions replace libc's in this executable.
static void hpctWaitReady(int fd, short events, int flags) {
  if (!hpctHarnessNoSpin || !(flags & MSG_DONTWAIT)) return;
  int saved = errno;
  struct pollfd p = {fd, events, 0};
  poll(&p, 1, 10);
  errno = saved;
}

extern "C" {
ssize_t recv(int fd, void* buf, size_t len, int flags) {
  ssize_t n = syscall(SYS_recvfrom, fd, buf, len, flags, NULL, NULL);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) hpctWaitReady(fd, POLLIN, flags);
  return n;
}
ssize_t send(int fd, const void* buf, size_t len, int flags) {
  ssize_t n = syscall(SYS_sendto, fd, buf, len, flags, NULL, 0);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) hpctWaitReady(fd, POLLOUT, flags);
  return n;
}
int accept(int fd, struct sockaddr* addr, socklen_t* len) {
  int got = (int)syscall(SYS_accept4, fd, addr, len, 0);
  if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) hpctWaitReady(fd, POLLIN, MSG_DONTWAIT);
  return got;
}
}

#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 30, 0)
// 2.30's headers and os/linux.cc refer to these; nothing on the bootstrap path calls them with a GPU.
extern "C" {
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
cudaError_t cudaSetDevice(int) { return cudaErrorNoDevice; }
cudaError_t cudaHostRegister(void*, size_t, unsigned int) { return cudaErrorNoDevice; }
cudaError_t cudaHostUnregister(void*) { return cudaErrorNoDevice; }
cudaError_t cudaHostGetDevicePointer(void**, void*, unsigned int) { return cudaErrorNoDevice; }
cudaError_t cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode*) { return cudaSuccess; }
}

// init.cc's: the environment plugin initialised once, as NCCL does before reading parameters.
static std::once_flag hpctEnvOnce;
static ncclResult_t hpctEnvResult = ncclSuccess;
ncclResult_t ncclInitEnv() {
  std::call_once(hpctEnvOnce, [] { hpctEnvResult = ncclEnvPluginInit(); });
  return hpctEnvResult;
}
int ncclParamSetCpuStackSize() { return 0; }   // os/linux.cc's extern (init.cc's NCCL_PARAM)

// RAS (2.30 joins every comm at bootstrap): not part of what the harness measures.
ncclResult_t ncclRasCommInit(struct ncclComm*, struct rasRankInit*) { return ncclSuccess; }
ncclResult_t ncclRasAddRanks(struct rasRankInit*, int) { return ncclSuccess; }
#endif

// ---- Group bracket: the harness never queues work, so leaving the outermost group just
// reports (and clears) the error recorded inside it.
__thread int ncclGroupDepth = 0;
__thread ncclResult_t ncclGroupError = ncclSuccess;

#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 23, 0)
ncclResult_t ncclGroupEndInternal(ncclSimInfo_t*) {
#else
ncclResult_t ncclGroupEndInternal() {
#endif
  if (ncclGroupDepth <= 0) return ncclInvalidUsage;
  if (--ncclGroupDepth > 0) return ncclSuccess;
  ncclResult_t ret = ncclGroupError;
  ncclGroupError = ncclSuccess;
  return ret;
}

ncclResult_t ncclCommSetAsyncError(ncclComm_t comm, ncclResult_t nextState) {
  if (comm) comm->asyncResult = nextState;
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError) {
  if (comm == NULL || asyncError == NULL) return ncclInvalidArgument;
  *asyncError = comm->asyncResult;
  return ncclSuccess;
}

// ---- The proxy thread needs a GPU; the bootstrap only hands it a listening socket.
ncclResult_t ncclProxyInit(struct ncclComm*, struct ncclSocket* sock, union ncclSocketAddress*, uint64_t*) {
  if (sock) {
    ncclSocketClose(sock);
    free(sock);
  }
  return ncclSuccess;
}

// ---- The part of comm creation the bootstrap depends on: a zeroed comm with rank, size,
// an abort flag and a blocking config, the pending rootless addresses attached exactly as
// init.cc attaches them, then bootstrapInit with the identity the caller computed.
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 23, 0)
ncclResult_t hpctCommInitRankDev(ncclComm_t* newcomm, int nranks, ncclUniqueId* commIdPtr, int myrank, int cudaDev,
                                 ncclConfig_t*) {
  ncclUniqueId commId = *commIdPtr;
#else
ncclResult_t hpctCommInitRankDev(ncclComm_t* newcomm, int nranks, ncclUniqueId commId, int myrank, int cudaDev,
                                 ncclConfig_t*) {
#endif
  struct ncclComm* comm = (struct ncclComm*)calloc(1, sizeof(struct ncclComm));
  uint32_t* abortFlag = (uint32_t*)calloc(1, sizeof(uint32_t));
  if (comm == NULL || abortFlag == NULL) return ncclSystemError;
  comm->rank = myrank;
  comm->nRanks = nranks;
  comm->cudaDev = cudaDev;
  comm->abortFlag = abortFlag;
  comm->config.blocking = 1;
  *newcomm = comm;
  hpctHarnessAbortFlag = abortFlag;
  NCCLCHECK(hpctRootlessAttach(comm));
  if (!comm->hpctRootless.enabled) {
    fprintf(stderr, "bootstrap_stubs: hpctRootlessAttach did not mark the comm rootless\n");
    return ncclInternalError;
  }
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 23, 0)
  return bootstrapInit(1, &commId, comm, NULL);
#else
  return bootstrapInit((struct ncclBootstrapHandle*)&commId, comm);
#endif
}
