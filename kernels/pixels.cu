// mmwire pixel kernels: Pillow-exact BICUBIC resize and the fused
// composite / pad / normalise / patchify of many images in one launch.
//
// Exactness rules (see materialize/_bicubic.py and materialize/_pipeline.py, which these
// kernels must equal byte for byte):
//   * resize: Q22 int32 weights computed on the host exactly as Pillow does; per output
//     sample acc = 2^21 + sum(px * k), clamp(acc >> 22, 0, 255); a uint8 image between the
//     two passes; RGBA premultiplied on the first read and unpremultiplied at the end.
//   * background composite: float32, every operation rounded on its own (__fmul_rn /
//     __fadd_rn / __fdiv_rn, so nvcc cannot contract anything into an FMA).
//   * normalise: a per-channel 256-entry table of the output dtype, computed on the host by
//     the CPU path; the kernel copies its bit patterns (T is the storage type: 32 or 16 bits).
//
// Every image is described by one row of NF int64 fields (the order is mirrored in
// kernels/_descriptors.py and checked by tests/test_kernels_host.py). Launches are 2-D
// and need no index division: the resize passes run one block row per image row
// (blockIdx.x, over all images of the launch) and blockIdx.y * blockDim.x + threadIdx.x
// across it; the fused finish runs one block per output patch with threadIdx = (px, py).
// A block finds its image by binary search on a running start field, so images of
// different sizes share one launch; the channel count is a template argument.

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
  ROW = 31,           // output row of this image's first patch (rows of other items may sit between)
  NF = 32
};

typedef long long i64;
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

// One pixel's CH channels, premultiplied by alpha as Pillow's RGBA -> RGBa does.
template <int CH>
__device__ __forceinline__ void load_px(const u8* __restrict__ p, bool premul, int v[4]) {
#pragma unroll
  for (int c = 0; c < 4; ++c) v[c] = c < CH ? (int)p[c] : 0;
  if (CH == 4 && premul) {
#pragma unroll
    for (int c = 0; c < 3; ++c) {
      int t = v[c] * v[3] + 128;
      v[c] = ((t >> 8) + t) >> 8;
    }
  }
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

// Undo the premultiplication exactly as Pillow's RGBa -> RGBA (truncating division).
__device__ __forceinline__ void unpremultiply(const i64* __restrict__ d, int v[4]) {
  const int a = v[3];
  if (d[PREMUL] != 0 && a != 0 && a != 255) {
#pragma unroll
    for (int c = 0; c < 3; ++c) v[c] = min(255, (255 * v[c]) / a);
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

template <int CH>
__device__ __forceinline__ void canvas_rgb(const u8* __restrict__ src, const u8* __restrict__ mid,
                                           const i64* __restrict__ d, const int* __restrict__ tab,
                                           int y, int x, int rgb[3]) {
  int v[4];
  resized_px<CH>(src, mid, d, tab, y, x, v);
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

// The last pass fused with composite, zero pad, normalise and patchify into
// (sum patches, 3, p, p). Grid: one block per patch of the launch; block (p, p).
// T is the output's bit pattern (32 or 16 bits).
template <typename T>
__global__ void finish(const u8* __restrict__ src, const u8* __restrict__ mid,
                       const i64* __restrict__ desc, const int* __restrict__ tab,
                       const T* __restrict__ table, T* __restrict__ out, int n_images) {
  const int p = blockDim.x;
  const i64* d = find_image(desc, n_images, PATCH_START, blockIdx.x);
  const int pj = (int)(blockIdx.x - d[PATCH_START]);
  const int gw = (int)d[GRID_W];
  const int gy = pj / gw;  // once per block
  const int y = gy * p + threadIdx.y, x = (pj - gy * gw) * p + threadIdx.x;
  int rgb[3] = {0, 0, 0};
  if (y < d[OUT_H] && x < d[OUT_W]) {
    switch (d[CH]) {
      case 1: canvas_rgb<1>(src, mid, d, tab, y, x, rgb); break;
      case 3: canvas_rgb<3>(src, mid, d, tab, y, x, rgb); break;
      default: canvas_rgb<4>(src, mid, d, tab, y, x, rgb); break;
    }
  }
  const int pp = p * p;
  const T* tb = table + d[TABLE];
  T* o = out + (d[ROW] + pj) * 3 * pp + threadIdx.y * p + threadIdx.x;  // i64 offsets
  o[0] = tb[rgb[0]];
  o[pp] = tb[256 + rgb[1]];
  o[2 * pp] = tb[512 + rgb[2]];
}

#ifndef __CUDACC_RTC__
// nvcc (the CI compile check) instantiates what NVRTC gets through name expressions.
template __global__ void finish<unsigned int>(const u8*, const u8*, const i64*, const int*,
                                              const unsigned int*, unsigned int*, int);
template __global__ void finish<unsigned short>(const u8*, const u8*, const i64*, const int*,
                                                const unsigned short*, unsigned short*, int);
#endif
