// The tensor-core resize: both BICUBIC passes of a tile as exact int8 matrix products.
//
// What it computes: a tile's window and intermediate in shared memory, staged with
// cp.async (copy_rows, load_planes), and each pass's outputs as sums of Q22 weights times
// pixel lines on the int8 tensor cores (mma_pass, mma_pass_rgb), warp by warp.
// Exactness rules: each Q22 weight is split into three bytes and the three products' int32
// sums add up to Pillow's accumulator exactly (below); outputs are clamped as the scalar
// passes clamp them (q22, clamp_q22), so every byte equals resize.cuh's and Pillow's.
#pragma once
#include "patches.cuh"

// ---- The tensor-core resize (MMA tiles: gray, RGB or RGBA, resized on both axes) ----
// A pass is a product of the Q22 weights (A: 16 outputs x k inputs) and pixel lines (B: k
// inputs x 8 lines) on the int8 tensor cores, exactly: each weight is split into bytes,
// w = b2 * 2^16 + b1 * 2^8 + b0 (b0, b1 unsigned, b2 signed since |w| < 2^23), and the three
// products' int32 sums add up to Pillow's accumulator (wrapping adds; the total is in range).
// The host splits them and lays each M-block's out as its lanes' A fragments, with the
// blocks' spans (_mma_axis; a tile's record says where: R_X_WORDS, R_X_SPANS, ...).
// An axis whose 16-output blocks take two 32-input steps where every 8-output block fits
// one (a downscale of about 1.5 to 2.6; R_X_NARROW, R_Y_NARROW) takes narrow blocks
// instead: the pixels are A (16 lines x 32 inputs), the weights B (32 inputs x 8 outputs,
// the high plane signed), half the products and a quarter of the weight registers.
// A tile's source window sits in shared memory as one plane a channel (rows of input
// columns; columns of input rows when Pillow resizes vertically first), or (R_RAW: gray and
// RGB passed horizontally first, rows on a word) as the source's rows copied as they are,
// whose RGB the first pass splits into channels as it reads it; the first pass writes the
// intermediate with the other axis contiguous, so both passes read 4
// consecutive k of a line as one word; the last pass writes its bytes over the window, and
// the block then sends them through the normalise table into the patches as units (above).

// (MMA_KS, the most 32-input steps of one 16-output block, and MMA_MAX_BLOCKS, the most
// M-blocks along a tile's side, come from the host: kernels/_abi.py.)
#define MMA_STAGE_GROUPS 4  // groups of 4 pixels a thread loads at once when staging rows

#ifndef MMWIRE_HOST_SHIM
// d = A (16 x 32, row) * B (32 x 8, col) + (FIRST ? init : d); A and B signed or unsigned
// bytes (never both signed). FIRST adds init instead of d, so nothing has to set d first.
template <bool A_SIGNED, bool FIRST, bool B_SIGNED = false>
__device__ __forceinline__ void mma_k32(int (&d)[4], const unsigned (&a)[4], unsigned b0,
                                        unsigned b1, int init = 0) {
#if __CUDA_ARCH__ >= 800
#define MMWIRE_MMA(TYPES, C)                                                             \
  asm("mma.sync.aligned.m16n8k32.row.col.s32." TYPES ".s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, " \
      "{%8,%9}, " C ";"                                                                  \
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])                                   \
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "r"(init))
#define MMWIRE_MMA_INIT(TYPES)                 \
  if constexpr (FIRST) {                       \
    MMWIRE_MMA(TYPES, "{%10,%10,%10,%10}");    \
  } else {                                     \
    MMWIRE_MMA(TYPES, "{%0,%1,%2,%3}");        \
  }
  static_assert(!(A_SIGNED && B_SIGNED), "one signed operand at most");
  if constexpr (A_SIGNED) {
    MMWIRE_MMA_INIT("s8.u8");
  } else if constexpr (B_SIGNED) {
    MMWIRE_MMA_INIT("u8.s8");
  } else {
    MMWIRE_MMA_INIT("u8.u8");
  }
#undef MMWIRE_MMA_INIT
#undef MMWIRE_MMA
#else
  __trap();  // the host plans MMA tiles only for devices of compute capability 8.0 or more
#endif
}

