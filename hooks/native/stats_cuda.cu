// The statistics row of a CUDA tensor (stats_cuda.h): hooks.triton_stats's row (numel, min, max, mean,
// std, l2, absmax, nan, inf, zeros over the finite values, then the sample), launched from C++ on the
// caller's stream, no host sync. Each block reads tiles of kTile elements (each thread kPer of them,
// coalesced): within a tile the count, sum and centred sum of squares in float32, merged across tiles
// by Chan's rule in float64; the sum of squares in float64 (squares of |x| > 1.8e19 overflow float32).
// A small tensor is read by one block that writes the row (one launch); a larger one by up to
// kMaxPrograms blocks whose partials a one-block launch merges. Every reduction has a fixed order
// (warp shuffles, then the warps in order; no atomics): the same tensor gives the same bits every run.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "stats_cuda.h"

namespace opband_cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kPer = 8;
constexpr int64_t kTile = kThreads * kPer;
constexpr int64_t kOneProgramTiles = 16;  // up to 32K elements: one launch (most of a decode step's tensors)
constexpr int64_t kMinTiles = 4;          // a block's least work when several are launched
constexpr int kMaxPrograms = 1024;
constexpr int kFields = 10;

struct Bool8 {
  uint8_t v;
};

template <typename T>
__device__ __forceinline__ float as_float(T v) {
  return static_cast<float>(v);
}
template <>
__device__ __forceinline__ float as_float<__half>(__half v) {
  return __half2float(v);
}
template <>
__device__ __forceinline__ float as_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float as_float<Bool8>(Bool8 b) {
  return b.v ? 1.0f : 0.0f;
}

struct Sum {
  template <typename V>
  __device__ V operator()(V a, V b) const { return a + b; }
};
struct Min {
  __device__ float operator()(float a, float b) const { return fminf(a, b); }
};
struct Max {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// The block's reduction of `v`, the same value in every thread: lane 0 of each warp after a shuffle tree,
// then the warps in order (a fixed order, so a fixed result).
template <typename V, typename Op>
__device__ V block_reduce(V v, Op op, V* shm) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  if ((threadIdx.x & 31) == 0) shm[threadIdx.x >> 5] = v;
  __syncthreads();
  V r = shm[0];
  for (int w = 1; w < kWarps; ++w) r = op(r, shm[w]);
  __syncthreads();  // shm is free for the next reduction
  return r;
}

struct Part {
  double cnt, mean, m2, sq, lo, hi, nans, infs, zeros;
};

struct Shared {
  float f[kWarps];
  double d[kWarps];
  long long i[kWarps];
};

