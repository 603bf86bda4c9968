// The CPU step's two passes over memory as compiled ops (cpu_ops.py builds and loads this file):
//   fused_stable::sum_squares  every grad read once: per-tensor sums of squares in fp64, one call for all tensors;
//   fused_stable::adamw        AdamW that reads each grad times the step's multiplier (clip coefficient / loss
//                              scale) and never writes it back, and advances the `step` counters itself; fp32,
//                              bf16 or fp16 params (with or without fp32 master copies), fp32 moments;
//   fused_stable::adamw_lowbit the same with bf16 or 8-bit moments (state_format.py), one pass per chunk:
//                              decode, update, encode, block by block, as the exact reference computes them;
//   fused_stable::lion         Lion (rules/lion/cpu.h) with fp32, bf16 or 8-bit exp_avg, on the same params,
//                              reading the grads as adamw does, with the exact reference's step scalars (bit for
//                              bit its update).
// Together 4 + 28 = 32 bytes per fp32 parameter, clipped or not (torch's CPU `_fused_adamw_` writes the scaled
// grads back when given `grad_scale`: 36), and two calls per step instead of five torch ops; 2 + 22 = 24 for bf16
// params (32 with a master copy), where torch's ops copy the params and grads to fp32 and back.
//
// Work is cut into fixed chunks of one tensor each, the same whatever the thread count, so the sums (and so
// the decisions) do not depend on it; at::parallel_for spreads the chunks over torch's threads.
// The per-element math and the step's scalars are the rule's (fused_stable/rules/<rule>/cpu.h, beside the
// kernels' triton.py): IEEE fp32 with no contraction (built with -ffp-contract=off), in the order of the
// kernels' update; AdamW's scalars computed in fp64 as torch's AdamW computes them, then rounded to fp32.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "adamw/cpu.h"  // fused_stable/rules/ is on the include path (cpu_ops.py)
#include "lion/cpu.h"

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

// ------------------------------------------------------------------------------------------------------------
// bf16 and 8-bit moments (fused_stable/state_format.py): the update of the exact reference
// (backends/torch/exact_reference.py) in one pass per chunk: each block of kQuantBlock elements decoded, updated
// and encoded again in registers. The arithmetic is state_format.py's, operation by operation in fp32 (IEEE
// division and square root: the hardware's correctly rounded ones, as state_format.sqrt_rn), and the stochastic
// rounding of bf16 exp_avg_sq draws state_format.random_bits: mix32(element ^ key), the element's index in its
// tensor (its memory order: the tensors are contiguous), the key per tensor and step (state_format.random_key,
// computed by the caller).

constexpr int kFormatBF16 = 1, kFormatQ8 = 2;  // state_format.BF16, Q8
// the block helpers always inlined into lowbit_piece (its loops vectorise only so; see rules/adamw/cpu.h)
#define FUSED_STABLE_INLINE __attribute__((always_inline)) inline
constexpr int64_t kQuantBlock = 128;           // state_format.QUANT_BLOCK; kUpdateChunk is a multiple of it

FUSED_STABLE_INLINE uint32_t mix32(uint32_t x) {  // state_format.mix32 (Wellons' lowbias32)
  x ^= x >> 16;
  x *= 0x21F0AAADu;
  x ^= x >> 15;
  x *= 0x735A2D97u;
  return x ^ (x >> 15);
}

// state_format.round_stochastic_bf16: the dropped low 16 bits plus 16 random ones carry into the kept half
FUSED_STABLE_INLINE c10::BFloat16 round_stochastic_bf16(float x, uint32_t bits) {
  uint32_t word;
  std::memcpy(&word, &x, sizeof(word));
  word = (word + (bits & 0xFFFFu)) & 0xFFFF0000u;
  float rounded;
  std::memcpy(&rounded, &word, sizeof(rounded));
  return c10::BFloat16(rounded);  // exact: the low half is zero
}

// state_format.decode_signed / decode_unsigned on one block
FUSED_STABLE_INLINE void decode_signed(const int8_t* codes, float scale, float* out, int64_t n) {
  constexpr float kInverse = static_cast<float>(1.0 / 127.0);
  for (int64_t i = 0; i < n; ++i) {
    const float q = static_cast<float>(codes[i]) * kInverse;
    out[i] = q * std::fabs(q) * scale;
  }
}