// lo and hi clamped to 0 .. 255, as bytes 0 and 1 of the result (the upper half 0): one
// instruction (I2IP) for what a max, a min and two byte moves do.
__device__ __forceinline__ unsigned sat_pair(int lo, int hi) {
#if __CUDA_ARCH__ >= 800
  unsigned d;
  asm("cvt.pack.sat.u8.s32.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(hi), "r"(lo), "r"(0));
  return d;
#else
  __trap();  // MMA tiles only (compute capability 8.0 or more)
  return 0;
#endif
}

// a, b, c and d clamped to 0 .. 255, as bytes 0 .. 3 of the result: two I2IP, the second
// taking the first's pair as its upper half.
__device__ __forceinline__ unsigned sat_quad(int a, int b, int c, int d) {
#if __CUDA_ARCH__ >= 800
  unsigned w;
  asm("cvt.pack.sat.u8.s32.b32 %0, %1, %2, %3;" : "=r"(w) : "r"(b), "r"(a), "r"(sat_pair(c, d)));
  return w;
#else
  __trap();  // MMA tiles only (compute capability 8.0 or more)
  return 0;
#endif
}

// The warp's 8 x 8 matrix of 16-bit elements transposed (movmatrix): lane (g, t) gives
// row g, columns 2 t (low half) and 2 t + 1, and gets the same of the transpose.
__device__ __forceinline__ unsigned transpose8x8(unsigned x) {
#if __CUDA_ARCH__ >= 800
  unsigned y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
#else
  __trap();  // MMA tiles only (compute capability 8.0 or more)
  return 0;
#endif
}
#define MMWIRE_SMEM_CHECK(bytes)

// 16 bytes from global to shared memory, both 16-aligned, without passing through registers
// (cp.async, L2 only): the copies of a thread land by its copy_wait. Before compute
// capability 8.0 (plain tiles only), an ordinary load and store.
__device__ __forceinline__ void copy16(void* smem, const void* global) {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global" MMWIRE_SRC_HINT " [%0], [%1], 16;" ::"r"(
                   (unsigned)__cvta_generic_to_shared(smem)),
               "l"(global));
#else
  *(uint4*)smem = __ldg((const uint4*)global);
#endif
}

