// benchmarks/state_codes_cpu.py's loop: the 8-bit codes of code format v1 (cpu_step.cpp's at main 977f179) and v2
// (fused_stable/backends/torch/state_codes.h), around an EMA per element, timed in C++.
#include <torch/extension.h>

#include <chrono>
#include <cmath>

#include "state_codes.h"

namespace v1 {  // as cpu_step.cpp had them at main 977f179

#define V1_INLINE __attribute__((always_inline)) inline
constexpr int64_t kQuantBlock = 128;

V1_INLINE void decode_signed(const int8_t* codes, float scale, float* out, int64_t n) {
  constexpr float kInverse = static_cast<float>(1.0 / 127.0);
  for (int64_t i = 0; i < n; ++i) {
    const float q = static_cast<float>(codes[i]) * kInverse;
    out[i] = q * std::fabs(q) * scale;
  }
}

V1_INLINE void decode_unsigned(const uint8_t* codes, float scale, float* out, int64_t n) {
  constexpr float kInverse = static_cast<float>(1.0 / 255.0);
  for (int64_t i = 0; i < n; ++i) {
    const float q = static_cast<float>(codes[i]) * kInverse;
    const float root = q * q * scale;
    out[i] = root * root;
  }
}

V1_INLINE float block_max(const float* values, int64_t n) {
  int32_t largest = 0;
  for (int64_t i = 0; i < n; ++i) {
    int32_t bits;
    std::memcpy(&bits, values + i, sizeof(bits));
    largest = std::max(largest, bits & 0x7FFFFFFF);
  }
  float result;
  std::memcpy(&result, &largest, sizeof(result));
  return result;
}

V1_INLINE int32_t round_up(float y) { return static_cast<int32_t>(y + 0.5f); }
V1_INLINE float inverse_of(float scale) { return scale > 0.0f ? 1.0f / scale : 0.0f; }

V1_INLINE float encode_signed(const float* x, int8_t* codes, int64_t n) {
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

V1_INLINE float encode_unsigned(const float* x, uint8_t* codes, int64_t n) {
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

}  // namespace v1

namespace v2 = fused_stable::state_codes;

// ns per element of `reps` passes: per block, decode both moments, an EMA, encode both
template <bool kV2>
double run(torch::Tensor m, torch::Tensor v, torch::Tensor codes_m, torch::Tensor codes_v, torch::Tensor scales_m,
           torch::Tensor scales_v, int64_t reps) {
  const int64_t n = m.numel();
  const float* grad_m = m.data_ptr<float>();
  const float* grad_v = v.data_ptr<float>();
  int8_t* cm = codes_m.data_ptr<int8_t>();
  uint8_t* cv = codes_v.data_ptr<uint8_t>();
  float* sm = scales_m.data_ptr<float>();
  float* sv = scales_v.data_ptr<float>();
  float buf_m[128], buf_v[128];
  const auto start = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < reps; ++r) {
    for (int64_t b = 0; b * 128 < n; ++b) {
      const int64_t f = b * 128;
      if (kV2) {
        v2::decode_signed(cm + f, sm[b], buf_m, 128);
        v2::decode_unsigned(cv + f, sv[b], buf_v, 128);
      } else {
        v1::decode_signed(cm + f, sm[b], buf_m, 128);
        v1::decode_unsigned(cv + f, sv[b], buf_v, 128);
      }
      for (int k = 0; k < 128; ++k) {
        buf_m[k] = 0.9f * buf_m[k] + 0.1f * grad_m[f + k];
        buf_v[k] = 0.999f * buf_v[k] + 0.001f * grad_v[f + k];
      }
      if (kV2) {
        sm[b] = v2::encode_signed(buf_m, cm + f, 128);
        sv[b] = v2::encode_unsigned(buf_v, cv + f, 128);
      } else {
        sm[b] = v1::encode_signed(buf_m, cm + f, 128);
        sv[b] = v1::encode_unsigned(buf_v, cv + f, 128);
      }
    }
  }
  const std::chrono::duration<double> seconds = std::chrono::steady_clock::now() - start;
  return seconds.count() / static_cast<double>(reps) / static_cast<double>(n) * 1e9;
}

double run_v1(torch::Tensor m, torch::Tensor v, torch::Tensor cm, torch::Tensor cv, torch::Tensor sm, torch::Tensor sv,
              int64_t reps) {
  return run<false>(m, v, cm, cv, sm, sv, reps);
}

double run_v2(torch::Tensor m, torch::Tensor v, torch::Tensor cm, torch::Tensor cv, torch::Tensor sm, torch::Tensor sv,
              int64_t reps) {
  return run<true>(m, v, cm, cv, sm, sv, reps);
}
