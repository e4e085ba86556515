// Writing patches: source loads, the normalise step, and the stores of the patch layout.
//
// What it computes: the output's rows of a tile's patches (PatchOrder, below: (3, p, p) or
// (3, T, p, p) a row, row-major or by merge window) from its pixels, read either
// from the source or from rows staged in shared memory (plain_runs, plain_units, which the
// plain tiles use and the MMA and general tiles reuse for their write-out); the word loads
// that read only bytes of the image (load_words, load_bytes, stage_row); the units a thread
// writes (Units, for_each_unit); one aligned store a run (store_run).
// Exactness rules: the normalise step is the host's (3, 256) table of the output's bit
// patterns, copied; or, for bf16 and fp16 where the host proved it equal on all 768 bytes
// (kernels/_affine.py), fma(v, a, b) in fp32 rounded once (AffineNorm, below). Padding is
// normalised zero, as the CPU path pads before normalising.
#pragma once
#include "resize.cuh"

#ifndef MMWIRE_HOST_SHIM
// Two words as one 8-byte store to global memory (p 8-aligned). Written as a uint2, nvcc
// split some of these into two 4-byte stores. Nothing in a launch reads what it stores, so
// the stores are marked streaming (st.global.cs: evict first from L2): the patches then
// leave L2 to the windows' sources, which neighbouring tiles share.
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
// 16-byte store a plane, fewer stores than pairs): only where `out` starts on 16 bytes,
// and then every patch does (3 p p fp32 values are 48 (p / 2)^2 bytes for an even p). The
// host guarantees 8 (UNIT_BYTES), so the rest go out as pairs.
template <typename T>
__device__ __forceinline__ bool wide_units(const T* out) {
  return sizeof(T) == 4 && ((unsigned long long)out & (WIDE_UNIT_BYTES - 1)) == 0;
}

// ---- The output layout: which row a patch goes to, and the planes of a row ----
// A module is compiled for one layout (kernels/_abi.py's OutputLayout, as MMWIRE_MERGE and
// MMWIRE_TEMPORAL). MMWIRE_MERGE 0 orders an image's patches row-major over its grid (Kimi);
// m > 0 orders them by m x m merge windows, the windows row-major and the patches row-major
// inside each (Qwen-VL, whose grids are multiples of m). A row holds each channel's plane
// MMWIRE_TEMPORAL times over: (3, T, p, p), the image repeated along the temporal axis (T = 1:
// Kimi's (3, p, p)). Every plane is p * p contiguous values either way, so the write-outs
// below store planes as they did; only a patch's row and its planes' offsets depend on it.
//
// MMWIRE_TILE_H and MMWIRE_TILE_W > 0 make rows whole tiles instead (PLANAR: Gemma 3's and
// InternVL's (3, TH, TW), T = 1): a canvas of whole tiles, tiles row-major, each row its
// tile's three planes of TH x TW values. A patch is then p lines of p values TW apart and a
// plane TH TW values, so the write-outs below take the lines and planes apart with
// line_values and plane_values; a unit of 2 or 4 values stays inside a line (the host
// plans PLANAR only where 4 divides p and TW).
constexpr int LAYOUT_MERGE = MMWIRE_MERGE;
constexpr int LAYOUT_T = MMWIRE_TEMPORAL;
constexpr int LAYOUT_TH = MMWIRE_TILE_H;
constexpr int LAYOUT_TW = MMWIRE_TILE_W;
constexpr bool PLANAR = LAYOUT_TW > 0;
// (the tile's sides where PLANAR; 1 otherwise, so the branches compiled out divide by no 0)
constexpr int PLANAR_TH = PLANAR ? LAYOUT_TH : 1, PLANAR_TW = PLANAR ? LAYOUT_TW : 1;

// Values in one output row.
__device__ __forceinline__ int row_values(int p) {
  return PLANAR ? 3 * LAYOUT_TH * LAYOUT_TW : 3 * LAYOUT_T * p * p;
}
// Values from one line of a patch to the next, and from one plane of a row to the next.
__device__ __forceinline__ int line_values(int p) { return PLANAR ? LAYOUT_TW : p; }
__device__ __forceinline__ int plane_values(int p) { return PLANAR ? LAYOUT_TH * LAYOUT_TW : p * p; }

