/* A null NCCL and CUDA driver for the engine's native launch: every call succeeds at once.
 * hpct/testing/nccl_sim/null.py compiles it; each function has the signature of the one it stands for.
 * null_calls counts the calls (a test checks the launch made them); hold_group_end makes
 * ncclGroupEnd wait, natively and without Python, until null_release is set or 10 s pass (a test
 * checks the launch runs without the GIL: a Python thread must set it meanwhile). */
#include <stddef.h>
#include <stdint.h>
#include <time.h>

volatile long null_calls = 0;
volatile int hold_group_end = 0;
volatile int null_release = 0;
volatile int null_held_out = 0;   /* the last held ncclGroupEnd gave up at its bound */
volatile int null_group_end_result = 0;   /* 7: ncclInProgress, as a non-blocking comm answers */

#define COUNT() __atomic_add_fetch(&null_calls, 1, __ATOMIC_RELAXED)

int null_group_start(void) { COUNT(); return 0; }

int null_group_end(void) {
  COUNT();
  if (hold_group_end) {
    struct timespec pause = {0, 1000000};
    for (int i = 0; i < 10000 && !null_release; ++i) nanosleep(&pause, NULL);
    null_held_out = !null_release;
  }
  return null_group_end_result;
}

int null_coll(const void* s, void* r, size_t n, int dt, int op, void* comm, void* stream) { COUNT(); return 0; }
int null_rooted(const void* s, void* r, size_t n, int dt, int op, int root, void* comm, void* stream) { COUNT(); return 0; }
int null_gather(const void* s, void* r, size_t n, int dt, void* comm, void* stream) { COUNT(); return 0; }
int null_p2p(void* b, size_t n, int dt, int peer, void* comm, void* stream) { COUNT(); return 0; }
int null_record(void* ev, void* stream) { COUNT(); return 0; }
int null_wait(void* stream, void* ev, unsigned flags) { COUNT(); return 0; }
int null_capturing(void* stream, int* status) { COUNT(); *status = 0; return 0; }
int null_sync(void* ev) { COUNT(); return 0; }
