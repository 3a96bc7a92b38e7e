// Shared scalar math for the CPU kernels of gspo_kernels (header only, no torch headers).
//
// Everything here is written as plain inline scalar code that GCC/Clang vectorize inside
// `#pragma omp simd` loops (-O3 -march=native): a polynomial exp for non-positive arguments,
// and loads/stores that convert fp16/bf16/fp64 <-> fp32.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#ifdef __linux__
#include <sys/mman.h>
#endif

namespace gspo {

// Elements of one row processed per chunk: the chunk is converted to fp32 (when needed) into a
// stack buffer that stays in L1 while the max pass and the exp pass read it.
constexpr int64_t kChunk = 2048;

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// exp(x) for x <= ~0 (arguments are always "value - running max"), relative error ~1e-7.
// x = k ln2 + r with |r| <= ln2/2; exp(r) by a degree-7 Taylor polynomial; 2^k from the exponent
// bits. Arguments below -87 are clamped (the result, ~1e-38, is negligible next to 1).
inline float exp_nonpos(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float k = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - k * 0.693145751953125f) - k * 1.428606765330187e-06f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t e = static_cast<int32_t>(k) + 127;
  return p * bits_to_float(static_cast<uint32_t>(e) << 23);
}

// Ask for transparent huge pages on a fresh, not yet touched buffer of `bytes` bytes (a gradient or
// saved-logits buffer of hundreds of MB): first-touch page faults then cost 512x fewer traps.
// A hint only: ignored where THP is off or unsupported.
inline void advise_huge_pages(void* ptr, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(1) << 21;
  if (bytes < 4 * kHuge) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(ptr) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(ptr) + bytes) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)ptr;
  (void)bytes;
#endif
}

// fp32 <-> storage dtype conversions, vectorizable.
inline float to_float(float v) { return v; }
inline float to_float(double v) { return static_cast<float>(v); }
inline float to_float(c10::BFloat16 v) { return bits_to_float(static_cast<uint32_t>(v.x) << 16); }
inline float to_float(c10::Half v) { return static_cast<float>(v); }

template <typename T>
inline T from_float(float v);
template <>
inline float from_float<float>(float v) { return v; }
template <>
inline double from_float<double>(float v) { return v; }
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float v) {
  uint32_t u = float_to_bits(v);
  u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even
  c10::BFloat16 out;
  out.x = static_cast<uint16_t>(u >> 16);
  return out;
}
template <>
inline c10::Half from_float<c10::Half>(float v) { return c10::Half(v); }

// A chunk of `n` elements of a row as fp32: the row itself for fp32 storage, else `buf` filled.
template <typename T>
inline const float* load_chunk(const T* src, int64_t n, float* buf) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) buf[i] = to_float(src[i]);
  return buf;
}
template <>
inline const float* load_chunk<float>(const float* src, int64_t, float*) {
  return src;
}

// Running softmax statistics of one row at temperature tau, in scaled units x = z / tau:
// m = max x, s = sum exp(x - m), a = sum exp(x - m) (x - m). Then
//   lse = m + log s,  entropy = log s - a / s.
struct RowStats {
  float m = -std::numeric_limits<float>::infinity();
  float s = 0.0f;
  float a = 0.0f;

  // Fold `n` fp32 values x[i] = (z[i] (+ bias[i])) * inv_t into the statistics: one max pass and
  // one exp pass over data that is already in cache.
  template <bool kEntropy, bool kBias>
  inline void fold(const float* z, const float* bias, int64_t n, float inv_t) {
    float cmax = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : cmax)
    for (int64_t i = 0; i < n; ++i) {
      const float v = kBias ? z[i] + bias[i] : z[i];
      cmax = v > cmax ? v : cmax;
    }
    cmax *= inv_t;
    if (!(cmax > -std::numeric_limits<float>::infinity())) return;  // all -inf (or empty)
    if (cmax > m) {
      if (s > 0.0f) {
        const float shift = m - cmax;
        const float c = std::exp(shift);
        a = c * (a + shift * s);
        s *= c;
      }
      m = cmax;
    }
    const float mm = m;
    float cs = 0.0f, ca = 0.0f;
#pragma omp simd reduction(+ : cs, ca)
    for (int64_t i = 0; i < n; ++i) {
      const float d = (kBias ? z[i] + bias[i] : z[i]) * inv_t - mm;
      const float e = exp_nonpos(d);
      cs += e;
      if (kEntropy) ca += e * d;
    }
    s += cs;
    a += ca;
  }

  float lse() const { return m + std::log(s); }
  float entropy() const { return std::log(s) - a / s; }
};

// Gradient of (g * logp + ge * entropy) w.r.t. the logits z of one chunk, fp32 out:
//   out[v] = inv_t * ( -p[v] * (g + ge * (log p[v] + H)) ),  p = exp(x - lse),  x = z * inv_t.
// The label term (+ inv_t * g) is added by the caller.
template <bool kEntropy, bool kBias>
inline void softmax_grad(const float* z, const float* bias, float* out, int64_t n, float inv_t, float lse,
                         float g, float ge, float ent) {
  const float c0 = g + ge * ent;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float d = (kBias ? z[i] + bias[i] : z[i]) * inv_t - lse;  // log p
    const float p = exp_nonpos(d);
    out[i] = kEntropy ? -inv_t * p * (c0 + ge * d) : -inv_t * g * p;
  }
}

}  // namespace gspo