// Where a tile's patches go: patch (gy, gx) of an image's grid (gw patches a row, p pixels
// a side) lies in row index(gy, gx) of the image's rows (PLANAR: the tile holding it);
// at(ky, kx) is the values from the first value of the tile's first patch (gy0, gx0),
// which is never after it in any order, to that of its patch (ky, kx); first() is the
// first value of patch (gy0, gx0) in its row (0 but for PLANAR).
struct PatchOrder {
  int gw, gy0, gx0, p;
  __device__ __forceinline__ int index(int gy, int gx) const {
    if constexpr (PLANAR) {
      const int tph = max(PLANAR_TH / p, 1), tpw = max(PLANAR_TW / p, 1);  // p divides them
      return (gy / tph) * (gw / tpw) + gx / tpw;
    } else if constexpr (LAYOUT_MERGE == 0) {
      return gy * gw + gx;
    } else {
      constexpr int m = LAYOUT_MERGE > 0 ? LAYOUT_MERGE : 1;  // (the branch is compiled for 0 too)
      return ((gy / m) * (gw / m) + gx / m) * (m * m) + (gy % m) * m + gx % m;
    }
  }
  // (PLANAR) patch (gy, gx)'s first value from its image's first row's
  __device__ __forceinline__ int planar(int gy, int gx) const {
    const int tph = max(PLANAR_TH / p, 1), tpw = max(PLANAR_TW / p, 1);
    const int ty = gy / tph, tx = gx / tpw;
    return (ty * (gw / tpw) + tx) * row_values(p) + (gy - ty * tph) * p * PLANAR_TW +
           (gx - tx * tpw) * p;
  }
  __device__ __forceinline__ int at(int ky, int kx) const {
    if constexpr (PLANAR) {
      return planar(gy0 + ky, gx0 + kx) - planar(gy0, gx0);
    } else if constexpr (LAYOUT_MERGE == 0) {
      return (ky * gw + kx) * row_values(p);
    } else {
      return (index(gy0 + ky, gx0 + kx) - index(gy0, gx0)) * row_values(p);
    }
  }
  __device__ __forceinline__ int first() const {
    if constexpr (PLANAR) {
      return planar(gy0, gx0) - index(gy0, gx0) * row_values(p);
    } else {
      return 0;
    }
  }
};

