// Lets kernels/pixels.cu compile as plain C++ so CI can run the kernels' own code on the
// CPU. driver.cpp runs the blocks of a launch in turn; the threads of one block run either
// in turn (kernels without barriers) or as fibers (ucontext) of one OS thread that switch
// at each barrier (__syncthreads, a warp's meeting), with __shared__ variables shared
// between them as on the GPU: a switch costs no wake-up of another thread. Float
// operations are IEEE single precision (the build uses -ffp-contract=off), like the *_rn
// intrinsics.
#pragma once
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#define MMWIRE_HOST_SHIM 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__ static  // one block at a time, so one copy serves the block's threads
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))

struct mmwire_dim { unsigned x, y, z; };
static mmwire_dim blockDim = {1, 1, 1}, gridDim = {1, 1, 1};
static mmwire_dim blockIdx = {0, 0, 0}, threadIdx = {0, 0, 0};  // the running fiber's

// A barrier of fibers: the last to arrive goes on; the others give the CPU back to the
// driver's scheduler (mmwire_yield) until the barrier's generation moves.
static void mmwire_yield();
struct mmwire_barrier {
  unsigned count, arrived = 0;
  unsigned long generation = 0;
  explicit mmwire_barrier(unsigned n) : count(n) {}
  void arrive_and_wait() {
    const unsigned long mine = generation;
    if (++arrived == count) {
      arrived = 0;
      ++generation;
      return;
    }
    while (generation == mine) mmwire_yield();
  }
};

static mmwire_barrier* mmwire_block_barrier = nullptr;
static inline void __syncthreads() {
  if (mmwire_block_barrier != nullptr) mmwire_block_barrier->arrive_and_wait();
}

// Dynamic shared memory: a fixed arena (the launches ask for at most 160 KiB).
static unsigned mmwire_dynamic_smem[160 * 1024 / sizeof(unsigned)];
static inline unsigned* dynamic_smem() { return mmwire_dynamic_smem; }

// CUDA's vector types of the 8- and 16-byte loads.
struct uint2 {
  unsigned x, y;
};
struct uint4 {
  unsigned x, y, z, w;
};

// The CUDA intrinsics the kernels use, with their documented semantics.
template <typename T>
static inline T __ldg(const T* p) { return *p; }
static inline unsigned __funnelshift_r(unsigned lo, unsigned hi, unsigned shift) {
  shift &= 31;
  return shift == 0 ? lo : (lo >> shift) | (hi << (32 - shift));
}
static inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
static inline unsigned __umulhi(unsigned a, unsigned b) {
  return (unsigned)(((unsigned long long)a * b) >> 32);
}
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const unsigned long long bytes = ((unsigned long long)y << 32) | x;
  unsigned r = 0;
  for (int n = 0; n < 4; ++n) r |= (unsigned)((bytes >> (8 * ((s >> (4 * n)) & 7))) & 255) << (8 * n);
  return r;
}

// The 8- and 16-byte stores of two and four words. On the GPU a store off its size's
// alignment faults; here it is counted (host_misaligned_stores), and the tests check none.
static std::atomic<unsigned long> mmwire_misaligned_stores{0};
static inline void store_pair8(void* p, unsigned x, unsigned y) {
  if (reinterpret_cast<unsigned long>(p) % 8 != 0) ++mmwire_misaligned_stores;
  const unsigned w[2] = {x, y};
  std::memcpy(p, w, sizeof w);
}
static inline void store_quad16(void* p, unsigned x, unsigned y, unsigned z, unsigned w) {
  if (reinterpret_cast<unsigned long>(p) % 16 != 0) ++mmwire_misaligned_stores;
  const unsigned q[4] = {x, y, z, w};
  std::memcpy(p, q, sizeof q);
}

using std::max;
using std::min;
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fdividef(float a, float b) { return a / b; }
static inline float __fmaf_rn(float a, float b, float c) { return std::fmaf(a, b, c); }
// the kernel's FMA that keeps subnormal operands, as the host's does (no -ffast-math here; a
// process flushing them would fail the affine tests: bytes below 128 would all read as 0)
static inline float fma_subnormal(float x, float y, float z) { return std::fmaf(x, y, z); }
static inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// cvt.rn.bf16x2.f32 (FMT 1, NORM_BF16) and cvt.rn.f16x2.f32 (NORM_F16): lo and hi rounded to
// nearest even, as a word's low and high half. bf16 keeps the top half of the fp32 bits,
// rounded (the affine map's values are finite: the host checks); fp16 through _Float16.
static inline unsigned mmwire_half_bits(int fmt, float x) {
  if (fmt == 1) {
    unsigned u;
    std::memcpy(&u, &x, sizeof u);
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  }
  const _Float16 h = (_Float16)x;
  unsigned short b;
  std::memcpy(&b, &h, sizeof b);
  return b;
}
template <int FMT>
static inline unsigned pack_halves(float lo, float hi) {
  return mmwire_half_bits(FMT, lo) | mmwire_half_bits(FMT, hi) << 16;
}

