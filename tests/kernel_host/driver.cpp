// The host build of kernels/pixels.cu (see shim.h), with C entry points for ctypes that
// run a whole launch: every block of the grid in order; the threads of a block in order,
// or (for the kernels with barriers) as fibers of this thread.
#include <sys/mman.h>
#include <ucontext.h>

#include <csetjmp>
#include <cstdlib>
#include <deque>
#include <vector>

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

// The fibers of a block: each a thread of the block with its own stack and the per-thread
// state the shim keeps in globals (threadIdx, blockIdx, pending cp.async copies), swapped
// in when the scheduler resumes it. A fiber starts with setcontext and then switches with
// _setjmp/_longjmp, which keep the signal mask alone: swapcontext's two system calls a
// switch were most of a barrier's cost (the build turns _FORTIFY_SOURCE off, whose
// longjmp check refuses a jump to another stack).
struct mmwire_fiber {
  ucontext_t context;
  jmp_buf jump;
  mmwire_dim thread, block;
  std::vector<std::pair<void*, const void*>> copies;
  bool started = false, done = false;
};
static jmp_buf mmwire_scheduler;
static mmwire_fiber* mmwire_running = nullptr;
static void* mmwire_kernel = nullptr;

static void mmwire_yield() {
  if (!_setjmp(mmwire_running->jump)) _longjmp(mmwire_scheduler, 1);
}

template <typename F>
[[noreturn]] static void mmwire_fiber_main() {
  (*static_cast<F*>(mmwire_kernel))();
  mmwire_running->done = true;
  _longjmp(mmwire_scheduler, 1);  // back to the scheduler; this stack is never resumed
}

