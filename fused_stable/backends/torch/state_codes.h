// The 8-bit state codes in code format v2 (fused_stable/state_format.py, "Q8 codes"), for the compiled CPU op:
// the same maps as the torch reference (state_format.encode_* / decode_*) and the Triton kernels
// (kernels/state_codes.py), operation by operation in fp32, so the three give the same codes, scales and decoded
// values bit for bit (tests/core/test_state_codes.py). Build with -ffp-contract=off (cpu_ops.py does): a fused
// multiply-add would round `y * levels + 0.5` once instead of twice.
//
// No square root and no division per element: a "pseudo root" on the fp32 bit pattern. For r in [0, 1],
// (bits(r) >> 1) + kRoot2 halves the exponent and carries the mantissa linearly (a piecewise-linear square root,
// exact at powers of 4, monotone, >= sqrt(r)); (bits(r) >> 2) + kRoot4 is it taken twice. Decoding inverts it on
// the bit pattern: ((bits(q) - constant) << shift), 0 for q = 0. Per block of n <= 128 elements:
//   s = the largest |x| (an integer max of the magnitude bits: a NaN anywhere makes s that NaN; 0 below FLT_MIN,
//       so 1 / s is finite), r = |x| * (1 / s) with its bits clamped to 1.0's (a NaN or infinity counts as 1);
//   signed   (exp_avg)     c = +-(int)(127 * proot2(r) + 0.5),  x = +-psquare2(|c| / 127) * s
//   unsigned (exp_avg_sq)  c =    (int)(255 * proot4(r) + 0.5),  x =    psquare4(c / 255) * s
// Every input, NaN and infinity included, has a defined code; a block with a non-finite scale decodes to
// non-finite values (0 * inf), as the reference does.
//
// The functions have the names and signatures of cpu_step.cpp's v1 ones (decode_* fill `out`, encode_* write the
// codes and return the block's scale), in namespace fused_stable::state_codes.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#ifndef FUSED_STABLE_INLINE
#define FUSED_STABLE_INLINE __attribute__((always_inline)) inline
#endif

