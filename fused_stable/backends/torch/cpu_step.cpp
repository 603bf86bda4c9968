// The CPU step's norm pass as a compiled op (cpu_ops.py builds and loads this file with the rules' updates):
//   fused_stable::sum_squares    every grad read once: per-tensor sums of squares in fp64, one call for all tensors;
//   fused_stable::advance_steps  a compiled update's `step` counters advanced, and their values for its scalars.
// The update pass is cpu_update.h, one op per rule (fused_stable::update_<rule>, from rules/<rule>/cpu.h, in the
// translation units cpu_ops.py generates); together 4 + 28 = 32 bytes per fp32 parameter with AdamW, clipped or
// not (torch's CPU `_fused_adamw_` writes the scaled grads back when given `grad_scale`: 36), and two calls per
// step instead of five torch ops.
//
// Work is cut into fixed chunks of one tensor each, the same whatever the thread count, so the sums (and so
// the decisions) do not depend on it; at::parallel_for spreads the chunks over torch's threads.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "cpu_update.h"  // cut, Piece

namespace {

using fused_stable::cpu::cut;
using fused_stable::cpu::Piece;

constexpr int64_t kNormChunk = 1 << 16;  // elements per work item of the norm pass

constexpr int kLanes = 32;  // fp64 accumulators per piece
constexpr int kStreams = 4;  // pieces summed side by side

// The sum of squares of each of `count` <= kStreams pieces (data[s][0, n[s])) into out[s], side by side: kLanes
// fp64 accumulators per piece, each piece's elements added in a fixed order (lane k takes the elements k mod kLanes
// in turn, then the tail, then the lanes pairwise), so a piece's sum does not depend on its neighbours or on the
// thread count. Side by side because one piece at a time reads memory at half the rate (the fp64 arithmetic per
// byte leaves too few loads in flight; measured 6-8 GB/s against 13-15 GB/s for 4 pieces on one core).
template <typename T, int kCount>
void sums_of_squares(const T* const* data, const int64_t* n, double* out) {
  double lanes[kCount][kLanes] = {};
  int64_t shortest = n[0];
  for (int s = 1; s < kCount; ++s) {
    shortest = std::min(shortest, n[s]);
  }
  int64_t together = 0;
  for (; together + kLanes <= shortest; together += kLanes) {
    for (int s = 0; s < kCount; ++s) {
      for (int k = 0; k < kLanes; ++k) {
        const double x = static_cast<double>(static_cast<float>(data[s][together + k]));
        lanes[s][k] += x * x;
      }
    }
  }
  for (int s = 0; s < kCount; ++s) {  // each piece's own rest, in the same order
    int64_t i = together;
    for (; i + kLanes <= n[s]; i += kLanes) {
      for (int k = 0; k < kLanes; ++k) {
        const double x = static_cast<double>(static_cast<float>(data[s][i + k]));
        lanes[s][k] += x * x;
      }
    }
    for (int k = 0; i < n[s]; ++i, ++k) {
      const double x = static_cast<double>(static_cast<float>(data[s][i]));
      lanes[s][k] += x * x;
    }
    for (int width = kLanes / 2; width > 0; width /= 2) {  // pairwise
      for (int k = 0; k < width; ++k) {
        lanes[s][k] += lanes[s][k + width];
      }
    }
    out[s] = lanes[s][0];
  }
}

template <typename T>
void typed_sums(const std::vector<at::Tensor>& grads, const Piece* pieces, int count, double* out) {
  const T* data[kStreams];
  int64_t n[kStreams];
  for (int s = 0; s < count; ++s) {
    data[s] = grads[pieces[s].tensor].const_data_ptr<T>() + pieces[s].begin;
    n[s] = pieces[s].end - pieces[s].begin;
  }
  switch (count) {
    case 4:
      return sums_of_squares<T, 4>(data, n, out);
    case 3:
      return sums_of_squares<T, 3>(data, n, out);
    case 2:
      return sums_of_squares<T, 2>(data, n, out);
    default:
      return sums_of_squares<T, 1>(data, n, out);
  }
}

// The sums of squares of `count` <= kStreams pieces whose grads share one dtype
void piece_sums(const std::vector<at::Tensor>& grads, const Piece* pieces, int count, double* out) {
  switch (grads[pieces[0].tensor].scalar_type()) {
    case at::kFloat:
      return typed_sums<float>(grads, pieces, count, out);
    case at::kBFloat16:
      return typed_sums<c10::BFloat16>(grads, pieces, count, out);
    case at::kHalf:
      return typed_sums<c10::Half>(grads, pieces, count, out);
    default:
      TORCH_CHECK(false, "fused_stable::sum_squares: unsupported grad dtype ", grads[pieces[0].tensor].scalar_type());
  }
}

// Per-tensor sums of squares into `out` (fp32, one per grad) and their global sum in fp64 (the return value).
double sum_squares(at::TensorList grads, const at::Tensor& out) {
  const int64_t n = static_cast<int64_t>(grads.size());
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() == n,
              "fused_stable::sum_squares: out must be a contiguous fp32 tensor of one value per grad");
  std::vector<at::Tensor> dense(grads.begin(), grads.end());
  std::vector<int64_t> sizes(n);
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(dense[t].device().is_cpu(), "fused_stable::sum_squares: grads must be CPU tensors");
    if (!dense[t].is_contiguous()) {
      dense[t] = dense[t].contiguous();  // rare (a transposed grad): one copy, the sum is the same
    }
    sizes[t] = dense[t].numel();
  }
  const std::vector<Piece> pieces = cut(sizes, kNormChunk);
  std::vector<double> partial(pieces.size());
  at::parallel_for(0, static_cast<int64_t>(pieces.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t k = first; k < last;) {  // up to kStreams pieces of one grad dtype at a time
      const at::ScalarType dtype = dense[pieces[k].tensor].scalar_type();
      int count = 1;
      while (count < kStreams && k + count < last && dense[pieces[k + count].tensor].scalar_type() == dtype) {
        ++count;
      }
      piece_sums(dense, &pieces[k], count, &partial[k]);
      k += count;
    }
  });
  std::vector<double> per_tensor(n, 0.0);
  for (size_t k = 0; k < pieces.size(); ++k) {
    per_tensor[pieces[k].tensor] += partial[k];
  }
  float* sums = out.data_ptr<float>();
  double total = 0.0;
  for (int64_t t = 0; t < n; ++t) {
    sums[t] = static_cast<float>(per_tensor[t]);
    total += per_tensor[t];
  }
  return total;
}

