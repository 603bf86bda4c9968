// SGD's per-element math in C++, for the compiled CPU update (backends/torch/cpu_update.h, the rule-free loop,
// takes `Rule` below as its template argument; backends/torch/cpu_ops.py finds this file, generates the op
// `fused_stable::update_sgd` from it and hashes it into the build's name). triton.py and torch.py beside it hold
// the same element in the same order:
//   Scalars   the update's scalars, torch.py's `step_scalars` in its order: the caller computes them with that
//             very function (fp32, from the group's fp32 row and the tensor's step), so they are the exact
//             reference's bits.
//   element   SGD on fp32 values, in the order of torch.py's `element`.
// Built with -ffp-contract=off: IEEE fp32, each operation rounded as written (no FMA).

#pragma once

namespace fused_stable {
namespace sgd {

struct Rule {
  static constexpr int kNumScalars = 7;
  static constexpr bool kHasOption = true;  // momentum != 0: the group keeps a momentum buffer
  static constexpr int num_states(bool momentum) { return momentum ? 1 : 0; }

  struct Scalars {
    float grad_mul, lr, weight_decay, momentum, one_minus_dampening, nesterov, first;
    // torch.py's `step_scalars` order; `first` is 1 on the buffer's first update (the tensor's step is 1)
    explicit Scalars(const float* row)
        : grad_mul(row[0]), lr(row[1]), weight_decay(row[2]), momentum(row[3]), one_minus_dampening(row[4]),
          nesterov(row[5]), first(row[6]) {}
  };

  // The param `p`, its grad `g` as stored and, with kMomentum, the buffer `buf` (`momentum_buffer`), updated in
  // place; the unused slots are left alone. Always inlined, as the other rules' elements: the op's loops vectorise
  // only with the element in their body.
  template <bool kMomentum>
  __attribute__((always_inline)) static inline void element(float& p, float g, float& buf, float&, float&,
                                                             const Scalars& s) {
    g = g * s.grad_mul;
    g = s.weight_decay != 0.0f ? g + s.weight_decay * p : g;  // torch adds nothing at 0 (an inf p stays out)
    if (kMomentum) {
      buf = s.first != 0.0f ? g : buf * s.momentum + s.one_minus_dampening * g;
      g = s.nesterov != 0.0f ? g + s.momentum * buf : buf;
    }
    p = p - s.lr * g;
  }
};

}  // namespace sgd
}  // namespace fused_stable