FUSED_STABLE_INLINE void decode_unsigned(const uint8_t* codes, float scale, float* out, int64_t n) {
  constexpr float kInverse = static_cast<float>(1.0 / 255.0);
  for (int64_t i = 0; i < n; ++i) {
    const float q = static_cast<float>(codes[i]) * kInverse;
    const float root = q * q * scale;
    out[i] = root * root;
  }
}

// The block's largest value (a NaN anywhere makes it NaN, as torch's amax); the padding's zeros change nothing.
// Taken on the bit patterns: for floats >= 0 their order is the int32 order of their bits, so the max is an
// integer max the compiler vectorises (a float max it does not, without -ffinite-math-only: measured a
// mispredicted branch per element). The sign bit is dropped (only a -0.0 or a NaN has one here: -0.0 counts as
// 0, as it did), and every NaN's pattern lies above infinity's, so a NaN in the block makes the max a NaN.
FUSED_STABLE_INLINE float block_max(const float* values, int64_t n) {
  constexpr int32_t kMagnitude = 0x7FFFFFFF;
  int32_t largest = 0;
  for (int64_t i = 0; i < n; ++i) {
    int32_t bits;
    std::memcpy(&bits, values + i, sizeof(bits));
    largest = std::max(largest, bits & kMagnitude);
  }
  float result;
  std::memcpy(&result, &largest, sizeof(result));
  return result;
}

// floor(y + 0.5) for y >= 0 (the codes' round half up) as a truncation to int32: the same value for every
// non-negative y (and the same int32 as floor's for a NaN), but the loop vectorises (floorf does not, here)
FUSED_STABLE_INLINE int32_t round_up(float y) { return static_cast<int32_t>(y + 0.5f); }

FUSED_STABLE_INLINE float inverse_of(float scale) { return scale > 0.0f ? 1.0f / scale : 0.0f; }

// state_format.encode_signed: s = the block's max |x|, c = round(127 * sqrt(|x| / s)) with x's sign, ties up
FUSED_STABLE_INLINE float encode_signed(const float* x, int8_t* codes, int64_t n) {
  float magnitude[kQuantBlock];
  for (int64_t i = 0; i < n; ++i) {
    magnitude[i] = std::fabs(x[i]);
  }
  const float scale = block_max(magnitude, n);
  const float inverse = inverse_of(scale);
  for (int64_t i = 0; i < n; ++i) {
    const int32_t code = round_up(std::sqrt(std::min(magnitude[i] * inverse, 1.0f)) * 127.0f);
    codes[i] = static_cast<int8_t>(x[i] < 0.0f ? -code : code);
  }
  return scale;
}

// state_format.encode_unsigned: r = sqrt(x), s = the block's max r, c = round(255 * sqrt(r / s)), ties up
FUSED_STABLE_INLINE float encode_unsigned(const float* x, uint8_t* codes, int64_t n) {
  float root[kQuantBlock];
  for (int64_t i = 0; i < n; ++i) {
    root[i] = std::sqrt(x[i]);
  }
  const float scale = block_max(root, n);
  const float inverse = inverse_of(scale);
  for (int64_t i = 0; i < n; ++i) {
    codes[i] = static_cast<uint8_t>(round_up(std::sqrt(std::min(root[i] * inverse, 1.0f)) * 255.0f));
  }
  return scale;
}

// One tensor's pointers for the low-precision update (the moments' codes or bf16 values, and in 8-bit the
// per-block scales; max_* only with amsgrad, master only with master weights).
struct LowbitTensor {
  void* param;
  const void* grad;
  float* master;
  void *exp_avg, *exp_avg_sq, *max_exp_avg_sq;
  float *exp_avg_scale, *exp_avg_sq_scale, *max_exp_avg_sq_scale;
  StepScalars scalars;
  uint32_t key;  // state_format.random_key of this tensor and step (bf16 exp_avg_sq's stochastic rounding)
};

