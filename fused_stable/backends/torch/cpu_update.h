// The compiled CPU update, written once for every elementwise rule: a template over the rule (rules/<rule>/cpu.h:
// its Scalars and element), as kernels/update.py is the Triton kernel's rule-free skeleton around the rule's
// constexpr element. cpu_ops.py generates one small translation unit per rule with a cpu.h, which includes this
// file and the rule's header and registers the op `fused_stable::update_<rule>` (FUSED_STABLE_REGISTER_UPDATE
// below): a new rule's fast CPU path is its header alone.
//
// What is here is rule-free: fixed chunks of one tensor each (the same whatever the thread count), spread over
// torch's threads by at::parallel_for, last chunk first; fp32, bf16 or fp16 params (grads of the same dtype, read
// times the step's multiplier inside the rule's element, never written), fp32 master copies (the master is updated
// and the param stores its rounding to nearest even); up to kMaxStates state slots in the rule's order, stored in
// the state format: fp32 updated in place element by element; bf16 (to nearest, or stochastically where the rule
// says) in the same one pass; 8-bit in one pass per 128-element block (codes decoded, the element, each slot's
// running largest magnitude; then the block encoded from registers with that scale), with cpu_state_codes.h's
// arithmetic (state_format.py's).
// The rule's scalars are the caller's, one fp32 row per tensor (or one for all): rules/<rule>/torch.py computes them
// on the host, so the update is the exact reference's bit for bit (exact_reference.py), or for AdamW's fp32 state
// the fp64 scalars of torch.optim.AdamW. The codecs and roundings per slot come from the rule's Python declaration
// (`Rule.slot_codes`: one bit per slot), written into the rule's translation unit by cpu_ops.py: template arguments,
// because a branch per element stops the loop vectorising; the op checks the caller's bits against them.
// Built with -ffp-contract=off: IEEE fp32, each operation rounded as written (cpu_ops.py's flags).

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_state_codes.h"

