// The state formats' element codes for the compiled CPU update (cpu_update.h), as kernels/state_codes.py is the
// Triton kernel's: bf16 stochastic rounding and the 8-bit blockwise codecs, state_format.py's arithmetic operation
// by operation in fp32 (IEEE division and square root: the hardware's correctly rounded ones, as
// state_format.sqrt_rn), so the compiled update is the exact reference's (exact_reference.py) bit for bit.
// The stochastic rounding of a bf16 state draws state_format.random_bits: mix32(element ^ key), the element's index
// in its whole param (its memory order: the tensors are contiguous; a shard's first element's index added), the key
// per tensor and step (state_format.random_key, computed by the caller).
// Every function here is always inlined into the update's block loop: its loops vectorise only so.

#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "state_codes.h"  // the 8-bit code format

#ifndef FUSED_STABLE_INLINE
#define FUSED_STABLE_INLINE __attribute__((always_inline)) inline
#endif

namespace fused_stable {
namespace cpu {

constexpr int64_t kQuantBlock = 128;  // state_format.QUANT_BLOCK

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

// The 8-bit codes (code format v2, state_format.py): one block decoded and encoded, state_codes.h's functions (the
// same in the torch reference and the Triton kernels)
using fused_stable::state_codes::decode_signed_one;
using fused_stable::state_codes::decode_unsigned_one;
using fused_stable::state_codes::encode_signed_with;
using fused_stable::state_codes::encode_unsigned_with;
using fused_stable::state_codes::largest_bits;
using fused_stable::state_codes::scale_of;

}  // namespace cpu
}  // namespace fused_stable