template <int kFormat>
FUSED_STABLE_INLINE void decode_block(const LowbitTensor& t, int64_t first, int64_t n, bool amsgrad, float* m, float* v, float* v_max) {
  if (kFormat == kFormatQ8) {
    const int64_t block = first / kQuantBlock;
    decode_signed(static_cast<const int8_t*>(t.exp_avg) + first, t.exp_avg_scale[block], m, n);
    decode_unsigned(static_cast<const uint8_t*>(t.exp_avg_sq) + first, t.exp_avg_sq_scale[block], v, n);
    if (amsgrad) {
      decode_unsigned(static_cast<const uint8_t*>(t.max_exp_avg_sq) + first, t.max_exp_avg_sq_scale[block], v_max, n);
    }
    return;
  }
  const auto* m16 = static_cast<const c10::BFloat16*>(t.exp_avg) + first;
  const auto* v16 = static_cast<const c10::BFloat16*>(t.exp_avg_sq) + first;
  for (int64_t i = 0; i < n; ++i) {
    m[i] = static_cast<float>(m16[i]);
    v[i] = static_cast<float>(v16[i]);
  }
  if (amsgrad) {
    const auto* max16 = static_cast<const c10::BFloat16*>(t.max_exp_avg_sq) + first;
    for (int64_t i = 0; i < n; ++i) {
      v_max[i] = static_cast<float>(max16[i]);
    }
  }
}

template <int kFormat>
FUSED_STABLE_INLINE void encode_block(const LowbitTensor& t, int64_t first, int64_t n, bool amsgrad, const float* m, const float* v,
                  const float* v_max) {
  if (kFormat == kFormatQ8) {
    const int64_t block = first / kQuantBlock;
    t.exp_avg_scale[block] = encode_signed(m, static_cast<int8_t*>(t.exp_avg) + first, n);
    t.exp_avg_sq_scale[block] = encode_unsigned(v, static_cast<uint8_t*>(t.exp_avg_sq) + first, n);
    if (amsgrad) {
      t.max_exp_avg_sq_scale[block] = encode_unsigned(v_max, static_cast<uint8_t*>(t.max_exp_avg_sq) + first, n);
    }
    return;
  }
  auto* m16 = static_cast<c10::BFloat16*>(t.exp_avg) + first;
  auto* v16 = static_cast<c10::BFloat16*>(t.exp_avg_sq) + first;
  for (int64_t i = 0; i < n; ++i) {
    m16[i] = c10::BFloat16(m[i]);  // to nearest even
    v16[i] = round_stochastic_bf16(v[i], mix32(static_cast<uint32_t>(first + i) ^ t.key));
  }
  if (amsgrad) {
    auto* max16 = static_cast<c10::BFloat16*>(t.max_exp_avg_sq) + first;
    for (int64_t i = 0; i < n; ++i) {
      max16[i] = c10::BFloat16(v_max[i]);  // a running maximum: to nearest even
    }
  }
}

// One chunk (whole blocks, but the tensor's last) of one tensor: per block, decode, AdamW, encode.
template <int kFormat, typename P, bool kAmsgrad, bool kMaster>
void lowbit_piece(const LowbitTensor& t, int64_t begin, int64_t end) {
  P* param = static_cast<P*>(t.param);
  const P* grad = static_cast<const P*>(t.grad);
  float m[kQuantBlock], v[kQuantBlock], v_max[kQuantBlock];
  for (int64_t first = begin; first < end; first += kQuantBlock) {
    const int64_t n = std::min(kQuantBlock, end - first);
    decode_block<kFormat>(t, first, n, kAmsgrad, m, v, v_max);
    for (int64_t k = 0; k < n; ++k) {
      const int64_t i = first + k;
      float p = kMaster ? t.master[i] : static_cast<float>(param[i]);
      fused_stable::adamw::adamw_element<kAmsgrad>(p, static_cast<float>(grad[i]), m[k], v[k], v_max[k], t.scalars);
      if (kMaster) {
        t.master[i] = p;
      }
      param[i] = static_cast<P>(p);
    }
    encode_block<kFormat>(t, first, n, kAmsgrad, m, v, v_max);
  }
}

template <int kFormat, typename P>
void lowbit_chunk_of(const LowbitTensor& t, bool amsgrad, int64_t begin, int64_t end) {
  const bool master = t.master != nullptr;
  if (amsgrad) {
    return master ? lowbit_piece<kFormat, P, true, true>(t, begin, end)
                  : lowbit_piece<kFormat, P, true, false>(t, begin, end);
  }
  return master ? lowbit_piece<kFormat, P, false, true>(t, begin, end)
                : lowbit_piece<kFormat, P, false, false>(t, begin, end);
}

