// mmwire pixel kernels: Pillow-exact BICUBIC resize and the fused
// resize / composite / pad / normalise / patchify of many images in one launch.
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
// kernels/_descriptors.py and checked by tests/test_kernels_host.py).
//   * resize_pass1 / resize_pass2 run one block row per image row (blockIdx.x, over all
//     images of the launch) and blockIdx.y * blockDim.x + threadIdx.x across it; a block
//     finds its image by binary search on a running start field.
//   * fused runs one block per output tile (a few patches) and reads its image from a
//     per-tile table. With two passes the tile's uint8 intermediate (its halo included)
//     lives in shared memory, so the whole pipeline is one launch and the intermediate
//     never reaches global memory; an image whose tile would not fit goes through the
//     global intermediate of resize_pass1 instead (TILED = 0). Its loops stride by the
//     block's shape, so any block shape gives the same bytes (the host build runs it with
//     a few threads per block).

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
  GRID_H = 32,        // patch rows of the canvas
  TILE_START = 33,    // first tile of this image among all tiles of the fused launch
  TILES_W = 34,       // tiles per canvas row
  TILED = 35,         // 1: two passes with the intermediate in shared memory (fused launch)
  NF = 36
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

// Channels of one pixel packed into a word (byte c = channel c), the intermediate's format.
template <int CH>
__device__ __forceinline__ unsigned pack_px(const int v[4]) {
  unsigned u = 0;
#pragma unroll
  for (int c = 0; c < CH; ++c) u |= (unsigned)v[c] << (8 * c);
  return u;
}

// One output sample of the last pass over packed words: n taps at m[t * step].
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
__device__ __forceinline__ unsigned* dynamic_smem() {
  extern __shared__ unsigned mmwire_smem[];
  return mmwire_smem;
}
#endif

// One tile of one image: patches (gy0 .. gy0 + nph) x (gx0 .. gx0 + npw) of its canvas.
// ms: the dynamic shared memory, which holds the tile's packed intermediate when TILED.
template <int CH, typename T>
__device__ __forceinline__ void fused_tile(const u8* __restrict__ src, const u8* __restrict__ mid,
                                           const i64* d, const int* __restrict__ tab,
                                           const T* tb, T* __restrict__ out, int tile, int tph,
                                           int tpw, int p, unsigned* ms) {
  const int tiles_w = (int)d[TILES_W], gw = (int)d[GRID_W], gh = (int)d[GRID_H];
  const int ty = tile / tiles_w;  // once per block
  const int gy0 = ty * tph, gx0 = (tile - ty * tiles_w) * tpw;
  const int nph = min(tph, gh - gy0), npw = min(tpw, gw - gx0);
  const int out_h = (int)d[OUT_H], out_w = (int)d[OUT_W];
  const int y0 = gy0 * p, x0 = gx0 * p;
  const int vy1 = min(y0 + nph * p, out_h), vx1 = min(x0 + npw * p, out_w);
  const bool tiled = d[TILED] != 0 && vy1 > y0 && vx1 > x0;
  const bool h_first = d[PASS1] == 1;
  int m0 = 0, mw = 1;  // the intermediate's first input row (h_first) or column, its width
  if (tiled) {
    const u8* s = src + d[SRC_OFF];
    const i64 row = d[IN_W] * CH;
    const bool premul = d[PREMUL] != 0;
    int v[4];
    if (h_first) {  // input rows m0.. through the horizontal pass, at output columns x0..vx1
      m0 = tab[d[Y_XMIN] + y0];
      const int rows = tab[d[Y_XMIN] + vy1 - 1] + tab[d[Y_N] + vy1 - 1] - m0;
      mw = vx1 - x0;
      for (int r = threadIdx.y; r < rows; r += blockDim.y) {
        for (int c = threadIdx.x; c < mw; c += blockDim.x) {
          const int x = x0 + c;
          pass_px<CH>(s + (i64)(m0 + r) * row, CH, premul, tab + d[X_K] + (i64)x * d[X_KSIZE],
                      tab[d[X_XMIN] + x], tab[d[X_N] + x], v);
          ms[r * mw + c] = pack_px<CH>(v);
        }
      }
    } else {  // output rows y0..vy1 through the vertical pass, at input columns m0..
      m0 = tab[d[X_XMIN] + x0];
      mw = tab[d[X_XMIN] + vx1 - 1] + tab[d[X_N] + vx1 - 1] - m0;
      for (int r = threadIdx.y; r < vy1 - y0; r += blockDim.y) {
        const int y = y0 + r;
        for (int c = threadIdx.x; c < mw; c += blockDim.x) {
          pass_px<CH>(s + (i64)(m0 + c) * CH, row, premul, tab + d[Y_K] + (i64)y * d[Y_KSIZE],
                      tab[d[Y_XMIN] + y], tab[d[Y_N] + y], v);
          ms[r * mw + c] = pack_px<CH>(v);
        }
      }
    }
  }
  __syncthreads();  // the intermediate and the block's normalise table are in place
  const int pp = p * p;
  for (int k = 0; k < nph * npw; ++k) {
    const int ky = k / npw;  // once per patch
    const int gy = gy0 + ky, gx = gx0 + k - ky * npw;
    T* o = out + (d[ROW] + (i64)gy * gw + gx) * 3 * pp;
    for (int py = threadIdx.y; py < p; py += blockDim.y) {
      const int y = gy * p + py;
      for (int px = threadIdx.x; px < p; px += blockDim.x) {
        const int x = gx * p + px;
        int rgb[3] = {0, 0, 0};
        if (y < out_h && x < out_w) {
          int v[4];
          if (!tiled) {
            resized_px<CH>(src, mid, d, tab, y, x, v);
          } else if (h_first) {
            packed_pass<CH>(ms + (tab[d[Y_XMIN] + y] - m0) * mw + (x - x0), mw,
                            tab + d[Y_K] + (i64)y * d[Y_KSIZE], tab[d[Y_N] + y], v);
          } else {
            packed_pass<CH>(ms + (y - y0) * mw + (tab[d[X_XMIN] + x] - m0), 1,
                            tab + d[X_K] + (i64)x * d[X_KSIZE], tab[d[X_N] + x], v);
          }
          to_rgb<CH>(d, y, x, v, rgb);
        }
        const int at = py * p + px;
        o[at] = tb[rgb[0]];
        o[pp + at] = tb[256 + rgb[1]];
        o[2 * pp + at] = tb[512 + rgb[2]];
      }
    }
  }
}

