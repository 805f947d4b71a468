// The statistics row of a CUDA tensor in one or two kernel launches, from C++ (hooks/native/stats_cuda.cu).
// Shared by the compiled observer and by hooks.tensors.device_stats (through hooks._observer.cuda_stats_row),
// so the observer's records and the dispatch mode's are the same bits. Plain CUDA: no torch header.
#pragma once

#include <cstdint>

namespace opband_cuda {

// The element types the kernel reads (each as float32, as hooks.triton_stats does).
enum Dtype : int { kF32 = 0, kF16, kBF16, kI64, kI32, kI16, kI8, kU8, kBool };

// How a tensor of `n` elements is read: by one block that writes the row itself (programs == 1), or by
// `programs` blocks of `tiles` tiles each, whose partials (kParts doubles per block) a second launch merges.
struct Plan {
  int programs;
  int64_t tiles;
};
constexpr int kParts = 9;  // count, mean, centred sum of squares, sum of squares, min, max, nan, inf, zeros

Plan plan(int64_t n);

// Launches the kernels on `stream` (a cudaStream_t) of the current device: the row at `row` (float32,
// 10 fields then `size` sampled values, zero past `picks`) of the `n` contiguous elements at `x`,
// sampled at the `picks` int64 flat indices at `idx`. `partials`: plan(n).programs * kParts doubles on the
// device when programs > 1 (else unused). Returns nullptr, or the CUDA error's text.
const char* stats_row(const void* x, int dtype, int64_t n, const int64_t* idx, int64_t picks, float* row, int size,
                      double* partials, const Plan& plan, void* stream);

}  // namespace opband_cuda