// The warp-level int8 matrix product of the tensor-core passes (mma.sync m16n8k32, s32
// accumulators): the 32 lanes of a warp (consecutive threads of the block) post their
// fragments, meet, and each adds its four results to d (FIRST: to init instead)
// from the whole A (16 x 32) and B (32 x 8), each of signed or unsigned bytes, read
// through the PTX fragment layout (lane = 4 g + t; A: a0 (g, 4t..), a1 (g + 8, 4t..),
// a2 (g, 16 + 4t..), a3 (g + 8, 16 + 4t..); B: b0 (4t.., g), b1 (16 + 4t.., g); D: d0, d1
// (g, 2t, 2t + 1), d2, d3 (g + 8, ...)).
struct mmwire_warp {
  mmwire_barrier* meet;
  unsigned a[32][4];
  unsigned b[32][2];
};
static mmwire_warp* mmwire_warps = nullptr;  // the running block's, set by the driver

template <bool A_SIGNED, bool FIRST, bool B_SIGNED = false>
static inline void mma_k32(int (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1,
                           int init = 0) {
  const unsigned tid = threadIdx.y * blockDim.x + threadIdx.x, lane = tid % 32;
  mmwire_warp& w = mmwire_warps[tid / 32];
  for (int i = 0; i < 4; ++i) w.a[lane][i] = a[i];
  w.b[lane][0] = b0;
  w.b[lane][1] = b1;
  w.meet->arrive_and_wait();
  const unsigned g = lane / 4, t = lane % 4;
  for (int e = 0; e < 4; ++e) {
    const unsigned row = g + 8 * (e / 2), col = 2 * t + e % 2;
    int sum = 0;
    for (unsigned k = 0; k < 32; ++k) {
      const unsigned aw = w.a[(row % 8) * 4 + (k % 16) / 4][row / 8 + 2 * (k / 16)];
      const unsigned bw = w.b[col * 4 + (k % 16) / 4][k / 16];
      const unsigned ab = (aw >> (8 * (k % 4))) & 255, bb = (bw >> (8 * (k % 4))) & 255;
      sum += (A_SIGNED ? (int)(signed char)ab : (int)ab) *
             (B_SIGNED ? (int)(signed char)bb : (int)bb);
    }
    d[e] = (int)((unsigned)(FIRST ? init : d[e]) + (unsigned)sum);
  }
  w.meet->arrive_and_wait();
}

// cp.async of 16 bytes: the copy waits in its thread's list and lands at the thread's
// copy_wait, the last moment the GPU's may land; until then shared memory holds what was
// there, so a read that does not wait for the copies (its own thread's copy_wait, then the
// block's barrier for the others') gets wrong bytes here too.
static std::vector<std::pair<void*, const void*>> mmwire_copies;  // the running fiber's
static inline void copy16(void* smem, const void* global) {
  mmwire_copies.emplace_back(smem, global);
}
template <typename T>
static inline T load_before_barrier(const T* p) { return *p; }
static inline void copy16_if_less(void* smem, const void* global, int a, int b) {
  if (a < b) copy16(smem, global);
}
static inline void copy_wait() {
  for (const auto& [to, from] : mmwire_copies) std::memcpy(to, from, 16);
  mmwire_copies.clear();
}

// lo and hi clamped to bytes, as bytes 0 and 1 (cvt.pack.sat.u8.s32.b32 with c = 0).
static inline unsigned sat_pair(int lo, int hi) {
  return (unsigned)min(max(lo, 0), 255) | (unsigned)min(max(hi, 0), 255) << 8;
}

// a, b, c and d clamped to bytes, as bytes 0 .. 3 (two chained cvt.pack.sat.u8.s32.b32).
static inline unsigned sat_quad(int a, int b, int c, int d) {
  return sat_pair(a, b) | sat_pair(c, d) << 16;
}

// movmatrix.sync.aligned.m8n8.trans.b16: the warp's lanes post their words (lane 4 g + t:
// row g, columns 2 t (low half) and 2 t + 1 of an 8 x 8 matrix of 16-bit elements), meet,
// and each takes the same place of the transpose.
static inline unsigned transpose8x8(unsigned x) {
  const unsigned tid = threadIdx.y * blockDim.x + threadIdx.x, lane = tid % 32;
  mmwire_warp& w = mmwire_warps[tid / 32];
  w.a[lane][0] = x;
  w.meet->arrive_and_wait();
  const unsigned g = lane / 4, t = lane % 4;
  unsigned y = 0;
  for (unsigned i = 0; i < 2; ++i) {  // element (g, 2 t + i) of the transpose: (2 t + i, g)
    const unsigned row = 2 * t + i, col = g;
    const unsigned from = w.a[4 * row + col / 2][0];
    y |= ((from >> (16 * (col % 2))) & 0xffffu) << (16 * i);
  }
  w.meet->arrive_and_wait();
  return y;
}

// The MMA tiles check the shared memory they lay out against what the launch asked for.
static unsigned long mmwire_smem_asked = 0;
static std::atomic<unsigned long> mmwire_smem_overflows{0};
#define MMWIRE_SMEM_CHECK(bytes) \
  if ((unsigned long)(bytes) > mmwire_smem_asked) ++mmwire_smem_overflows;
