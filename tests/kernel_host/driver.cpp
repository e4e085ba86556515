// The host build of kernels/pixels.cu (see shim.h), with C entry points for ctypes that
// run a whole launch: every block of the grid, every thread of the block, in order.
#include "shim.h"
#include PIXELS_CU

template <typename F>
static void run(const unsigned grid[2], const unsigned block[2], F kernel) {
  gridDim = {grid[0], grid[1], 1};
  blockDim = {block[0], block[1], 1};
  for (unsigned bx = 0; bx < grid[0]; ++bx)
    for (unsigned by = 0; by < grid[1]; ++by)
      for (unsigned ty = 0; ty < block[1]; ++ty)
        for (unsigned tx = 0; tx < block[0]; ++tx) {
          blockIdx = {bx, by, 0};
          threadIdx = {tx, ty, 0};
          kernel();
        }
}

extern "C" void host_pass1(const unsigned* grid, const unsigned* block, const u8* src, u8* mid,
                           const i64* desc, const int* tab, int n) {
  run(grid, block, [&] { resize_pass1(src, mid, desc, tab, n); });
}

extern "C" void host_pass2(const unsigned* grid, const unsigned* block, const u8* src,
                           const u8* mid, const i64* desc, const int* tab, u8* dst, int n) {
  run(grid, block, [&] { resize_pass2(src, mid, desc, tab, dst, n); });
}

extern "C" void host_finish_u32(const unsigned* grid, const unsigned* block, const u8* src,
                                const u8* mid, const i64* desc, const int* tab,
                                const unsigned int* table, unsigned int* out, int n) {
  run(grid, block, [&] { finish<unsigned int>(src, mid, desc, tab, table, out, n); });
}

extern "C" void host_finish_u16(const unsigned* grid, const unsigned* block, const u8* src,
                                const u8* mid, const i64* desc, const int* tab,
                                const unsigned short* table, unsigned short* out, int n) {
  run(grid, block, [&] { finish<unsigned short>(src, mid, desc, tab, table, out, n); });
}
