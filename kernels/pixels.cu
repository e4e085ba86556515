// mmwire pixel kernels: Pillow-exact BICUBIC resize and the fused resize / composite /
// pad / normalise / patchify of many images per launch.
//
// The sources, each with its own header comment:
//   abi.cuh      what the kernels share with the host (kernels/_abi.py, passed as -D flags)
//   resize.cuh   the resize passes pixel by pixel, premultiply, composite; resize_pass1/2
//   patches.cuh  loads, the normalise step and the stores of the patch layout
//   mma.cuh      the tensor-core resize (both passes as exact int8 products)
//   tiles.cuh    the fused kernel's MMA, plain and general tiles
//   pixels.cu    the fused entry point (this file)
// Exactness: every byte equals the CPU path (materialize, over kernels/reference.py, over
// Pillow) for every image size, channel count, background, patch size and output dtype;
// tests/test_kernels_host.py checks the host build with ==, and tests/test_gpu.py the GPU.
// Every image is described by one descriptor row (enum Field); resize_pass1 and
// resize_pass2 run one block row per image row, over all images of the launch, a block
// finding its image by binary search on a running start field. `fused` (compiled per
// output type, channel count and kind, one launch per pair present) runs one block per
// output tile of a few patches. Loops stride by the block's shape, so any block shape gives
// the same bytes (the GPU runs (p / 2, 256 / (p / 2)) for an even p, a thread per pixel
// pair; the host build a few threads per block).
#include "tiles.cuh"

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

// A module compiled for one patch size (MMWIRE_PATCH = p) has it as a constant: its
// divisions by p and by a patch's units become multiplies and its plane offsets
// immediates. MMWIRE_PATCH = 0: the patch argument, any size.

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
// Blocks have at most FUSED_THREADS threads; each kind's launch bounds ask for the
// resident blocks a multiprocessor the host sets (FUSED_*_MIN_BLOCKS, kernels/_abi.py),
// which caps its registers.

// The resident blocks a multiprocessor a kind's launch asks for (its launch bounds).
__host__ __device__ constexpr int fused_min_blocks(int kind) {
  return kind == PLAIN     ? FUSED_PLAIN_MIN_BLOCKS
         : kind == GENERAL ? FUSED_GENERAL_MIN_BLOCKS
         : kind == MMA     ? FUSED_MMA_MIN_BLOCKS
                           : FUSED_MIXED_MIN_BLOCKS;
}

// The record of the block about a wave on (BLOCKS, the blocks a multiprocessor the launch's
// kind holds, fused_min_blocks: %nsmid times that many records on), fetched into L2 by one
// thread (compute capability 9.0; nothing elsewhere): a record is read once, by its own
// block as the first thing it does, so it would come from HBM with every warp of the block
// waiting on it. A wave ahead is when that block starts. A fetch changes nothing but where
// the bytes are.
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
        // split_rgb8 order needs. It is kept because ptxas lays out the RAW branch's code
        // differently without it, and that layout runs the resized batches slower)
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