namespace fused_stable {
namespace state_codes {

constexpr uint32_t kOneBits = 0x3F800000u;    // 1.0f
constexpr uint32_t kMagnitude = 0x7FFFFFFFu;  // all but the sign bit
constexpr uint32_t kSign = 0x80000000u;
constexpr uint32_t kFltMinBits = 0x00800000u;  // 2^-126, the smallest normal fp32
constexpr uint32_t kRoot2 = 0x1FC00000u;       // proot2: (bits >> 1) + kRoot2 maps 1.0 to 1.0
constexpr uint32_t kRoot4 = 0x2FA00000u;       // proot4: (bits >> 2) + kRoot4 maps 1.0 to 1.0
constexpr float kSignedLevels = 127.0f;        // state_format.EXP_AVG_LEVELS
constexpr float kUnsignedLevels = 255.0f;      // state_format.EXP_AVG_SQ_LEVELS

FUSED_STABLE_INLINE uint32_t bits_of(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
}

FUSED_STABLE_INLINE float float_of(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// state_format.pseudo_root: r's magnitude bits clamped to 1.0's, shifted, plus the constant
template <int kShift, uint32_t kConstant>
FUSED_STABLE_INLINE float pseudo_root(float ratio) {
  const uint32_t bits = std::min(bits_of(ratio) & kMagnitude, kOneBits);
  return float_of((bits >> kShift) + kConstant);
}

// state_format.pseudo_square: ((bits(|q|) - constant) << shift), 0 for |q| below the constant's value, q's sign kept
template <int kShift, uint32_t kConstant>
FUSED_STABLE_INLINE float pseudo_square(float q) {
  const int32_t magnitude = static_cast<int32_t>(bits_of(q) & kMagnitude) - static_cast<int32_t>(kConstant);
  const uint32_t root = static_cast<uint32_t>(std::max(magnitude, 0)) << kShift;
  return float_of(root | (bits_of(q) & kSign));
}

// The largest magnitude's bits of a block, kept as the block's values are produced: an integer max (vectorises,
// and a NaN's bits lie above infinity's, so a NaN anywhere is the max)
FUSED_STABLE_INLINE uint32_t largest_bits(uint32_t largest, float x) { return std::max(largest, bits_of(x) & kMagnitude); }

// The block's scale from its largest magnitude's bits: 0 below FLT_MIN (so 1 / s is finite)
FUSED_STABLE_INLINE float scale_of(uint32_t largest) { return float_of(largest < kFltMinBits ? 0u : largest); }

// The block's scale: the largest magnitude, 0 below FLT_MIN
FUSED_STABLE_INLINE float block_scale(const float* x, int64_t n) {
  uint32_t largest = 0;
  for (int64_t i = 0; i < n; ++i) {
    largest = largest_bits(largest, x[i]);
  }
  return scale_of(largest);
}

FUSED_STABLE_INLINE float inverse_of(float scale) { return scale > 0.0f ? 1.0f / scale : 0.0f; }

// floor(y + 0.5) for y in [0, levels]: a truncation, which vectorises (floorf does not, here)
FUSED_STABLE_INLINE int32_t round_up(float y) { return static_cast<int32_t>(y + 0.5f); }

// state_format.decode_signed of one code: psquare2(c / 127) * s, c's sign kept
FUSED_STABLE_INLINE float decode_signed_one(int8_t code, float scale) {
  constexpr float kInverse = static_cast<float>(1.0 / 127.0);
  return pseudo_square<1, kRoot2>(static_cast<float>(code) * kInverse) * scale;
}

// state_format.decode_unsigned of one code: psquare4(c / 255) * s
FUSED_STABLE_INLINE float decode_unsigned_one(uint8_t code, float scale) {
  constexpr float kInverse = static_cast<float>(1.0 / 255.0);
  return pseudo_square<2, kRoot4>(static_cast<float>(code) * kInverse) * scale;
}

// state_format.encode_signed of one value, given 1 / its block's scale: round(127 * proot2(|x| / s)), x's sign
FUSED_STABLE_INLINE int8_t encode_signed_one(float x, float inverse) {
  const float magnitude = float_of(bits_of(x) & kMagnitude);
  const int32_t code = round_up(pseudo_root<1, kRoot2>(magnitude * inverse) * kSignedLevels);
  return static_cast<int8_t>(x < 0.0f ? -code : code);
}

// state_format.encode_unsigned of one value, given 1 / its block's scale: round(255 * proot4(|x| / s))
FUSED_STABLE_INLINE uint8_t encode_unsigned_one(float x, float inverse) {
  const float magnitude = float_of(bits_of(x) & kMagnitude);
  return static_cast<uint8_t>(round_up(pseudo_root<2, kRoot4>(magnitude * inverse) * kUnsignedLevels));
}

// state_format.decode_signed on one block
FUSED_STABLE_INLINE void decode_signed(const int8_t* codes, float scale, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = decode_signed_one(codes[i], scale);
  }
}

// state_format.decode_unsigned on one block
FUSED_STABLE_INLINE void decode_unsigned(const uint8_t* codes, float scale, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    out[i] = decode_unsigned_one(codes[i], scale);
  }
}

// state_format.encode_signed on one block whose scale is known: the codes
FUSED_STABLE_INLINE void encode_signed_with(const float* x, float scale, int8_t* codes, int64_t n) {
  const float inverse = inverse_of(scale);
  for (int64_t i = 0; i < n; ++i) {
    codes[i] = encode_signed_one(x[i], inverse);
  }
}

// state_format.encode_unsigned on one block whose scale is known: the codes
FUSED_STABLE_INLINE void encode_unsigned_with(const float* x, float scale, uint8_t* codes, int64_t n) {
  const float inverse = inverse_of(scale);
  for (int64_t i = 0; i < n; ++i) {
    codes[i] = encode_unsigned_one(x[i], inverse);
  }
}

// state_format.encode_signed: s = the block's max |x|, c = round(127 * proot2(|x| / s)) with x's sign, ties up
FUSED_STABLE_INLINE float encode_signed(const float* x, int8_t* codes, int64_t n) {
  const float scale = block_scale(x, n);
  encode_signed_with(x, scale, codes, n);
  return scale;
}

// state_format.encode_unsigned: s = the block's max |x|, c = round(255 * proot4(|x| / s)), ties up
FUSED_STABLE_INLINE float encode_unsigned(const float* x, uint8_t* codes, int64_t n) {
  const float scale = block_scale(x, n);
  encode_unsigned_with(x, scale, codes, n);
  return scale;
}

}  // namespace state_codes
}  // namespace fused_stable
