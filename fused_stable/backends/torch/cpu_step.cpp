// The CPU step's two passes over memory as compiled ops (cpu_ops.py builds and loads this file):
//   fused_stable::sum_squares  every grad read once: per-tensor sums of squares in fp64, one call for all tensors;
//   fused_stable::adamw        AdamW that reads each grad times the step's multiplier (clip coefficient / loss
//                              scale) and never writes it back, and advances the `step` counters itself; fp32,
//                              bf16 or fp16 params (with or without fp32 master copies), fp32 moments.
// Together 4 + 28 = 32 bytes per fp32 parameter, clipped or not (torch's CPU `_fused_adamw_` writes the scaled
// grads back when given `grad_scale`: 36), and two calls per step instead of five torch ops; 2 + 22 = 24 for bf16
// params (32 with a master copy), where torch's ops copy the params and grads to fp32 and back.
//
// Work is cut into fixed chunks of one tensor each, the same whatever the thread count, so the sums (and so
// the decisions) do not depend on it; at::parallel_for spreads the chunks over torch's threads.
// The per-element math and the step's scalars are the rule's (fused_stable/rules/adamw/cpu.h, beside the
// kernels' triton.py): IEEE fp32 with no contraction (built with -ffp-contract=off), in the order of the
// kernels' update; the scalars computed in fp64 as torch's AdamW computes them, then rounded to fp32.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "adamw/cpu.h"  // fused_stable/rules/ is on the include path (cpu_ops.py)

namespace {

constexpr int64_t kNormChunk = 1 << 16;   // elements per work item of the norm pass
constexpr int64_t kUpdateChunk = 1 << 16; // of the update (5 streams of 256 KiB: a chunk stays in L2)

struct Piece {
  int64_t tensor, begin, end;
};

std::vector<Piece> cut(const std::vector<int64_t>& sizes, int64_t chunk) {
  std::vector<Piece> pieces;
  for (int64_t t = 0; t < static_cast<int64_t>(sizes.size()); ++t) {
    for (int64_t begin = 0; begin < sizes[t]; begin += chunk) {
      pieces.push_back({t, begin, std::min(sizes[t], begin + chunk)});
    }
  }
  return pieces;
}

template <typename T>
double sum_of_squares(const T* data, int64_t begin, int64_t end) {
  // kLanes fp64 accumulators: the compiler vectorises the loop (enough independent additions to hide their
  // latency), and the order of the additions is fixed
  constexpr int kLanes = 32;
  double lanes[kLanes] = {};
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    for (int k = 0; k < kLanes; ++k) {
      const double x = static_cast<double>(static_cast<float>(data[i + k]));
      lanes[k] += x * x;
    }
  }
  for (int k = 0; i < end; ++i, ++k) {
    const double x = static_cast<double>(static_cast<float>(data[i]));
    lanes[k] += x * x;
  }
  for (int width = kLanes / 2; width > 0; width /= 2) {  // pairwise
    for (int k = 0; k < width; ++k) {
      lanes[k] += lanes[k + width];
    }
  }
  return lanes[0];
}

