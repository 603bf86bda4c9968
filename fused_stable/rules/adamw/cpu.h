// AdamW's per-element math in C++, for the compiled CPU op (backends/torch/cpu_step.cpp includes this file;
// backends/torch/cpu_ops.py puts this folder on the include path and hashes it into the build's name).
// triton.py and torch.py beside it hold the same two functions in the same order:
//   step_scalars   a tensor's scalars for the update. Unlike the kernels' (fp32 from the hyper-parameter row,
//                  exp via expm1), computed in fp64 as torch's AdamW computes them, then rounded to fp32.
//   adamw_element  AdamW on fp32 values, in the order of triton.py's `adamw_element`.
// Built with -ffp-contract=off: IEEE fp32, each operation rounded as written.

#pragma once

#include <algorithm>
#include <cmath>

namespace fused_stable {
namespace adamw {

struct StepScalars {
  float grad_mul, decay, beta1, beta2, one_minus_beta1, one_minus_beta2, eps, step_size, bias_correction2_sqrt;
};

// `step` already advanced for this step; `grad_mul` carries the clip coefficient, the loss scale and, for
// maximize=True, the sign.
inline StepScalars step_scalars(double lr, double beta1, double beta2, double weight_decay, double eps,
                                double grad_mul, double step) {
  const double bias_correction1 = 1.0 - std::pow(beta1, step);
  const double bias_correction2 = 1.0 - std::pow(beta2, step);
  return {static_cast<float>(grad_mul),
          static_cast<float>(1.0 - lr * weight_decay),
          static_cast<float>(beta1),
          static_cast<float>(beta2),
          static_cast<float>(1.0 - beta1),
          static_cast<float>(1.0 - beta2),
          static_cast<float>(eps),
          static_cast<float>(lr / bias_correction1),
          static_cast<float>(std::sqrt(bias_correction2))};
}

// The param `p`, its grad `g` as stored, the moments `m`, `v` and, with kAmsgrad, `v_max` (else untouched),
// updated in place.
// Always inlined: the compiled op's loops vectorise only with the element in their body, and the compiler's own
// inlining budget (per translation unit) gives out once cpu_step.cpp instantiates the element many times
// (measured: the fp32 update 9x slower when it stopped being inlined).
template <bool kAmsgrad>
__attribute__((always_inline)) inline void adamw_element(float& p, float g, float& m, float& v, float& v_max, const StepScalars& s) {
  g = g * s.grad_mul;
  p = p * s.decay;
  m = m + s.one_minus_beta1 * (g - m);
  v = v * s.beta2 + s.one_minus_beta2 * (g * g);
  float v_hat = v;
  if (kAmsgrad) {
    v_max = std::max(v_max, v);
    v_hat = v_max;
  }
  const float denom = std::sqrt(v_hat) / s.bias_correction2_sqrt + s.eps;
  p = p - s.step_size * (m / denom);
}

}  // namespace adamw
}  // namespace fused_stable
