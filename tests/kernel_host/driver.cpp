// The host build of kernels/pixels.cu (see shim.h), with C entry points for ctypes.
#include "shim.h"
#include PIXELS_CU

extern "C" void finish_u32(const u8* src, const u8* mid, const i64* desc, const int* tab,
                           const unsigned int* table, unsigned int* out, int n, int p, int total) {
  finish<unsigned int>(src, mid, desc, tab, table, out, n, p, total);
}

extern "C" void finish_u16(const u8* src, const u8* mid, const i64* desc, const int* tab,
                           const unsigned short* table, unsigned short* out, int n, int p,
                           int total) {
  finish<unsigned short>(src, mid, desc, tab, table, out, n, p, total);
}