double piece_sum(const at::Tensor& grad, const Piece& piece) {
  switch (grad.scalar_type()) {
    case at::kFloat:
      return sum_of_squares(grad.const_data_ptr<float>(), piece.begin, piece.end);
    case at::kBFloat16:
      return sum_of_squares(grad.const_data_ptr<c10::BFloat16>(), piece.begin, piece.end);
    case at::kHalf:
      return sum_of_squares(grad.const_data_ptr<c10::Half>(), piece.begin, piece.end);
    default:
      TORCH_CHECK(false, "fused_stable::sum_squares: unsupported grad dtype ", grad.scalar_type());
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
    for (int64_t k = first; k < last; ++k) {
      partial[k] = piece_sum(dense[pieces[k].tensor], pieces[k]);
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

using fused_stable::adamw::StepScalars;

// One chunk of one tensor. P is the param's (and grad's) dtype: fp32, or bf16 / fp16 read as fp32 and stored
// rounded to nearest even; with kMaster the fp32 master copy is the value updated and the param its rounding.
template <typename P, bool kAmsgrad, bool kMaster>
void update_piece(P* __restrict param, const P* __restrict grad, float* __restrict master, float* __restrict exp_avg,
                  float* __restrict exp_avg_sq, float* __restrict max_exp_avg_sq, const StepScalars& s, int64_t begin,
                  int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    float p = kMaster ? master[i] : static_cast<float>(param[i]);
    float m = exp_avg[i], v = exp_avg_sq[i];
    float v_max = kAmsgrad ? max_exp_avg_sq[i] : 0.0f;
    fused_stable::adamw::adamw_element<kAmsgrad>(p, static_cast<float>(grad[i]), m, v, v_max, s);
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (kAmsgrad) {
      max_exp_avg_sq[i] = v_max;
    }
    if (kMaster) {
      master[i] = p;
    }
    param[i] = static_cast<P>(p);
  }
}

template <typename P, bool kAmsgrad>
void update_piece_of(at::Tensor& param, const at::Tensor& grad, float* master, float* exp_avg, float* exp_avg_sq,
                     float* max_exp_avg_sq, const StepScalars& s, int64_t begin, int64_t end) {
  P* p = param.data_ptr<P>();
  const P* g = grad.const_data_ptr<P>();
  if (master != nullptr) {
    update_piece<P, kAmsgrad, true>(p, g, master, exp_avg, exp_avg_sq, max_exp_avg_sq, s, begin, end);
  } else {
    update_piece<P, kAmsgrad, false>(p, g, nullptr, exp_avg, exp_avg_sq, max_exp_avg_sq, s, begin, end);
  }
}

template <bool kAmsgrad>
void update_chunk(at::Tensor& param, const at::Tensor& grad, float* master, float* exp_avg, float* exp_avg_sq,
                  float* max_exp_avg_sq, const StepScalars& s, int64_t begin, int64_t end) {
  switch (param.scalar_type()) {
    case at::kFloat:
      return update_piece_of<float, kAmsgrad>(param, grad, master, exp_avg, exp_avg_sq, max_exp_avg_sq, s, begin,
                                              end);
    case at::kBFloat16:
      return update_piece_of<c10::BFloat16, kAmsgrad>(param, grad, master, exp_avg, exp_avg_sq, max_exp_avg_sq, s,
                                                      begin, end);
    case at::kHalf:
      return update_piece_of<c10::Half, kAmsgrad>(param, grad, master, exp_avg, exp_avg_sq, max_exp_avg_sq, s,
                                                  begin, end);
    default:
      TORCH_CHECK(false, "fused_stable::adamw: unsupported param dtype ", param.scalar_type());
  }
}

bool is_plain(const at::Tensor& t, const at::Tensor& like, at::ScalarType dtype) {
  return t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() && t.numel() == like.numel();
}

bool is_plain_fp32(const at::Tensor& t, const at::Tensor& like) { return is_plain(t, like, at::kFloat); }

// AdamW on fp32, bf16 or fp16 params (grads of the same dtype) with fp32 moments and, when `masters` is not
// empty, fp32 master copies (then the master is updated and the param stores its rounding): grads multiplied
// by `grad_mul` as they are read (never written), the weight decay decoupled, each param's `step` (0-dim fp32)
// advanced by one first, as torch's AdamW does.
void adamw(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
           at::TensorList max_exp_avg_sqs, at::TensorList masters, at::TensorList steps, double lr, double beta1,
           double beta2, double weight_decay, double eps, bool maximize, double grad_mul) {
  const int64_t n = static_cast<int64_t>(params.size());
  const bool amsgrad = !max_exp_avg_sqs.empty();
  const bool with_masters = !masters.empty();
  TORCH_CHECK(static_cast<int64_t>(grads.size()) == n && static_cast<int64_t>(exp_avgs.size()) == n &&
                  static_cast<int64_t>(exp_avg_sqs.size()) == n && static_cast<int64_t>(steps.size()) == n &&
                  (!amsgrad || static_cast<int64_t>(max_exp_avg_sqs.size()) == n) &&
                  (!with_masters || static_cast<int64_t>(masters.size()) == n),
              "fused_stable::adamw: the lists must have one tensor per param");
  std::vector<int64_t> sizes(n);
  std::vector<StepScalars> scalars(n);
  std::vector<at::Tensor> dense_grads(grads.begin(), grads.end());
  std::vector<at::Tensor> dense_params(params.begin(), params.end());
  for (int64_t t = 0; t < n; ++t) {
    const at::Tensor& p = params[t];
    if (!dense_grads[t].is_contiguous()) {
      dense_grads[t] = dense_grads[t].contiguous();  // rare (a transposed grad): read from a copy
    }
    TORCH_CHECK(is_plain(p, p, p.scalar_type()) && is_plain(dense_grads[t], p, p.scalar_type()) &&
                    is_plain_fp32(exp_avgs[t], p) && is_plain_fp32(exp_avg_sqs[t], p) &&
                    (!amsgrad || is_plain_fp32(max_exp_avg_sqs[t], p)) &&
                    (!with_masters || is_plain_fp32(masters[t], p)),
                "fused_stable::adamw: params and grads must be contiguous CPU tensors of one dtype and size, the "
                "moments and master copies contiguous fp32 of that size");
    TORCH_CHECK(steps[t].scalar_type() == at::kFloat && steps[t].numel() == 1,
                "fused_stable::adamw: each step must be a 0-dim fp32 tensor");
    float* step = steps[t].data_ptr<float>();
    *step += 1.0f;
    scalars[t] = fused_stable::adamw::step_scalars(lr, beta1, beta2, weight_decay, eps,
                                                   maximize ? -grad_mul : grad_mul, static_cast<double>(*step));
    sizes[t] = p.numel();
  }
  const std::vector<Piece> pieces = cut(sizes, kUpdateChunk);
  // last chunk first: the grads the norm pass read last are still in the caches (measured 1-9% faster on the
  // 25M-param dense set with one thread; elementwise, so the order changes no value)
  const int64_t num_pieces = static_cast<int64_t>(pieces.size());
  at::parallel_for(0, num_pieces, 1, [&](int64_t first, int64_t last) {
    for (int64_t j = first; j < last; ++j) {
      const int64_t k = num_pieces - 1 - j;
      const int64_t t = pieces[k].tensor;
      float* master = with_masters ? masters[t].data_ptr<float>() : nullptr;
      float* exp_avg = exp_avgs[t].data_ptr<float>();
      float* exp_avg_sq = exp_avg_sqs[t].data_ptr<float>();
      if (amsgrad) {
        update_chunk<true>(dense_params[t], dense_grads[t], master, exp_avg, exp_avg_sq,
                           max_exp_avg_sqs[t].data_ptr<float>(), scalars[t], pieces[k].begin, pieces[k].end);
      } else {
        update_chunk<false>(dense_params[t], dense_grads[t], master, exp_avg, exp_avg_sq, nullptr, scalars[t],
                            pieces[k].begin, pieces[k].end);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(fused_stable, m) {
  m.def("sum_squares(Tensor[] grads, Tensor(a!) out) -> float", &sum_squares);
  m.def(
      "adamw(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] max_exp_avg_sqs, Tensor(f!)[] masters, Tensor(e!)[] steps, float lr, float beta1, float beta2, "
      "float weight_decay, float eps, bool maximize, float grad_mul) -> ()",
      &adamw);
}
