// Lion's per-element math in C++, for the compiled CPU op (backends/torch/cpu_step.cpp includes this file;
// backends/torch/cpu_ops.py puts this folder on the include path and hashes it into the build's name).
// triton.py and torch.py beside it hold the same element in the same order:
//   StepScalars   the update's scalars, torch.py's `step_scalars` in its order: the caller computes them with
//                 that very function (fp32, from the group's fp32 row), so they are the exact reference's bits.
//   lion_element  Lion on fp32 values, in the order of torch.py's `element`.
// Built with -ffp-contract=off: IEEE fp32, each operation rounded as written (no FMA), as torch's ops round.

#pragma once

namespace fused_stable {
namespace lion {

constexpr int kNumScalars = 7;

struct StepScalars {
  float grad_mul, decay, lr, beta1, beta2, one_minus_beta1, one_minus_beta2;
};

// torch.py's `step_scalars` values, in its order (grad_mul, decay, lr, beta1, beta2, 1 - beta1, 1 - beta2)
inline StepScalars scalars_from(const float* row) {
  return {row[0], row[1], row[2], row[3], row[4], row[5], row[6]};
}

// The param `p`, its grad `g` as stored and the momentum `m` (`exp_avg`), updated in place.
// Always inlined, as adamw_element: the op's loops vectorise only with the element in their body.
__attribute__((always_inline)) inline void lion_element(float& p, float g, float& m, const StepScalars& s) {
  g = g * s.grad_mul;
  p = p * s.decay;
  const float interpolation = m * s.beta1 + s.one_minus_beta1 * g;
  // torch.sign's values: 1, -1, and +0.0 for +-0 and NaN (so p - lr * 0 leaves p's bits, a -0.0 too)
  const float direction = interpolation > 0.0f ? 1.0f : (interpolation < 0.0f ? -1.0f : 0.0f);
  p = p - s.lr * direction;
  m = m * s.beta2 + s.one_minus_beta2 * g;
}

}  // namespace lion
}  // namespace fused_stable