// Tiles first .. first + tiles - 1 of x, folded (every thread returns the block's partials).
template <typename T>
__device__ Part fold(const T* __restrict__ x, int64_t n, int64_t first, int64_t tiles, Shared& shm) {
  double cnt = 0.0, mean = 0.0, m2 = 0.0;  // the block's, the same in every thread
  double sq = 0.0;                         // this thread's
  float lo = INFINITY, hi = -INFINITY;
  long long nans = 0, infs = 0, zeros = 0;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t base = (first + t) * kTile + threadIdx.x;
    float v[kPer];
    bool fin[kPer];
    float c = 0.0f, s = 0.0f;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int64_t off = base + static_cast<int64_t>(k) * kThreads;
      const bool inside = off < n;
      const float xv = inside ? as_float(x[off]) : 0.0f;
      const bool is_nan = xv != xv;
      const bool is_inf = fabsf(xv) == INFINITY;
      fin[k] = inside && !is_nan && !is_inf;
      v[k] = fin[k] ? xv : 0.0f;
      c += fin[k] ? 1.0f : 0.0f;
      s += v[k];
      sq += static_cast<double>(v[k]) * static_cast<double>(v[k]);
      if (fin[k]) {
        lo = fminf(lo, xv);
        hi = fmaxf(hi, xv);
      }
      nans += inside && is_nan;
      infs += inside && is_inf;
      zeros += inside && xv == 0.0f;
    }
    const float tile_c = block_reduce(c, Sum{}, shm.f);
    const float tile_mean = block_reduce(s, Sum{}, shm.f) / fmaxf(tile_c, 1.0f);
    float d2 = 0.0f;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const float d = fin[k] ? v[k] - tile_mean : 0.0f;
      d2 += d * d;
    }
    const float tile_m2 = block_reduce(d2, Sum{}, shm.f);
    const double c64 = tile_c;
    const double total = cnt + c64;
    const double delta = static_cast<double>(tile_mean) - mean;
    const double share = c64 / fmax(total, 1.0);
    mean = mean + delta * share;
    m2 = m2 + static_cast<double>(tile_m2) + delta * delta * cnt * share;
    cnt = total;
  }
  Part p;
  p.cnt = cnt;
  p.mean = mean;
  p.m2 = m2;
  p.sq = block_reduce(sq, Sum{}, shm.d);
  p.lo = block_reduce(lo, Min{}, shm.f);
  p.hi = block_reduce(hi, Max{}, shm.f);
  p.nans = static_cast<double>(block_reduce(nans, Sum{}, shm.i));
  p.infs = static_cast<double>(block_reduce(infs, Sum{}, shm.i));
  p.zeros = static_cast<double>(block_reduce(zeros, Sum{}, shm.i));
  return p;
}

// The row: numel, min, max, mean, std, l2, absmax, nan, inf, zeros, then the sample (zero-padded).
template <typename T>
__device__ void write_row(const Part& p, const T* __restrict__ x, int64_t n, const int64_t* __restrict__ idx,
                          int64_t picks, float* __restrict__ row, int size) {
  if (threadIdx.x == 0) {
    row[0] = static_cast<float>(n);
    row[1] = static_cast<float>(p.lo);
    row[2] = static_cast<float>(p.hi);
    row[3] = static_cast<float>(p.mean);
    row[4] = static_cast<float>(sqrt(p.m2 / fmax(p.cnt, 1.0)));
    row[5] = static_cast<float>(sqrt(p.sq));
    row[6] = static_cast<float>(fmax(-p.lo, p.hi));
    row[7] = static_cast<float>(p.nans);
    row[8] = static_cast<float>(p.infs);
    row[9] = static_cast<float>(p.zeros);
  }
  for (int s = threadIdx.x; s < size; s += kThreads) row[kFields + s] = s < picks ? as_float(x[idx[s]]) : 0.0f;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) one_program(const T* __restrict__ x, int64_t n, int64_t tiles,
                                                         const int64_t* __restrict__ idx, int64_t picks,
                                                         float* __restrict__ row, int size) {
  __shared__ Shared shm;
  const Part p = fold(x, n, 0, tiles, shm);
  write_row(p, x, n, idx, picks, row, size);
}

template <typename T>
__global__ void __launch_bounds__(kThreads) partials(const T* __restrict__ x, int64_t n, int64_t tiles,
                                                      double* __restrict__ out) {
  __shared__ Shared shm;
  const Part p = fold(x, n, static_cast<int64_t>(blockIdx.x) * tiles, tiles, shm);
  if (threadIdx.x == 0) {
    double* o = out + static_cast<int64_t>(blockIdx.x) * kParts;
    o[0] = p.cnt;
    o[1] = p.mean;
    o[2] = p.m2;
    o[3] = p.sq;
    o[4] = p.lo;
    o[5] = p.hi;
    o[6] = p.nans;
    o[7] = p.infs;
    o[8] = p.zeros;
  }
}

