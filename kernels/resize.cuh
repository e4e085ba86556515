// Pillow's BICUBIC resize, pixel by pixel, and the pixel arithmetic every kernel shares.
//
// What it computes: the descriptor lookup (find_image), RGBA premultiply and unpremultiply,
// one output sample of a pass (pass_px, packed_pass), the composite of an RGBA pixel on
// its background (rgba_to_rgb), and the resize-only entry points resize_pass1 (source ->
// uint8 intermediate) and resize_pass2 (the last pass -> uint8 HWC, what Image.resize
// returns).
// Exactness rules (kernels/reference.py is the oracle, byte for byte):
//   * a pass: acc = 2^21 + sum(px * k) over the host's Q22 int32 weights, then
//     clamp(acc >> 22, 0, 255); a uint8 image between the two passes.
//   * RGBA: premultiplied as Pillow's RGBA -> RGBa on the first read ((t >> 8) + t) >> 8
//     with t = v a + 128), unpremultiplied by truncating division at the end.
//   * the composite: float32, each operation rounded on its own (__fmul_rn, __fadd_rn,
//     __fdiv_rn), so nothing contracts into an FMA, then floor.
#pragma once
#include "abi.cuh"

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
  const i64 row = staged ? d[MID_W] * CH : d[SRC_PITCH];
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
  const i64 row = d[SRC_PITCH];
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
