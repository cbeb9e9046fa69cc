// The payload the NCCL bootstrap harness and the exchange harness gather: every rank can compute
// every other rank's block, so a gathered buffer is checked (or digested) byte for byte.
#ifndef HPCT_TESTS_PAYLOAD_H_
#define HPCT_TESTS_PAYLOAD_H_

#include <stddef.h>
#include <stdint.h>

// Rank r's block of allgather a: bytes no other block shares at any offset (xorshift32).
// tests/test_nccl_bootstrap.py computes the same in Python.
static inline void fill(unsigned char* block, size_t size, int rank, int a) {
  uint32_t x = 2654435761u * (uint32_t)(rank + 1) ^ (uint32_t)(a * 40503 + 7);
  for (size_t i = 0; i < size; i++) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    block[i] = (unsigned char)x;
  }
}

// FNV-1a, 64 bits.
static inline uint64_t fnv1a(const unsigned char* p, size_t n) {
  uint64_t h = 1469598103934665603ULL;
  for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ULL;
  return h;
}

#endif
