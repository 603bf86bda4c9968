// Adafactor's factored update as one compiled op, `fused_stable::adafactor_factored` (cpu_ops.py builds every
// rules/*/cpu_matrix.cpp into the library beside cpu_step.cpp): rules/adafactor/torch.py calls it on the CPU step's
// host path for contiguous fp32 params of >= 2 dims, each seen as [batch, rows, cols] (factored over its last two).
//
// Three passes over each matrix where torch's for-loop step makes about fifteen (each op its own pass):
//   1. the grad (times the step's multiplier) and the param read: each row's and column's sum of squares of the
//      grad and the param's sum of squares (its RMS scales the step); a row's variance updated at the row's end;
//      then, per matrix, the columns' variances, the mean row variance and the param's RMS;
//   2. the grad read again: the update's sum of squares (its RMS is clipped to d);
//   3. the grad read, the param read and written: the decay, then the update.
// The element arithmetic is torch's in fp32, op for op (rules/adafactor/__init__.py's math); the sums are fp64,
// each in a fixed order whatever the thread count (work cut into fixed units of whole rows of one matrix), rounded to
// fp32 where torch's fp32 reductions return. So the result is torch's up to those reductions' last bits (torch sums in
// fp32, in its own order): the tests hold it to the floor of torch against itself.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kUnitElements = 1 << 16;  // elements per unit of work (at least): whole rows of one matrix
// units per matrix (at most): each keeps its column sums (cols fp64 values), so a wide matrix in one-row units
// would hold twice its own bytes in them; 16 bound them to 128 bytes per column
constexpr int64_t kMaxUnits = 16;
constexpr int kLanes = 16;                  // fp64 accumulators per sum

// The per-param scalars, fp64 columns of the op's `scalars` ([params, kColumns]), from rules/adafactor/torch.py.
enum Column {
  kGradMul,    // the step's multiplier (the clip's and the loss scale's), negated with maximize
  kBeta,       // this step's EMA weight of g * g: step ** beta2_decay
  kEps1,       // the variance floor (None: fp32's machine epsilon)
  kEps2,       // the floor of the param's RMS
  kRho,        // min(lr, 1 / sqrt(step))
  kDecay,      // 1 - lr * weight_decay
  kSqrtNumel,  // torch's numel ** 0.5
  kD,          // the update's RMS threshold
  kColumns
};

struct Matrix {  // one param as [batch, rows, cols], with its states and scalars
  float* p;
  const float* g;
  float* row_var;  // [batch, rows]
  float* col_var;  // [batch, cols]
  int64_t batch, rows, cols;
  const double* s;  // its row of `scalars`
  std::vector<float> mean_row_var;  // per batch, clamped to eps1 (after pass 1)
  double alpha = 0.0;               // the step size before the update's clip (after pass 1)
  float coef = 0.0f;                // -alpha / denom, torch's `add_` alpha (after pass 2)
};

struct Unit {  // rows [r0, r1) of batch b of one matrix
  int64_t matrix, b, r0, r1;
  int64_t col_offset;  // its column sums' place in the partial sums (pass 1)
  double p_sumsq = 0.0, u_sumsq = 0.0;
};

inline double pairwise(double* lanes) {
  for (int width = kLanes / 2; width > 0; width /= 2) {
    for (int k = 0; k < width; ++k) {
      lanes[k] += lanes[k + width];
    }
  }
  return lanes[0];
}

// torch's `norm(x, dim).square_().div_(n)` from the fp64 sum of squares: the norm returned in fp32, then fp32 ops
inline float mean_square(double sumsq, int64_t n) {
  const float norm = static_cast<float>(std::sqrt(sumsq));
  return (norm * norm) / static_cast<float>(n);
}

// torch's vectorised CPU lerp with a scalar weight (ATen's lerp_vec)
inline float lerp(float start, float end, float weight) {
  const bool small = std::abs(weight) < 0.5f;
  return std::fma(small ? weight : weight - 1.0f, end - start, small ? start : end);
}

// U = g * rsqrt(max(row_var * col_var / mean_row_var, eps1 ** 2)), as torch's ops round it
inline float update_of(float row_var, float col_var, float mean_row_var, float eps1_sq, float g) {
  float v = (row_var * col_var) / mean_row_var;
  v = v < eps1_sq ? eps1_sq : v;  // clamp_(min=...), NaN kept
  return (1.0f / std::sqrt(v)) * g;
}