template <int kFormat>
void lowbit_chunk(const LowbitTensor& t, at::ScalarType dtype, bool amsgrad, int64_t begin, int64_t end) {
  switch (dtype) {
    case at::kFloat:
      return lowbit_chunk_of<kFormat, float>(t, amsgrad, begin, end);
    case at::kBFloat16:
      return lowbit_chunk_of<kFormat, c10::BFloat16>(t, amsgrad, begin, end);
    case at::kHalf:
      return lowbit_chunk_of<kFormat, c10::Half>(t, amsgrad, begin, end);
    default:
      TORCH_CHECK(false, "fused_stable::adamw_lowbit: unsupported param dtype ", dtype);
  }
}

bool is_scales_of(const at::Tensor& scales, const at::Tensor& like) {
  return is_plain_fp32(scales, scales) && scales.numel() == (like.numel() + kQuantBlock - 1) / kQuantBlock;
}

// AdamW with bf16 (`state_format` 1) or 8-bit (2) moments: the update of the exact reference, with its step
// scalars given per tensor (`scalars`: [n, 8] fp32, rules/adamw/torch.py's `step_scalars` in its order, computed
// by the caller from the `step` counters it has already advanced) and the stochastic rounding's keys (`keys`:
// [n] int64, state_format.random_key). Grads are read (times the scalars' grad multiplier), never written.
void adamw_lowbit(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                  at::TensorList max_exp_avg_sqs, at::TensorList exp_avg_scales, at::TensorList exp_avg_sq_scales,
                  at::TensorList max_exp_avg_sq_scales, at::TensorList masters, const at::Tensor& scalars,
                  const at::Tensor& keys, int64_t state_format) {
  const int64_t n = static_cast<int64_t>(params.size());
  const bool amsgrad = !max_exp_avg_sqs.empty();
  const bool with_masters = !masters.empty();
  const bool q8 = state_format == kFormatQ8;
  TORCH_CHECK(state_format == kFormatBF16 || q8,
              "fused_stable::adamw_lowbit: state_format must be 1 (bf16) or 2 (8bit)");
  auto sized = [n](at::TensorList list, bool wanted) {
    return static_cast<int64_t>(list.size()) == (wanted ? n : 0);
  };
  TORCH_CHECK(sized(grads, true) && sized(exp_avgs, true) && sized(exp_avg_sqs, true) &&
                  sized(max_exp_avg_sqs, amsgrad) && sized(masters, with_masters) && sized(exp_avg_scales, q8) &&
                  sized(exp_avg_sq_scales, q8) && sized(max_exp_avg_sq_scales, q8 && amsgrad),
              "fused_stable::adamw_lowbit: the lists must have one tensor per param (scales in 8bit only)");
  TORCH_CHECK(scalars.scalar_type() == at::kFloat && scalars.is_contiguous() && scalars.dim() == 2 &&
                  scalars.size(0) == n && scalars.size(1) == 8 && keys.scalar_type() == at::kLong &&
                  keys.is_contiguous() && keys.numel() == n,
              "fused_stable::adamw_lowbit: scalars must be contiguous fp32 [params, 8], keys int64 [params]");
  const float* scalar_rows = scalars.const_data_ptr<float>();
  const int64_t* key_values = keys.const_data_ptr<int64_t>();
  std::vector<at::Tensor> dense_grads(grads.begin(), grads.end());
  std::vector<LowbitTensor> tensors(n);
  std::vector<int64_t> sizes(n);
  const at::ScalarType dtype = n > 0 ? params[0].scalar_type() : at::kFloat;
  for (int64_t t = 0; t < n; ++t) {
    const at::Tensor& p = params[t];
    if (!dense_grads[t].is_contiguous()) {
      dense_grads[t] = dense_grads[t].contiguous();  // rare (a transposed grad): read from a copy
    }
    const at::ScalarType m_dtype = q8 ? at::kChar : at::kBFloat16;
    const at::ScalarType v_dtype = q8 ? at::kByte : at::kBFloat16;
    TORCH_CHECK(p.scalar_type() == dtype && is_plain(p, p, dtype) && is_plain(dense_grads[t], p, dtype) &&
                    is_plain(exp_avgs[t], p, m_dtype) && is_plain(exp_avg_sqs[t], p, v_dtype) &&
                    (!amsgrad || is_plain(max_exp_avg_sqs[t], p, v_dtype)) &&
                    (!with_masters || is_plain_fp32(masters[t], p)),
                "fused_stable::adamw_lowbit: params and grads must be contiguous CPU tensors of one dtype and size, "
                "the moments contiguous of that size in the state format's dtypes, the masters fp32");
    TORCH_CHECK(!q8 || (is_scales_of(exp_avg_scales[t], p) && is_scales_of(exp_avg_sq_scales[t], p) &&
                        (!amsgrad || is_scales_of(max_exp_avg_sq_scales[t], p))),
                "fused_stable::adamw_lowbit: 8-bit scales must be contiguous fp32, one per block of 128 elements");
    const float* row = scalar_rows + 8 * t;
    LowbitTensor& lt = tensors[t];
    lt.param = p.data_ptr();
    lt.grad = dense_grads[t].const_data_ptr();
    lt.master = with_masters ? masters[t].data_ptr<float>() : nullptr;
    lt.exp_avg = exp_avgs[t].data_ptr();
    lt.exp_avg_sq = exp_avg_sqs[t].data_ptr();
    lt.max_exp_avg_sq = amsgrad ? max_exp_avg_sqs[t].data_ptr() : nullptr;
    lt.exp_avg_scale = q8 ? exp_avg_scales[t].data_ptr<float>() : nullptr;
    lt.exp_avg_sq_scale = q8 ? exp_avg_sq_scales[t].data_ptr<float>() : nullptr;
    lt.max_exp_avg_sq_scale = q8 && amsgrad ? max_exp_avg_sq_scales[t].data_ptr<float>() : nullptr;
    // torch.py's order: grad_mul, decay, beta2, 1 - beta1, 1 - beta2, eps, step_size, sqrt(bias_correction2)
    lt.scalars = {row[0], row[1], 0.0f, row[2], row[3], row[4], row[5], row[6], row[7]};
    lt.key = static_cast<uint32_t>(key_values[t]);
    sizes[t] = p.numel();
  }
  const std::vector<Piece> pieces = cut(sizes, kUpdateChunk);  // whole blocks: the chunk is a multiple of 128
  const int64_t num_pieces = static_cast<int64_t>(pieces.size());
  at::parallel_for(0, num_pieces, 1, [&](int64_t first, int64_t last) {
    for (int64_t j = first; j < last; ++j) {
      const Piece& piece = pieces[num_pieces - 1 - j];  // last chunk first, as adamw
      if (q8) {
        lowbit_chunk<kFormatQ8>(tensors[piece.tensor], dtype, amsgrad, piece.begin, piece.end);
      } else {
        lowbit_chunk<kFormatBF16>(tensors[piece.tensor], dtype, amsgrad, piece.begin, piece.end);
      }
    }
  });
}