// The three planes' values r[c] of a run stored at o, an offset into a row's first plane:
// each plane LAYOUT_T times.
template <int N, typename Norm, typename T>
__device__ __forceinline__ void store_planes(const Norm& norm, T* __restrict__ o, int pp,
                                             const typename Norm::V (&r)[3][N]) {
#pragma unroll
  for (int c = 0; c < 3; ++c) {
#pragma unroll
    for (int t = 0; t < LAYOUT_T; ++t) norm.template store<N>(o + (c * LAYOUT_T + t) * pp, r[c]);
  }
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
// (NORM_* come from the host: kernels/_abi.py.)

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
// spread over the block's threads, and the rest of each 128-byte line is read soon after,
// so one fetch serves them.
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
// aligned store: UNIT_BYTES = 8 bytes, U = 2 for fp32 and 4 for the 16-bit types; or for
// fp32 U = 4, WIDE_UNIT_BYTES, where out allows it: wide_units), as
// U / 2 runs of a pixel pair of a patch row (a run never wraps a row).
// Units are counted without dividing: a thread's next is nt units on, nt / units patches
// and nt % units units. (for_each_unit, below, walks them so only where a patch plane has
// more units than the block has threads.)
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
  // The unit's first value in the tile's patches (32-bit, from its first patch's row).
  __device__ __forceinline__ int offset(int p, const PatchOrder& order) const {
    if constexpr (PLANAR) {  // the unit's line and column in its patch
      const int e = U * u, py = (int)__umulhi((unsigned)e, inv_p);
      return order.at(ky, kx) + py * LAYOUT_TW + e - py * p;
    } else {
      return order.at(ky, kx) + U * u;
    }
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
// patch's row (32-bit; where its patches go: order). Where a patch plane has no more units than the
// block has threads, the block takes `per` patches at a time, thread tid unit tid % units
// of patch tid / units (threads past per * units take none): the same unit of every patch
// it visits, so where its runs lie in a patch is worked out once and a move divides
// nothing. Else the Units walk.
template <int U, typename F>
__device__ __forceinline__ void for_each_unit(int p, int nph, int npw, const PatchOrder& order,
                                              F f) {
  const int tid = threadIdx.y * blockDim.x + threadIdx.x, nt = blockDim.x * blockDim.y;
  const int pp = p * p, units = pp / U;
  int ry[U / 2], cx[U / 2];
  if (units > nt) {
    for (Units<U> k(p, npw); k.ky < nph; k.next(npw)) {
#pragma unroll
      for (int run = 0; run < U / 2; ++run) k.run_at(run, p, ry[run], cx[run]);
      f(ry, cx, k.offset(p, order));
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
  const int in_plane = PLANAR ? py[0] * LAYOUT_TW + px[0] : U * u;  // the unit's first value
  while (ky < nph) {
#pragma unroll
    for (int run = 0; run < U / 2; ++run) {
      ry[run] = ky * p + py[run];
      cx[run] = kx * p + px[run];
    }
    f(ry, cx, order.at(ky, kx) + in_plane);
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
// launch's (32, 8) block) lays its threads out that way, by their index. order: where the
// tile's patches go, from o0.
template <int CH, int V, bool FLAT, typename Rows, typename Norm, typename T>
__device__ __forceinline__ void plain_runs(const Rows& rows, const i64* d, const Norm& norm,
                                           T* __restrict__ o0, int p, const PatchOrder& order,
                                           int nph, int npw, int vh, int vw, int y0, int x0) {
  int tx = threadIdx.x, ty = threadIdx.y, bx = blockDim.x, by = blockDim.y;
  if constexpr (FLAT) {
    const int tid = ty * bx + tx, nt = bx * by;
    bx = min((p + V - 1) / V, nt);
    by = div_small(nt, bx);
    ty = div_small(tid, bx);
    tx = tid - ty * bx;
    if (ty >= by) return;  // (the last phase of the tile: no barrier follows)
  }
  const int pp = plane_values(p);
  for (PatchRow k(ty, by, p, npw); k.ky < nph; k.next(p, npw)) {
    const int ry = k.ky * p + k.py, cx = k.kx * p;  // the row and first column in the tile
    T* o = o0 + (order.at(k.ky, k.kx) + k.py * line_values(p));
    const u8* s = rows.row(ry) + cx * CH;
    for (int px = tx * V; px < p; px += bx * V) {
      const int n = ry < vh ? min(V, vw - cx - px) : 0;  // pixels of the run in the image
      typename Norm::V r[3][V];
      run_values<CH, V, Rows::SHARED>(s + px * CH, n, d, y0 + ry, x0 + cx + px, norm, r, 0);
      store_planes<V>(norm, o + px, pp, r);
    }
  }
}

// The same for RGB and gray in the 16-bit types, and fp32's staged tiles where wide_units: a
// thread takes units (above) instead of a pixel pair of each patch row it walks, so each
// plane's four values go out in one store, of 8 or 16 bytes (fp32 from the source keeps
// the pairs, which suit its unstaged loads; RGBA too: its composite needs the registers).
template <int CH, int U, typename Rows, typename Norm, typename T>
__device__ __forceinline__ void plain_units(const Rows& rows, const i64* d, const Norm& norm,
                                            T* __restrict__ o0, int p, const PatchOrder& order,
                                            int nph, int npw, int vh, int vw, int y0, int x0) {
  const int pp = plane_values(p);
  // INSIDE: the whole tile lies in the image (no padding), so every run has both pixels and
  // the loop is compiled without the checks (most tiles; those at the canvas's right and
  // bottom edges take the general loop)
  auto units = [&](auto inside) {
    for_each_unit<U>(p, nph, npw, order, [&](const int (&ry)[U / 2], const int (&cx)[U / 2],
                                             int at) {
      typename Norm::V r[3][U];
#pragma unroll
      for (int run = 0; run < U / 2; ++run) {
        // the run's pixels in the image
        const int n = decltype(inside)::value ? 2 : ry[run] < vh ? min(2, vw - cx[run]) : 0;
        run_values<CH, 2, Rows::SHARED>(rows.row(ry[run]) + cx[run] * CH, n, d, y0 + ry[run],
                                        x0 + cx[run], norm, r, 2 * run);
      }
      store_planes<U>(norm, o0 + at, pp, r);
    });
  };
  if (vh == nph * p && vw == npw * p) {
    units(Int<1>());
  } else {
    units(Int<0>());
  }
}
