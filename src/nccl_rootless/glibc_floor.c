/* Keep libnccl loadable on glibc 2.28 (manylinux_2_28, as torch's wheels and NVIDIA's NCCL
 * wheels), although hpct-build compiles it on a newer glibc.  The same idea as the hpct
 * extension's src/compat/glibc_floor.c, for the names NCCL uses: objects compiled against
 * glibc >= 2.34 refer to pthread, semaphore, shm and dl* functions under GLIBC_2.34 (they moved
 * into libc.so.6), to exp/log2 under GLIBC_2.29, stat under GLIBC_2.33 and the variable
 * __libc_single_threaded (GLIBC_2.32).  hpct-build links this object into libnccl through
 * LDFLAGS (no NCCL makefile is edited) with -Wl,--wrap=NAME for every NAME below
 * (hpct/builder/nccl.py reads them from this file), so each reference lands on __wrap_NAME,
 * which jumps to NAME under its oldest version, still exported by every newer glibc.
 * x86_64 only (the versions are x86_64's); tests/test_nccl_build.py reads the built
 * library's required GLIBC versions.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>

#if defined(__x86_64__)

/* __wrap_NAME: a tail jump to NAME@VERSION, so arguments in any register (integer or
 * floating point) pass through untouched; hidden, so nothing outside libnccl sees it. */