// 16 bytes (4 bytes) of global memory through a coherent load. The MMA passes' weights and
// spans are read-only, but ptxas moved their non-coherent (__ldg) loads after the barrier
// the passes wait on; a coherent load stays before it, so its latency hides in the wait.
__device__ __forceinline__ uint4 load_before_barrier(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ uint2 load_before_barrier(const uint2* p) {
  uint2 v;
  asm volatile("ld.global.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
__device__ __forceinline__ int load_before_barrier(const int* p) {
  int v;
  asm volatile("ld.global.s32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// copy16 where a < b (signed), else nothing: the test predicates the copy, with no branch.
__device__ __forceinline__ void copy16_if_less(void* smem, const void* global, int a, int b) {
#if __CUDA_ARCH__ >= 800
  asm volatile(
      "{ .reg .pred p; setp.lt.s32 p, %2, %3; @p cp.async.cg.shared.global" MMWIRE_SRC_HINT
      " [%0], [%1], 16; }" ::"r"((unsigned)__cvta_generic_to_shared(smem)),
      "l"(global), "r"(a), "r"(b));
#else
  if (a < b) copy16(smem, global);
#endif
}

__device__ __forceinline__ void copy_wait() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}
#endif

// Rows 0 .. rows - 1 of `bytes` bytes each, row r from src + r * stride, into shared memory
// at dst (row r at dst + r * pitch, from the 16-byte granule of its first byte: that byte
// at its skew, (src + r * stride) & 15, at most `skew`), with 16-byte cp.async (nothing
// passes through registers, so all a block's copies are in flight at once; each thread's
// land by its copy_wait). A row's copies run from the granule of its first byte to that of
// its last, so nothing unmapped is read. 2^lg threads take a row (at least its granules,
// at most a warp or the block): a thread keeps its place in the row and moves nt >> lg
// rows at a time, with 32-bit offsets, four rows a round, its granule and, for rows of up
// to 2^(lg + 1) granules, the one 2^lg on (both predicated); threads past the last whole
// group of 2^lg take no row. Row r goes to dst + r * pitch + (r >> 3) * shift (StagedRows;
// a shift only where nt is a multiple of 256, so that nt >> lg is one of 8).
__device__ __forceinline__ void copy_rows(const u8* src, int stride, int rows, int bytes,
                                          int skew, u8* dst, int pitch, int shift = 0) {
  const int tid = threadIdx.y * blockDim.x + threadIdx.x, nt = blockDim.x * blockDim.y;
  const int most = (bytes + skew + 15) >> 4;  // a row's granules at most
  // the least lg with 2^lg >= most, but 2^lg at most nt and 32 (a loop of up to six
  // rounds here cost 2.7 % of the MMA launch's instructions)
  const int lg = min(min(most > 1 ? 32 - __clz(most - 1) : 0, 31 - __clz(nt)), 5);
  const int step_rows = nt >> lg, at = 16 * (tid & ((1 << lg) - 1)), lanes = 16 << lg;
  if (tid >= step_rows << lg) return;  // a block of fewer threads than a power of two
  // the row's first byte as t past the granule of src's (32-bit: the host refuses a tile
  // whose rows span 4 GiB, _records), its granule's first byte then at from + (t & ~15)
  const u8* from = (const u8*)(((u64)src & ~15ull) + (unsigned)at);
  unsigned t = ((unsigned)(u64)src & 15u) + (unsigned)(tid >> lg) * (unsigned)stride;
  const unsigned dt = (unsigned)step_rows * (unsigned)stride;
  u8* to = dst + (tid >> lg) * pitch + ((tid >> lg) >> 3) * shift + at;
  const int dto = step_rows * pitch + (step_rows >> 3) * shift;
  if (most <= (1 << lg)) {  // a row's granules at most one a thread (the usual case)
    // the thread's granule holds a byte of the row where at - bytes < the row's skew: a
    // predicated copy, no branch, so the rows' copies go out four at a time (about 10.5
    // instructions a row where a branch around each copy took 17)
    const int past = at - bytes;
    int r = tid >> lg;
#pragma unroll 1
    for (; r + 3 * step_rows < rows; r += 4 * step_rows) {
#pragma unroll
      for (int i = 0; i < 4; ++i, t += dt, to += dto) {
        copy16_if_less(to, from + (t & ~15u), past, (int)(t & 15u));
      }
    }
#pragma unroll 1
    for (; r < rows; r += step_rows, t += dt, to += dto) {
      copy16_if_less(to, from + (t & ~15u), past, (int)(t & 15u));
    }
  } else if (most <= (2 << lg)) {  // two a thread, the second `lanes` on, both predicated
    // (the 4000 x 3000 photo's raw rows of 43 granules: the loop below takes about 25
    // instructions a copy). It repeats the branch above with a second copy rather than
    // templating one loop on the copies a thread: that loop made 32 more SASS instructions
    // and 8-byte spills in the gray MMA and mixed kernels.
    const int past = at - bytes, past2 = past + lanes;
    int r = tid >> lg;
#pragma unroll 1
    for (; r + 3 * step_rows < rows; r += 4 * step_rows) {
#pragma unroll
      for (int i = 0; i < 4; ++i, t += dt, to += dto) {
        const u8* g = from + (t & ~15u);
        copy16_if_less(to, g, past, (int)(t & 15u));
        copy16_if_less(to + lanes, g + lanes, past2, (int)(t & 15u));
      }
    }
#pragma unroll 1
    for (; r < rows; r += step_rows, t += dt, to += dto) {
      const u8* g = from + (t & ~15u);
      copy16_if_less(to, g, past, (int)(t & 15u));
      copy16_if_less(to + lanes, g + lanes, past2, (int)(t & 15u));
    }
  } else {
#pragma unroll 1
    for (int r = tid >> lg; r < rows; r += step_rows, t += dt, to += dto) {
      const unsigned end = (t & 15u) + bytes;
      for (unsigned o = 0; at + o < end; o += lanes) copy16(to + o, from + (t & ~15u) + o);
    }
  }
}

// The row pitch of an unresized tile's staged pixels (copy_rows) for rows of `bytes` bytes:
// room for a skew of up to 15 and whole 16-byte granules, and 80 or 112 past a multiple of
// 128 (the next one up), where the write-out's lanes, about nine rows of a patch a warp,
// read fewer words of one bank: 2.9 shared wavefronts a load where 192 bytes (the mixed
// batch's 4-patch tiles) took 4.2 (host: _plain_pitch).
__device__ __forceinline__ int plain_pitch(int bytes) {
  const int need = ((bytes + 30) >> 4) << 4, r = need & 127;
  return need + (r <= 80 ? 80 - r : 112 - r);
}

// Words of an M-block's A fragments (a block of the host's _mma_axis fragments): per byte
// plane q and 32-input step s, 32 lanes x 4 words.
#define MMA_FRAGMENT_WORDS (3 * MMA_KS * 32 * 4)

// Lane (g, t)'s A fragments of one M-block (outputs o0 .. o0 + 15), per byte plane q and
// 32-input step s (the first KS): word r holds output o0 + g (r = 0, 2) or o0 + g + 8 (r =
// 1, 3), inputs span.at + 32 s + 4 t + 0..3 (r = 0, 1) or 16 more (r = 2, 3), one byte of
// each weight; outputs past the axis (canvas padding) have none, so they come out 0, nor
// do a tile's last block's outputs past the tile (the next tile's: never written out, so
// the window need not hold their taps). The host lays them out in this order (_mma_axis),
// so a plane and step is one 16-byte load a lane, coalesced over the warp; straight from
// global memory (L1), no shared copy.
template <int KS>
__device__ __forceinline__ void load_weights(const int* __restrict__ frags, int lane,
                                             unsigned (&a)[3][KS][4]) {
#pragma unroll
  for (int q = 0; q < 3; ++q) {
#pragma unroll
    for (int st = 0; st < KS; ++st) {
      const uint4 w = load_before_barrier((const uint4*)frags + (q * MMA_KS + st) * 32 + lane);
      a[q][st][0] = w.x;
      a[q][st][1] = w.y;
      a[q][st][2] = w.z;
      a[q][st][3] = w.w;
    }
  }
}

// Pillow's rounding 2^21 in the high plane's units (clamp_q22 shifts that plane by 16): the
// first product of that plane starts from it, so the clamp adds nothing.
#define MMA_BIAS_HIGH (1 << (21 - 16))

// acc += the three byte planes' products of 32-input step s with B words (b0, b1); FIRST:
// acc = them, the high plane's from the rounding (MMA_BIAS_HIGH).
template <bool FIRST, int KS>
__device__ __forceinline__ void plane_products(const unsigned (&a)[3][KS][4], int s, unsigned b0,
                                               unsigned b1, int (&acc)[3][4]) {
  mma_k32<false, FIRST>(acc[0], a[0][s], b0, b1);
  mma_k32<false, FIRST>(acc[1], a[1][s], b0, b1);
  mma_k32<true, FIRST>(acc[2], a[2][s], b0, b1, FIRST ? MMA_BIAS_HIGH : 0);
}

// acc = the three byte planes' products of one N-block (its lane's k words at l) over S
// 32-input steps, the high plane's with the rounding (MMA_BIAS_HIGH).
template <int S, int KS>
__device__ __forceinline__ void products(const unsigned (&a)[3][KS][4], const u8* l,
                                         int (&acc)[3][4]) {
  plane_products<true>(a, 0, *(const unsigned*)l, *(const unsigned*)(l + 16), acc);
#pragma unroll
  for (int s = 1; s < S; ++s) {
    const unsigned b0 = *(const unsigned*)(l + 32 * s);
    const unsigned b1 = *(const unsigned*)(l + 32 * s + 16);
    plane_products<false>(a, s, b0, b1, acc);
  }
}

// A block's weights as a warp_tasks' run holds them. Wide (16-output M-blocks, the weights
// the A operand): load_weights' fragments over KS 32-input steps. Narrow (8-output blocks
// over one 32-input step, the weights the B operand, the pixels A; R_X_NARROW and
// R_Y_NARROW): lane (g, t)'s word r of byte plane q holds output o0 + g, inputs span.at +
// 16 r + 4 t + 0..3, one byte of each weight (the host's _mma_axis with narrow,
// MMA_NARROW_WORDS a block, one 8-byte load a plane and lane, coalesced): 6 registers where
// a wide block of two steps takes 24.
#define MMA_NARROW_WORDS (3 * 32 * 2)
template <int STEPS>
struct WideWeights {
  static constexpr bool NARROW = false;
  static constexpr int KS = STEPS, WORDS = MMA_FRAGMENT_WORDS, OUTPUTS = 16, LINES = 8;
  unsigned a[3][KS][4];
  __device__ __forceinline__ void load(const int* __restrict__ frags, int lane) {
    load_weights<KS>(frags, lane, a);
  }
};
struct NarrowWeights {
  static constexpr bool NARROW = true;
  static constexpr int KS = 1, WORDS = MMA_NARROW_WORDS, OUTPUTS = 8, LINES = 16;
  unsigned b[3][2];
  __device__ __forceinline__ void load(const int* __restrict__ frags, int lane) {
#pragma unroll
    for (int q = 0; q < 3; ++q) {
      const uint2 w = load_before_barrier((const uint2*)frags + q * 32 + lane);
      b[q][0] = w.x;
      b[q][1] = w.y;
    }
  }
};

// acc = the three byte planes' products of a narrow block's weights b with the pixels a
// (A: rows g and g + 8, which are the N-block's lines 2 g and 2 g + 1 (lane_line), inputs
// 4 t.. and 16 + 4 t..), the high plane's (B signed) from the rounding (MMA_BIAS_HIGH).
__device__ __forceinline__ void narrow_products(const unsigned (&b)[3][2], const unsigned (&a)[4],
                                                int (&acc)[3][4]) {
  mma_k32<false, true>(acc[0], a, b[0][0], b[0][1]);
  mma_k32<false, true>(acc[1], a, b[1][0], b[1][1]);
  mma_k32<false, true, true>(acc[2], a, b[2][0], b[2][1], MMA_BIAS_HIGH);
}

// Result x's planes' sums (the rounding is in the high plane's) as Pillow's accumulator,
// >> 22: within -640 .. 639, to be clamped to a byte.
__device__ __forceinline__ int q22(const int (&acc)[3][4], int x) {
  return (int)((unsigned)acc[0][x] + ((unsigned)acc[1][x] << 8) + ((unsigned)acc[2][x] << 16)) >>
         22;
}

// A task's four results clamped to bytes, as two byte pairs (upper halves 0): v[r] holds
// result 2 r (byte 0) and 2 r + 1 (byte 1), the lane's row g (r = 0) and g + 8 of D.
__device__ __forceinline__ void clamp_q22(const int (&acc)[3][4], unsigned (&v)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) v[r] = sat_pair(q22(acc, 2 * r), q22(acc, 2 * r + 1));
}

// A narrow task's four results clamped to bytes and turned by the warp so the lane holds
// one output's four consecutive lines: D's rows g and g + 8 are lines 2 g and 2 g + 1
// (lane_line), so the lane's word (lines 2 g, 2 g + 1 of output 2 t, then of 2 t + 1) is
// row g, columns 2 t and 2 t + 1 of an 8 x 8 matrix of line pairs (row) by outputs
// (column); transposed, lane (g, t) gets output g, lines 4 t .. 4 t + 3 (byte e = 4 t + e).
__device__ __forceinline__ unsigned narrow_lines(const int (&acc)[3][4]) {
  return transpose8x8(sat_quad(q22(acc, 0), q22(acc, 2), q22(acc, 1), q22(acc, 3)));
}

// The first line of an N-block a lane reads: g for wide blocks (B's column g), 2 g for
// narrow ones (A's row g; its row g + 8 is line 2 g + 1), so that a narrow task's results
// turn into words of four lines (narrow_lines).
template <typename W>
__device__ __forceinline__ int lane_line(int g) {
  return W::NARROW ? 2 * g : g;
}

// Where a pass's lane finds its lines: its first (lane_line) of channel c's N-block lb at
// first + c * plane + lb * step; a narrow lane's second line `odd` bytes after it (a row
// pitch, or more or less where a raw window's rows have different skews).
struct Lines {
  const u8* first;
  int plane, step, odd;
};

// Rows of an MMA tile's raw window are 16 bytes further on each group of 8 (row r at
// r * pitch + (r >> 3) * MMA_GROUP_SHIFT: StagedRows), so that a narrow N-block's lines 2 g
// (and 2 g + 1), g = 0 .. 7, fall in eight different 16-byte quarters of the banks, as a
// wide one's lines g do: with a pitch 16 past a multiple of 32 (mma_pitch) they fell in
// four, and each load took two wavefronts. (The intermediate keeps plain rows: its shifts
// would cost the 4000 x 3000 photo's 2 x 8 tiles their place in MMA_SMEM_BYTES.)
// (MMA_GROUP_SHIFT comes from the host: kernels/_abi.py.)

// A warp's contiguous run of a pass's (M-block, channel, N-block) tasks: `blocks` M-blocks
// of CH channels x lbs N-blocks (counted without dividing: (warp + 1) * tasks stays far
// below 2^21, so div_small serves: 32 warps at most, and tasks = blocks * CH * lbs with
// blocks <= MMA_MAX_BLOCKS and lbs a window's lines / 8), block by block: it loads the
// block's A fragments (load_weights: frags, MMA_FRAGMENT_WORDS a block) and span (spans:
// (at, steps) int32 pairs) and calls body(most_steps, a, j, c, lb, n, at) for block j's n
// tasks from channel c's N-block lb (both 0 but for the run's first block), most_steps
// Int<KS> when the block takes more than one 32-input step (Int<2> for a two-step block
// where KS is 3; the same for the whole warp), else Int<1>. The run's first block's
// fragments and span are loaded before ready() (every thread calls it: the barrier the pass
// waits on), so those loads overlap the wait. W: the blocks' weights (WideWeights or
// NarrowWeights, whose blocks take one step), a its value.
template <int CH, typename W, typename Ready, typename Body>
__device__ __forceinline__ void warp_tasks(const int* __restrict__ frags,
                                           const int* __restrict__ spans, int blocks, int lbs,
                                           Ready ready, Body body) {
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5, warps = (blockDim.x * blockDim.y) >> 5;
  const int per_block = CH * lbs, tasks = blocks * per_block;
  const int first = div_small(warp * tasks, warps), last = div_small((warp + 1) * tasks, warps);
  int j = div_small(first, per_block), lb = first - j * per_block, c = 0;
  if (CH > 1) {
    c = div_small(lb, lbs);
    lb -= c * lbs;
  }
  W a;
  int at = 0, steps = 0;
  auto load = [&] {  // block j's fragments and span
    a.load(frags + j * W::WORDS, lane);
    at = load_before_barrier(spans + 2 * j);
    steps = load_before_barrier(spans + 2 * j + 1);
  };
  if (first < last) load();
  ready();
  for (int task = first; task < last; c = lb = 0) {
    const int n = min(last, (j + 1) * per_block) - task;  // the warp's tasks of block j
    task += n;
    if (W::KS > 2 && steps == 2) {  // a two-step block of a three-step tile
      body(Int<2>(), a, j, c, lb, n, at);
    } else if (W::KS > 1 && steps > 1) {
      body(Int<W::KS>(), a, j, c, lb, n, at);
    } else {
      body(Int<1>(), a, j, c, lb, n, at);
    }
    if (task < last) {
      ++j;
      load();
    }
  }
}

// One pass of a tile: `blocks` M-blocks of 16 outputs (their spans, from the host's
// _mma_axis: the inputs each block reads, (at, steps) int32 pairs: from its first tap
// aligned down to 4, so a lane's 4 k values are one aligned word, `steps` of 32; their A
// fragments from frags on, MMA_FRAGMENT_WORDS a block) times CH channels x `lbs` N-blocks of
// 8 lines of `in` (k = 0 at the first block's first input). Each warp takes a contiguous
// run of the (M-block, channel, N-block) tasks (warp_tasks); for each M-block of its run
// out_at(j) gives the lane's place for the block's first task (a task's output is out_plane
// a channel and out_step an N-block on). The block's tasks then go channel by channel, two
// at a time (their loads and products interleave; one at a time for blocks of three steps,
// whose weights take 36 registers), in a loop compiled for the block's
// number of 32-input steps: within a channel a task's lines and output move by adds,
// nothing decided per task.
// done(m, acc) gets each task's place m and its D fragment acc (three planes' products):
// rows output 16 j + g and 16 j + g + 8, columns lines 2 t and 2 t + 1 of the N-block.
// W: WideWeights<the most 32-input steps of the tile's blocks>. ready(): the barrier after
// which `in` is in place (warp_tasks calls it once the warp's first weights are on their
// way).
// W = NarrowWeights: blocks of 8 outputs, one step each, times N-blocks of 16 lines (the
// pixels the A operand: a lane reads lines 2 g and 2 g + 1, lane_line); D's rows g and
// g + 8 are then those lines, its columns outputs 8 j + 2 t and 8 j + 2 t + 1.
template <int CH, typename W, typename Ready, typename OutAt, typename Done>
__device__ __forceinline__ void mma_pass(const int* __restrict__ frags,
                                         const int* __restrict__ spans, int blocks, int lbs,
                                         const Lines& in, int out_plane, int out_step,
                                         Ready ready, OutAt out_at, Done done) {
  const int lane = (threadIdx.y * blockDim.x + threadIdx.x) & 31;
  const u8* lane_in = in.first + 4 * (lane & 3) - __ldg(spans);
  warp_tasks<CH, W>(frags, spans, blocks, lbs, ready, [&](auto most_steps, const W& w, int j,
                                                         int c, int lb, int n, int at) {
    [[maybe_unused]] constexpr int S = decltype(most_steps)::value;  // (wide blocks only)
    const u8* l0 = lane_in + at;  // its line's k words of the block's first step
    u8* o0 = out_at(j);
    // channel by channel (c, from N-block lb): a run of N-blocks moves by adds alone
    for (int left = n; left > 0; ++c, lb = 0) {
      const int seg = min(left, lbs - lb);  // this channel's tasks
      left -= seg;
      const u8* l = l0 + c * in.plane + lb * in.step;
      u8* o = o0 + c * out_plane + lb * out_step;
      auto tasks = [&](auto count) {  // N consecutive tasks, their products interleaved
        constexpr int N = decltype(count)::value;
        int acc[N][3][4];
#pragma unroll
        for (int i = 0; i < N; ++i) {
          const u8* li = l + i * in.step;
          if constexpr (W::NARROW) {
            const unsigned x[4] = {*(const unsigned*)li, *(const unsigned*)(li + in.odd),
                                   *(const unsigned*)(li + 16),
                                   *(const unsigned*)(li + in.odd + 16)};
            narrow_products(w.b, x, acc[i]);
          } else {
            products<S>(w.a, li, acc[i]);
          }
        }
#pragma unroll
        for (int i = 0; i < N; ++i) done(o + i * out_step, acc[i]);
      };
      int k = seg;
      if constexpr (S < 3) {
#pragma unroll 1
        for (; k >= 2; k -= 2, l += 2 * in.step, o += 2 * out_step) tasks(Int<2>());
        if (k != 0) tasks(Int<1>());
      } else {  // three steps: one task at a time, fewer registers
#pragma unroll 1
        for (; k != 0; --k, l += in.step, o += out_step) tasks(Int<1>());
      }
    }
  });
}

// Four RGB pixels (12 bytes as three words) as one word a channel (byte e = pixel e).
__device__ __forceinline__ void split_rgb(unsigned x0, unsigned x1, unsigned x2,
                                          unsigned (&w)[3]) {
  w[0] = __byte_perm(__byte_perm(x0, x1, 0x0630), x2, 0x5210);
  w[1] = __byte_perm(__byte_perm(x0, x1, 0x0741), x2, 0x6210);
  w[2] = __byte_perm(__byte_perm(x0, x1, 0x0052), x2, 0x7410);
}

// A lane's eight RGB pixels of a 32-input step as two words a channel: x holds pixels 0..3
// (12 bytes as three words) and y pixels 16..19 from the lane's; lo[c] gets channel c of
// pixels 0, 1, 16, 17 (byte e: the e-th), hi[c] of 2, 3, 18, 19, the inputs the host puts
// in a raw RGB first pass's two words (_mma_axis with rgb). Ten byte moves, where the
// pixels in order took twelve (split_rgb: a channel's four from three words).
__device__ __forceinline__ void split_rgb8(const unsigned* x, const unsigned* y,
                                           unsigned (&lo)[3], unsigned (&hi)[3]) {
  lo[0] = __byte_perm(x[0], y[0], 0x7430);  // R0 R1 R16 R17
  const unsigned gb_x = __byte_perm(x[0], x[1], 0x5241), gb_y = __byte_perm(y[0], y[1], 0x5241);
  lo[1] = __byte_perm(gb_x, gb_y, 0x5410);  // (G0 G1 B0 B1 and G16 G17 B16 B17)
  lo[2] = __byte_perm(gb_x, gb_y, 0x7632);
  hi[2] = __byte_perm(x[2], y[2], 0x7430);  // B2 B3 B18 B19
  const unsigned rg_x = __byte_perm(x[1], x[2], 0x6352), rg_y = __byte_perm(y[1], y[2], 0x6352);
  hi[0] = __byte_perm(rg_x, rg_y, 0x5410);  // (R2 R3 G2 G3 and R18 R19 G18 G19)
  hi[1] = __byte_perm(rg_x, rg_y, 0x7632);
}

// The three channels' products of one N-block of an RGB window staged raw (R_RAW), over S
// 32-input steps: a lane's pixels of a step are 12 bytes of its line (window row) l and 12
// bytes 16 pixels on, split into two words a channel (split_rgb8); acc[c] as products' acc.
template <int S, int KS>
__device__ __forceinline__ void rgb_products(const unsigned (&a)[3][KS][4], const u8* l,
                                             int (&acc)[3][3][4]) {
#pragma unroll
  for (int s = 0; s < S; ++s) {
    const unsigned* w = (const unsigned*)(l + 96 * s);
    unsigned b0[3], b1[3];
    split_rgb8(w, w + 12, b0, b1);  // (16 pixels on)
#pragma unroll
    for (int c = 0; c < 3; ++c) {
      if (s == 0) {
        plane_products<true>(a, 0, b0[c], b1[c], acc[c]);
      } else {
        plane_products<false>(a, s, b0[c], b1[c], acc[c]);
      }
    }
  }
}

// rgb_products for a narrow block (NarrowWeights b, one step): a lane's A words are rows l
// and l + odd (lines 2 g and 2 g + 1, lane_line), each row's pixels split as there (its
// first words A's first half of k, the second the second).
__device__ __forceinline__ void rgb_narrow_products(const unsigned (&b)[3][2], const u8* l,
                                                    int odd, int (&acc)[3][3][4]) {
  const unsigned* w0 = (const unsigned*)l;
  const unsigned* w8 = (const unsigned*)(l + odd);
  unsigned x[4][3];
  split_rgb8(w0, w0 + 12, x[0], x[2]);  // (16 pixels on)
  split_rgb8(w8, w8 + 12, x[1], x[3]);
#pragma unroll
  for (int c = 0; c < 3; ++c) {
    const unsigned a[4] = {x[0][c], x[1][c], x[2][c], x[3][c]};
    narrow_products(b, a, acc[c]);
  }
}

// The first pass of an RGB tile whose window is staged raw (R_RAW: rows of the source's
// bytes, channels interleaved): as mma_pass over `blocks` M-blocks times `lbs` N-blocks of
// 8 window rows, but a task takes all three channels of its N-block (rgb_products: one
// set of loads serves them, and their products interleave), so the window needs no
// planes. in: the lane's rows (Lines: its row lane_line(g), its skew in the staged row
// included; step, an N-block's rows on; no planes). done(m, acc) as mma_pass's, for each
// channel's output at out_at(j) + c * out_plane. W as mma_pass's (narrow: N-blocks of 16
// rows).
template <typename W, typename Ready, typename OutAt, typename Done>
__device__ __forceinline__ void mma_pass_rgb(const int* __restrict__ frags,
                                             const int* __restrict__ spans, int blocks, int lbs,
                                             const Lines& in, int out_plane, int out_step,
                                             Ready ready, OutAt out_at, Done done) {
  const int lane = (threadIdx.y * blockDim.x + threadIdx.x) & 31;
  const u8* lane_in = in.first + 12 * (lane & 3) - 3 * __ldg(spans);
  const int step = in.step, odd = in.odd;
  warp_tasks<1, W>(frags, spans, blocks, lbs, ready, [&](auto most_steps, const W& w, int j, int,
                                                        int lb, int n, int at) {
    [[maybe_unused]] constexpr int S = decltype(most_steps)::value;  // (wide blocks only)
    const u8* l = lane_in + 3 * at + lb * step;
    u8* o = out_at(j) + lb * out_step;
#pragma unroll 1
    for (int k = 0; k < n; ++k, l += step, o += out_step) {
      int acc[3][3][4];
      if constexpr (W::NARROW) {
        rgb_narrow_products(w.b, l, odd, acc);
      } else {
        rgb_products<S>(w.a, l, acc);
      }
#pragma unroll
      for (int c = 0; c < 3; ++c) done(o + c * out_plane, acc[c]);
    }
  });
}

// A task's clamped bytes (clamp_q22's v) where each of D's rows is a pair of neighbours in
// a row: each pair as one 16-bit store, at m and `below` bytes on.
__device__ __forceinline__ void store_pairs(u8* m, int below, const unsigned v[2]) {
  *(unsigned short*)m = (unsigned short)v[0];
  *(unsigned short*)(m + below) = (unsigned short)v[1];
}

// A wide task's clamped bytes (clamp_q22's v) into rows of lines: its outputs g and g + 8
// are columns 8 apart, its lines 2 t and 2 t + 1 neighbouring rows of `pitch`: at m,
// m + pitch, m + 8 and m + pitch + 8.
__device__ __forceinline__ void store_columns(u8* m, int pitch, const unsigned v[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    m[8 * r] = (u8)v[r];
    m[pitch + 8 * r] = (u8)(v[r] >> 8);
  }
}

// Where a pass's lane puts its tasks' bytes in a plane of row pitch `pitch` at base, whose
// rows are the pass's outputs (OUT_ROWS; its lines then the columns) or its lines: at(j),
// the lane's place for block j's first task; step, an N-block on; store(m, acc), a task's
// bytes from its D fragment (mma_pass's acc): a narrow task's into rows of outputs as one
// word of four lines (narrow_lines); into rows of the pass's outputs (wide) or of its
// lines (narrow: rows 2 g and 2 g + 1), where a D row's two bytes are neighbours, as two
// pairs; a wide task's into rows of lines byte by byte (store_columns).
template <typename W, bool OUT_ROWS>
struct LaneOut {
  u8* base;
  int pitch, g, t;
  __device__ __forceinline__ u8* at(int j) const {
    if constexpr (OUT_ROWS) {
      return W::NARROW ? base + (8 * j + g) * pitch + 4 * t : base + (16 * j + g) * pitch + 2 * t;
    } else {
      return W::NARROW ? base + 2 * g * pitch + 8 * j + 2 * t : base + 2 * t * pitch + 16 * j + g;
    }
  }
  __device__ __forceinline__ int step() const { return OUT_ROWS ? W::LINES : W::LINES * pitch; }
  __device__ __forceinline__ void store(u8* m, const int (&acc)[3][4]) const {
    if constexpr (OUT_ROWS && W::NARROW) {
      *(unsigned*)m = narrow_lines(acc);
    } else {
      unsigned v[2];
      clamp_q22(acc, v);
      if constexpr (OUT_ROWS) {
        store_pairs(m, 8 * pitch, v);
      } else if constexpr (W::NARROW) {
        store_pairs(m, pitch, v);
      } else {
        store_columns(m, pitch, v);
      }
    }
  }
};

// The smallest row pitch of at least n bytes that is 16 more than a multiple of 32: the 8
// lines x 4 words a warp reads fall in 32 different banks.
__device__ __forceinline__ int mma_pitch(int n) { return ((n + 15) & ~31) + 16; }

// Four consecutive rows' words of one channel (byte e = column c + e) as four columns'
// words (byte e = row 4 q + e): a 4 x 4 byte transpose.
__device__ __forceinline__ void transpose4(const unsigned (&w)[4], unsigned (&t)[4]) {
  const unsigned lo01 = __byte_perm(w[0], w[1], 0x5140), lo23 = __byte_perm(w[2], w[3], 0x5140);
  const unsigned hi01 = __byte_perm(w[0], w[1], 0x7362), hi23 = __byte_perm(w[2], w[3], 0x7362);
  t[0] = __byte_perm(lo01, lo23, 0x5410);
  t[1] = __byte_perm(lo01, lo23, 0x7632);
  t[2] = __byte_perm(hi01, hi23, 0x5410);
  t[3] = __byte_perm(hi01, hi23, 0x7632);
}

// Four pixels of a source row from column c as one word a channel (byte e = pixel c + e),
// for cols >= 4 and without a branch: 12 bytes for RGB (16 for RGBA) with word loads; a
// group past `cols` loads the row's last four pixels instead and shifts its own to the low
// bytes (the bytes above are 0), so nothing past `cols` is read. WHOLE: the caller knows
// the four pixels are in the image's row and start on a word (the group then takes plain
// word loads). RGBA comes premultiplied (an MMA tile's RGBA is always resized).
template <int CH, bool WHOLE = false>
__device__ __forceinline__ void load_planes(const u8* __restrict__ row, int c, int cols,
                                            unsigned (&w)[CH]) {
  constexpr int NW = CH == 1 ? 1 : CH;  // words of four pixels
  const int at = WHOLE ? c : min(c, cols - 4);
  unsigned x[NW];
  if constexpr (WHOLE) {
    const unsigned* p = (const unsigned*)(row + at * CH);
#pragma unroll
    for (int i = 0; i < NW; ++i) x[i] = src_word(p + i);
  } else {
    load_words<NW>(row + at * CH, x);
  }
  if constexpr (CH == 1) {
    w[0] = x[0];
  } else if constexpr (CH == 4) {  // a pixel a word: premultiplied, then bytes to planes
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      int v[4];
      unpack_px<4>(x[i], v);
      premultiply(v);
      x[i] = pack_px<4>(v);
    }
    transpose4(x, w);
  } else {
    split_rgb(x[0], x[1], x[2], w);
  }
  if constexpr (!WHOLE) {
    const unsigned shift = 8u * (unsigned)(c - at);  // 0 .. 24
#pragma unroll
    for (int ch = 0; ch < CH; ++ch) w[ch] >>= shift;
  }
}
