// AdamW's per-element math in C++, for the compiled CPU update (backends/torch/cpu_update.h, the rule-free loop,
// takes `Rule` below as its template argument; backends/torch/cpu_ops.py finds this file, generates the op
// `fused_stable::update_adamw` from it and hashes it into the build's name). triton.py and torch.py beside it hold
// the same element in the same order:
//   Scalars   the update's scalars, one fp32 row in torch.py's `step_scalars` order. The caller computes them on
//             the host: torch.py's `step_scalars` (the exact reference's bits) for bf16 and 8-bit state, and for
//             fp32 state torch.py's `float64_step_scalars` (torch.optim.AdamW's fp64 arithmetic, rounded once).
//   element   AdamW on fp32 values, in the order of triton.py's `adamw_element`.
// Built with -ffp-contract=off: IEEE fp32, each operation rounded as written.

#pragma once

#include <algorithm>
#include <cmath>

namespace fused_stable {
namespace adamw {

struct Rule {
  static constexpr int kNumScalars = 8;
  static constexpr bool kHasOption = true;  // amsgrad
  // exp_avg, exp_avg_sq, and with amsgrad max_exp_avg_sq (the slots' order: __init__.py's `state_names`)
  static constexpr int num_states(bool amsgrad) { return amsgrad ? 3 : 2; }

  struct Scalars {
    float grad_mul, decay, beta2, one_minus_beta1, one_minus_beta2, eps, step_size, bias_correction2_sqrt;
    // torch.py's `step_scalars` order; `grad_mul` carries the clip coefficient, the loss scale and, for
    // maximize=True, the sign
    explicit Scalars(const float* row)
        : grad_mul(row[0]), decay(row[1]), beta2(row[2]), one_minus_beta1(row[3]), one_minus_beta2(row[4]),
          eps(row[5]), step_size(row[6]), bias_correction2_sqrt(row[7]) {}
  };

  // The param `p`, its grad `g` as stored, the moments `m`, `v` and, with kAmsgrad, `v_max` (else untouched),
  // updated in place.
  // Always inlined: the compiled op's loops vectorise only with the element in their body, and the compiler's own
  // inlining budget (per translation unit) gives out once the op instantiates the element many times
  // (measured: the fp32 update 9x slower when it stopped being inlined).
  template <bool kAmsgrad>
  __attribute__((always_inline)) static inline void element(float& p, float g, float& m, float& v, float& v_max,
                                                             const Scalars& s) {
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
};

}  // namespace adamw
}  // namespace fused_stable