#define HPCT_FORWARD(name, version)                                    \
  __asm__(".symver hpct_old_" #name "," #name "@" version "\n"        \
          ".globl __wrap_" #name "\n"                                  \
          ".hidden __wrap_" #name "\n"                                 \
          ".type __wrap_" #name ",@function\n"                         \
          "__wrap_" #name ":\n"                                        \
          "\tjmp hpct_old_" #name "@PLT\n"                             \
          ".size __wrap_" #name ",.-__wrap_" #name "\n");

HPCT_FORWARD(exp, "GLIBC_2.2.5")
HPCT_FORWARD(log2, "GLIBC_2.2.5")
HPCT_FORWARD(dlclose, "GLIBC_2.2.5")
HPCT_FORWARD(dlerror, "GLIBC_2.2.5")
HPCT_FORWARD(dlinfo, "GLIBC_2.3.3")
HPCT_FORWARD(dlmopen, "GLIBC_2.3.4")
HPCT_FORWARD(dlopen, "GLIBC_2.2.5")
HPCT_FORWARD(dlsym, "GLIBC_2.2.5")
HPCT_FORWARD(dlvsym, "GLIBC_2.2.5")
HPCT_FORWARD(dladdr, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_attr_getstacksize, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_attr_setstacksize, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_condattr_setpshared, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_create, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_detach, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_getspecific, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_join, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_key_create, "GLIBC_2.2.5")
HPCT_FORWARD(__pthread_key_create, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_key_delete, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_kill, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_mutex_trylock, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_mutexattr_destroy, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_mutexattr_init, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_mutexattr_setpshared, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_mutexattr_settype, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_once, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_rwlock_destroy, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_rwlock_init, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_rwlock_rdlock, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_rwlock_timedrdlock, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_rwlock_timedwrlock, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_rwlock_tryrdlock, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_rwlock_trywrlock, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_rwlock_unlock, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_rwlock_wrlock, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_rwlockattr_destroy, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_rwlockattr_init, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_rwlockattr_setpshared, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_setattr_default_np, "GLIBC_2.18")
HPCT_FORWARD(pthread_setname_np, "GLIBC_2.12")
HPCT_FORWARD(pthread_setspecific, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_spin_destroy, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_spin_init, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_spin_lock, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_spin_trylock, "GLIBC_2.2.5")
HPCT_FORWARD(pthread_spin_unlock, "GLIBC_2.2.5")
HPCT_FORWARD(sem_destroy, "GLIBC_2.2.5")
HPCT_FORWARD(sem_init, "GLIBC_2.2.5")
HPCT_FORWARD(sem_post, "GLIBC_2.2.5")
HPCT_FORWARD(sem_timedwait, "GLIBC_2.2.5")
HPCT_FORWARD(sem_trywait, "GLIBC_2.2.5")
HPCT_FORWARD(sem_wait, "GLIBC_2.2.5")
HPCT_FORWARD(shm_open, "GLIBC_2.2.5")
HPCT_FORWARD(shm_unlink, "GLIBC_2.2.5")

/* stat became a libc function in 2.33; before, the header inlined __xstat with the struct
 * stat version (1 on x86_64). */
extern int hpct_old___xstat(int ver, const char* path, struct stat* buf);
__asm__(".symver hpct_old___xstat,__xstat@GLIBC_2.2.5");
__attribute__((visibility("hidden"))) int __wrap_stat(const char* path, struct stat* buf) {
  return hpct_old___xstat(1, path, buf);
}

/* fstat64 became a libc function in 2.33 (libstdc++.a calls it): __fxstat64 before. */
extern int hpct_old___fxstat64(int ver, int fd, struct stat64* buf);
__asm__(".symver hpct_old___fxstat64,__fxstat64@GLIBC_2.2.5");
__attribute__((visibility("hidden"))) int __wrap_fstat64(int fd, struct stat64* buf) {
  return hpct_old___fxstat64(1, fd, buf);
}

/* arc4random (2.36) backs libstdc++'s std::random_device; getrandom (2.25) gives the same. */
__attribute__((visibility("hidden"))) uint32_t __wrap_arc4random(void) {
  uint32_t v = 0;
  size_t got = 0;
  while (got < sizeof v) {
    ssize_t n = getrandom((char*)&v + got, sizeof v - got, 0);
    if (n > 0) got += (size_t)n;
  }
  return v;
}

/* pthread_cond_clockwait (2.30), what std::condition_variable uses for a steady_clock
 * deadline: glibc's own where it has it, else the deadline moved to CLOCK_REALTIME for
 * pthread_cond_timedwait (right unless the wall clock jumps meanwhile). */
extern void* hpct_old_dlvsym_cw(void* handle, const char* symbol, const char* version);
__asm__(".symver hpct_old_dlvsym_cw,dlvsym@GLIBC_2.2.5");
extern int hpct_old_pthread_cond_timedwait(pthread_cond_t* c, pthread_mutex_t* m, const struct timespec* t);
__asm__(".symver hpct_old_pthread_cond_timedwait,pthread_cond_timedwait@GLIBC_2.3.2");
typedef int (*hpct_clockwait_fn)(pthread_cond_t*, pthread_mutex_t*, clockid_t, const struct timespec*);
__attribute__((visibility("hidden"))) int __wrap_pthread_cond_clockwait(pthread_cond_t* c, pthread_mutex_t* m,
                                                                        clockid_t clock, const struct timespec* deadline) {
  static hpct_clockwait_fn real;
  static int lookedUp;
  if (!__atomic_load_n(&lookedUp, __ATOMIC_ACQUIRE)) {
    hpct_clockwait_fn f = (hpct_clockwait_fn)hpct_old_dlvsym_cw(RTLD_DEFAULT, "pthread_cond_clockwait", "GLIBC_2.30");
    __atomic_store_n(&real, f, __ATOMIC_RELAXED);
    __atomic_store_n(&lookedUp, 1, __ATOMIC_RELEASE);
  }
  hpct_clockwait_fn f = __atomic_load_n(&real, __ATOMIC_RELAXED);
  if (f) return f(c, m, clock, deadline);
  if (clock == CLOCK_REALTIME) return hpct_old_pthread_cond_timedwait(c, m, deadline);
  struct timespec nowClock, nowReal, when;
  clock_gettime(clock, &nowClock);
  clock_gettime(CLOCK_REALTIME, &nowReal);
  int64_t leftNs = (int64_t)(deadline->tv_sec - nowClock.tv_sec) * 1000000000 + (deadline->tv_nsec - nowClock.tv_nsec);
  if (leftNs < 0) leftNs = 0;
  int64_t at = (int64_t)nowReal.tv_nsec + leftNs % 1000000000;
  when.tv_sec = nowReal.tv_sec + (time_t)(leftNs / 1000000000) + (time_t)(at / 1000000000);
  when.tv_nsec = (long)(at % 1000000000);
  return hpct_old_pthread_cond_timedwait(c, m, &when);
}

/* libstdc++ skips atomic reference counts while this says the process has one thread
 * (glibc 2.32+).  Zero is always correct, only a little slower. */
__attribute__((visibility("hidden"))) char __wrap___libc_single_threaded = 0;

#endif
