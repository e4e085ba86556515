// mmwire pixel kernels: Pillow-exact BICUBIC resize and the fused
// resize / composite / pad / normalise / patchify of many images per launch.
//
// Exactness rules (see materialize/_bicubic.py and materialize/_pipeline.py, which these
// kernels must equal byte for byte):
//   * resize: Q22 int32 weights computed on the host exactly as Pillow does; per output
//     sample acc = 2^21 + sum(px * k), clamp(acc >> 22, 0, 255); a uint8 image between the
//     two passes; RGBA premultiplied on the first read and unpremultiplied at the end.
//   * background composite: float32, every operation rounded on its own (__fmul_rn /
//     __fadd_rn / __fdiv_rn, so nvcc cannot contract anything into an FMA).
//   * normalise: a per-channel 256-entry table of the output dtype, computed on the host by
//     the CPU path; the kernel copies its bit patterns (T is the storage type: 32 or 16 bits),
//     or for bf16 and fp16 computes the affine form the host proved equal to it on every
//     byte (see "Normalise" below).
//
// Every image is described by one row of NF int64 fields (the order is mirrored in
// kernels/_descriptors.py and checked by tests/test_kernels_host.py).
//   * resize_pass1 / resize_pass2 run one block row per image row (blockIdx.x, over all
//     images of the launch) and blockIdx.y * blockDim.x + threadIdx.x across it; a block
//     finds its image by binary search on a running start field.
//   * fused (compiled per channel count and kind, one launch per pair present) runs one
//     block per output tile (a few patches) and reads its image from a per-tile table
//     (MIXED: one launch of a channel count's PLAIN and MMA tiles, each block either).
//     PLAIN tiles (unresized) read each pixel run straight from the source, with word
//     loads, and write each plane's run in one store. MMA tiles (resized on both axes)
//     run both passes as int8 matrix products on the tensor cores (see "The
//     tensor-core resize" below). Otherwise (GENERAL) the block copies the tile's source
//     window (the resize taps' halo included) into shared memory with coalesced loads,
//     runs the first of two passes there into a shared intermediate, and the last pass,
//     composite, normalise and patchify from it: the intermediate never reaches global
//     memory. An image whose tile would not fit (TILED = 0) reads global memory instead:
//     its source, or for two passes the intermediate of resize_pass1. The loops stride by
//     the block's shape, so any block shape gives the same bytes (the GPU runs
//     (p / 2, 256 / (p / 2)) for an even p, a thread per pixel pair; the host build a few
//     threads per block).

enum Field {
  SRC_OFF = 0,        // byte offset of the image (uint8 HWC) in the source buffer
  IN_W = 1,
  IN_H = 2,
  CH = 3,             // 1 (gray), 3 (RGB) or 4 (RGBA)
  OUT_W = 4,          // resized size (before padding)
  OUT_H = 5,
  PASS1 = 6,          // 0 none, 1 horizontal, 2 vertical: the pass into the mid buffer
  PASS2 = 7,          // 0 none, 1 horizontal, 2 vertical: the pass of the final read
  MID_OFF = 8,        // byte offset of this image's uint8 intermediate
  MID_W = 9,
  MID_H = 10,
  MID_ROW = 11,       // first row of this image among all mid rows of the launch
  PATCH_START = 12,   // first patch of this image among all patches of the launch
  GRID_W = 13,        // patches per canvas row
  PREMUL = 14,        // 1: RGBA through premultiplied alpha (only when resized)
  BG = 15,            // 0: drop alpha, 1: chessboard, 2: solid fill
  BG_SQUARE = 16,
  BG_TOP_LEFT_WHITE = 17,
  BG_WHITE = 18,      // the white cells' level, or the solid fill level
  BG_GRAY = 19,
  X_XMIN = 20,        // int32 offsets into the coefficient buffer (horizontal axis)
  X_N = 21,
  X_K = 22,
  X_KSIZE = 23,
  Y_XMIN = 24,        // the same for the vertical axis
  Y_N = 25,
  Y_K = 26,
  Y_KSIZE = 27,
  OUT_ROW = 28,       // first row of this image among all output rows (resize-only launch)
  OUT_OFF = 29,       // byte offset of this image's uint8 HWC output (resize-only launch)
  TABLE = 30,         // element offset of this image's (3, 256) normalise table
  ROW = 31,           // output row of this image's first patch (other items' rows may sit between)
  GRID_H = 32,        // patch rows of the canvas
  TILE_START = 33,    // first tile of this image among all tiles of the fused launch
  TILES_W = 34,       // tiles per canvas row
  TILED = 35,         // 1: the tile's source window (and intermediate) in shared memory
  TILE_PH = 36,       // patches per tile, down and across (fused launch)
  TILE_PW = 37,
  NF = 38
};

// An MMA or plain tile's record (int32, built by the host's _mma_records and
// _plain_records): what its block would otherwise work out from its image's descriptor
// (and for MMA its spans) before it could stage its window or read its pixels, so that
// starts after one load. The order is mirrored in kernels/_descriptors.py. A plain tile's
// has no spans or fragments, and R_PLAIN its only flag; its R_SRC_* is its first pixel and
// R_USED_* the part of it inside the image.
enum Record {
  R_IMAGE = 0,        // the tile's image (its descriptor row)
  R_SRC_LO = 1,       // byte offset in the source of the window's first pixel (low, high word)
  R_SRC_HI = 2,
  R_ROW_BYTES = 3,    // the image's source row, in bytes
  R_USED_W = 4,       // the window's columns and rows the taps use
  R_USED_H = 5,
  R_X_SPANS = 6,      // int32 offset of the tile column's first M-block span (at, steps)
  R_Y_SPANS = 7,      // the same, the tile row's
  R_X_WORDS = 8,      // int32 offset of the tile column's first M-block A fragments
  R_Y_WORDS = 9,      // the same, the tile row's
  R_TILE_H = 10,      // the tile's patches down and across (short at the canvas's edges)
  R_TILE_W = 11,
  R_GY0 = 12,         // its first patch row and column in the canvas
  R_GX0 = 13,
  R_PATCH = 14,       // its first patch's output row
  R_GRID_W = 15,      // patches per canvas row
  R_TABLE = 16,       // element offset of its image's normalise table
  R_FLAGS = 17,       // R_TWO_STEPS | R_V_FIRST | R_WHOLE | R_RAW | R_*_NARROW, or R_PLAIN
  R_PAD0 = 18,        // (a record is five 16-byte loads)
  R_PAD1 = 19,
  NR = 20
};
#define R_TWO_STEPS 1  // some used wide M-block takes MMA_KS 32-input steps
#define R_V_FIRST 2    // Pillow resizes this image vertically first
#define R_WHOLE 4      // the window's rows start on a word and its groups lie in the image
#define R_RAW 8        // gray or RGB passed horizontally first, whose window's rows start on a
                       // word: staged as the source's bytes (mma_tile; the host puts the
                       // source itself on a word)
#define R_PLAIN 16     // a plain tile (its only flag), so a MIXED launch tells the kinds apart
#define R_X_NARROW 32  // the horizontal pass takes narrow blocks (NarrowWeights): 8 outputs
#define R_Y_NARROW 64  // a block in one 32-input step (the vertical pass: R_Y_NARROW)

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned char u8;

// The last image whose `field` start is <= i (starts are non-decreasing; an image with no
// work has the same start as the next one, so the last match is the one that owns i).
__device__ __forceinline__ const i64* find_image(const i64* __restrict__ desc, int n_images,
                                                 int field, i64 i) {
  int lo = 0, hi = n_images - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (desc[(i64)mid * NF + field] <= i) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return desc + (i64)lo * NF;
}

// Premultiply RGB by alpha as Pillow's RGBA -> RGBa does.
__device__ __forceinline__ void premultiply(int v[4]) {
#pragma unroll
  for (int c = 0; c < 3; ++c) {
    int t = v[c] * v[3] + 128;
    v[c] = ((t >> 8) + t) >> 8;
  }
}

// One pixel's CH channels, premultiplied when asked (RGBA only).
template <int CH>
__device__ __forceinline__ void load_px(const u8* __restrict__ p, bool premul, int v[4]) {
#pragma unroll
  for (int c = 0; c < 4; ++c) v[c] = c < CH ? (int)p[c] : 0;
  if (CH == 4 && premul) premultiply(v);
}

// One output sample (all channels) of one 8-bit pass: n taps at base + (xmin + t) * step.
template <int CH>
__device__ __forceinline__ void pass_px(const u8* __restrict__ base, i64 step, bool premul,
                                        const int* __restrict__ k, int xmin, int n, int out[4]) {
  int acc[4] = {1 << 21, 1 << 21, 1 << 21, 1 << 21};
  const u8* p = base + (i64)xmin * step;
  for (int t = 0; t < n; ++t, p += step) {
    int v[4];
    load_px<CH>(p, premul, v);
    const int w = k[t];
#pragma unroll
    for (int c = 0; c < CH; ++c) acc[c] += v[c] * w;
  }
#pragma unroll
  for (int c = 0; c < 4; ++c) out[c] = min(max(acc[c] >> 22, 0), 255);
}

// The resized (still premultiplied, for RGBA) pixel (y, x) of image d, all channels.
template <int CH>
__device__ __forceinline__ void resized_px(const u8* __restrict__ src, const u8* __restrict__ mid,
                                           const i64* __restrict__ d, const int* __restrict__ tab,
                                           int y, int x, int out[4]) {
  const bool staged = d[PASS1] != 0;
  const u8* st = staged ? mid + d[MID_OFF] : src + d[SRC_OFF];
  const i64 row = (staged ? d[MID_W] : d[IN_W]) * CH;
  const bool premul = !staged && d[PREMUL] != 0;
  const int p2 = (int)d[PASS2];
  if (p2 == 1) {
    pass_px<CH>(st + (i64)y * row, CH, premul, tab + d[X_K] + (i64)x * d[X_KSIZE],
                tab[d[X_XMIN] + x], tab[d[X_N] + x], out);
  } else if (p2 == 2) {
    pass_px<CH>(st + (i64)x * CH, row, premul, tab + d[Y_K] + (i64)y * d[Y_KSIZE],
                tab[d[Y_XMIN] + y], tab[d[Y_N] + y], out);
  } else {
    load_px<CH>(st + (i64)y * row + (i64)x * CH, premul, out);
  }
}

