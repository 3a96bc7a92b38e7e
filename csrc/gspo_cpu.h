// Shared scalar math for the CPU kernels of gspo_kernels (header only, no torch headers).
//
// Plain inline scalar code that GCC/Clang vectorize inside `#pragma omp simd` loops (-O3
// -march=native): a polynomial exp for non-positive arguments, loads/stores that convert
// fp16/bf16/fp64 <-> fp32, and the running softmax statistics of a row.
//
// Numerics (the build uses no -ffast-math and -ffp-contract=off, see setup.py):
// * a logit is scaled exactly one way everywhere, x = (z [+ b]) * inv_t, so the row max m, the
//   label's x and every x of the backward are the same fp32 numbers;
// * a row keeps its max m and log s (s = sum exp(x - m)) separately, never one fp32
//   lse = m + log s: log p = (x - m) - log s, where x - m is exact near the max, so logits offset
//   by 1e4 or scaled by 1/temperature = 1e6 lose nothing to the rounding of a large lse;
// * sums over a row run in kLanes fixed lanes (lane j takes the elements j, j + kLanes, ... of
//   a chunk or tile), combined in a fixed tree: the bits of a row's results do not depend on the
//   row's address, its neighbours, the thread that runs it or the vector width of the machine.
// * exp of -inf (or below -87.3) is exactly 0, and p * log p is 0 there: -inf logits on
//   non-label columns add nothing, not NaN.
// * soft cap c (Gemma's final_logit_softcapping): x = c tanh((z [+ b]) / c) / tau instead, through the
//   kCap = true instantiations of the same loops (kCap = false is the uncapped code, unchanged); the
//   gradient of each logit is multiplied by sech^2((z [+ b]) / c). With the cap a -inf logit becomes
//   -c / tau (a real column), as in the model.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#ifdef __linux__
#include <sys/mman.h>
#endif

namespace gspo {

// Scalar helpers called inside `#pragma omp simd` loops must be inlined there, or the loop calls them
// one element at a time (GCC left exp_nonpos out of line in linear_logprobs.cpp, through the PLT).
#define GSPO_INLINE inline __attribute__((always_inline))

// Elements of one row processed per chunk: the chunk is converted to fp32 (when needed) into a
// stack buffer that stays in L1 while the max pass and the exp pass read it.
constexpr int64_t kChunk = 2048;
// Fixed number of partial sums per row (see the header comment).
constexpr int kLanes = 16;
// Elements per sub-chunk of RowStats::fold (a multiple of kLanes; two stack buffers of it).
constexpr int64_t kSub = 512;

GSPO_INLINE float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

GSPO_INLINE uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// exp(x) for x <= ~0 (arguments are always "value - running max"), relative error ~2e-7.
// x = k ln2 + r with |r| <= ln2/2; exp(r) by a degree-7 Taylor polynomial; 2^k from the exponent
// bits. Arguments below -87.3 (where exp(x) < 2^-126) give exactly 0, -inf included; NaN gives NaN.
GSPO_INLINE float exp_nonpos(float x) {
  const bool underflow = x < -87.3f;
  const float xc = underflow ? -87.3f : x;
  const float k = std::floor(std::fma(xc, 1.44269504088896341f, 0.5f));
  const float r = std::fma(-k, 1.428606765330187e-06f, std::fma(-k, 0.693145751953125f, xc));
  float p = 1.0f / 5040.0f;
  p = std::fma(p, r, 1.0f / 720.0f);
  p = std::fma(p, r, 1.0f / 120.0f);
  p = std::fma(p, r, 1.0f / 24.0f);
  p = std::fma(p, r, 1.0f / 6.0f);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.0f);
  p = std::fma(p, r, 1.0f);
  const int32_t e = (x == x ? static_cast<int32_t>(k) : 0) + 127;  // NaN: keep the cast defined
  const float v = p * bits_to_float(static_cast<uint32_t>(e) << 23);
  return underflow ? 0.0f : v;
}

// The one way a logit is scaled (see the header comment).
template <bool kBias>
GSPO_INLINE float scaled(const float* z, const float* bias, int64_t i, float inv_t) {
  return (kBias ? z[i] + bias[i] : z[i]) * inv_t;
}

// The soft cap c at temperature tau, as the kernels use it.
struct Cap {
  float inv_c = 0.0f;  // 1 / c
  float c_t = 0.0f;    // c / tau
  Cap() = default;
  Cap(double c, double tau) : inv_c(static_cast<float>(1.0 / c)), c_t(static_cast<float>(c / tau)) {}
};

