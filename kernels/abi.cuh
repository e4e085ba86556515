// What the kernels share with the host, and the integer types they use.
//
// Every value here comes from kernels/_abi.py as a -D flag (mmwire.kernels.compile_options:
// NVRTC, the CI's nvcc and the tests' host build all take them): the descriptor row's and
// the tile record's field orders (MMWIRE_FIELDS, MMWIRE_RECORD_FIELDS), the fused kernel's
// kinds (MMWIRE_KINDS), the records' flags (R_*), the normalise tables' layout (NORM_*), the
// MMA limits (MMA_*), the fused launch bounds (FUSED_*), the store units (*UNIT_BYTES) and
// the patch size a module is compiled for (MMWIRE_PATCH, 0 for any) and its output layout
// (MMWIRE_MERGE, MMWIRE_TEMPORAL: see patches.cuh). None is set here, so a
// build without them stops at the check below rather than disagreeing with the host.
#pragma once

#if !defined(MMWIRE_FIELDS) || !defined(MMWIRE_RECORD_FIELDS) || !defined(MMWIRE_KINDS) || \
    !defined(NORM_STRIDE) || !defined(MMA_KS) || !defined(FUSED_THREADS) ||                 \
    !defined(UNIT_BYTES) || !defined(MMWIRE_PATCH) || !defined(MMWIRE_MERGE) ||          \
    !defined(MMWIRE_TEMPORAL) || !defined(MMWIRE_TILE_H) || !defined(MMWIRE_TILE_W)
#error "compile the kernels with the flags of mmwire.kernels.compile_options()"
#endif

// (The enums' names come as MMWIRE_ENUM(A)MMWIRE_ENUM(B)..., numbered from 0 in order.)
#define MMWIRE_ENUM(name) name,

// One image's descriptor row: NF int64 fields (FIELDS in kernels/_abi.py says what each is).
enum Field { MMWIRE_FIELDS NF };

// An MMA or plain tile's record: NR int32 fields (RECORD_FIELDS), whole 16-byte loads.
enum Record { MMWIRE_RECORD_FIELDS NR };

// The fused kernel's kinds (its KIND template argument; KINDS).
enum Kind { MMWIRE_KINDS };

#undef MMWIRE_ENUM

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned char u8;