// The blocks' partials merged as hooks.triton_stats._merge does: count and mean first, then each
// block's centred sum of squares plus its count times its mean's squared distance from the mean.
template <typename T>
__global__ void __launch_bounds__(kThreads) merge(const double* __restrict__ part, int programs,
                                                   const T* __restrict__ x, int64_t n,
                                                   const int64_t* __restrict__ idx, int64_t picks,
                                                   float* __restrict__ row, int size) {
  __shared__ Shared shm;
  double c = 0.0, cm = 0.0;
  for (int i = threadIdx.x; i < programs; i += kThreads) {
    c += part[i * kParts];
    cm += part[i * kParts] * part[i * kParts + 1];
  }
  Part p;
  p.cnt = block_reduce(c, Sum{}, shm.d);
  p.mean = block_reduce(cm, Sum{}, shm.d) / fmax(p.cnt, 1.0);
  double m2 = 0.0, sq = 0.0, nans = 0.0, infs = 0.0, zeros = 0.0;
  float lo = INFINITY, hi = -INFINITY;
  for (int i = threadIdx.x; i < programs; i += kThreads) {
    const double* q = part + i * kParts;
    const double spread = q[1] - p.mean;
    m2 += q[2] + q[0] * spread * spread;
    sq += q[3];
    lo = fminf(lo, static_cast<float>(q[4]));
    hi = fmaxf(hi, static_cast<float>(q[5]));
    nans += q[6];
    infs += q[7];
    zeros += q[8];
  }
  p.m2 = block_reduce(m2, Sum{}, shm.d);
  p.sq = block_reduce(sq, Sum{}, shm.d);
  p.lo = block_reduce(lo, Min{}, shm.f);
  p.hi = block_reduce(hi, Max{}, shm.f);
  p.nans = block_reduce(nans, Sum{}, shm.d);
  p.infs = block_reduce(infs, Sum{}, shm.d);
  p.zeros = block_reduce(zeros, Sum{}, shm.d);
  write_row(p, x, n, idx, picks, row, size);
}

template <typename T>
const char* launch(const void* data, int64_t n, const int64_t* idx, int64_t picks, float* row, int size,
                   double* part, const Plan& plan, cudaStream_t stream) {
  const T* x = static_cast<const T*>(data);
  if (plan.programs == 1) {
    one_program<T><<<1, kThreads, 0, stream>>>(x, n, plan.tiles, idx, picks, row, size);
  } else {
    partials<T><<<plan.programs, kThreads, 0, stream>>>(x, n, plan.tiles, part);
    merge<T><<<1, kThreads, 0, stream>>>(part, plan.programs, x, n, idx, picks, row, size);
  }
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace

Plan plan(int64_t n) {
  const int64_t tiles = (n + kTile - 1) / kTile;
  if (tiles <= kOneProgramTiles) return {1, tiles};
  int64_t per = (tiles + kMaxPrograms - 1) / kMaxPrograms;
  if (per < kMinTiles) per = kMinTiles;
  return {static_cast<int>((tiles + per - 1) / per), per};
}

const char* stats_row(const void* x, int dtype, int64_t n, const int64_t* idx, int64_t picks, float* row, int size,
                      double* partials, const Plan& plan, void* stream) {
  auto s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case kF32: return launch<float>(x, n, idx, picks, row, size, partials, plan, s);
    case kF16: return launch<__half>(x, n, idx, picks, row, size, partials, plan, s);
    case kBF16: return launch<__nv_bfloat16>(x, n, idx, picks, row, size, partials, plan, s);
    case kI64: return launch<long long>(x, n, idx, picks, row, size, partials, plan, s);
    case kI32: return launch<int32_t>(x, n, idx, picks, row, size, partials, plan, s);
    case kI16: return launch<int16_t>(x, n, idx, picks, row, size, partials, plan, s);
    case kI8: return launch<int8_t>(x, n, idx, picks, row, size, partials, plan, s);
    case kU8: return launch<uint8_t>(x, n, idx, picks, row, size, partials, plan, s);
    case kBool: return launch<Bool8>(x, n, idx, picks, row, size, partials, plan, s);
    default: return "opband: no CUDA statistics kernel for this dtype";
  }
}

}  // namespace opband_cuda