void first_pass(Matrix& m, Unit& u, double* __restrict col) {
  const float mul = static_cast<float>(m.s[kGradMul]);
  const float beta = static_cast<float>(m.s[kBeta]);
  const int64_t cols = m.cols;
  double p_lanes[kLanes] = {};
  for (int64_t r = u.r0; r < u.r1; ++r) {
    const float* __restrict g = m.g + (u.b * m.rows + r) * cols;
    const float* __restrict p = m.p + (u.b * m.rows + r) * cols;
    double lanes[kLanes] = {};
    int64_t c = 0;
    for (; c + kLanes <= cols; c += kLanes) {
      for (int k = 0; k < kLanes; ++k) {
        const double x = static_cast<double>(g[c + k] * mul);
        const double q = static_cast<double>(p[c + k]);
        lanes[k] += x * x;
        col[c + k] += x * x;
        p_lanes[k] += q * q;
      }
    }
    for (int k = 0; c < cols; ++c, ++k) {
      const double x = static_cast<double>(g[c] * mul);
      const double q = static_cast<double>(p[c]);
      lanes[k] += x * x;
      col[c] += x * x;
      p_lanes[k] += q * q;
    }
    float& row_var = m.row_var[u.b * m.rows + r];
    row_var = lerp(row_var, mean_square(pairwise(lanes), cols), beta);
  }
  u.p_sumsq = pairwise(p_lanes);
}

// After pass 1, one matrix: its columns' variances (the units' column sums added in unit order), each batch's
// mean row variance, the param's RMS and the step size.
void between_passes(Matrix& m, const Unit* units, int64_t count, const std::vector<double>& col_sums) {
  const float beta = static_cast<float>(m.s[kBeta]);
  const float eps1 = static_cast<float>(m.s[kEps1]);
  std::vector<double> sums(m.batch * m.cols, 0.0);  // [batch, cols]
  double p_sumsq = 0.0;
  for (int64_t j = 0; j < count; ++j) {
    const double* col = col_sums.data() + units[j].col_offset;
    double* into = sums.data() + units[j].b * m.cols;
    for (int64_t c = 0; c < m.cols; ++c) {
      into[c] += col[c];
    }
    p_sumsq += units[j].p_sumsq;
  }
  for (int64_t c = 0; c < m.batch * m.cols; ++c) {
    m.col_var[c] = lerp(m.col_var[c], mean_square(sums[c], m.rows), beta);
  }
  m.mean_row_var.assign(m.batch, 0.0f);
  for (int64_t b = 0; b < m.batch; ++b) {
    double row_sum = 0.0;
    for (int64_t r = 0; r < m.rows; ++r) {
      row_sum += m.row_var[b * m.rows + r];
    }
    const float mean = static_cast<float>(row_sum) / static_cast<float>(m.rows);  // torch's mean: sum / n in fp32
    m.mean_row_var[b] = mean < eps1 ? eps1 : mean;
  }
  const double rms = static_cast<double>(static_cast<float>(std::sqrt(p_sumsq))) / m.s[kSqrtNumel];
  m.alpha = std::max(m.s[kEps2], rms) * m.s[kRho];
}

// Pass 2 (`apply` false): the update's sum of squares; pass 3 (`apply` true): p = p * decay + coef * U.
template <bool kApply>
void update_pass(const Matrix& m, Unit& u) {
  const float mul = static_cast<float>(m.s[kGradMul]);
  const float eps1_sq = static_cast<float>(m.s[kEps1] * m.s[kEps1]);
  const float decay = static_cast<float>(m.s[kDecay]);
  const bool decays = m.s[kDecay] != 1.0;
  const float mean_row_var = m.mean_row_var[u.b];
  const float* __restrict col_var = m.col_var + u.b * m.cols;
  const int64_t cols = m.cols;
  double lanes[kLanes] = {};
  for (int64_t r = u.r0; r < u.r1; ++r) {
    const float* __restrict g = m.g + (u.b * m.rows + r) * cols;
    float* __restrict p = m.p + (u.b * m.rows + r) * cols;
    const float row_var = m.row_var[u.b * m.rows + r];
    if (kApply) {
      for (int64_t c = 0; c < cols; ++c) {
        const float x = update_of(row_var, col_var[c], mean_row_var, eps1_sq, g[c] * mul);
        p[c] = std::fma(x, m.coef, decays ? p[c] * decay : p[c]);  // torch's vectorised add_(U, alpha=coef)
      }
      continue;
    }
    int64_t c = 0;
    for (; c + kLanes <= cols; c += kLanes) {
      for (int k = 0; k < kLanes; ++k) {
        const double x = update_of(row_var, col_var[c + k], mean_row_var, eps1_sq, g[c + k] * mul);
        lanes[k] += x * x;
      }
    }
    for (int k = 0; c < cols; ++c, ++k) {
      const double x = update_of(row_var, col_var[c], mean_row_var, eps1_sq, g[c] * mul);
      lanes[k] += x * x;
    }
  }
  if (!kApply) {
    u.u_sumsq = pairwise(lanes);
  }
}