// a / b rounded down, for 0 <= a < 2^21 and b > 0, through the float reciprocal: (a + 0.5)
// / b lies at least 0.5 / b from an integer, and __fdividef is off by at most 2^-22 of it
// (2 ulp), less than that distance while a + 0.5 < 2^21, so the truncation is exact. Five
// instructions where the integer division takes fourteen.
__device__ __forceinline__ int div_small(int a, int b) {
  return (int)__fdividef((float)a + 0.5f, (float)b);
}

// Undo the premultiplication exactly as Pillow's RGBa -> RGBA (truncating division; 255 v
// is at most 65025, so div_small is exact).
__device__ __forceinline__ void unpremultiply(const i64* __restrict__ d, int v[4]) {
  const int a = v[3];
  if (d[PREMUL] != 0 && a != 0 && a != 255) {
#pragma unroll
    for (int c = 0; c < 3; ++c) v[c] = min(255, div_small(255 * v[c], a));
  }
}

// Final RGB of an RGBA canvas pixel (y, x): alpha dropped or composited in float32.
__device__ __forceinline__ void rgba_to_rgb(const i64* __restrict__ d, int y, int x,
                                            const int v[4], int rgb[3]) {
  if (d[BG] == 0) {
    rgb[0] = v[0];
    rgb[1] = v[1];
    rgb[2] = v[2];
    return;
  }
  float fill;
  if (d[BG] == 1) {
    const int sq = (int)d[BG_SQUARE];
    const int parity = ((y / sq) + (x / sq)) & 1;
    const bool white = parity == (d[BG_TOP_LEFT_WHITE] != 0 ? 0 : 1);
    fill = (float)(white ? d[BG_WHITE] : d[BG_GRAY]);
  } else {
    fill = (float)d[BG_WHITE];
  }
  const float a = fminf(fmaxf(__fdiv_rn((float)v[3], 255.0f), 0.0f), 1.0f);
  const float bg = __fmul_rn(__fsub_rn(1.0f, a), fill);
#pragma unroll
  for (int c = 0; c < 3; ++c) {
    float m = __fadd_rn(__fmul_rn(a, (float)v[c]), bg);
    m = fminf(fmaxf(m, 0.0f), 255.0f);
    rgb[c] = (int)floorf(m);
  }
}

template <int CH>
__device__ __forceinline__ void pass1_px(const u8* __restrict__ src, u8* __restrict__ mid,
                                         const i64* __restrict__ d, const int* __restrict__ tab,
                                         int y, int x) {
  const u8* s = src + d[SRC_OFF];
  const i64 row = d[IN_W] * CH;
  const bool premul = d[PREMUL] != 0;
  int out[4];
  if (d[PASS1] == 1) {
    pass_px<CH>(s + (i64)y * row, CH, premul, tab + d[X_K] + (i64)x * d[X_KSIZE],
                tab[d[X_XMIN] + x], tab[d[X_N] + x], out);
  } else {
    pass_px<CH>(s + (i64)x * CH, row, premul, tab + d[Y_K] + (i64)y * d[Y_KSIZE],
                tab[d[Y_XMIN] + y], tab[d[Y_N] + y], out);
  }
  u8* m = mid + d[MID_OFF] + ((i64)y * d[MID_W] + x) * CH;
#pragma unroll
  for (int c = 0; c < CH; ++c) m[c] = (u8)out[c];
}

// Pass 1 of the images that need two passes: source -> uint8 intermediate.
// Grid: (all mid rows of the launch, column blocks of the widest).
extern "C" __global__ void resize_pass1(const u8* __restrict__ src, u8* __restrict__ mid,
                                        const i64* __restrict__ desc, const int* __restrict__ tab,
                                        int n_images) {
  const i64* d = find_image(desc, n_images, MID_ROW, blockIdx.x);
  const int y = (int)(blockIdx.x - d[MID_ROW]);
  const int x = blockIdx.y * blockDim.x + threadIdx.x;
  if (y >= d[MID_H] || x >= d[MID_W]) return;
  switch (d[CH]) {
    case 1: pass1_px<1>(src, mid, d, tab, y, x); break;
    case 3: pass1_px<3>(src, mid, d, tab, y, x); break;
    default: pass1_px<4>(src, mid, d, tab, y, x); break;
  }
}

template <int CH>
__device__ __forceinline__ void pass2_px(const u8* __restrict__ src, const u8* __restrict__ mid,
                                         const i64* __restrict__ d, const int* __restrict__ tab,
                                         u8* __restrict__ dst, int y, int x) {
  int v[4];
  resized_px<CH>(src, mid, d, tab, y, x, v);
  if (CH == 4) unpremultiply(d, v);
  u8* o = dst + d[OUT_OFF] + ((i64)y * d[OUT_W] + x) * CH;
#pragma unroll
  for (int c = 0; c < CH; ++c) o[c] = (u8)v[c];
}

// The resize alone: the last pass into uint8 HWC outputs (what Image.resize returns).
// Grid: (all output rows of the launch, column blocks of the widest).
extern "C" __global__ void resize_pass2(const u8* __restrict__ src, const u8* __restrict__ mid,
                                        const i64* __restrict__ desc, const int* __restrict__ tab,
                                        u8* __restrict__ dst, int n_images) {
  const i64* d = find_image(desc, n_images, OUT_ROW, blockIdx.x);
  const int y = (int)(blockIdx.x - d[OUT_ROW]);
  const int x = blockIdx.y * blockDim.x + threadIdx.x;
  if (y >= d[OUT_H] || x >= d[OUT_W]) return;
  switch (d[CH]) {
    case 1: pass2_px<1>(src, mid, d, tab, dst, y, x); break;
    case 3: pass2_px<3>(src, mid, d, tab, dst, y, x); break;
    default: pass2_px<4>(src, mid, d, tab, dst, y, x); break;
  }
}

// A resized (premultiplied, for RGBA) pixel as the canvas's RGB.
template <int CH>
__device__ __forceinline__ void to_rgb(const i64* __restrict__ d, int y, int x, int v[4],
                                       int rgb[3]) {
  if (CH == 1) {
    rgb[0] = rgb[1] = rgb[2] = v[0];
  } else if (CH == 3) {
    rgb[0] = v[0];
    rgb[1] = v[1];
    rgb[2] = v[2];
  } else {
    unpremultiply(d, v);
    rgba_to_rgb(d, y, x, v, rgb);
  }
}

// Channels of one pixel packed into a word (byte c = channel c), the shared memory format.
template <int CH>
__device__ __forceinline__ unsigned pack_px(const int v[4]) {
  unsigned u = 0;
#pragma unroll
  for (int c = 0; c < CH; ++c) u |= (unsigned)v[c] << (8 * c);
  return u;
}

template <int CH>
__device__ __forceinline__ void unpack_px(unsigned u, int v[4]) {
#pragma unroll
  for (int c = 0; c < 4; ++c) v[c] = c < CH ? (int)((u >> (8 * c)) & 255u) : 0;
}

// One output sample of a pass over packed words: n taps at m[t * step].
template <int CH>
__device__ __forceinline__ void packed_pass(const unsigned* m, int step,
                                            const int* __restrict__ k, int n, int out[4]) {
  int acc[4] = {1 << 21, 1 << 21, 1 << 21, 1 << 21};
  for (int t = 0; t < n; ++t) {
    const unsigned u = m[t * step];
    const int w = k[t];
#pragma unroll
    for (int c = 0; c < CH; ++c) acc[c] += (int)((u >> (8 * c)) & 255u) * w;
  }
#pragma unroll
  for (int c = 0; c < 4; ++c) out[c] = min(max(acc[c] >> 22, 0), 255);
}

#ifndef MMWIRE_HOST_SHIM
// Two words as one 8-byte store to global memory (p 8-aligned). Written as a uint2, nvcc
// split some of these into two 4-byte stores. Nothing in a launch reads what it stores, so
// the stores are marked streaming (st.global.cs: evict first from L2): the patches then
// leave L2 to the windows' sources, which neighbouring tiles share. Measured 1-2.4 µs
// faster on the seed, resized and tall batches, plain and MMA kernels alike (the mixed batch
// within its spread; bench/results/20261201-store-hints, ab-81).
__device__ __forceinline__ void store_pair8(void* p, unsigned x, unsigned y) {
  asm volatile("st.global.cs.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(x), "r"(y));
}

// Four words as one 16-byte store to global memory (p 16-aligned), streaming as store_pair8.
__device__ __forceinline__ void store_quad16(void* p, unsigned x, unsigned y, unsigned z,
                                             unsigned w) {
  asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(x), "r"(y), "r"(z),
               "r"(w));
}
#endif

// V values of T as one store (o aligned to V elements): with V = 2, 8 bytes for fp32 and 4
// for the 16-bit types; with V = 4, 16 bytes for fp32 (wide_units) and 8 for the 16-bit
// types. A warp writes fewer, wider stores.
template <int V, typename T>
__device__ __forceinline__ void store_run(T* __restrict__ o, const T (&v)[V]) {
  if constexpr (V == 1) {
    o[0] = v[0];
  } else if constexpr (V == 2 && sizeof(T) == 4) {
    *(unsigned long long*)o = (unsigned long long)v[0] | ((unsigned long long)v[1] << 32);
  } else if constexpr (V == 2) {
    *(unsigned*)o = (unsigned)v[0] | ((unsigned)v[1] << 16);
  } else if constexpr (sizeof(T) == 4) {
    static_assert(V == 4, "16-byte stores at most");
    store_quad16(o, (unsigned)v[0], (unsigned)v[1], (unsigned)v[2], (unsigned)v[3]);
  } else {
    static_assert(V == 4, "8-byte stores at most");
    store_pair8(o, (unsigned)v[0] | ((unsigned)v[1] << 16),
                (unsigned)v[2] | ((unsigned)v[3] << 16));
  }
}

