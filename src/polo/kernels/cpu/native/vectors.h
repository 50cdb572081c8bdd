// The vector loads and stores every polo native kernel shares (float32 or bf16 in memory, float32 in
// registers), and the row scaling of its two RMSNorms. Included by the kernels' .cpp files (each keeps its own copy: an anonymous namespace).
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>

namespace {

using fVec = at::vec::Vectorized<float>;
using bVec = at::vec::Vectorized<at::BFloat16>;
constexpr int64_t kV = fVec::size();
constexpr int64_t kStep = 2 * kV;  // elements per step: one bf16 vector, two float ones
static_assert(bVec::size() == kStep, "a bf16 vector holds two float vectors' worth");

// v rounded to the nearest bf16 (ties to even), kept as floats: bf16's rounding on the bits of fp32, in
// registers (a third of the instructions of packing to bf16 and unpacking again); NaN stays NaN.
inline fVec round_to_bf16(const fVec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd),
                                           _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), v, _mm512_castsi512_ps(rounded));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7FFF)), odd),
                                           _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  return _mm256_blendv_ps(v, _mm256_castsi256_ps(rounded), _mm256_cmp_ps(v, v, _CMP_ORD_Q));
#else
  auto [a, b] = at::vec::convert_to_float<at::BFloat16>(at::vec::convert_from_float<at::BFloat16>(v, v));
  return a;
#endif
}

// kStep elements of T at p (n of them valid, the rest read as 0) as two float vectors; stored back
// rounded to T; `round` gives T's rounding of two float vectors as floats.
template <typename T>
struct Pair;

template <>
struct Pair<float> {
  static inline void load(const float* p, int64_t n, fVec& lo, fVec& hi) {
    if (n >= kStep) {
      lo = fVec::loadu(p);
      hi = fVec::loadu(p + kV);
    } else {
      lo = fVec::loadu(p, std::min(n, kV));
      hi = n > kV ? fVec::loadu(p + kV, n - kV) : fVec(0.f);
    }
  }
  static inline void store(float* p, int64_t n, const fVec& lo, const fVec& hi) {
    if (n >= kStep) {
      lo.store(p);
      hi.store(p + kV);
    } else {
      lo.store(p, std::min(n, kV));
      if (n > kV) hi.store(p + kV, n - kV);
    }
  }
  static inline void round(fVec&, fVec&) {}
};

template <>
struct Pair<at::BFloat16> {
  static inline void load(const at::BFloat16* p, int64_t n, fVec& lo, fVec& hi) {
    const bVec v = n >= kStep ? bVec::loadu(p) : bVec::loadu(p, static_cast<int16_t>(n));
    auto [a, b] = at::vec::convert_to_float<at::BFloat16>(v);
    lo = a;
    hi = b;
  }
  static inline void store(at::BFloat16* p, int64_t n, const fVec& lo, const fVec& hi) {
    const bVec v = at::vec::convert_from_float<at::BFloat16>(lo, hi);
    if (n >= kStep) {
      v.store(p);
    } else {
      v.store(p, static_cast<int>(n));
    }
  }
  static inline void round(fVec& lo, fVec& hi) {
    lo = round_to_bf16(lo);
    hi = round_to_bf16(hi);
  }
};

// RMSNorm's output for one row of d values at x: o(w · x(x · s)), s the row's 1 / rms, x(·) x's rounding, o(·) the
// output's (norms.cpp's rms_norm, decode_step.cpp's add_rms_norm). The weight w is read as floats from float or bf16
// (a bf16 weight widened exactly, as a cast would).
template <typename X, typename O, typename W = float>
inline void scaled_row(const X* x, const W* w, O* out, float s, int64_t d) {
  const fVec sv(s);
  fVec lo, hi, wlo, whi;
  for (int64_t i = 0; i < d; i += kStep) {
    Pair<X>::load(x + i, d - i, lo, hi);
    Pair<W>::load(w + i, d - i, wlo, whi);
    lo = lo * sv;
    hi = hi * sv;
    Pair<X>::round(lo, hi);  // x̂ in x's dtype, then the product with the weight
    Pair<O>::store(out + i, d - i, lo * wlo, hi * whi);
  }
}

}  // namespace
