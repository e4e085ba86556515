// The fused kernel's three ways through a tile: MMA tiles (resized on both axes, the
// passes on the tensor cores), plain tiles (unresized: straight to the write-out), and
// general tiles (any resize, the passes scalar in shared memory or from global memory).
//
// What it computes: for one tile of the canvas, resize, composite, zero pad, normalise and
// patchify into its patches of (patches, 3, p, p).
// Exactness rules: those of resize.cuh for the passes and composite and patches.cuh for
// the normalise step; every tile computes its pixels from the same descriptor, so tile
// shapes and block shapes never change a byte.
#pragma once
#include "mma.cuh"

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
  // the most steps of any wide block: 1, 2, or 3 (R_THREE_STEPS, in modules of MMA_KS 3)
  const int ks = (MMA_KS > 2 && (flags & R_THREE_STEPS)) ? 3 : (flags & R_TWO_STEPS) ? 2 : 1;
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
  // the passes, each compiled for narrow blocks and for wide blocks of one, two and (where
  // MMA_KS is 3) three 32-input steps (fewer registers for fewer); each waits for its input
  // with the barrier it calls once its warp's first weights are on their way
  auto run = [&](auto pass, bool narrow) {
    if (narrow) {
      pass(NarrowWeights());
    } else if (ks == 1) {
      pass(WideWeights<1>());
    } else {
      if constexpr (MMA_KS > 2) {
        if (ks > 2) {
          pass(WideWeights<MMA_KS>());
          return;
        }
      }
      pass(WideWeights<2>());
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
            // (never three steps: _mma_raw stages such an RGB image as planes, since
            // rgb_products' three channels of three steps would spill registers)
            if constexpr (W::KS <= 2) {
              mma_pass_rgb<W>(f1, s1, blocks, lbs, in, mid_plane, o.step(), staged, mid_at,
                              to_mid);
            }
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
  const PatchOrder order{rec[R_GRID_W], rec[R_GY0], rec[R_GX0], p};
  T* o0 = out + (i64)rec[R_PATCH] * row_values(p) + order.first();  // patch offsets: 32-bit
  const int pp = plane_values(p);
  auto write_units = [&](auto unit, auto norm) {
    constexpr int U = decltype(unit)::value;
    using Norm = decltype(norm);
    for_each_unit<U>(p, nph, npw, order, [&](const int (&ry)[U / 2], const int (&cx)[U / 2],
                                             int at) {
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
      store_planes<U>(norm, o0 + at, pp, r);
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
// types in a plain launch, read the source, where L1 serves their narrower loads. Beside
// MMA blocks, three a multiprocessor, little L1 is left, so there every type stages (with
// the host's larger MIXED_PLAIN_TILE).
template <int CH, bool FLAT, typename T>
__device__ __forceinline__ void plain_tile(const u8* __restrict__ src,
                                           const i64* __restrict__ desc,
                                           const T* __restrict__ table, const int (&rec)[NR],
                                           i64* d, T* tb, T* __restrict__ out, int p, u8* sm) {
  // the table and its header as 8-byte words
  block_copy((u64*)tb, (const u64*)(table + rec[R_TABLE]), (int)(NORM_STRIDE * sizeof(T) / 8));
  if constexpr (CH == 4) block_copy(d, desc + (i64)rec[R_IMAGE] * NF, NF);
  const int row = rec[R_ROW_BYTES], nph = rec[R_TILE_H], npw = rec[R_TILE_W];
  const int vh = rec[R_USED_H], vw = rec[R_USED_W];
  const int y0 = rec[R_GY0] * p, x0 = rec[R_GX0] * p;
  const PatchOrder order{rec[R_GRID_W], rec[R_GY0], rec[R_GX0], p};  // where its patches go
  const u8* s0 = src + (i64)(((u64)(unsigned)rec[R_SRC_HI] << 32) | (unsigned)rec[R_SRC_LO]);
  T* o0 = out + (i64)rec[R_PATCH] * row_values(p) + order.first();
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
        plain_runs<CH, 1, FLAT>(staged, d, nm, o0, p, order, nph, npw, vh, vw, y0, x0);
      } else if (sizeof(T) == 2 || wide_units(out)) {  // 16-bit: 8-byte units, as unstaged
        plain_units<CH, 4>(staged, d, nm, o0, p, order, nph, npw, vh, vw, y0, x0);
      } else {
        plain_runs<CH, 2, FLAT>(staged, d, nm, o0, p, order, nph, npw, vh, vw, y0, x0);
      }
    } else if ((p & 1) != 0) {
      plain_runs<CH, 1, FLAT>(source, d, nm, o0, p, order, nph, npw, vh, vw, y0, x0);
    } else if constexpr (CH == 4) {
      plain_runs<CH, 2, FLAT>(source, d, nm, o0, p, order, nph, npw, vh, vw, y0, x0);
    } else {
      plain_units<CH, UNIT_BYTES / sizeof(T)>(source, d, nm, o0, p, order, nph, npw, vh, vw, y0,
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
  const PatchOrder order{gw, gy0, gx0, p};
  T* const o0 = out + (d[ROW] + order.index(gy0, gx0)) * row_values(p) + order.first();
  const int pp = plane_values(p);
  // the tile's patches, V pixels of a patch row at a time (V = 2 when p is even; an odd p
  // goes pixel by pixel): resized(y, x, v) gives a canvas pixel inside the resized image;
  // the rest is padding (0 before normalising)
  auto write_runs = [&](auto run, auto resized) {
    constexpr int V = decltype(run)::value;
    for (PatchRow k(ty, by, p, npw); k.ky < nph; k.next(p, npw)) {
      T* o = o0 + order.at(k.ky, k.kx) + k.py * line_values(p);
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
        for (int c = 0; c < 3; ++c) {
#pragma unroll
          for (int t = 0; t < LAYOUT_T; ++t) store_run<V>(o + (c * LAYOUT_T + t) * pp + px, r[c]);
        }
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
    const int row = (int)d[SRC_PITCH];
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