Matrix matrix_of(const at::Tensor& p, const at::Tensor& g, const at::Tensor& row_var, const at::Tensor& col_var,
                 const double* s) {
  TORCH_CHECK(p.dim() >= 2 && p.scalar_type() == at::kFloat && p.is_contiguous() && p.device().is_cpu(),
              "fused_stable::adafactor_factored: params must be contiguous fp32 CPU tensors of >= 2 dims");
  TORCH_CHECK(g.sizes() == p.sizes() && g.scalar_type() == at::kFloat && g.is_contiguous(),
              "fused_stable::adafactor_factored: each grad must be a contiguous fp32 tensor of its param's shape");
  const int64_t rows = p.size(-2), cols = p.size(-1);
  const int64_t batch = rows * cols == 0 ? 0 : p.numel() / (rows * cols);
  TORCH_CHECK(row_var.numel() == batch * rows && col_var.numel() == batch * cols &&
                  row_var.scalar_type() == at::kFloat && col_var.scalar_type() == at::kFloat &&
                  row_var.is_contiguous() && col_var.is_contiguous(),
              "fused_stable::adafactor_factored: row_var [..., rows, 1] and col_var [..., 1, cols], contiguous fp32");
  return Matrix{p.data_ptr<float>(), g.const_data_ptr<float>(), row_var.data_ptr<float>(),
                col_var.data_ptr<float>(), batch, rows, cols, s};
}

// Every matrix cut into units of whole rows (at least one row and kUnitElements elements, at most kMaxUnits per
// batch entry), in matrix order;
// their column sums' places in one buffer, whose size is returned.
int64_t cut_rows(const std::vector<Matrix>& matrices, std::vector<Unit>& units, std::vector<int64_t>& first_unit) {
  int64_t col_size = 0;
  for (int64_t t = 0; t < static_cast<int64_t>(matrices.size()); ++t) {
    const Matrix& m = matrices[t];
    first_unit.push_back(static_cast<int64_t>(units.size()));
    const int64_t fill = (kUnitElements + m.cols - 1) / std::max<int64_t>(1, m.cols);
    const int64_t step = std::max({int64_t{1}, fill, (m.rows + kMaxUnits - 1) / kMaxUnits});
    for (int64_t b = 0; b < m.batch; ++b) {
      for (int64_t r0 = 0; r0 < m.rows; r0 += step) {
        units.push_back(Unit{t, b, r0, std::min(m.rows, r0 + step), col_size});
        col_size += m.cols;
      }
    }
  }
  first_unit.push_back(static_cast<int64_t>(units.size()));
  return col_size;
}

void adafactor_factored(at::TensorList params, at::TensorList grads, at::TensorList row_vars, at::TensorList col_vars,
                        const at::Tensor& scalars) {
  const int64_t n = static_cast<int64_t>(params.size());
  TORCH_CHECK(static_cast<int64_t>(grads.size()) == n && static_cast<int64_t>(row_vars.size()) == n &&
                  static_cast<int64_t>(col_vars.size()) == n,
              "fused_stable::adafactor_factored: one grad, row_var and col_var per param");
  TORCH_CHECK(scalars.scalar_type() == at::kDouble && scalars.is_contiguous() && scalars.dim() == 2 &&
                  scalars.size(0) == n && scalars.size(1) == kColumns,
              "fused_stable::adafactor_factored: scalars must be contiguous fp64 [params, ", kColumns, "]");
  const double* s = scalars.const_data_ptr<double>();
  std::vector<Matrix> matrices;
  for (int64_t t = 0; t < n; ++t) {
    matrices.push_back(matrix_of(params[t], grads[t], row_vars[t], col_vars[t], s + t * kColumns));
  }
  std::vector<Unit> units;
  std::vector<int64_t> first_unit;
  std::vector<double> col_sums(cut_rows(matrices, units, first_unit), 0.0);
  const int64_t count = static_cast<int64_t>(units.size());
  at::parallel_for(0, count, 1, [&](int64_t first, int64_t last) {
    for (int64_t j = first; j < last; ++j) {
      first_pass(matrices[units[j].matrix], units[j], col_sums.data() + units[j].col_offset);
    }
  });
  at::parallel_for(0, n, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      between_passes(matrices[t], &units[first_unit[t]], first_unit[t + 1] - first_unit[t], col_sums);
    }
  });
  at::parallel_for(0, count, 1, [&](int64_t first, int64_t last) {
    for (int64_t j = first; j < last; ++j) {
      update_pass<false>(matrices[units[j].matrix], units[j]);
    }
  });
  for (int64_t t = 0; t < n; ++t) {  // the update's RMS clipped to d: torch's `denom`
    Matrix& m = matrices[t];
    double u_sumsq = 0.0;
    for (int64_t j = first_unit[t]; j < first_unit[t + 1]; ++j) {
      u_sumsq += units[j].u_sumsq;
    }
    const double rms = static_cast<double>(static_cast<float>(std::sqrt(u_sumsq))) / (m.s[kSqrtNumel] * m.s[kD]);
    m.coef = static_cast<float>(-m.alpha / std::max(1.0, rms));
  }
  at::parallel_for(0, count, 1, [&](int64_t first, int64_t last) {
    for (int64_t j = first; j < last; ++j) {
      update_pass<true>(matrices[units[j].matrix], units[j]);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fused_stable, m) {
  m.def(
      "adafactor_factored(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] row_vars, Tensor(c!)[] col_vars, "
      "Tensor scalars) -> ()",
      &adafactor_factored);
}