// ------------------------------------------------------------------------------------------------------------
// Lion (fused_stable/rules/lion/cpu.h) with fp32, bf16 or 8-bit exp_avg: one pass per chunk, the grads read times
// the step's multiplier (in the scalars) and never written: with the norm pass 4 + 20 = 24 bytes per fp32
// parameter (2 + 14 for a bf16 param, 2 + 20 with an fp32 master; 4 bytes fewer with bf16 exp_avg, 6 with 8-bit).
// The step scalars are the caller's: rules/lion/torch.py's `step_scalars`, the exact reference's function, so the
// update is the reference's bit for bit (the element's ops in its order, each rounded as torch rounds it; bf16
// exp_avg rounded stochastically with the reference's random bits, 8-bit exp_avg with the signed codec, block by
// block as adamw_lowbit). Lion keeps no bias correction: no `step` is read (the bf16 keys carry it).

// One tensor's pointers for Lion: exp_avg's fp32 or bf16 values or 8-bit codes, their per-block scales in 8-bit,
// the master only with master weights.
struct LionTensor {
  void* param;
  const void* grad;
  float* master;
  void* exp_avg;
  float* exp_avg_scale;
  uint32_t key;  // state_format.random_key of this tensor and step (bf16 exp_avg's stochastic rounding)
};