namespace fused_stable {
namespace cpu {

constexpr int64_t kUpdateChunk = 1 << 16;  // elements per work item (5 streams of 256 KiB: a chunk stays in L2)
static_assert(kUpdateChunk % kQuantBlock == 0, "a chunk holds whole 8-bit blocks");
constexpr int kMaxStates = 3;                                 // kernels/update.py's MAX_STATES
constexpr int kFormatFP32 = 0, kFormatBF16 = 1, kFormatQ8 = 2;  // state_format.FP32, BF16, Q8

struct Piece {
  int64_t tensor, begin, end;
};

// Every tensor cut into chunks of `chunk` elements (the last of each tensor shorter), in tensor order.
inline std::vector<Piece> cut(const std::vector<int64_t>& sizes, int64_t chunk) {
  std::vector<Piece> pieces;
  for (int64_t t = 0; t < static_cast<int64_t>(sizes.size()); ++t) {
    for (int64_t begin = 0; begin < sizes[t]; begin += chunk) {
      pieces.push_back({t, begin, std::min(sizes[t], begin + chunk)});
    }
  }
  return pieces;
}

// One tensor's pointers: its states' fp32 or bf16 values or 8-bit codes in the rule's order, their per-block
// scales in 8-bit, the master only with master weights.
struct UpdateTensor {
  void* param;
  const void* grad;
  float* master;
  void* states[kMaxStates];
  float* scales[kMaxStates];
  uint32_t key;          // state_format.random_key of this tensor and step (bf16 stochastic rounding)
  int64_t first_element;  // the index of its first element in its whole param (a shard's; its random bits')
};

// The rule's declaration per slot, one bit each: the 8-bit codec is signed; the bf16 store rounds stochastically.
// A template argument of the block loop (compile-time codecs: a branch per element would stop it vectorising),
// built from the rule's Python declaration by the generated translation unit (cpu_ops.update_source) and checked
// against the caller's bits at every call.
struct SlotCodes {
  uint32_t signed_slots, stochastic_slots;
  constexpr bool is_signed(int slot) const { return (signed_slots >> slot) & 1u; }
  constexpr bool is_stochastic(int slot) const { return (stochastic_slots >> slot) & 1u; }
};

// Software prefetch, kPrefetchAhead elements (8 blocks) ahead of the block at `first`, of every stream the block
// loop reads and writes: with the hardware prefetchers alone the bf16 and 8-bit loops (more arithmetic per byte than
// fp32's, so fewer loads in flight) ran 10-30% slower (bf16 1.57-1.64 -> 1.14-1.18 ns/element, 8-bit 1.68-1.82 ->
// 1.52-1.56, one Intel Xeon core, benchmarks/cpu_update_alone.py); the fp32 loop measured no faster with it.
constexpr int64_t kPrefetchAhead = 8 * kQuantBlock;

template <bool kWrite, typename T>
FUSED_STABLE_INLINE void prefetch_block(const T* start) {
  const char* bytes = reinterpret_cast<const char*>(start);
  for (int64_t b = 0; b < kQuantBlock * static_cast<int64_t>(sizeof(T)); b += 64) {  // 64-byte cache lines
    __builtin_prefetch(bytes + b, kWrite ? 1 : 0, 3);
  }
}

template <bool kMaster, int kStates, typename P, typename S0, typename S1, typename S2>
FUSED_STABLE_INLINE void prefetch_ahead(const P* param, const P* grad, const float* master, const S0* s0,
                                        const S1* s1, const S2* s2, int64_t first, int64_t end) {
  const int64_t ahead = first + kPrefetchAhead;
  if (ahead + kQuantBlock > end) {
    return;
  }
  prefetch_block<true>(param + ahead);
  prefetch_block<false>(grad + ahead);
  if (kMaster) {
    prefetch_block<true>(master + ahead);
  }
  if (kStates > 0) {
    prefetch_block<true>(s0 + ahead);
  }
  if (kStates > 1) {
    prefetch_block<true>(s1 + ahead);
  }
  if (kStates > 2) {
    prefetch_block<true>(s2 + ahead);
  }
}

// One fp32 chunk of one tensor, every state updated in place. P is the param's (and grad's) dtype: fp32, or bf16 /
// fp16 read as fp32 and stored rounded to nearest even; with kMaster the fp32 master copy is the value updated and
// the param its rounding. The pointers are parameters (restrict): the loop vectorises with no aliasing checks.
template <class Rule, int kStates, bool kOption, typename P, bool kMaster>
void fp32_piece(P* __restrict param, const P* __restrict grad, float* __restrict master, float* __restrict s0,
                float* __restrict s1, float* __restrict s2, const typename Rule::Scalars& s, int64_t begin,
                int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    float p = kMaster ? master[i] : static_cast<float>(param[i]);
    float a = kStates > 0 ? s0[i] : 0.0f;  // a slot past the rule's count: a zero the element leaves alone
    float b = kStates > 1 ? s1[i] : 0.0f;
    float c = kStates > 2 ? s2[i] : 0.0f;
    Rule::template element<kOption>(p, static_cast<float>(grad[i]), a, b, c, s);
    if (kStates > 0) {
      s0[i] = a;
    }
    if (kStates > 1) {
      s1[i] = b;
    }
    if (kStates > 2) {
      s2[i] = c;
    }
    if (kMaster) {
      master[i] = p;
    }
    param[i] = static_cast<P>(p);
  }
}

// What a slot's element is stored as: bf16, or its 8-bit code (int8 for a signed codec, uint8 for an unsigned one)
template <int kFormat, bool kSigned>
using Stored = std::conditional_t<kFormat == kFormatQ8, std::conditional_t<kSigned, int8_t, uint8_t>, c10::BFloat16>;

// One slot's stored element as fp32: bf16 widened, or its 8-bit code decoded with its block's scale.
template <typename S>
FUSED_STABLE_INLINE float load_value(S stored, float scale) {
  if constexpr (std::is_same_v<S, int8_t>) {
    return decode_signed_one(stored, scale);
  } else if constexpr (std::is_same_v<S, uint8_t>) {
    return decode_unsigned_one(stored, scale);
  } else {
    return static_cast<float>(stored);
  }
}

// One slot's element stored in bf16: rounded to nearest even, or stochastically (the element's index in its whole
// param and the tensor's key: the reference's random bits).
template <bool kStochastic>
FUSED_STABLE_INLINE c10::BFloat16 to_bf16(float value, uint32_t key, int64_t element) {
  return kStochastic ? round_stochastic_bf16(value, mix32(static_cast<uint32_t>(element) ^ key)) : c10::BFloat16(value);
}

// One slot's 8-bit block encoded with its scale (the block's largest magnitude, kept while its values were made).
template <typename S>
FUSED_STABLE_INLINE void store_codes(const float* values, uint32_t largest, S* codes, float& scale, int64_t n) {
  scale = scale_of(largest);
  if constexpr (std::is_same_v<S, int8_t>) {
    encode_signed_with(values, scale, codes, n);
  } else {
    encode_unsigned_with(values, scale, codes, n);
  }
}

// One bf16 or 8-bit chunk (whole blocks, but the tensor's last) of one tensor, one pass per 8-bit block: each
// element's states loaded (bf16 widened, codes decoded), the rule's element, the param stored, and the new states
// stored in bf16, or in 8-bit kept in registers with each slot's running largest magnitude, then encoded with that
// scale (the encode alone needs the whole block). The pointers are parameters (restrict): the loop vectorises with
// no aliasing checks. P and kMaster as in fp32_piece; S0-S2 the slots' stored types.
template <class Rule, int kFormat, int kStates, bool kOption, typename P, bool kMaster, SlotCodes kCodes, typename S0,
          typename S1, typename S2>
void block_loop(P* __restrict param, const P* __restrict grad, float* __restrict master, S0* __restrict s0,
                S1* __restrict s1, S2* __restrict s2, float* const* scales, uint32_t key, int64_t first_element,
                const typename Rule::Scalars& s, int64_t begin, int64_t end) {
  constexpr bool kCoded = kFormat == kFormatQ8;
  alignas(64) float values[kMaxStates][kQuantBlock];
  for (int64_t first = begin; first < end; first += kQuantBlock) {  // bf16 by blocks too: the prefetch's step
    const int64_t n = std::min(kQuantBlock, end - first);
    prefetch_ahead<kMaster, kStates>(param, grad, master, s0, s1, s2, first, end);
    const int64_t b = first / kQuantBlock;
    const float scale0 = kCoded && kStates > 0 ? scales[0][b] : 0.0f;
    const float scale1 = kCoded && kStates > 1 ? scales[1][b] : 0.0f;
    const float scale2 = kCoded && kStates > 2 ? scales[2][b] : 0.0f;
    uint32_t largest0 = 0, largest1 = 0, largest2 = 0;
    for (int64_t k = 0; k < n; ++k) {
      const int64_t i = first + k;
      float p = kMaster ? master[i] : static_cast<float>(param[i]);  // (a master holds the fp32 value)
      float v0 = kStates > 0 ? load_value(s0[i], scale0) : 0.0f;
      float v1 = kStates > 1 ? load_value(s1[i], scale1) : 0.0f;
      float v2 = kStates > 2 ? load_value(s2[i], scale2) : 0.0f;
      Rule::template element<kOption>(p, static_cast<float>(grad[i]), v0, v1, v2, s);
      if (kMaster) {
        master[i] = p;
      }
      param[i] = static_cast<P>(p);
      if constexpr (kCoded) {  // the slots the rule keeps: their values and running largest magnitudes
        if (kStates > 0) {
          values[0][k] = v0;
          largest0 = largest_bits(largest0, v0);
        }
        if (kStates > 1) {
          values[1][k] = v1;
          largest1 = largest_bits(largest1, v1);
        }
        if (kStates > 2) {
          values[2][k] = v2;
          largest2 = largest_bits(largest2, v2);
        }
      } else {
        if (kStates > 0) {
          s0[i] = to_bf16<kCodes.is_stochastic(0)>(v0, key, first_element + i);
        }
        if (kStates > 1) {
          s1[i] = to_bf16<kCodes.is_stochastic(1)>(v1, key, first_element + i);
        }
        if (kStates > 2) {
          s2[i] = to_bf16<kCodes.is_stochastic(2)>(v2, key, first_element + i);
        }
      }
    }
    if constexpr (kCoded) {  // each slot's codes and scale
      if (kStates > 0) {
        store_codes(values[0], largest0, s0 + first, scales[0][b], n);
      }
      if (kStates > 1) {
        store_codes(values[1], largest1, s1 + first, scales[1][b], n);
      }
      if (kStates > 2) {
        store_codes(values[2], largest2, s2 + first, scales[2][b], n);
      }
    }
  }
}

template <class Rule, int kFormat, int kStates, bool kOption, typename P, bool kMaster, SlotCodes kCodes>
void block_piece(const UpdateTensor& t, const typename Rule::Scalars& s, int64_t begin, int64_t end) {
  using S0 = Stored<kFormat, kCodes.is_signed(0)>;
  using S1 = Stored<kFormat, kCodes.is_signed(1)>;
  using S2 = Stored<kFormat, kCodes.is_signed(2)>;
  block_loop<Rule, kFormat, kStates, kOption, P, kMaster, kCodes>(
      static_cast<P*>(t.param), static_cast<const P*>(t.grad), t.master, static_cast<S0*>(t.states[0]),
      static_cast<S1*>(t.states[1]), static_cast<S2*>(t.states[2]), t.scales, t.key, t.first_element, s, begin, end);
}

template <class Rule, class Codes, int kFormat, bool kOption, typename P>
void typed_piece(const UpdateTensor& t, const typename Rule::Scalars& s, int64_t begin, int64_t end) {
  constexpr int kStates = Rule::num_states(kOption);
  static_assert(kStates >= 0 && kStates <= kMaxStates, "a rule keeps at most kMaxStates states");
  const bool with_master = t.master != nullptr;
  if constexpr (kFormat == kFormatFP32) {
    P* param = static_cast<P*>(t.param);
    const P* grad = static_cast<const P*>(t.grad);
    float* slot[kMaxStates];
    for (int k = 0; k < kMaxStates; ++k) {
      slot[k] = k < kStates ? static_cast<float*>(t.states[k]) : nullptr;
    }
    if (with_master) {
      fp32_piece<Rule, kStates, kOption, P, true>(param, grad, t.master, slot[0], slot[1], slot[2], s, begin, end);
    } else {
      fp32_piece<Rule, kStates, kOption, P, false>(param, grad, nullptr, slot[0], slot[1], slot[2], s, begin, end);
    }
  } else if (with_master) {
    block_piece<Rule, kFormat, kStates, kOption, P, true, Codes::of(kOption)>(t, s, begin, end);
  } else {
    block_piece<Rule, kFormat, kStates, kOption, P, false, Codes::of(kOption)>(t, s, begin, end);
  }
}

template <class Rule, class Codes, int kFormat, bool kOption>
void option_piece(const UpdateTensor& t, at::ScalarType dtype, const typename Rule::Scalars& s, int64_t begin,
                  int64_t end) {
  switch (dtype) {
    case at::kFloat:
      return typed_piece<Rule, Codes, kFormat, kOption, float>(t, s, begin, end);
    case at::kBFloat16:
      return typed_piece<Rule, Codes, kFormat, kOption, c10::BFloat16>(t, s, begin, end);
    default:  // at::kHalf (checked by the op)
      return typed_piece<Rule, Codes, kFormat, kOption, c10::Half>(t, s, begin, end);
  }
}

// One chunk: the instantiation for the call's state format, option and param dtype (option=true is instantiated
// only for a rule that has one).
template <class Rule, class Codes, int kFormat>
void format_piece(const UpdateTensor& t, at::ScalarType dtype, bool option, const typename Rule::Scalars& s,
                  int64_t begin, int64_t end) {
  if constexpr (Rule::kHasOption) {
    if (option) {
      return option_piece<Rule, Codes, kFormat, true>(t, dtype, s, begin, end);
    }
  }
  option_piece<Rule, Codes, kFormat, false>(t, dtype, s, begin, end);
}

inline bool is_plain(const at::Tensor& t, const at::Tensor& like, at::ScalarType dtype) {
  return t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() && t.numel() == like.numel();
}

inline bool is_scales_of(const at::Tensor& scales, const at::Tensor& like) {
  return is_plain(scales, scales, at::kFloat) && scales.numel() == (like.numel() + kQuantBlock - 1) / kQuantBlock;
}

// The dtype a state slot is stored in: fp32, bf16, or the slot's 8-bit code dtype (state_format.CODE_DTYPES).
inline at::ScalarType slot_dtype(int64_t state_format, bool is_signed) {
  if (state_format == kFormatQ8) {
    return is_signed ? at::kChar : at::kByte;
  }
  return state_format == kFormatBF16 ? at::kBFloat16 : at::kFloat;
}

// The lists of one call, checked: everything a CPU tensor, one param dtype the op compiles, one tensor per param in
// each list (states and scales slot by slot: slot k of tensor t at k * n + t; scales in 8-bit only), the rule's
// number of scalars in each row, one row per tensor or one for all.
inline void check_lists(int64_t n, int64_t num_states, int64_t num_scalars, at::TensorList params,
                        at::TensorList grads, at::TensorList states, at::TensorList scales, at::TensorList masters,
                        const at::Tensor& scalars, const at::Tensor& keys, const at::Tensor& first_elements,
                        int64_t state_format) {
  const char* op = "fused_stable's compiled CPU update";
  TORCH_CHECK(state_format >= kFormatFP32 && state_format <= kFormatQ8, op, ": state_format must be 0, 1 or 2");
  const int64_t scale_count = state_format == kFormatQ8 ? n * num_states : 0;
  auto sized = [](at::TensorList list, int64_t count) { return static_cast<int64_t>(list.size()) == count; };
  TORCH_CHECK(sized(grads, n) && sized(states, n * num_states) && sized(scales, scale_count) &&
                  (masters.empty() || sized(masters, n)),
              op, ": the lists must have one tensor per param (", num_states,
              " states and their scales slot by slot, scales in 8bit only)");
  TORCH_CHECK(scalars.scalar_type() == at::kFloat && scalars.is_contiguous() && scalars.device().is_cpu() &&
                  scalars.dim() == 2 && scalars.size(1) == num_scalars &&
                  (scalars.size(0) == n || scalars.size(0) == 1),
              op, ": scalars must be contiguous fp32 [params or 1, ", num_scalars, "] (the rule's step_scalars)");
  TORCH_CHECK(keys.scalar_type() == at::kLong && keys.is_contiguous() && keys.numel() == n, op,
              ": keys must be int64, one per param");
  TORCH_CHECK(first_elements.scalar_type() == at::kLong && first_elements.is_contiguous() &&
                  first_elements.numel() == n,
              op, ": first_elements must be int64, one per param");
  const at::ScalarType dtype = n > 0 ? params[0].scalar_type() : at::kFloat;
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op, ": unsupported param dtype ",
              dtype);
}

