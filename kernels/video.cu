// Video frames to Qwen-VL's pixel_values_videos, exactly as transformers computes them on
// the CPU: torch's antialiased bicubic resize of uint8 frames (separable, horizontal pass
// first into a uint8 intermediate, each pass a sum of int16 weights with a per-axis
// precision, rounded by adding half and shifting, clamped), then float32 (x - mean) / std,
// then rows of T consecutive frames (the last repeated to fill the final temporal patch)
// by merge window. The weight tables come from the host (mmwire.kernels._video).
//
// Frames are (n, H, W, 3) uint8, C-contiguous. All arithmetic is exact integer arithmetic
// except the normalisation, a float32 subtraction and a correctly rounded division.

// One axis of the resize: out[i] = clamp((2^(p-1) + sum_k in[lo[i] + k] * w[i][k]) >> p).
struct Axis {
  const int *lo;     // first input index of each output index
  const int *count;  // how many inputs each output index reads
  const int *w;      // weights, `taps` per output index (int16 values)
  int taps;
  int precision;
};

__device__ __forceinline__ unsigned char resample(const unsigned char *src, long stride,
                                                  const Axis &a, int i) {
  int acc = 1 << (a.precision - 1);
  const int *w = a.w + (long)i * a.taps;
  const unsigned char *s = src + (long)a.lo[i] * stride;
  const int n = a.count[i];
  for (int k = 0; k < n; ++k) acc += (int)s[(long)k * stride] * w[k];
  acc >>= a.precision;  // arithmetic: a negative sum floors, as the reference's srai does
  return (unsigned char)(acc < 0 ? 0 : (acc > 255 ? 255 : acc));
}

// The vertical pass (when the height changes), the normalisation and the rows, one thread
// per output value. `src` is (n, H1, W2, 3): the horizontal pass's output, or the frames.
template <typename T>
__device__ void video_rows(const unsigned char *src, T *out, int frames, int height1,
                           int height2, int width2, int patch, int merge, int temporal,
                           int grid_h, int grid_w, long values, int vertical,
                           const int *lo, const int *count, const int *w, int taps,
                           int precision, float m0, float m1, float m2, float s0, float s1,
                           float s2) {
  const long v = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (v >= values) return;
  const int row_len = 3 * temporal * patch * patch;
  const long r = v / row_len;
  int j = (int)(v % row_len);
  const int px = j % patch;
  j /= patch;
  const int py = j % patch;
  j /= patch;
  const int tt = j % temporal;
  const int c = j / temporal;
  // row r = (((t * gh/m + bh) * gw/m + bw) * m + mh) * m + mw
  long q = r;
  const int mw = (int)(q % merge);
  q /= merge;
  const int mh = (int)(q % merge);
  q /= merge;
  const int bw = (int)(q % (grid_w / merge));
  q /= grid_w / merge;
  const int bh = (int)(q % (grid_h / merge));
  const int t = (int)(q / (grid_h / merge));
  int f = t * temporal + tt;
  if (f >= frames) f = frames - 1;  // the last frame fills the final temporal patch
  const int y = (bh * merge + mh) * patch + py;
  const int x = (bw * merge + mw) * patch + px;
  const unsigned char *col = src + ((long)f * height1 * width2 + x) * 3 + c;
  unsigned char u;
  if (vertical) {
    const Axis a{lo, count, w, taps, precision};
    u = resample(col, (long)width2 * 3, a, y);
  } else {
    u = col[(long)y * width2 * 3];
  }
  const float mean = c == 0 ? m0 : (c == 1 ? m1 : m2);
  const float std = c == 0 ? s0 : (c == 1 ? s1 : s2);
  const float value = ((float)u - mean) / std;
  if constexpr (sizeof(T) == 4) {
    out[v] = value;
  } else {  // bfloat16, rounded to nearest even from the float32 value
    const unsigned int bits = __float_as_uint(value);
    out[v] = (T)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  }
}

extern "C" {

// The horizontal pass: (n, H, W, 3) -> (n, H, W2, 3), one thread per output pixel.
__global__ void video_horizontal(const unsigned char *in, unsigned char *out, int rows,
                                 int width, int width2, const int *lo, const int *count,
                                 const int *w, int taps, int precision) {
  const long pixel = (long)blockIdx.x * blockDim.x + threadIdx.x;
  if (pixel >= (long)rows * width2) return;
  const long row = pixel / width2;
  const int x = (int)(pixel % width2);
  const Axis a{lo, count, w, taps, precision};
  const unsigned char *src = in + row * width * 3;
  unsigned char *dst = out + pixel * 3;
  for (int c = 0; c < 3; ++c) dst[c] = resample(src + c, 3, a, x);
}

__global__ void video_rows_f32(const unsigned char *src, float *out, int frames, int height1,
                               int height2, int width2, int patch, int merge, int temporal,
                               int grid_h, int grid_w, long values, int vertical,
                               const int *lo, const int *count, const int *w, int taps,
                               int precision, float m0, float m1, float m2, float s0,
                               float s1, float s2) {
  video_rows<float>(src, out, frames, height1, height2, width2, patch, merge, temporal,
                    grid_h, grid_w, values, vertical, lo, count, w, taps, precision, m0, m1,
                    m2, s0, s1, s2);
}

__global__ void video_rows_bf16(const unsigned char *src, unsigned short *out, int frames,
                                int height1, int height2, int width2, int patch, int merge,
                                int temporal, int grid_h, int grid_w, long values,
                                int vertical, const int *lo, const int *count, const int *w,
                                int taps, int precision, float m0, float m1, float m2,
                                float s0, float s1, float s2) {
  video_rows<unsigned short>(src, out, frames, height1, height2, width2, patch, merge,
                             temporal, grid_h, grid_w, values, vertical, lo, count, w, taps,
                             precision, m0, m1, m2, s0, s1, s2);
}

}  // extern "C"
