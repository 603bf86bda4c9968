// The state formats' element codes for the compiled CPU update (cpu_update.h), as kernels/state_codes.py is the
// Triton kernel's: bf16 stochastic rounding and the 8-bit blockwise codecs, state_format.py's arithmetic operation
// by operation in fp32 (IEEE division and square root: the hardware's correctly rounded ones, as
// state_format.sqrt_rn), so the compiled update is the exact reference's (exact_reference.py) bit for bit.
// The stochastic rounding of a bf16 state draws state_format.random_bits: mix32(element ^ key), the element's index
// in its tensor (its memory order: the tensors are contiguous), the key per tensor and step
// (state_format.random_key, computed by the caller).
// Every function here is always inlined into the update's block loop: its loops vectorise only so.

#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#define FUSED_STABLE_INLINE __attribute__((always_inline)) inline

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

}  // namespace cpu
}  // namespace fused_stable