// Whether a launch's fp32 patches go out as units of four values (WIDE_UNIT_BYTES, one
// 16-byte store a plane; measured faster than pairs: bench/results/20261201-wide-stores):
// only where `out` starts on 16 bytes, and then every patch does (3 p p fp32 values are
// 48 (p / 2)^2 bytes for an even p). The host asks for 8 (UNIT_BYTES), so the rest go out
// as pairs.
#define WIDE_UNIT_BYTES 16
template <typename T>
__device__ __forceinline__ bool wide_units(const T* out) {
  return sizeof(T) == 4 && ((unsigned long long)out & (WIDE_UNIT_BYTES - 1)) == 0;
}

// ---- Normalise: a byte of plane c to the output's bits ----
// Every launch's tables are rows of NORM_STRIDE elements (T): the (3, 256) table, then a
// header of NORM_HEADER elements whose first words are (u32 mode, f32 a[3], f32 b[3]).
// The table (TableNorm, copied into shared memory) serves every type. For the 16-bit types
// the host also tries fma(v, a[c], b[c]) in fp32, rounded once to bf16 or fp16, and where
// that equals the table on all 768 bytes (kernels/_affine.py; it does for the usual means
// and deviations) the header's mode says so and the MMA and plain tiles compute it
// (AffineNorm): a byte-to-float permute and an FMA a value and one conversion a pair, where
// the table took a shared load and its addressing. The permute puts the byte v in the bits
// 16 .. 23 of a word, which as an fp32 is v 2^-133 exactly (a subnormal below 128, the
// least normal exponent from 128 on), and the header's a is the form's times 2^133, so the
// FMA's exact product is v a and its one rounding the form's (where the form's a is below
// 2^-5; else a 2^133 passes fp32 and the host keeps the table). It needs an FMA that keeps
// subnormal operands (fma_subnormal), where the build's own flushes them.
#define NORM_VALUES 768
#define NORM_HEADER 16
#define NORM_STRIDE (NORM_VALUES + NORM_HEADER)
#define NORM_TABLE 0
#define NORM_BF16 1
#define NORM_F16 2

template <typename T>
struct TableNorm {
  using V = T;  // what a value is held as until its store
  const T* tb;
  __device__ __forceinline__ T operator()(int c, int v) const { return tb[256 * c + v]; }
  // byte k of w
  __device__ __forceinline__ T byte(int c, unsigned w, int k) const {
    return tb[256 * c + ((w >> (8 * k)) & 255u)];
  }
  template <int N>
  __device__ __forceinline__ void store(T* __restrict__ o, const T (&r)[N]) const {
    store_run<N>(o, r);
  }
};

#ifndef MMWIRE_HOST_SHIM
// fma(x, y, z) rounded once to nearest even, subnormal operands and results as they are:
// the PTX instruction without .ftz (the build's C++ float operations flush them).
__device__ __forceinline__ float fma_subnormal(float x, float y, float z) {
  float r;
  asm("fma.rn.f32 %0, %1, %2, %3;" : "=f"(r) : "f"(x), "f"(y), "f"(z));
  return r;
}

// lo and hi rounded to bf16 (FMT NORM_BF16) or fp16 (NORM_F16), nearest even, as the low
// and high half of a word (cvt.rn puts its first operand in the high half).
template <int FMT>
__device__ __forceinline__ unsigned pack_halves(float lo, float hi) {
  unsigned r;
  if constexpr (FMT == NORM_BF16) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
}
#endif

template <int FMT>
struct AffineNorm {
  using V = float;
  float a[3], b[3];  // a: the form's times 2^133
  // byte k of w as bits 16 .. 23 of an fp32, the rest 0 (one permute): the byte times
  // 2^-133, exactly; times a, plus b, rounded once
  __device__ __forceinline__ float byte(int c, unsigned w, int k) const {
    const float x = __uint_as_float(__byte_perm(w, 0u, 0x4044u | (k << 8)));
    return fma_subnormal(x, a[c], b[c]);
  }
  __device__ __forceinline__ float operator()(int c, int v) const {
    return byte(c, (unsigned)v, 0);
  }
  template <int N>
  __device__ __forceinline__ void store(unsigned short* __restrict__ o,
                                        const float (&r)[N]) const {
    unsigned short h[N];
    if constexpr (N == 1) {
      h[0] = (unsigned short)pack_halves<FMT>(r[0], 0.0f);
    } else {
#pragma unroll
      for (int i = 0; i < N; i += 2) {
        const unsigned w = pack_halves<FMT>(r[i], r[i + 1]);
        h[i] = (unsigned short)w;
        h[i + 1] = (unsigned short)(w >> 16);
      }
    }
    store_run<N>(o, h);
  }
};

// f(norm) with the normaliser the table tb (NORM_STRIDE values in shared memory) asks for:
// the table itself, or for the 16-bit types its affine form.
template <typename T, typename F>
__device__ __forceinline__ void with_norm(const T* tb, F f) {
  if constexpr (sizeof(T) == 2) {
    const unsigned* h = (const unsigned*)(tb + NORM_VALUES);
    const unsigned mode = h[0];
    if (mode != NORM_TABLE) {
      auto affine = [&](auto norm) {
#pragma unroll
        for (int c = 0; c < 3; ++c) {
          norm.a[c] = __uint_as_float(h[1 + c]);
          norm.b[c] = __uint_as_float(h[4 + c]);
        }
        f(norm);
      };
      if (mode == NORM_BF16) {
        affine(AffineNorm<NORM_BF16>());
      } else {
        affine(AffineNorm<NORM_F16>());
      }
      return;
    }
  }
  f(TableNorm<T>{tb});
}

template <int N>
struct Int {
  static constexpr int value = N;
};

#ifndef MMWIRE_HOST_SHIM
__device__ __forceinline__ unsigned* dynamic_smem() {
  extern __shared__ unsigned mmwire_smem[];
  return mmwire_smem;
}
#endif

// to[i] = from[i] for i < n, the block's threads one element each in turn (the descriptor
// row and the normalise table into shared memory).
template <typename W>
__device__ __forceinline__ void block_copy(W* to, const W* from, int n) {
  const int tid = threadIdx.y * blockDim.x + threadIdx.x, nt = blockDim.x * blockDim.y;
#pragma unroll 1
  for (int i = tid; i < n; i += nt) to[i] = from[i];
}

// A row of one patch of a tile: patch (ky, kx), pixel row py. A thread walks the tile's
// patch rows (patch-major) from its first, `step` rows at a time, so a block of any height
// keeps all its threads busy; the step is split once into whole patches and rows, so a move
// divides nothing and wraps at most a row of patches at a time.
struct PatchRow {
  int ky, kx, py, dk, dp;
  __device__ __forceinline__ PatchRow(int first, int step, int p, int npw)
      : ky(0), kx(0), py(0), dk(step / p), dp(step - step / p * p) {
    advance(first / p, first - first / p * p, p, npw);
  }
  __device__ __forceinline__ void advance(int patches, int rows, int p, int npw) {
    py += rows;
    if (py >= p) {
      py -= p;
      ++patches;
    }
    kx += patches;
    while (kx >= npw) {
      kx -= npw;
      ++ky;
    }
  }
  __device__ __forceinline__ void next(int p, int npw) { advance(dk, dp, p, npw); }
};

// The source's reads (src_word, copy16) ask L2 to fetch 128 bytes around each from HBM
// (.L2::128B, a prefetch size hint): a tile reads its rows in words and 16-byte pieces
// spread over the block's threads, and the rest of each 128-byte line is read soon after.
// Measured 0.3-2 µs faster than without (bench/results/20261201-store-hints, ab-83).
#define MMWIRE_SRC_HINT ".L2::128B"