// One chunk of one tensor (whole blocks but the tensor's last); P and kMaster as in update_piece. fp32 exp_avg is
// updated in place element by element; bf16 and 8-bit are decoded, updated and encoded per block.
template <int kFormat, typename P, bool kMaster>
void lion_piece(const LionTensor& t, const fused_stable::lion::StepScalars& s, int64_t begin, int64_t end) {
  P* __restrict param = static_cast<P*>(t.param);
  const P* __restrict grad = static_cast<const P*>(t.grad);
  float* __restrict master = t.master;
  if (kFormat == 0) {
    float* __restrict exp_avg = static_cast<float*>(t.exp_avg);
    for (int64_t i = begin; i < end; ++i) {
      float p = kMaster ? master[i] : static_cast<float>(param[i]);  // a master holds the fp32 value
      fused_stable::lion::lion_element(p, static_cast<float>(grad[i]), exp_avg[i], s);
      if (kMaster) {
        master[i] = p;
      }
      param[i] = static_cast<P>(p);  // fp32, or to nearest even (the kernels' to_storage)
    }
    return;
  }
  float m[kQuantBlock];
  for (int64_t first = begin; first < end; first += kQuantBlock) {
    const int64_t n = std::min(kQuantBlock, end - first);
    if (kFormat == kFormatQ8) {
      decode_signed(static_cast<const int8_t*>(t.exp_avg) + first, t.exp_avg_scale[first / kQuantBlock], m, n);
    } else {
      const auto* m16 = static_cast<const c10::BFloat16*>(t.exp_avg) + first;
      for (int64_t k = 0; k < n; ++k) {
        m[k] = static_cast<float>(m16[k]);
      }
    }
    for (int64_t k = 0; k < n; ++k) {
      const int64_t i = first + k;
      float p = kMaster ? master[i] : static_cast<float>(param[i]);  // (as above)
      fused_stable::lion::lion_element(p, static_cast<float>(grad[i]), m[k], s);
      if (kMaster) {
        master[i] = p;
      }
      param[i] = static_cast<P>(p);
    }
    if (kFormat == kFormatQ8) {
      t.exp_avg_scale[first / kQuantBlock] = encode_signed(m, static_cast<int8_t*>(t.exp_avg) + first, n);
    } else {
      auto* m16 = static_cast<c10::BFloat16*>(t.exp_avg) + first;
      for (int64_t k = 0; k < n; ++k) {  // Lion's STOCHASTIC_BF16: exp_avg
        m16[k] = round_stochastic_bf16(m[k], mix32(static_cast<uint32_t>(first + k) ^ t.key));
      }
    }
  }
}

template <int kFormat>
void lion_chunk(const LionTensor& t, at::ScalarType dtype, const fused_stable::lion::StepScalars& s, int64_t begin,
                int64_t end) {
  const bool master = t.master != nullptr;
  switch (dtype) {
    case at::kFloat:
      return master ? lion_piece<kFormat, float, true>(t, s, begin, end)
                    : lion_piece<kFormat, float, false>(t, s, begin, end);
    case at::kBFloat16:
      return master ? lion_piece<kFormat, c10::BFloat16, true>(t, s, begin, end)
                    : lion_piece<kFormat, c10::BFloat16, false>(t, s, begin, end);
    default:
      return master ? lion_piece<kFormat, c10::Half, true>(t, s, begin, end)
                    : lion_piece<kFormat, c10::Half, false>(t, s, begin, end);
  }
}

// Checks one param's tensors and returns its pointers (a non-contiguous grad read from a copy in `grad`).
LionTensor lion_tensor(const at::Tensor& p, at::Tensor& grad, const at::Tensor& exp_avg, const at::Tensor* scale,
                       const at::Tensor* master, int64_t state_format, int64_t key) {
  if (!grad.is_contiguous()) {
    grad = grad.contiguous();  // rare (a transposed grad): read from a copy
  }
  const at::ScalarType m_dtype = state_format == kFormatQ8 ? at::kChar
                                 : state_format == kFormatBF16 ? at::kBFloat16
                                                               : at::kFloat;
  TORCH_CHECK(is_plain(p, p, p.scalar_type()) && is_plain(grad, p, p.scalar_type()) && is_plain(exp_avg, p, m_dtype) &&
                  (master == nullptr || is_plain_fp32(*master, p)),
              "fused_stable::lion: params and grads must be contiguous CPU tensors of one dtype and size, exp_avg "
              "contiguous of that size in the state format's dtype, the master copies fp32");
  TORCH_CHECK(scale == nullptr || is_scales_of(*scale, p),
              "fused_stable::lion: 8-bit scales must be contiguous fp32, one per block of 128 elements");
  return {p.data_ptr(), grad.const_data_ptr(),        master ? master->data_ptr<float>() : nullptr,
          exp_avg.data_ptr(), scale ? scale->data_ptr<float>() : nullptr, static_cast<uint32_t>(key)};
}

