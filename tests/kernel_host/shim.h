// Lets kernels/pixels.cu compile as plain C++ so CI can run the kernels' own code on the
// CPU: driver.cpp runs every (block, thread) of a launch in turn, setting the built-in
// index variables below. Float operations are IEEE single precision (the build uses
// -ffp-contract=off), like the *_rn intrinsics.
#pragma once
#include <algorithm>
#include <cmath>

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict

struct mmwire_dim { unsigned x, y, z; };
static mmwire_dim blockIdx = {0, 0, 0}, threadIdx = {0, 0, 0};
static mmwire_dim blockDim = {1, 1, 1}, gridDim = {1, 1, 1};

using std::max;
using std::min;
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