// One word of the source (read-only for the launch), through the read-only path as __ldg.
__device__ __forceinline__ unsigned src_word(const unsigned* p) {
#ifdef MMWIRE_HOST_SHIM
  return *p;
#else
  unsigned v;
  asm("ld.global.nc" MMWIRE_SRC_HINT ".u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
#endif
}

// Bytes p .. p + 4 * W as W words, from aligned word loads that touch only words holding
// at least one of those bytes (an aligned word never straddles a page, so nothing unmapped
// is read, and nothing past the word of the last byte).
template <int W>
__device__ __forceinline__ void load_words(const u8* p, unsigned out[W]) {
  const unsigned long long at = (unsigned long long)p;
  const unsigned* w = (const unsigned*)(at & ~3ull);
  const unsigned shift = (unsigned)(at & 3ull) * 8u;
  unsigned a[W + 1];
#pragma unroll
  for (int i = 0; i < W; ++i) a[i] = src_word(w + i);
  a[W] = shift != 0 ? src_word(w + W) : 0u;
#pragma unroll
  for (int i = 0; i < W; ++i) out[i] = __funnelshift_r(a[i], a[i + 1], shift);
}

// n pixels of one source row into packed words (byte c = channel c; the bytes above CH
// are never read), premultiplied when asked. Threads take groups of G pixels (4 bytes a
// channel-row word: G = 4 for gray and RGB, 1 for RGBA) with word loads; the row's last
// partial group goes pixel by pixel.
template <int CH>
__device__ __forceinline__ void stage_row(const u8* __restrict__ s, int n, bool premul,
                                          unsigned* dst, int t, int nt) {
  constexpr int G = CH == 4 ? 1 : 4;
  constexpr int W = G * CH / 4;
  int v[4];
  for (int g = t; g * G < n; g += nt) {
    const int c = g * G;
    if (c + G <= n) {
      unsigned w[W];
      load_words<W>(s + c * CH, w);
      if (CH == 1) {
#pragma unroll
        for (int i = 0; i < 4; ++i) dst[c + i] = w[0] >> (8 * i);
      } else if (CH == 3) {
        dst[c] = w[0];
        dst[c + 1] = __byte_perm(w[0], w[1], 0x6543);
        dst[c + 2] = __byte_perm(w[1], w[2 % W], 0x5432);
        dst[c + 3] = w[2 % W] >> 8;
      } else if (premul) {
        unpack_px<4>(w[0], v);
        premultiply(v);
        dst[c] = pack_px<4>(v);
      } else {
        dst[c] = w[0];
      }
    } else {
      for (int i = c; i < n; ++i) {
        load_px<CH>(s + i * CH, premul, v);
        dst[i] = pack_px<CH>(v);
      }
    }
  }
}

// NB <= 8 bytes at p as two words (bytes past NB undefined), from the aligned words that
// hold at least one of them (as load_words: nothing unmapped, nothing past the last byte's).
// SHARED: p is in shared memory; its word is found by pointer arithmetic, not through an
// integer, so nvcc keeps the shared address space (32-bit LDS, where the integer's round
// trip made generic 64-bit loads and address arithmetic).
template <int NB, bool SHARED = false>
__device__ __forceinline__ void load_bytes(const u8* p, unsigned (&out)[2]) {
  const unsigned skew = (unsigned)((unsigned long long)p & 3ull);
  const unsigned* w = (const unsigned*)(p - skew);
  const unsigned words = (skew + NB + 3) >> 2;  // 1 .. 3
  auto word = [&](int i) {  // SHARED: p is in shared memory
    if constexpr (SHARED) {
      return w[i];
    } else {
      return src_word(w + i);
    }
  };
  const unsigned a0 = word(0);
  const unsigned a1 = words > 1 ? word(1) : 0u;
  const unsigned a2 = words > 2 ? word(2) : 0u;
  out[0] = __funnelshift_r(a0, a1, 8 * skew);
  out[1] = __funnelshift_r(a1, a2, 8 * skew);
}

// The units of a tile's patches a thread writes, for an even p: U consecutive values of a
// patch plane (a plane is p * p values, a multiple of 4, so with U = 2 or 4 a unit is one
// aligned store: UNIT_BYTES = 8 bytes, U = 2 for fp32 and 4 for the 16-bit types, which
// measured best; or for fp32 U = 4, WIDE_UNIT_BYTES, where out allows it: wide_units), as
// U / 2 runs of a pixel pair of a patch row (a run never wraps a row).
// Units are counted without dividing: a thread's next is nt units on, nt / units patches
// and nt % units units. (for_each_unit, below, walks them so only where a patch plane has
// more units than the block has threads.)
#define UNIT_BYTES 8
template <int U>
struct Units {
  int ky, kx, u, units, dk, du;
  unsigned inv_p;  // e / p as a high product, exact while e * p < 2^32: e < p * p, p <= 256
  __device__ __forceinline__ Units(int p, int npw) {
    const int tid = threadIdx.y * blockDim.x + threadIdx.x, nt = blockDim.x * blockDim.y;
    units = p * p / U;
    dk = div_small(nt, units);
    du = nt - dk * units;
    const int k = div_small(tid, units);  // the thread's first patch of the tile, and unit
    u = tid - k * units;
    ky = div_small(k, npw);
    kx = k - ky * npw;
    inv_p = 0xffffffffu / (unsigned)p + 1u;
  }
  // The tile pixel (ry, cx) of the unit's run i.
  __device__ __forceinline__ void run_at(int i, int p, int& ry, int& cx) const {
    const int e = U * u + 2 * i;  // the run's first value in the plane
    const int py = (int)__umulhi((unsigned)e, inv_p);
    ry = ky * p + py;
    cx = kx * p + e - py * p;
  }
  // The unit's first value in the tile's patches (32-bit, from its first patch).
  __device__ __forceinline__ int offset(int p, int gw) const {
    return (ky * gw + kx) * 3 * p * p + U * u;
  }
  __device__ __forceinline__ void next(int npw) {
    u += du;
    kx += dk;
    if (u >= units) {
      u -= units;
      ++kx;
    }
    while (kx >= npw) {
      kx -= npw;
      ++ky;
    }
  }
};

// Calls f(ry, cx, at) for each unit of a tile's patches (nph x npw) a thread writes: ry[i],
// cx[i] the tile pixel of its run i, `at` its first value's offset from the tile's first
// patch (32-bit; gw patches a canvas row). Where a patch plane has no more units than the
// block has threads, the block takes `per` patches at a time, thread tid unit tid % units
// of patch tid / units (threads past per * units take none): the same unit of every patch
// it visits, so where its runs lie in a patch is worked out once and a move divides nothing
// (the MMA tiles' write-out measured faster so: bench/results/20261201-mma-units). Else
// the Units walk.
template <int U, typename F>
__device__ __forceinline__ void for_each_unit(int p, int nph, int npw, int gw, F f) {
  const int tid = threadIdx.y * blockDim.x + threadIdx.x, nt = blockDim.x * blockDim.y;
  const int pp = p * p, units = pp / U;
  int ry[U / 2], cx[U / 2];
  if (units > nt) {
    for (Units<U> k(p, npw); k.ky < nph; k.next(npw)) {
#pragma unroll
      for (int run = 0; run < U / 2; ++run) k.run_at(run, p, ry[run], cx[run]);
      f(ry, cx, k.offset(p, gw));
    }
    return;
  }
  const int per = div_small(nt, units), k = div_small(tid, units), u = tid - k * units;
  int py[U / 2], px[U / 2];
#pragma unroll
  for (int run = 0; run < U / 2; ++run) {
    const int e = U * u + 2 * run;  // the run's first value in the plane
    py[run] = div_small(e, p);
    px[run] = e - py[run] * p;
  }
  int ky = k < per ? div_small(k, npw) : nph, kx = k - ky * npw;
  while (ky < nph) {
#pragma unroll
    for (int run = 0; run < U / 2; ++run) {
      ry[run] = ky * p + py[run];
      cx[run] = kx * p + px[run];
    }
    f(ry, cx, (ky * gw + kx) * 3 * pp + U * u);
    kx += per;
    while (kx >= npw) {
      kx -= npw;
      ++ky;
    }
  }
}

// The normalised values of a run of V pixels of a source row from s, n of them in the image
// (the rest is padding), the first at canvas pixel (y, x): plane c's into r[c][at ..].
template <int CH, int V, bool SHARED, int N, typename Norm>
__device__ __forceinline__ void run_values(const u8* __restrict__ s, int n, const i64* d, int y,
                                           int x, const Norm& norm,
                                           typename Norm::V (&r)[3][N], int at) {
  unsigned w[2];
  if constexpr (CH != 4) {  // gray and RGB: each value from its byte (gray's fills 3 planes)
    if (n == V) {
      load_bytes<V * CH, SHARED>(s, w);
#pragma unroll
      for (int i = 0; i < V; ++i) {
#pragma unroll
        for (int c = 0; c < 3; ++c) {
          const int b = i * CH + (CH == 1 ? 0 : c);
          r[c][at + i] = norm.byte(c, w[b >> 2], b & 3);
        }
      }
      return;
    }
  }
  int v[V][4] = {};  // (set below where used: zeroed only for the host compiler's sake)
  if (CH == 4 && n == V) {
    load_bytes<V * CH, SHARED>(s, w);
#pragma unroll
    for (int i = 0; i < V; ++i) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int b = i * CH + c;
        v[i][c] = c < CH ? (int)((w[b >> 2] >> (8 * (b & 3))) & 255u) : 0;
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) {
      if (i < n) load_px<CH>(s + i * CH, false, v[i]);
    }
  }
#pragma unroll
  for (int i = 0; i < V; ++i) {
    int rgb[3] = {0, 0, 0};
    if (i < n) to_rgb<CH>(d, y, x + i, v[i], rgb);
#pragma unroll
    for (int c = 0; c < 3; ++c) r[c][at + i] = norm(c, rgb[c]);
  }
}

// Rows copy_rows staged at the start of the dynamic shared memory, as they are (an
// unresized tile's pixels, an MMA tile's raw window): row ry at ry * pitch + (ry >> 3) *
// shift, after its skew (the low bits of its source address: first + ry * stride, mod 16).
// An MMA tile's window shifts each group of 8 rows 16 bytes on (MMA_GROUP_SHIFT).
struct StagedRows {
  static constexpr bool SHARED = true;
  int pitch;
  unsigned first, stride;
  int shift = 0;
  __device__ __forceinline__ const u8* row(int ry) const {
    return (const u8*)dynamic_smem() + ry * pitch + (ry >> 3) * shift +
           ((first + (unsigned)ry * stride) & 15u);
  }
};

// An unresized tile's rows where they are in the source: row ry at s0 + ry * stride.
struct SourceRows {
  static constexpr bool SHARED = false;
  const u8* s0;
  i64 stride;
  __device__ __forceinline__ const u8* row(int ry) const { return s0 + (i64)ry * stride; }
};

// An unresized tile from its rows (StagedRows or SourceRows; no window, no barrier after
// the table): a thread takes runs of V pixels of the patch rows it walks, reads each run's
// bytes with a few word loads and writes each plane's V values in one store. o0 is the
// tile's first patch; (vh, vw) the part of the tile inside the image. The block's threads
// are its (x, y), the plain launch's block being (p / V, 256 / (p / V)); FLAT (a mixed
// launch's (32, 8) block) lays its threads out that way, by their index.
template <int CH, int V, bool FLAT, typename Rows, typename Norm, typename T>
__device__ __forceinline__ void plain_runs(const Rows& rows, const i64* d, const Norm& norm,
                                           T* __restrict__ o0, int p, int gw, int nph, int npw,
                                           int vh, int vw, int y0, int x0) {
  int tx = threadIdx.x, ty = threadIdx.y, bx = blockDim.x, by = blockDim.y;
  if constexpr (FLAT) {
    const int tid = ty * bx + tx, nt = bx * by;
    bx = min((p + V - 1) / V, nt);
    by = div_small(nt, bx);
    ty = div_small(tid, bx);
    tx = tid - ty * bx;
    if (ty >= by) return;  // (the last phase of the tile: no barrier follows)
  }
  const int pp = p * p;
  for (PatchRow k(ty, by, p, npw); k.ky < nph; k.next(p, npw)) {
    const int ry = k.ky * p + k.py, cx = k.kx * p;  // the row and first column in the tile
    T* o = o0 + ((k.ky * gw + k.kx) * 3 * pp + k.py * p);
    const u8* s = rows.row(ry) + cx * CH;
    for (int px = tx * V; px < p; px += bx * V) {
      const int n = ry < vh ? min(V, vw - cx - px) : 0;  // pixels of the run in the image
      typename Norm::V r[3][V];
      run_values<CH, V, Rows::SHARED>(s + px * CH, n, d, y0 + ry, x0 + cx + px, norm, r, 0);
#pragma unroll
      for (int c = 0; c < 3; ++c) norm.template store<V>(o + c * pp + px, r[c]);
    }
  }
}

