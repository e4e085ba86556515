// Lets kernels/pixels.cu compile as plain C++ so CI can run the kernels' own code on the
// CPU. driver.cpp runs the blocks of a launch in turn; the threads of one block run either
// in turn (kernels without barriers) or as real threads meeting at a std::barrier for
// __syncthreads, with __shared__ variables shared between them as on the GPU. Float
// operations are IEEE single precision (the build uses -ffp-contract=off), like the *_rn
// intrinsics.
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>

#define MMWIRE_HOST_SHIM 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__ static  // one block at a time, so one copy serves the block's threads
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))

struct mmwire_dim { unsigned x, y, z; };
static mmwire_dim blockIdx = {0, 0, 0}, blockDim = {1, 1, 1}, gridDim = {1, 1, 1};
static thread_local mmwire_dim threadIdx = {0, 0, 0};

static std::barrier<>* mmwire_block_barrier = nullptr;
static inline void __syncthreads() {
  if (mmwire_block_barrier != nullptr) mmwire_block_barrier->arrive_and_wait();
}

// Dynamic shared memory: a fixed arena (the launches ask for at most 48 KiB).
static unsigned mmwire_dynamic_smem[48 * 1024 / sizeof(unsigned)];
static inline unsigned* dynamic_smem() { return mmwire_dynamic_smem; }

// The CUDA intrinsics the kernels use, with their documented semantics.
template <typename T>
static inline T __ldg(const T* p) { return *p; }
static inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned shift) {
  shift &= 31;
  return shift == 0 ? lo : (lo >> shift) | (hi << (32 - shift));
}
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const unsigned long long bytes = ((unsigned long long)y << 32) | x;
  unsigned r = 0;
  for (int n = 0; n < 4; ++n) r |= (unsigned)((bytes >> (8 * ((s >> (4 * n)) & 7))) & 255) << (8 * n);
  return r;
}

using std::max;
using std::min;
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