// Each `step` counter (0-dim fp32) advanced by one, as torch's AdamW does before its bias corrections, and its new
// value into `values` (fp32, one per counter): one call for a compiled update's counters, where torch's
// _foreach_add_ takes ~1.7 us per 0-dim tensor on the CPU.
void advance_steps(at::TensorList steps, const at::Tensor& values) {
  const int64_t n = static_cast<int64_t>(steps.size());
  TORCH_CHECK(values.scalar_type() == at::kFloat && values.is_contiguous() && values.device().is_cpu() &&
                  values.numel() == n,
              "fused_stable::advance_steps: values must be a contiguous fp32 CPU tensor of one value per step");
  float* out = values.data_ptr<float>();
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(steps[t].scalar_type() == at::kFloat && steps[t].numel() == 1 && steps[t].device().is_cpu(),
                "fused_stable::advance_steps: each step must be a 0-dim fp32 CPU tensor");
    float* step = steps[t].data_ptr<float>();
    *step += 1.0f;
    out[t] = *step;
  }
}

}  // namespace

TORCH_LIBRARY(fused_stable, m) {
  m.def("sum_squares(Tensor[] grads, Tensor(a!) out) -> float", &sum_squares);
  m.def("advance_steps(Tensor(a!)[] steps, Tensor(b!) values) -> ()", &advance_steps);
}