// tanh(u) and sech^2(u) = 1 - tanh^2(u), vectorizable (no libm call): with e = exp(-2|u|),
// tanh|u| = (1 - e) / (1 + e) and sech^2 u = 4e / (1 + e)^2, which keeps its relative accuracy where tanh
// saturates (1 - tanh^2 would cancel there); for |u| < 0.625, where 1 - e cancels, tanh u = u P(u^2)
// with P fitted to tanh(u)/u on that range (relative error 4e-9 in exact arithmetic). Both results are
// within a few 1e-7 relative; u = +-inf gives +-1 and 0, NaN gives NaN.
GSPO_INLINE float tanh_sech2(float u, float* sech2) {
  const float a = std::fabs(u);
  const float e = exp_nonpos(-2.0f * a);
  const float inv = 1.0f / (1.0f + e);
  const float s = u * u;
  float p = -0.0056523592211306095f;
  p = std::fma(p, s, 0.02058350294828415f);
  p = std::fma(p, s, -0.05371849611401558f);
  p = std::fma(p, s, 0.13331091403961182f);
  p = std::fma(p, s, -0.3333325982093811f);
  p = std::fma(p, s, 1.0f);
  const float big = (1.0f - e) * inv;
  *sech2 = 4.0f * e * inv * inv;
  return a < 0.625f ? u * p : std::copysign(big, u);
}

// The capped logit c tanh(v / c) / tau of v = z [+ b].
template <bool kBias>
GSPO_INLINE float capped(const float* z, const float* bias, int64_t i, const Cap& cap) {
  float unused;
  return tanh_sech2((kBias ? z[i] + bias[i] : z[i]) * cap.inv_c, &unused) * cap.c_t;
}

// d(c tanh(v / c))/dv = sech^2(v / c) of one logit v = z [+ b].
GSPO_INLINE float cap_slope(float v, const Cap& cap) {
  float sech2;
  tanh_sech2(v * cap.inv_c, &sech2);
  return sech2;
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

// fp32 <-> storage dtype conversions, vectorizable. fp16/bf16 -> fp32 is exact.
GSPO_INLINE float to_float(float v) { return v; }
GSPO_INLINE float to_float(double v) { return static_cast<float>(v); }
GSPO_INLINE float to_float(c10::BFloat16 v) { return bits_to_float(static_cast<uint32_t>(v.x) << 16); }
GSPO_INLINE float to_float(c10::Half v) { return static_cast<float>(v); }

template <typename T>
GSPO_INLINE T from_float(float v);
template <>
GSPO_INLINE float from_float<float>(float v) { return v; }
template <>
GSPO_INLINE double from_float<double>(float v) { return v; }
template <>
GSPO_INLINE c10::BFloat16 from_float<c10::BFloat16>(float v) {
  uint32_t u = float_to_bits(v);
  u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even
  c10::BFloat16 out;
  out.x = static_cast<uint16_t>(u >> 16);
  return out;
}
template <>
GSPO_INLINE c10::Half from_float<c10::Half>(float v) { return c10::Half(v); }

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

// Sum of kLanes partial sums in a fixed tree.
inline float lane_sum(const float* lanes) {
  float t[kLanes / 2];
  for (int j = 0; j < kLanes / 2; ++j) t[j] = lanes[j] + lanes[j + kLanes / 2];
  for (int w = kLanes / 4; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) t[j] = t[j] + t[j + w];
  return t[0];
}

// Running softmax statistics of one row at temperature tau, in scaled units x = z / tau:
// m = max x, s = sum exp(x - m), a = sum exp(x - m) (x - m). Then
//   log p_y = (x_y - m) - log s,  entropy = log s - a / s.
struct RowStats {
  float m = -std::numeric_limits<float>::infinity();
  float s = 0.0f;
  float a = 0.0f;

  // Fold `n` values x[i] = scaled(z, bias, i) (capped(z, bias, i) with kCap) into the statistics: one
  // max pass and one exp pass over data that is already in cache.
  template <bool kEntropy, bool kBias, bool kCap = false>
  GSPO_INLINE void fold(const float* z, const float* bias, int64_t n, float inv_t, const Cap& cap = Cap()) {
    if (kCap && n == 0) return;  // (below, the cap would turn the empty chunk's -inf max into -c / tau)
    float cmax = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : cmax)
    for (int64_t i = 0; i < n; ++i) {
      const float v = kBias ? z[i] + bias[i] : z[i];
      cmax = v > cmax ? v : cmax;
    }
    if (kCap) {  // tanh is increasing: the max of the capped values, up to the rounding of tanh_sech2
      cmax = capped<false>(&cmax, nullptr, 0, cap);
    } else {
      cmax *= inv_t;  // max(v) * inv_t == max(v * inv_t): rounding is monotone
    }
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
    alignas(64) float cs[kLanes] = {};
    alignas(64) float ca[kLanes] = {};
    alignas(64) float eb[kSub];
    alignas(64) float db[kSub];
    for (int64_t c = 0; c < n; c += kSub) {
      const int64_t len = std::min<int64_t>(kSub, n - c);
      const float* zc = z + c;
      const float* bc = kBias ? bias + c : nullptr;
#pragma omp simd
      for (int64_t i = 0; i < len; ++i) {  // the exps, vectorized like any elementwise loop
        const float d = (kCap ? capped<kBias>(zc, bc, i, cap) : scaled<kBias>(zc, bc, i, inv_t)) - mm;
        const float e = exp_nonpos(d);
        eb[i] = e;
        if (kEntropy) db[i] = e > 0.0f ? e * d : 0.0f;  // e = 0 (a -inf logit): adds 0, not NaN
      }
      const int64_t padded = (len + kLanes - 1) / kLanes * kLanes;
      for (int64_t i = len; i < padded; ++i) {
        eb[i] = 0.0f;
        db[i] = 0.0f;
      }
      for (int64_t i = 0; i < padded; i += kLanes) {  // element c + i + j goes to lane j
        for (int j = 0; j < kLanes; ++j) cs[j] += eb[i + j];
        if (kEntropy)
          for (int j = 0; j < kLanes; ++j) ca[j] += db[i + j];
      }
    }
    s += lane_sum(cs);
    if (kEntropy) a += lane_sum(ca);
  }

  // Fold another row segment's statistics (computed from the same scaled logits) into these.
  inline void merge(const RowStats& o) {
    if (!(o.s > 0.0f)) return;  // an empty or all -inf segment
    if (!(s > 0.0f)) {
      *this = o;
      return;
    }
    const float top = std::max(m, o.m);
    const float sh = m - top, osh = o.m - top;
    const float c = std::exp(sh), oc = std::exp(osh);
    a = c * (a + sh * s) + oc * (o.a + osh * o.s);
    s = c * s + oc * o.s;
    m = top;
  }

  float log_s() const { return std::log(s); }
  float entropy() const { return std::log(s) - a / s; }
};