// Every block in turn; its threads run as fibers that switch at each barrier.
template <typename F>
static void run_threads(const unsigned grid[2], const unsigned block[2], F kernel) {
  gridDim = {grid[0], grid[1], 1};
  blockDim = {block[0], block[1], 1};
  const unsigned n = block[0] * block[1];
  if (n == 0 || n > 1024) return;  // the Python side checks the shape
  mmwire_barrier barrier(n);
  mmwire_block_barrier = &barrier;
  // warps of 32 consecutive threads (the last one shorter) for the tensor-core emulation
  std::deque<mmwire_barrier> meets;
  for (unsigned i = 0; i < n; i += 32) meets.emplace_back(std::min(32u, n - i));
  std::vector<mmwire_warp> warps(meets.size());
  for (size_t i = 0; i < warps.size(); ++i) warps[i].meet = &meets[i];
  mmwire_warps = warps.data();
  mmwire_kernel = &kernel;
  constexpr size_t stack = 256 << 10;  // touched only as deep as a kernel goes
  void* stacks = mmap(nullptr, stack * n, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (stacks == MAP_FAILED) std::abort();
  std::vector<mmwire_fiber> fibers(n);
  for (unsigned bx = 0; bx < grid[0]; ++bx)
    for (unsigned by = 0; by < grid[1]; ++by) {
      for (unsigned k = 0; k < n; ++k) {
        mmwire_fiber& f = fibers[k];
        f.thread = {k % block[0], k / block[0], 0};
        f.block = {bx, by, 0};
        f.done = false;
        f.started = false;
        getcontext(&f.context);
        f.context.uc_stack.ss_sp = static_cast<char*>(stacks) + k * stack;
        f.context.uc_stack.ss_size = stack;
        f.context.uc_link = nullptr;
        makecontext(&f.context, mmwire_fiber_main<F>, 0);
      }
      for (unsigned left = n; left > 0;) {  // round robin until every thread returned
        for (mmwire_fiber& f : fibers) {
          if (f.done) continue;
          mmwire_running = &f;
          threadIdx = f.thread;
          blockIdx = f.block;
          std::swap(mmwire_copies, f.copies);
          if (!_setjmp(mmwire_scheduler)) {
            if (f.started) _longjmp(f.jump, 1);
            f.started = true;
            setcontext(&f.context);
          }
          std::swap(mmwire_copies, f.copies);
          left -= f.done;
        }
      }
    }
  munmap(stacks, stack * n);
  mmwire_running = nullptr;
  mmwire_block_barrier = nullptr;
  mmwire_warps = nullptr;
}

extern "C" void host_pass1(const unsigned* grid, const unsigned* block, const u8* src, u8* mid,
                           const i64* desc, const int* tab, int n) {
  run(grid, block, [&] { resize_pass1(src, mid, desc, tab, n); });
}

extern "C" void host_pass2(const unsigned* grid, const unsigned* block, const u8* src,
                           const u8* mid, const i64* desc, const int* tab, u8* dst, int n) {
  run(grid, block, [&] { resize_pass2(src, mid, desc, tab, dst, n); });
}

template <typename T>
static void fused_any(const unsigned* grid, const unsigned* block, const u8* src, const u8* mid,
                      const i64* desc, const int* tab, const T* table, const int* tiles, T* out,
                      int p, int first, int overlapping, int ch, int kind, unsigned smem) {
  mmwire_smem_asked = smem;
  run_threads(grid, block, [&] {
    auto launch = [&](auto kernel) {
      kernel(src, mid, desc, tab, table, tiles, out, p, first, overlapping);
    };
    if (ch == 1 && kind == GENERAL) launch(fused<T, 1, GENERAL>);
    if (ch == 3 && kind == GENERAL) launch(fused<T, 3, GENERAL>);
    if (ch == 4 && kind == GENERAL) launch(fused<T, 4, GENERAL>);
    if (ch == 1 && kind == PLAIN) launch(fused<T, 1, PLAIN>);
    if (ch == 3 && kind == PLAIN) launch(fused<T, 3, PLAIN>);
    if (ch == 4 && kind == PLAIN) launch(fused<T, 4, PLAIN>);
    if (ch == 1 && kind == MMA) launch(fused<T, 1, MMA>);
    if (ch == 3 && kind == MMA) launch(fused<T, 3, MMA>);
    if (ch == 4 && kind == MMA) launch(fused<T, 4, MMA>);
    if (ch == 1 && kind == MIXED) launch(fused<T, 1, MIXED>);
    if (ch == 3 && kind == MIXED) launch(fused<T, 3, MIXED>);
    if (ch == 4 && kind == MIXED) launch(fused<T, 4, MIXED>);
  });
}

extern "C" void host_fused_u32(const unsigned* grid, const unsigned* block, const u8* src,
                               const u8* mid, const i64* desc, const int* tab,
                               const unsigned int* table, const int* tiles, unsigned int* out,
                               int p, int first, int overlapping, int ch, int kind,
                               unsigned smem) {
  fused_any(grid, block, src, mid, desc, tab, table, tiles, out, p, first, overlapping, ch, kind,
            smem);
}

extern "C" void host_fused_u16(const unsigned* grid, const unsigned* block, const u8* src,
                               const u8* mid, const i64* desc, const int* tab,
                               const unsigned short* table, const int* tiles,
                               unsigned short* out, int p, int first, int overlapping, int ch,
                               int kind, unsigned smem) {
  fused_any(grid, block, src, mid, desc, tab, table, tiles, out, p, first, overlapping, ch, kind,
            smem);
}

// The kernels' row pitches, for the host's mirrors (_plain_pitch, _mma_pitch) to be checked.
extern "C" int host_plain_pitch(int bytes) { return plain_pitch(bytes); }
extern "C" int host_mma_pitch(int bytes) { return mma_pitch(bytes); }

// How many MMA tiles so far laid out more shared memory than their launch asked for.
extern "C" unsigned long host_smem_overflows() { return mmwire_smem_overflows; }

// How many 8- or 16-byte stores so far were off their size's alignment (a fault on the GPU).
extern "C" unsigned long host_misaligned_stores() { return mmwire_misaligned_stores; }