// One param's tensors checked and their pointers (a non-contiguous grad read from a copy kept in `grad`).
inline UpdateTensor tensor_of(int64_t t, int64_t n, int64_t num_states, at::TensorList params, at::Tensor& grad,
                              at::TensorList states, at::TensorList scales, at::TensorList masters,
                              int64_t state_format, SlotCodes codes, int64_t key, int64_t first_element) {
  const char* op = "fused_stable's compiled CPU update";
  const at::Tensor& p = params[t];
  if (!grad.is_contiguous()) {
    grad = grad.contiguous();  // rare (a transposed grad): read from a copy
  }
  TORCH_CHECK(p.scalar_type() == params[0].scalar_type() && is_plain(p, p, p.scalar_type()) &&
                  is_plain(grad, p, p.scalar_type()) && (masters.empty() || is_plain(masters[t], p, at::kFloat)),
              op, ": params and grads must be contiguous CPU tensors of one dtype and size, the masters fp32");
  UpdateTensor u{p.data_ptr(), grad.const_data_ptr(), masters.empty() ? nullptr : masters[t].data_ptr<float>(),
                 {nullptr, nullptr, nullptr}, {nullptr, nullptr, nullptr}, static_cast<uint32_t>(key), first_element};
  for (int64_t slot = 0; slot < num_states; ++slot) {
    const at::Tensor& state = states[slot * n + t];
    TORCH_CHECK(is_plain(state, p, slot_dtype(state_format, codes.is_signed(slot))), op,
                ": each state must be contiguous of its param's size in the state format's dtypes");
    u.states[slot] = state.data_ptr();
    if (state_format == kFormatQ8) {
      TORCH_CHECK(is_scales_of(scales[slot * n + t], p), op,
                  ": 8-bit scales must be contiguous fp32, one per block of 128 elements");
      u.scales[slot] = scales[slot * n + t].data_ptr<float>();
    }
  }
  return u;
}

