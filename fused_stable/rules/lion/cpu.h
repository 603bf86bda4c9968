// Lion's per-element math in C++, for the compiled CPU update (backends/torch/cpu_update.h, the rule-free loop,
// takes `Rule` below as its template argument; backends/torch/cpu_ops.py finds this file, generates the op
// `fused_stable::update_lion` from it and hashes it into the build's name). triton.py and torch.py beside it hold
// the same element in the same order:
//   Scalars   the update's scalars, torch.py's `step_scalars` in its order: the caller computes them with that
//             very function (fp32, from the group's fp32 row), so they are the exact reference's bits.
//   element   Lion on fp32 values, in the order of torch.py's `element`.
// Built with -ffp-contract=off: IEEE fp32, each operation rounded as written (no FMA), as torch's ops round.

#pragma once

namespace fused_stable {
namespace lion {

struct Rule {
  static constexpr int kNumScalars = 7;
  static constexpr bool kHasOption = false;
  static constexpr int num_states(bool) { return 1; }  // exp_avg

  struct Scalars {
    float grad_mul, decay, lr, beta1, beta2, one_minus_beta1, one_minus_beta2;
    // torch.py's `step_scalars` order (grad_mul, decay, lr, beta1, beta2, 1 - beta1, 1 - beta2)
    explicit Scalars(const float* row)
        : grad_mul(row[0]), decay(row[1]), lr(row[2]), beta1(row[3]), beta2(row[4]), one_minus_beta1(row[5]),
          one_minus_beta2(row[6]) {}
  };

  // The param `p`, its grad `g` as stored and the momentum `m` (`exp_avg`), updated in place; the two unused
  // slots are left alone.
  // Always inlined, as AdamW's element: the op's loops vectorise only with the element in their body.
  template <bool kOption>
  __attribute__((always_inline)) static inline void element(float& p, float g, float& m, float&, float&,
                                                             const Scalars& s) {
    g = g * s.grad_mul;
    p = p * s.decay;
    const float interpolation = m * s.beta1 + s.one_minus_beta1 * g;
    // torch.sign's values: 1, -1, and +0.0 for +-0 and NaN (so p - lr * 0 leaves p's bits, a -0.0 too)
    const float direction = interpolation > 0.0f ? 1.0f : (interpolation < 0.0f ? -1.0f : 0.0f);
    p = p - s.lr * direction;
    m = m * s.beta2 + s.one_minus_beta2 * g;
  }
};

}  // namespace lion
}  // namespace fused_stable