// The same for RGB and gray in the 16-bit types, and fp32's staged tiles where wide_units: a
// thread takes units (above) instead of a pixel pair of each patch row it walks, so each
// plane's four values go out in one store, of 8 or 16 bytes (fp32 from the source keeps
// the pairs: its units measured slower; RGBA too: its composite needs the registers).
template <int CH, int U, typename Rows, typename Norm, typename T>
__device__ __forceinline__ void plain_units(const Rows& rows, const i64* d, const Norm& norm,
                                            T* __restrict__ o0, int p, int gw, int nph, int npw,
                                            int vh, int vw, int y0, int x0) {
  const int pp = p * p;
  // INSIDE: the whole tile lies in the image (no padding), so every run has both pixels and
  // the loop is compiled without the checks (most tiles; those at the canvas's right and
  // bottom edges take the general loop)
  auto units = [&](auto inside) {
    for_each_unit<U>(p, nph, npw, gw, [&](const int (&ry)[U / 2], const int (&cx)[U / 2], int at) {
      typename Norm::V r[3][U];
#pragma unroll
      for (int run = 0; run < U / 2; ++run) {
        // the run's pixels in the image
        const int n = decltype(inside)::value ? 2 : ry[run] < vh ? min(2, vw - cx[run]) : 0;
        run_values<CH, 2, Rows::SHARED>(rows.row(ry[run]) + cx[run] * CH, n, d, y0 + ry[run],
                                        x0 + cx[run], norm, r, 2 * run);
      }
#pragma unroll
      for (int c = 0; c < 3; ++c) norm.template store<U>(o0 + at + c * pp, r[c]);
    });
  };
  if (vh == nph * p && vw == npw * p) {
    units(Int<1>());
  } else {
    units(Int<0>());
  }
}

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
// the high plane signed), half the products and a quarter of the weight registers (the
// 8-image mixed batch 2.0-2.6 µs faster on the H200: bench/results/20261202-narrow-on-gpu).
// A tile's source window sits in shared memory as one plane a channel (rows of input
// columns; columns of input rows when Pillow resizes vertically first), or (R_RAW: gray and
// RGB passed horizontally first, rows on a word) as the source's rows copied as they are,
// whose RGB the first pass splits into channels as it reads it; the first pass writes the
// intermediate with the other axis contiguous, so both passes read 4
// consecutive k of a line as one word; the last pass writes its bytes over the window, and
// the block then sends them through the normalise table into the patches as units (above).

#define MMA_KS 2  // the most 32-input steps of one 16-output block (host: _MMA_STEPS)
#define MMA_MAX_BLOCKS 16  // the most M-blocks along a tile's side (host: _MMA_MAX_BLOCKS)
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
// the passes wait on; a coherent load stays before it, so its latency hides in the wait
// (measured 0.5-1.4 µs faster on the MMA batches: bench/results/20261201-staging-loads).
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
    // instructions a row where a branch around each copy took 17; 0.4-1 µs faster on
    // the MMA batches: bench/results/20261201-staging-loads)
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
    // (the 4000 x 3000 photo's raw rows of 43 granules: the loop below took about 25
    // instructions a copy; this 0.4 µs faster on the bf16 mixed batch:
    // bench/results/20261202-session34). It repeats the branch above with a second copy:
    // one loop templated on the copies a thread, the same arithmetic, made 32 more SASS
    // instructions and 8-byte spills in the gray MMA and mixed kernels, unmeasured on the
    // GPU, so the two stay apart.
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
#define MMA_GROUP_SHIFT 16