// The rule's update of every tensor of one call (the op `fused_stable::update_<rule>`): `states` and `scales` slot
// by slot (see check_lists), `masters` empty or one fp32 copy per param, `scalars` the rule's step scalars ([n or
// 1, Rule::kNumScalars] fp32), `keys` each tensor's stochastic-rounding key and `first_elements` the index of its
// first element in its whole param (a shard's: the random bits hash global indices; both read in bf16 only),
// `option` the group's option (AdamW's amsgrad), `signed_slots` / `stochastic_slots` the rule's codecs and bf16
// roundings (checked against the compiled ones).
template <class Rule, class Codes>
void update(at::TensorList params, at::TensorList grads, at::TensorList states, at::TensorList scales,
            at::TensorList masters, const at::Tensor& scalars, const at::Tensor& keys,
            const at::Tensor& first_elements, int64_t state_format, bool option, int64_t signed_slots,
            int64_t stochastic_slots) {
  const int64_t n = static_cast<int64_t>(params.size());
  TORCH_CHECK(!option || Rule::kHasOption, "fused_stable's compiled CPU update: this rule takes no option");
  const int64_t num_states = Rule::num_states(option);
  check_lists(n, num_states, Rule::kNumScalars, params, grads, states, scales, masters, scalars, keys,
              first_elements, state_format);
  const SlotCodes codes = Codes::of(option);  // the rule's declaration, compiled in: the caller's must agree
  TORCH_CHECK(state_format != kFormatQ8 || signed_slots == codes.signed_slots,
              "fused_stable's compiled CPU update: called with signed 8-bit slots ", signed_slots,
              ", built for the rule's declared ", codes.signed_slots);
  TORCH_CHECK(state_format != kFormatBF16 || stochastic_slots == codes.stochastic_slots,
              "fused_stable's compiled CPU update: called with stochastic bf16 slots ", stochastic_slots,
              ", built for the rule's declared ", codes.stochastic_slots);
  std::vector<at::Tensor> dense_grads(grads.begin(), grads.end());
  std::vector<UpdateTensor> tensors(n);
  std::vector<typename Rule::Scalars> rows;
  std::vector<int64_t> sizes(n);
  const float* row = scalars.const_data_ptr<float>();
  const int64_t* key = keys.const_data_ptr<int64_t>();
  const int64_t* first_element = first_elements.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t) {
    tensors[t] = tensor_of(t, n, num_states, params, dense_grads[t], states, scales, masters, state_format, codes,
                           key[t], first_element[t]);
    sizes[t] = params[t].numel();
  }
  for (int64_t r = 0; r < scalars.size(0); ++r) {
    rows.emplace_back(row + r * Rule::kNumScalars);
  }
  const bool one_row = rows.size() == 1;
  const at::ScalarType dtype = n > 0 ? params[0].scalar_type() : at::kFloat;
  const std::vector<Piece> pieces = cut(sizes, kUpdateChunk);  // whole 8-bit blocks: the chunk is a multiple of 128
  // last chunk first: the grads the norm pass read last are still in the caches (measured 1-9% faster on the
  // 25M-param dense set with one thread; elementwise, so the order changes no value)
  const int64_t num_pieces = static_cast<int64_t>(pieces.size());
  at::parallel_for(0, num_pieces, 1, [&](int64_t first, int64_t last) {
    for (int64_t j = first; j < last; ++j) {
      const Piece& piece = pieces[num_pieces - 1 - j];
      const UpdateTensor& t = tensors[piece.tensor];
      const typename Rule::Scalars& s = rows[one_row ? 0 : piece.tensor];
      if (state_format == kFormatQ8) {
        format_piece<Rule, Codes, kFormatQ8>(t, dtype, option, s, piece.begin, piece.end);
      } else if (state_format == kFormatBF16) {
        format_piece<Rule, Codes, kFormatBF16>(t, dtype, option, s, piece.begin, piece.end);
      } else {
        format_piece<Rule, Codes, kFormatFP32>(t, dtype, option, s, piece.begin, piece.end);
      }
    }
  });
}

}  // namespace cpu
}  // namespace fused_stable