// Gradient of (g * logp + ge * entropy) w.r.t. the logits z of one chunk, fp32 out:
//   out[v] = inv_t * ( -p[v] * (g + ge * (log p[v] + H)) ),  log p = (x - m) - log_s.
// A -inf logit has p = 0 and gets exactly 0. The label term (+ inv_t * g) is added by the caller.
// kCap: x = capped(z, bias, v) and out[v] is multiplied by sech^2(v / c); the caller's label term is
// then inv_t * g * cap_slope(z[y] [+ b[y]]) (read before `out` overwrites `z` when they alias).
template <bool kEntropy, bool kBias, bool kCap = false>
inline void softmax_grad(const float* z, const float* bias, float* out, int64_t n, float inv_t, float m,
                         float log_s, float g, float ge, float ent, const Cap& cap = Cap()) {
  const float c0 = g + ge * ent;
  const float ng = -inv_t * g;
  if constexpr (kCap) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      float slope;
      const float x = tanh_sech2((kBias ? z[i] + bias[i] : z[i]) * cap.inv_c, &slope) * cap.c_t;
      const float d = (x - m) - log_s;  // log p
      const float p = exp_nonpos(d);
      float o;
      if (kEntropy) {
        const float t = p * (c0 + ge * d);
        o = p > 0.0f ? -inv_t * t : (d == d ? 0.0f : d);  // p = 0: 0 (NaN stays NaN)
      } else {
        o = ng * p;
      }
      out[i] = o * slope;
    }
  } else {  // the uncapped loop, exactly as before the cap existed
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float d = (scaled<kBias>(z, bias, i, inv_t) - m) - log_s;  // log p
      const float p = exp_nonpos(d);
      if (kEntropy) {
        const float t = p * (c0 + ge * d);
        out[i] = p > 0.0f ? -inv_t * t : (d == d ? 0.0f : d);  // p = 0: 0 (NaN stays NaN)
      } else {
        out[i] = ng * p;
      }
    }
  }
}

}  // namespace gspo