// A warp's contiguous run of a pass's (M-block, channel, N-block) tasks: `blocks` M-blocks
// of CH channels x lbs N-blocks (counted without dividing: (warp + 1) * tasks stays far
// below 2^21, so div_small serves: 32 warps at most, and tasks = blocks * CH * lbs with
// blocks <= MMA_MAX_BLOCKS and lbs a window's lines / 8), block by block: it loads the
// block's A fragments (load_weights: frags, MMA_FRAGMENT_WORDS a block) and span (spans:
// (at, steps) int32 pairs) and calls body(most_steps, a, j, c, lb, n, at) for block j's n
// tasks from channel c's N-block lb (both 0 but for the run's first block), most_steps
// Int<KS> when the block takes more than one 32-input step (the same for the whole warp),
// else Int<1>. The run's first block's fragments and span are loaded before ready() (every
// thread calls it: the barrier the pass waits on), so those loads overlap the wait. W: the
// blocks' weights (WideWeights or NarrowWeights, whose blocks take one step), a its value.
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
    if (W::KS > 1 && steps > 1) {
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
// at a time (their loads and products interleave), in a loop compiled for the block's
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
#pragma unroll 1
      for (; k >= 2; k -= 2, l += 2 * in.step, o += 2 * out_step) tasks(Int<2>());
      if (k != 0) tasks(Int<1>());
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


// One MMA tile (a gray, RGB or RGBA image resized on both axes), from its record rec
// (enum Record): patches (gy0 .. gy0 + nph) x (gx0 .. gx0 + npw) of its canvas, computed
// whole (the rows and columns past the resized image get no weights, so they are the 0
// padding). Blocks are whole warps. Shared memory: the window planes (later the second
// pass's output planes) and the intermediate planes (the weights and spans come from global
// memory: load_weights). The first pass's lines are the window's rows (horizontal first) or
// columns (VFIRST: the window is staged transposed); it writes the intermediate with the
// other axis contiguous, so the second pass reads its lines the same way. The second pass
// writes bytes, row-major in both orders; the patches are written from them after a
// barrier, as units of 8 bytes (16 for fp32 where wide_units; an unresized tile's way), not
// by the lanes of the products.
// RGBA is premultiplied as it is staged (its alpha a fourth plane), and unpremultiplied and
// composited as the patches are written (with its descriptor, copied into d meanwhile).
// RAW (never with VFIRST or RGBA): the window is one plane of the source's rows, copied with
// cp.async, and the first pass reads them skewed (mma_pass_rgb for RGB).
template <int CH, bool VFIRST, bool RAW, typename T>
__device__ __forceinline__ void mma_tile(const u8* __restrict__ src, const i64* __restrict__ desc,
                                         const int* __restrict__ tab,
                                         const T* __restrict__ table, const int (&rec)[NR], i64* d,
                                         T* tb, T* __restrict__ out, int p, u8* sm) {
  const int tid = threadIdx.y * blockDim.x + threadIdx.x, nt = blockDim.x * blockDim.y;
  const int g = (tid & 31) >> 2, t = tid & 3;  // the lane's group and place in it
  const int nph = rec[R_TILE_H], npw = rec[R_TILE_W];  // its patches
  const int th = nph * p, tw = npw * p;
  const int my = (th + 15) >> 4, mx = (tw + 15) >> 4;  // M-blocks down and across
  // the tile column's and row's spans and fragments (_mma_axis), of which it uses mx and my
  const int* sx = tab + rec[R_X_SPANS];
  const int* sy = tab + rec[R_Y_SPANS];
  const int* fx = tab + rec[R_X_WORDS];
  const int* fy = tab + rec[R_Y_WORDS];
  // the image's normalise table into tb as 8-byte words, and for RGBA its descriptor into
  // d: loaded now, stored after the window's loads (the staging barrier covers them)
  constexpr int TW = (int)(NORM_STRIDE * sizeof(T) / 8);
  const u64* words = (const u64*)(table + rec[R_TABLE]);
  const u64 tw0 = tid < TW ? words[tid] : 0, tw1 = tid + nt < TW ? words[tid + nt] : 0;
  const i64* row = desc + (i64)rec[R_IMAGE] * NF;
  const i64 d0 = CH == 4 && tid < NF ? row[tid] : 0;
  const int flags = rec[R_FLAGS];
  const int ks = (flags & R_TWO_STEPS) ? MMA_KS : 1;  // the most steps of any wide block
  // whether each pass takes narrow blocks (8 outputs, one step, 16 lines an N-block)
  const bool narrow1 = flags & (VFIRST ? R_Y_NARROW : R_X_NARROW);
  const bool narrow2 = flags & (VFIRST ? R_X_NARROW : R_Y_NARROW);
  // the inputs the tile's taps use: only these are staged and passed. A product's last
  // step may read up to 32 ks bytes past them, into the next line or the slack after a
  // region; those inputs only ever meet weight 0
  const int uc = rec[R_USED_W], ur = rec[R_USED_H];
  // the first pass: its axis, outputs (16-aligned: m1 M-blocks) and lines (aligned to an
  // N-block's: 16 narrow, 8 wide); the second's outputs
  const int* f1 = VFIRST ? fy : fx;
  const int* s1 = VFIRST ? sy : sx;
  const int out1 = VFIRST ? th : tw, out2 = VFIRST ? tw : th, m1 = VFIRST ? my : mx;
  const int lines1 = narrow1 ? ((VFIRST ? uc : ur) + 15) & ~15 : ((VFIRST ? uc : ur) + 7) & ~7;
  // RAW: one plane of the source's rows as they are (a row's bytes from its first one's
  // 16-byte granule on: up to 12 bytes of skew before them), else a plane a channel
  const int wp = RAW ? mma_pitch(CH * uc + 12) : mma_pitch(VFIRST ? ur : uc);
  const int mp = mma_pitch(lines1);
  // a raw window's rows MMA_GROUP_SHIFT bytes further on each group of 8, where copy_rows
  // can (blocks of a multiple of 256 threads, as on the GPU; the host's are smaller too)
  const int shift = RAW && (nt & 255) == 0 ? MMA_GROUP_SHIFT : 0;
  const int win_plane = lines1 * wp + (lines1 >> 3) * shift;
  const int mid_plane = 16 * m1 * mp, slack = 32 * ks;
  // the second pass's bytes, a plane a channel of 16 my rows x op columns (all its M- and
  // N-blocks reach: op is at least tw rounded up to 16), where the window was
  const int op = mma_pitch(tw), out_plane = 16 * my * op;
  const int first = RAW ? max(win_plane, CH * out_plane) : CH * max(win_plane, out_plane);
  const int win_slack = RAW ? CH * slack + 16 : slack;  // a raw row's products reach further
  u8* win = sm;
  u8* ob = sm;
  u8* mid = win + first + win_slack;
  MMWIRE_SMEM_CHECK(first + win_slack + CH * mid_plane + slack);
  const int rb = rec[R_ROW_BYTES];
  const u8* s = src + (i64)(((u64)(unsigned)rec[R_SRC_HI] << 32) | (unsigned)rec[R_SRC_LO]);
  if constexpr (RAW) {
    // the rows as they are, with cp.async. They start on a word (R_RAW), so their skews in
    // the granule are 0, 4, 8 or 12, and the same every 8 rows.
    copy_rows(s, rb, ur, CH * uc, 12, win, wp, shift);
  } else {  // the window's rows and columns that the taps use
    const int groups = (uc + 3) >> 2;
    const int quads = VFIRST ? (ur + 3) >> 2 : ur;  // row groups of one work item
    const int total = quads * groups;
    const unsigned magic = 0xffffffffu / (unsigned)groups + 1u;  // i / groups: i * groups < 2^32
    auto row_of = [&](int i) { return groups == 1 ? i : (int)__umulhi((unsigned)i, magic); };
    if (uc < 4) {  // narrower than a word: pixel by pixel
      for (int i = tid; i < ur * uc; i += nt) {
        const int y = i / uc, c = i - y * uc;
        int v[4];
        load_px<CH>(s + (i64)y * rb + c * CH, true, v);  // (premultiplies only RGBA)
#pragma unroll
        for (int ch = 0; ch < CH; ++ch) {
          win[ch * win_plane + (VFIRST ? c * wp + y : y * wp + c)] = (u8)v[ch];
        }
      }
    } else if (VFIRST) {  // 4 rows x 4 columns a thread, transposed: a word a column
      for (int i = tid; i < total; i += nt) {
        const int q = row_of(i), c = 4 * (i - q * groups);
        unsigned w[4][CH];
#pragma unroll
        for (int e = 0; e < 4; ++e) {  // rows past the used ones repeat the last
          load_planes<CH>(s + (i64)min(4 * q + e, ur - 1) * rb, c, uc, w[e]);
        }
#pragma unroll
        for (int ch = 0; ch < CH; ++ch) {
          const unsigned rows[4] = {w[0][ch], w[1][ch], w[2][ch], w[3][ch]};
          unsigned cols[4];
          transpose4(rows, cols);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            *(unsigned*)(win + ch * win_plane + (c + e) * wp + 4 * q) = cols[e];
          }
        }
      }
    } else {  // MMA_STAGE_GROUPS groups of 4 pixels a step, loads first (past the window's
              // end, a group repeats the last one: the same bytes to the same place)
      auto stage = [&](auto whole) {
        for (int i = tid; i < total; i += MMA_STAGE_GROUPS * nt) {
          int y[MMA_STAGE_GROUPS], c[MMA_STAGE_GROUPS];
          unsigned w[MMA_STAGE_GROUPS][CH];
#pragma unroll
          for (int e = 0; e < MMA_STAGE_GROUPS; ++e) {
            const int at = min(i + e * nt, total - 1);
            y[e] = row_of(at);
            c[e] = 4 * (at - y[e] * groups);
            load_planes<CH, decltype(whole)::value == 1>(s + (i64)y[e] * rb, c[e], uc, w[e]);
          }
#pragma unroll
          for (int e = 0; e < MMA_STAGE_GROUPS; ++e) {
#pragma unroll
            for (int ch = 0; ch < CH; ++ch) {
              *(unsigned*)(win + ch * win_plane + y[e] * wp + c[e]) = w[e][ch];
            }
          }
        }
      };
      // rows that start on a word, and every group inside the image (not only the window):
      // plain word loads (the usual case away from an image's right edge; the host checks
      // the offsets, the source's start is checked here)
      if ((rec[R_FLAGS] & R_WHOLE) && ((unsigned long long)src & 3) == 0) {
        stage(Int<1>());
      } else {
        stage(Int<0>());
      }
    }
  }
  if (tid < TW) ((u64*)tb)[tid] = tw0;
  if (tid + nt < TW) ((u64*)tb)[tid + nt] = tw1;
#pragma unroll 1
  for (int i = tid + 2 * nt; i < TW; i += nt) ((u64*)tb)[i] = words[i];
  if constexpr (CH == 4) {
    if (tid < NF) d[tid] = d0;
    for (int i = tid + nt; i < NF; i += nt) d[i] = row[i];
  }
  // the passes, each compiled for narrow blocks and for wide blocks of one and of two
  // 32-input steps (fewer registers for one); each waits for its input with the barrier it
  // calls once its warp's first weights are on their way
  auto run = [&](auto pass, bool narrow) {
    if (narrow) {
      pass(NarrowWeights());
    } else if (ks == 1) {
      pass(WideWeights<1>());
    } else {
      pass(WideWeights<MMA_KS>());
    }
  };
  auto staged = [&] {
    if constexpr (RAW) copy_wait();  // this thread's copies have landed
    __syncthreads();  // the window, the block's normalise table (and RGBA's d) are in place
  };
  // the first pass: its outputs (M) times window lines of a channel (N) into the
  // intermediate, a line of the other axis per output
  run(
      [&](auto weights) {
        using W = decltype(weights);
        const int blocks = (out1 + W::OUTPUTS - 1) / W::OUTPUTS, lbs = lines1 / W::LINES;
        const LaneOut<W, true> o{mid, mp, g, t};
        auto mid_at = [&](int j) { return o.at(j); };
        auto to_mid = [&](u8* m, const int (&acc)[3][4]) { o.store(m, acc); };
        const int lg = lane_line<W>(g);
        if constexpr (RAW) {  // the lane's rows of the window (where copy_rows staged them)
          const StagedRows rows{wp, (unsigned)(u64)s, (unsigned)rb, shift};
          const u8* lines = rows.row(lg);
          // an N-block's rows on (whole groups of 8: W::LINES / 8 shifts, as LINES times
          // shift / 8), and a narrow block's second line
          const Lines in{lines, win_plane, W::LINES * (wp + shift / 8),
                         (int)(rows.row(lg + 1) - lines)};
          if constexpr (CH == 3) {
            mma_pass_rgb<W>(f1, s1, blocks, lbs, in, mid_plane, o.step(), staged, mid_at,
                            to_mid);
          } else {
            mma_pass<CH, W>(f1, s1, blocks, lbs, in, mid_plane, o.step(), staged, mid_at,
                            to_mid);
          }
        } else {
          mma_pass<CH, W>(f1, s1, blocks, lbs, Lines{win + lg * wp, win_plane, W::LINES * wp, wp},
                          mid_plane, o.step(), staged, mid_at, to_mid);
        }
      },
      narrow1);
  // the intermediate is in place, the window done with
  auto intermediate = [] { __syncthreads(); };
  run(
      [&](auto weights) {
        using W = decltype(weights);
        const Lines in2{mid + lane_line<W>(g) * mp, mid_plane, W::LINES * mp, mp};
        const int blocks = (out2 + W::OUTPUTS - 1) / W::OUTPUTS;
        const int lbs = (out1 + W::LINES - 1) / W::LINES;
        // vertical (!VFIRST): output rows (M) times columns of a channel (N), the tile's
        // rows its outputs; horizontal: output columns (M) times rows (N), its rows the lines
        const LaneOut<W, !VFIRST> o{ob, op, g, t};
        mma_pass<CH, W>(
            VFIRST ? fx : fy, VFIRST ? sx : sy, blocks, lbs, in2, out_plane, o.step(),
            intermediate, [&](int j) { return o.at(j); },
            [&](u8* m, const int (&acc)[3][4]) { o.store(m, acc); });
      },
      narrow2);
  __syncthreads();  // the tile's bytes are in place
  // through the normalise table into the patches, as an unresized tile (the rows and
  // columns past the resized image came out 0: the padding; RGBA is unpremultiplied and
  // composited first, inside the resized image only)
  T* o0 = out + (i64)rec[R_PATCH] * 3 * p * p;  // patch offsets are 32-bit
  const int pp = p * p, gw = rec[R_GRID_W];
  auto write_units = [&](auto unit, auto norm) {
    constexpr int U = decltype(unit)::value;
    using Norm = decltype(norm);
    for_each_unit<U>(p, nph, npw, gw, [&](const int (&ry)[U / 2], const int (&cx)[U / 2], int at) {
      typename Norm::V r[3][U];
#pragma unroll
      for (int run = 0; run < U / 2; ++run) {
        const u8* b = ob + ry[run] * op + cx[run];
        if constexpr (CH == 4) {
          unsigned pair[4];
#pragma unroll
          for (int c = 0; c < 4; ++c) pair[c] = *(const unsigned short*)(b + c * out_plane);
          const int y = rec[R_GY0] * p + ry[run], x = rec[R_GX0] * p + cx[run];
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            int v[4], rgb[3] = {0, 0, 0};
#pragma unroll
            for (int c = 0; c < 4; ++c) v[c] = (int)((pair[c] >> (8 * i)) & 255u);
            if (y < (int)d[OUT_H] && x + i < (int)d[OUT_W]) to_rgb<4>(d, y, x + i, v, rgb);
#pragma unroll
            for (int c = 0; c < 3; ++c) r[c][2 * run + i] = norm(c, rgb[c]);
          }
        } else {
#pragma unroll
          for (int c = 0; c < 3; ++c) {  // gray fills all three planes
            const unsigned pair = *(const unsigned short*)(b + (CH == 1 ? 0 : c * out_plane));
            r[c][2 * run] = norm.byte(c, pair, 0);
            r[c][2 * run + 1] = norm.byte(c, pair, 1);
          }
        }
      }
#pragma unroll
      for (int c = 0; c < 3; ++c) norm.template store<U>(o0 + at + c * pp, r[c]);
    });
  };
  with_norm(tb, [&](auto norm) __attribute__((always_inline)) {
    if (wide_units(out)) {
      write_units(Int<4>(), norm);
    } else {
      write_units(Int<UNIT_BYTES / sizeof(T)>(), norm);
    }
  });
}

