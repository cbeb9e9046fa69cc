/* Keep the extension loadable on glibc 2.28 (manylinux_2_28, as torch's wheels).
 *
 * The wheel is built on a newer glibc and carries its own libstdc++ (linked
 * statically, every symbol local).  Objects compiled against a new glibc refer to
 * symbol versions an old one lacks: functions that moved into libc.so.6 in 2.34
 * get a GLIBC_2.34 version, and a few functions did not exist in 2.28 at all.
 * CMakeLists.txt links with --wrap=NAME for each name below, so every reference,
 * also those inside libgloo.a and libstdc++.a, lands on the __wrap_NAME here.
 * Each wrapper either calls the same function under its oldest version (present
 * in every glibc since 2.2.5, still exported by new ones as a compat version) or
 * provides the behaviour with older calls.  auditwheel checks the result.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>

#define HIDDEN __attribute__((visibility("hidden")))

/* A function under its GLIBC_2.2.5 version: declare hpct_old_NAME, bind it to
 * NAME@GLIBC_2.2.5, and forward __wrap_NAME to it. */
#define OLD_VERSION(ret, name, params, args)                          \
  extern ret hpct_old_##name params;                                  \
  __asm__(".symver hpct_old_" #name "," #name "@GLIBC_2.2.5");        \
  HIDDEN ret __wrap_##name params { return hpct_old_##name args; }

OLD_VERSION(int, pthread_create, (pthread_t *t, const pthread_attr_t *a, void *(*f)(void *), void *arg),
            (t, a, f, arg))
OLD_VERSION(int, pthread_join, (pthread_t t, void **ret), (t, ret))
OLD_VERSION(int, pthread_detach, (pthread_t t), (t))
OLD_VERSION(int, pthread_once, (pthread_once_t *o, void (*f)(void)), (o, f))
OLD_VERSION(int, pthread_key_create, (pthread_key_t *k, void (*d)(void *)), (k, d))
OLD_VERSION(int, __pthread_key_create, (pthread_key_t *k, void (*d)(void *)), (k, d))
OLD_VERSION(int, pthread_key_delete, (pthread_key_t k), (k))
OLD_VERSION(void *, pthread_getspecific, (pthread_key_t k), (k))
OLD_VERSION(int, pthread_setspecific, (pthread_key_t k, const void *v), (k, v))
OLD_VERSION(int, pthread_mutex_trylock, (pthread_mutex_t *m), (m))
OLD_VERSION(int, dladdr, (const void *addr, Dl_info *info), (addr, info))
OLD_VERSION(void *, dlsym, (void *handle, const char *symbol), (handle, symbol))
OLD_VERSION(void *, dlvsym, (void *handle, const char *symbol, const char *version), (handle, symbol, version))

/* libstdc++ skips atomic reference counts while this says the process has one
 * thread (glibc 2.32+).  Zero is always correct, only a little slower. */
HIDDEN char __wrap___libc_single_threaded = 0;

/* fstat64 became a libc function in 2.33; before, the header inlined a call to
 * __fxstat64 with the struct stat version (1 on x86_64). */
extern int hpct_old___fxstat64(int ver, int fd, struct stat64 *buf);
__asm__(".symver hpct_old___fxstat64,__fxstat64@GLIBC_2.2.5");
HIDDEN int __wrap_fstat64(int fd, struct stat64 *buf) { return hpct_old___fxstat64(1, fd, buf); }

/* arc4random (2.36) backs std::random_device; getrandom (2.25) gives the same
 * kernel randomness. */
HIDDEN uint32_t __wrap_arc4random(void) {
  uint32_t v = 0;
  size_t got = 0;
  while (got < sizeof v) {
    ssize_t n = getrandom((char *)&v + got, sizeof v - got, 0);
    if (n > 0) got += (size_t)n;
    /* EINTR: try again; the kernel's pool never runs dry once seeded. */
  }
  return v;
}

/* pthread_cond_clockwait (2.30) is what std::condition_variable uses for a
 * steady_clock deadline.  Where glibc has it, call it (looked up once, at its
 * first version); on an older glibc, turn the deadline into a CLOCK_REALTIME
 * one for pthread_cond_timedwait: right unless the wall clock jumps meanwhile. */
typedef int (*clockwait_fn)(pthread_cond_t *, pthread_mutex_t *, clockid_t, const struct timespec *);

HIDDEN int __wrap_pthread_cond_clockwait(pthread_cond_t *c, pthread_mutex_t *m, clockid_t clock,
                                         const struct timespec *deadline) {
  static clockwait_fn real;
  static int looked_up;
  if (!__atomic_load_n(&looked_up, __ATOMIC_ACQUIRE)) {
    clockwait_fn f = (clockwait_fn)hpct_old_dlvsym(RTLD_DEFAULT, "pthread_cond_clockwait", "GLIBC_2.30");
    __atomic_store_n(&real, f, __ATOMIC_RELAXED);
    __atomic_store_n(&looked_up, 1, __ATOMIC_RELEASE);
  }
  clockwait_fn f = __atomic_load_n(&real, __ATOMIC_RELAXED);
  if (f) return f(c, m, clock, deadline);
  if (clock == CLOCK_REALTIME) return pthread_cond_timedwait(c, m, deadline);
  struct timespec now_clock, now_real, abs;
  clock_gettime(clock, &now_clock);
  clock_gettime(CLOCK_REALTIME, &now_real);
  int64_t left_ns = (int64_t)(deadline->tv_sec - now_clock.tv_sec) * 1000000000 +
                    (deadline->tv_nsec - now_clock.tv_nsec);
  if (left_ns < 0) left_ns = 0;
  int64_t at = (int64_t)now_real.tv_nsec + left_ns % 1000000000;
  abs.tv_sec = now_real.tv_sec + (time_t)(left_ns / 1000000000) + (time_t)(at / 1000000000);
  abs.tv_nsec = (long)(at % 1000000000);
  return pthread_cond_timedwait(c, m, &abs);
}