// Lion on fp32, bf16 or fp16 params (grads of the same dtype) with exp_avg in `state_format` (0 fp32, 1 bf16, 2
// 8-bit: state_format.py; `exp_avg_scales` its per-block scales in 8-bit, else empty) and, when `masters` is not
// empty, fp32 master copies (the master is updated, the param stores its rounding). `scalars`: 7 fp32 values,
// rules/lion/torch.py's `step_scalars` in its order (grad_mul, decay, lr, beta1, beta2, 1 - beta1, 1 - beta2);
// `keys`: [n] int64, state_format.random_key per tensor (read in bf16 only).
void lion(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_scales,
          at::TensorList masters, const at::Tensor& scalars, const at::Tensor& keys, int64_t state_format) {
  const int64_t n = static_cast<int64_t>(params.size());
  const bool with_masters = !masters.empty();
  const bool q8 = state_format == kFormatQ8;
  TORCH_CHECK(state_format >= 0 && state_format <= kFormatQ8, "fused_stable::lion: state_format must be 0, 1 or 2");
  TORCH_CHECK(static_cast<int64_t>(grads.size()) == n && static_cast<int64_t>(exp_avgs.size()) == n &&
                  (!with_masters || static_cast<int64_t>(masters.size()) == n) &&
                  static_cast<int64_t>(exp_avg_scales.size()) == (q8 ? n : 0),
              "fused_stable::lion: the lists must have one tensor per param (scales in 8bit only)");
  TORCH_CHECK(scalars.scalar_type() == at::kFloat && scalars.is_contiguous() &&
                  scalars.numel() == fused_stable::lion::kNumScalars && scalars.device().is_cpu(),
              "fused_stable::lion: scalars must be 7 contiguous fp32 values (rules/lion/torch.py's step_scalars)");
  TORCH_CHECK(keys.scalar_type() == at::kLong && keys.is_contiguous() && keys.numel() == n,
              "fused_stable::lion: keys must be int64, one per param");
  const fused_stable::lion::StepScalars s = fused_stable::lion::scalars_from(scalars.const_data_ptr<float>());
  const at::ScalarType dtype = n > 0 ? params[0].scalar_type() : at::kFloat;
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "fused_stable::lion: unsupported param dtype ", dtype);
  std::vector<at::Tensor> dense_grads(grads.begin(), grads.end());
  std::vector<LionTensor> tensors(n);
  std::vector<int64_t> sizes(n);
  const int64_t* key_values = keys.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(params[t].scalar_type() == dtype, "fused_stable::lion: the params must share one dtype");
    tensors[t] = lion_tensor(params[t], dense_grads[t], exp_avgs[t], q8 ? &exp_avg_scales[t] : nullptr,
                             with_masters ? &masters[t] : nullptr, state_format, key_values[t]);
    sizes[t] = params[t].numel();
  }
  const std::vector<Piece> pieces = cut(sizes, kUpdateChunk);  // whole 8-bit blocks: a multiple of 128
  const int64_t num_pieces = static_cast<int64_t>(pieces.size());
  at::parallel_for(0, num_pieces, 1, [&](int64_t first, int64_t last) {
    for (int64_t j = first; j < last; ++j) {
      const Piece& piece = pieces[num_pieces - 1 - j];  // last chunk first, as adamw
      const LionTensor& t = tensors[piece.tensor];
      if (q8) {
        lion_chunk<kFormatQ8>(t, dtype, s, piece.begin, piece.end);
      } else if (state_format == kFormatBF16) {
        lion_chunk<kFormatBF16>(t, dtype, s, piece.begin, piece.end);
      } else {
        lion_chunk<0>(t, dtype, s, piece.begin, piece.end);
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
  m.def(
      "adamw_lowbit(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] max_exp_avg_sqs, Tensor(e!)[] exp_avg_scales, Tensor(f!)[] exp_avg_sq_scales, "
      "Tensor(g!)[] max_exp_avg_sq_scales, Tensor(h!)[] masters, Tensor scalars, Tensor keys, int state_format) -> ()",
      &adamw_lowbit);
  m.def(
      "lion(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_scales, "
      "Tensor(d!)[] masters, Tensor scalars, Tensor keys, int state_format) -> ()",
      &lion);
}