// One unresized tile (a PLAIN or MIXED launch's; FLAT for MIXED's blocks: plain_runs) from
// its record rec (enum Record: its first pixel, the part of it inside the image, its
// patches): no window, nothing worked out from the descriptor, so the table's loads go out
// after one load and the pixels' right after the barrier (RGBA also copies its descriptor
// into d, for the composite). sm: the dynamic shared memory, where gray and RGB stage the
// tile's pixels as they are (copy_rows: all in flight at once, one wait) in rows of
// plain_pitch (the host's _plain_pitch) in fp32, and in every type in a mixed launch (FLAT),
// and write them as units of 8 bytes (16 for fp32 where wide_units); RGBA, and the 16-bit
// types in a plain launch, read the source, which measured faster for them
// (bench/results/20261201-plain-staging). Beside MMA blocks, three a multiprocessor, little
// L1 is left: there the 16-bit types' tiles read from the source made the mixed launch
// slower than two launches, and staged (with the host's larger MIXED_PLAIN_TILE) faster
// (bench/results/20261201-staged-plain).
template <int CH, bool FLAT, typename T>
__device__ __forceinline__ void plain_tile(const u8* __restrict__ src,
                                           const i64* __restrict__ desc,
                                           const T* __restrict__ table, const int (&rec)[NR],
                                           i64* d, T* tb, T* __restrict__ out, int p, u8* sm) {
  // the table and its header as 8-byte words
  block_copy((u64*)tb, (const u64*)(table + rec[R_TABLE]), (int)(NORM_STRIDE * sizeof(T) / 8));
  if constexpr (CH == 4) block_copy(d, desc + (i64)rec[R_IMAGE] * NF, NF);
  const int row = rec[R_ROW_BYTES], nph = rec[R_TILE_H], npw = rec[R_TILE_W];
  const int gw = rec[R_GRID_W], vh = rec[R_USED_H], vw = rec[R_USED_W];
  const int y0 = rec[R_GY0] * p, x0 = rec[R_GX0] * p;
  const u8* s0 = src + (i64)(((u64)(unsigned)rec[R_SRC_HI] << 32) | (unsigned)rec[R_SRC_LO]);
  T* o0 = out + (i64)rec[R_PATCH] * 3 * p * p;
  const SourceRows source{s0, row};
  constexpr bool STAGE = CH != 4 && (sizeof(T) == 4 || FLAT);
  const StagedRows staged{plain_pitch(npw * p * CH), (unsigned)(u64)s0, (unsigned)row};
  if constexpr (STAGE) {
    MMWIRE_SMEM_CHECK(vh * staged.pitch);
    copy_rows(s0, row, vh, vw * CH, 15, sm, staged.pitch);
    copy_wait();
  }
  __syncthreads();  // the block's normalise table (RGBA's d, and the staged pixels) in place
  with_norm(tb, [&](auto nm) __attribute__((always_inline)) {
    if constexpr (STAGE) {
      if ((p & 1) != 0) {
        plain_runs<CH, 1, FLAT>(staged, d, nm, o0, p, gw, nph, npw, vh, vw, y0, x0);
      } else if (sizeof(T) == 2 || wide_units(out)) {  // 16-bit: 8-byte units, as unstaged
        plain_units<CH, 4>(staged, d, nm, o0, p, gw, nph, npw, vh, vw, y0, x0);
      } else {
        plain_runs<CH, 2, FLAT>(staged, d, nm, o0, p, gw, nph, npw, vh, vw, y0, x0);
      }
    } else if ((p & 1) != 0) {
      plain_runs<CH, 1, FLAT>(source, d, nm, o0, p, gw, nph, npw, vh, vw, y0, x0);
    } else if constexpr (CH == 4) {
      plain_runs<CH, 2, FLAT>(source, d, nm, o0, p, gw, nph, npw, vh, vw, y0, x0);
    } else {
      plain_units<CH, UNIT_BYTES / sizeof(T)>(source, d, nm, o0, p, gw, nph, npw, vh, vw, y0,
                                              x0);
    }
  });
}

// One tile of one image: patches (gy0 .. gy0 + nph) x (gx0 .. gx0 + npw) of its canvas.
// sm: the dynamic shared memory, for the tile's window and intermediate when TILED. Every
// loop strides by the block's shape; the GPU's (p / 2, 256 / (p / 2)) blocks give each
// thread a pixel pair px, px + 1 of the patch rows it walks, so nothing is divided per
// pixel and each of the three planes gets one 2-value store.
template <int CH, typename T>
__device__ __forceinline__ void fused_tile(const u8* __restrict__ src, const u8* __restrict__ mid,
                                           const i64* d, const int* __restrict__ tab,
                                           const T* tb, T* __restrict__ out, int tile, int p,
                                           unsigned* sm) {
  const int tx = threadIdx.x, ty = threadIdx.y, bx = blockDim.x, by = blockDim.y;
  const int tiles_w = (int)d[TILES_W], tph = (int)d[TILE_PH], tpw = (int)d[TILE_PW];
  const int gw = (int)d[GRID_W];
  const int trow = tile / tiles_w;  // once per block
  const int gy0 = trow * tph, gx0 = (tile - trow * tiles_w) * tpw;
  const int nph = min(tph, (int)d[GRID_H] - gy0), npw = min(tpw, gw - gx0);
  const int out_h = (int)d[OUT_H], out_w = (int)d[OUT_W];
  const int y0 = gy0 * p, x0 = gx0 * p;
  const int vy1 = min(y0 + nph * p, out_h), vx1 = min(x0 + npw * p, out_w);
  const bool tiled = d[TILED] != 0 && vy1 > y0 && vx1 > x0;
  const int p1 = (int)d[PASS1], p2 = (int)d[PASS2];
  const i64 first_patch = d[ROW] + (i64)gy0 * gw + gx0;
  const int pp = p * p;
  // the tile's patches, V pixels of a patch row at a time (V = 2 when p is even; an odd p
  // goes pixel by pixel): resized(y, x, v) gives a canvas pixel inside the resized image;
  // the rest is padding (0 before normalising)
  auto write_runs = [&](auto run, auto resized) {
    constexpr int V = decltype(run)::value;
    for (PatchRow k(ty, by, p, npw); k.ky < nph; k.next(p, npw)) {
      T* o = out + (first_patch + (i64)k.ky * gw + k.kx) * 3 * pp + k.py * p;
      const int y = (gy0 + k.ky) * p + k.py;
      const int xp = (gx0 + k.kx) * p;
      for (int px = tx * V; px < p; px += bx * V) {
        T r[3][V];
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const int x = xp + px + i;
          int rgb[3] = {0, 0, 0};
          if (y < out_h && x < out_w) {
            int v[4];
            resized(y, x, v);
            to_rgb<CH>(d, y, x, v, rgb);
          }
#pragma unroll
          for (int c = 0; c < 3; ++c) r[c][i] = tb[256 * c + rgb[c]];
        }
#pragma unroll
        for (int c = 0; c < 3; ++c) store_run<V>(o + c * pp + px, r[c]);
      }
    }
  };
  auto write_tile = [&](auto resized) {
    if ((p & 1) == 0) {
      write_runs(Int<2>(), resized);
    } else {
      write_runs(Int<1>(), resized);
    }
  };
  if (!tiled) {  // global memory: the source, or resize_pass1's intermediate
    __syncthreads();  // the block's normalise table is in place
    write_tile([&](int y, int x, int v[4]) { resized_px<CH>(src, mid, d, tab, y, x, v); });
    return;
  }
  // offsets of the coefficient tables in tab (32-bit: fewer registers than pointers)
  const int x_min = (int)d[X_XMIN], x_n = (int)d[X_N], x_k = (int)d[X_K];
  const int y_min = (int)d[Y_XMIN], y_n = (int)d[Y_N], y_k = (int)d[Y_K];
  const int x_ks = (int)d[X_KSIZE], y_ks = (int)d[Y_KSIZE];
  // the final pass's source: fb, rows of fw packed pixels whose (0, 0) is the coordinate
  // (oy, ox) of the grid that pass reads (input or canvas, per axis)
  const unsigned* fb = sm;
  int oy = y0, ox = x0, fw = 1;
  {
    int wy0 = y0, wh = vy1 - y0, wx0 = x0, ww = vx1 - x0;  // the source window
    if (p1 == 2 || p2 == 2) {
      wy0 = tab[y_min + y0];
      wh = tab[y_min + vy1 - 1] + tab[y_n + vy1 - 1] - wy0;
    }
    if (p1 == 1 || p2 == 1) {
      wx0 = tab[x_min + x0];
      ww = tab[x_min + vx1 - 1] + tab[x_n + vx1 - 1] - wx0;
    }
    const int row = (int)d[IN_W] * CH;
    const u8* s = src + d[SRC_OFF] + (i64)wy0 * row + (i64)wx0 * CH;
    const bool premul = d[PREMUL] != 0;
    int v[4];
    for (int r = ty; r < wh; r += by) {
      stage_row<CH>(s + (i64)r * row, ww, premul, sm + r * ww, tx, bx);
    }
    oy = wy0;
    ox = wx0;
    fw = ww;
    if (p1 != 0) {
      __syncthreads();  // the window is in place
      unsigned* ms = sm + wh * ww;
      if (p1 == 1) {  // the window's rows through the horizontal pass, output columns x0..vx1
        const int mw = vx1 - x0;
        for (int r = ty; r < wh; r += by) {
          for (int c = tx; c < mw; c += bx) {
            const int x = x0 + c;
            packed_pass<CH>(sm + r * ww + (tab[x_min + x] - wx0), 1, tab + x_k + x * x_ks,
                            tab[x_n + x], v);
            ms[r * mw + c] = pack_px<CH>(v);
          }
        }
        ox = x0;
        fw = mw;
      } else {  // output rows y0..vy1 through the vertical pass, the window's columns
        for (int r = ty; r < vy1 - y0; r += by) {
          const int y = y0 + r;
          for (int c = tx; c < ww; c += bx) {
            packed_pass<CH>(sm + (tab[y_min + y] - wy0) * ww + c, ww, tab + y_k + y * y_ks,
                            tab[y_n + y], v);
            ms[r * ww + c] = pack_px<CH>(v);
          }
        }
        oy = y0;
      }
      fb = ms;
    }
  }
  __syncthreads();  // the final pass's source and the block's normalise table are in place
  // the final pass, one loop per kind (nothing is decided per pixel)
  if (p2 == 1) {
    write_tile([&](int y, int x, int v[4]) {
      packed_pass<CH>(fb + (y - oy) * fw + (tab[x_min + x] - ox), 1, tab + x_k + x * x_ks,
                      tab[x_n + x], v);
    });
  } else if (p2 == 2) {
    write_tile([&](int y, int x, int v[4]) {
      packed_pass<CH>(fb + (tab[y_min + y] - oy) * fw + (x - ox), fw, tab + y_k + y * y_ks,
                      tab[y_n + y], v);
    });
  } else {
    write_tile([&](int y, int x, int v[4]) { unpack_px<CH>(fb[(y - oy) * fw + (x - ox)], v); });
  }
}