// The whole pixel pipeline after pass 1 (or all of it, for TILED images): resize, composite,
// zero pad, normalise and patchify into (sum patches, 3, p, p). Grid: one block per tile of
// tph x tpw patches (tile_image names each tile's image); any block shape, (p, p) on the GPU.
// Dynamic shared memory: the largest TILED intermediate of the launch, 4 bytes per pixel.
// T is the output's bit pattern (32 or 16 bits).
template <typename T>
__global__ void fused(const u8* __restrict__ src, const u8* __restrict__ mid,
                      const i64* __restrict__ desc, const int* __restrict__ tab,
                      const T* __restrict__ table, const int* __restrict__ tile_image,
                      T* __restrict__ out, int tph, int tpw, int p) {
  __shared__ i64 d[NF];
  __shared__ T tb[3 * 256];
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  const int nt = blockDim.x * blockDim.y;
  const i64 image = tile_image[blockIdx.x];
  for (int i = tid; i < NF; i += nt) d[i] = desc[image * NF + i];
  __syncthreads();
  for (int i = tid; i < 3 * 256; i += nt) tb[i] = table[d[TABLE] + i];
  const int tile = (int)(blockIdx.x - d[TILE_START]);
  unsigned* ms = dynamic_smem();
  switch (d[CH]) {
    case 1: fused_tile<1, T>(src, mid, d, tab, tb, out, tile, tph, tpw, p, ms); break;
    case 3: fused_tile<3, T>(src, mid, d, tab, tb, out, tile, tph, tpw, p, ms); break;
    default: fused_tile<4, T>(src, mid, d, tab, tb, out, tile, tph, tpw, p, ms); break;
  }
}

#ifndef __CUDACC_RTC__
// nvcc (the CI compile check) instantiates what NVRTC gets through name expressions.
template __global__ void fused<unsigned int>(const u8*, const u8*, const i64*, const int*,
                                             const unsigned int*, const int*, unsigned int*, int,
                                             int, int);
template __global__ void fused<unsigned short>(const u8*, const u8*, const i64*, const int*,
                                               const unsigned short*, const int*,
                                               unsigned short*, int, int, int);
#endif