// The op of the rule whose header defines fused_stable::<rule>::Rule, as `fused_stable::update_<rule>` (one line in
// the translation unit cpu_ops.py generates per rule; TORCH_LIBRARY_FRAGMENT: every rule adds to the one library).
// The four masks are the rule's slot codes without and with its option (SlotCodes: signed 8-bit codec, stochastic
// bf16 rounding, one bit per slot), which cpu_ops.update_source writes from the rule's Python declaration.
#define FUSED_STABLE_REGISTER_UPDATE(rule, signed_plain, stochastic_plain, signed_option, stochastic_option)      \
  namespace fused_stable {                                                                                      \
  namespace rule {                                                                                              \
  struct Codes {                                                                                                \
    static constexpr cpu::SlotCodes of(bool option) {                                                           \
      return option ? cpu::SlotCodes{signed_option, stochastic_option}                                          \
                    : cpu::SlotCodes{signed_plain, stochastic_plain};                                           \
    }                                                                                                           \
  };                                                                                                            \
  }                                                                                                             \
  }                                                                                                             \
  TORCH_LIBRARY_FRAGMENT(fused_stable, m) {                                                                     \
    m.def("update_" #rule                                                                                       \
          "(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] states, Tensor(c!)[] scales, Tensor(d!)[] masters, " \
          "Tensor scalars, Tensor keys, Tensor first_elements, int state_format, bool option, int signed_slots, "  \
          "int stochastic_slots) -> ()",                                                                        \
          &fused_stable::cpu::update<fused_stable::rule::Rule, fused_stable::rule::Codes>);                     \
  }