// Programmatic dependent launch (compute capability 9.0; no-ops elsewhere): the host
// launches each fused launch of a call after its first with programmatic stream
// serialization (`overlapping`), so its blocks may start while the launch before it
// finishes (its last blocks leave multiprocessors idle), once every block of that launch
// has started and let it (let_next_launch_start). They may: the launches of a call write
// other patches and read nothing another writes (resize_pass1's intermediate is complete
// before the first starts). wait_for_previous_launch returns once the launch before has
// completed and its writes are visible.
__device__ __forceinline__ void let_next_launch_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_previous_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// A module compiled for one patch size (-DMMWIRE_PATCH=p, _launch._module) has it as a
// constant: its divisions by p and by a patch's units become multiplies and its plane
// offsets immediates. 0: the patch argument, any size.
#ifndef MMWIRE_PATCH
#define MMWIRE_PATCH 0
#endif

// The whole pixel pipeline (after resize_pass1 for images that are not TILED): resize,
// composite, zero pad, normalise and patchify into (sum patches, 3, p, p). Grid: one block
// per tile, one launch per channel count and kind (`tiles` names each tile's image, this
// launch's from first_tile; for MMA and PLAIN, `tiles` holds this launch's tile records,
// enum Record). KIND: GENERAL (any block shape, (p / 2, 256 / (p / 2))
// on the GPU for an even p, (p, 256 / p) for an odd one), PLAIN (unresized TILED images
// only: no resize code, no window), MMA (resized on both axes, either pass order, p
// even: the tensor-core passes; blocks of whole warps, (32, 8) on the GPU), MIXED (PLAIN and
// MMA tiles in one launch, as MMA's blocks; a record flagged R_PLAIN is a PLAIN tile, whose
// threads are then laid out by their index: plain_runs' FLAT). overlapping:
// 1 where the host launched this launch to overlap the call's launch before it (above).
// Dynamic shared memory: the largest TILED window plus intermediate of the launch (for
// PLAIN, the largest tile's pixels where they are staged: fp32 gray and RGB; none for the
// others; for MIXED the larger of its two kinds'). T is the output's bit pattern (32 or 16
// bits).
// Blocks have at most FUSED_THREADS threads; asking for a number of resident blocks a
// multiprocessor caps the registers, and the occupancy that buys matters more than the few
// values the compiler then keeps in local memory (the H200 A/B in bench/results). PLAIN has
// fewer registers, so more resident blocks hide its loads. MMA tiles of up to 71 KiB fit
// three blocks a multiprocessor (MMA_SMEM_BYTES), so they take the registers of three, and
// so do MIXED launches.
#define FUSED_THREADS 256
#define FUSED_MIN_BLOCKS 5
#define FUSED_PLAIN_MIN_BLOCKS 8
#define FUSED_MMA_MIN_BLOCKS 3
enum Kind { GENERAL = 0, PLAIN = 1, MMA = 2, MIXED = 3 };

// The resident blocks a multiprocessor a kind's launch asks for (its launch bounds).
__host__ __device__ constexpr int fused_min_blocks(int kind) {
  return kind == PLAIN     ? FUSED_PLAIN_MIN_BLOCKS
         : kind == GENERAL ? FUSED_MIN_BLOCKS
                           : FUSED_MMA_MIN_BLOCKS;
}

// The record of the block about a wave on (BLOCKS, the blocks a multiprocessor the launch's
// kind holds, fused_min_blocks: %nsmid times that many records on), fetched into L2 by one
// thread (compute capability 9.0; nothing elsewhere): a record is read once, by its own
// block as the first thing it does, so it came from HBM, and every warp of the block waited
// on it (4.6 % of the mixed batch's stall samples); the mixed batch about 1 µs faster in
// both types on the H200 (bench/results/20261202-session34). Two or four waves on were
// level with three, six slower (bench/results/20261202-session35). A fetch changes nothing
// but where the bytes are.
template <int BLOCKS>
__device__ __forceinline__ void prefetch_record_ahead(const int* tiles) {
#if !defined(MMWIRE_HOST_SHIM) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (threadIdx.x != 0 || threadIdx.y != 0) return;
  unsigned sms;
  asm("mov.u32 %0, %%nsmid;" : "=r"(sms));
  const unsigned long long next = blockIdx.x + BLOCKS * (unsigned long long)sms;
  if (next < gridDim.x) {  // (a record: NR words from a multiple of 16 bytes)
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(tiles + next * NR),
                 "n"(NR * 4)
                 : "memory");
  }
#endif
}

template <typename T, int CH, int KIND>
__global__ void __launch_bounds__(FUSED_THREADS, fused_min_blocks(KIND))
    fused(const u8* __restrict__ src, const u8* __restrict__ mid, const i64* __restrict__ desc,
          const int* __restrict__ tab, const T* __restrict__ table,
          const int* __restrict__ tiles, T* __restrict__ out, int patch, int first_tile,
          int overlapping) {
  const int p = MMWIRE_PATCH != 0 ? MMWIRE_PATCH : patch;
  __shared__ i64 d[NF];
  __shared__ __align__(8) T tb[NORM_STRIDE];
  let_next_launch_start();
  [&]() __attribute__((always_inline)) {  // the tile (inlined: nvcc made a call of it)
    if constexpr (KIND != GENERAL) {  // its record (five 16-byte loads)
      int rec[NR];
      const uint4* at = (const uint4*)tiles + (i64)blockIdx.x * (NR / 4);
#pragma unroll
      for (int i = 0; i < NR / 4; ++i) {
        const uint4 w = __ldg(at + i);
        rec[4 * i] = (int)w.x;
        rec[4 * i + 1] = (int)w.y;
        rec[4 * i + 2] = (int)w.z;
        rec[4 * i + 3] = (int)w.w;
      }
      // (plain launches too: the fp32 seed batch 0.1-0.5 µs faster in two A/B calls, level
      // in bf16 and in the bench; bench/results/20261202-session35)
      prefetch_record_ahead<fused_min_blocks(KIND)>(tiles);
      u8* sm = (u8*)dynamic_smem();
      if constexpr (KIND == PLAIN) {
        plain_tile<CH, false>(src, desc, table, rec, d, tb, out, p, sm);
      } else if (KIND == MIXED && (rec[R_FLAGS] & R_PLAIN)) {
        if constexpr (KIND == MIXED) plain_tile<CH, true>(src, desc, table, rec, d, tb, out, p, sm);
      } else if (rec[R_FLAGS] & R_V_FIRST) {  // then straight to staging
        mma_tile<CH, true, false, T>(src, desc, tab, table, rec, d, tb, out, p, sm);
      } else if (CH != 4 && (rec[R_FLAGS] & R_RAW) && ((u64)src & 3) == 0) {
        // (the test is always true: the host puts src on a word, which an RGB window's
        // split_rgb8 order needs. It stays for the code ptxas makes of it: without it the
        // resized batch was 0.5-1.0 µs slower; bench/results/20261202-session39)
        mma_tile<CH, false, CH != 4, T>(src, desc, tab, table, rec, d, tb, out, p, sm);
      } else {
        mma_tile<CH, false, false, T>(src, desc, tab, table, rec, d, tb, out, p, sm);
      }
      return;
    }
    const int t = first_tile + (int)blockIdx.x;
    block_copy(d, desc + (i64)tiles[t] * NF, NF);
    __syncthreads();
    const int tile = t - (int)d[TILE_START];
    // the table as 8-byte words (each image's starts at a multiple of NORM_STRIDE values)
    block_copy((u64*)tb, (const u64*)(table + d[TABLE]), (int)(NORM_VALUES * sizeof(T) / 8));
    fused_tile<CH, T>(src, mid, d, tab, tb, out, tile, p, dynamic_smem());
  }();
  // overlapping (the host launched this one to overlap the call's launch before it): the
  // last block ends only after that launch has, its patches visible, so whatever the stream
  // runs after this launch comes after that one too
  if (overlapping != 0 && blockIdx.x == gridDim.x - 1 && threadIdx.x == 0 && threadIdx.y == 0) {
    wait_for_previous_launch();
  }
}

#ifndef __CUDACC_RTC__
// nvcc (the CI compile check) instantiates what NVRTC gets through name expressions.
#define MMWIRE_FUSED(T, CH, KIND)                                                   \
  template __global__ void fused<T, CH, KIND>(const u8*, const u8*, const i64*, const int*, \
                                              const T*, const int*, T*, int, int, int);
#define MMWIRE_FUSED_ALL(T) \
  MMWIRE_FUSED(T, 1, 0)     \
  MMWIRE_FUSED(T, 3, 0)     \
  MMWIRE_FUSED(T, 4, 0)     \
  MMWIRE_FUSED(T, 1, 1)     \
  MMWIRE_FUSED(T, 3, 1)     \
  MMWIRE_FUSED(T, 4, 1)     \
  MMWIRE_FUSED(T, 1, 2)     \
  MMWIRE_FUSED(T, 3, 2)     \
  MMWIRE_FUSED(T, 4, 2)     \
  MMWIRE_FUSED(T, 1, 3)     \
  MMWIRE_FUSED(T, 3, 3)     \
  MMWIRE_FUSED(T, 4, 3)
MMWIRE_FUSED_ALL(unsigned int)
MMWIRE_FUSED_ALL(unsigned short)
#endif
