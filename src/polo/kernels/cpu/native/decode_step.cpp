// The small element-wise parts of a sampling decode step (polo.kernels.cpu.decode), each one pass:
//   add_rms_norm: a decoder layer's residual add and the RMSNorm after it;
//   rotary:       the rotary position embedding of a step's queries or keys.
//
// Written by hand because torch's CPU build runs each of these as several ops (the rotary embedding
// as a negation, a concatenation, two products and a sum), each a dispatch and a pass over its
// tensors; at a decode step's 32 rows of SmolLM2-135M they cost more in dispatch than in arithmetic.
// No maintained library ships such CPU kernels for this torch.
//
// The roundings are torch's, so that the results are the torch path's bit for bit:
//   add_rms_norm: s = x(r + h); out = o(w · x(s · rstd)), rstd = 1 / sqrt(Σs² / d + eps) in fp32 (as rms_norm in
//                 norms.cpp, over the rounded sum); returns (out, s)
//   rotary:       out = x(x(q · cos) + x(rot(q) · sin)), rot(q) = [-q₂, q₁] for the halves of d
// where x(·) rounds to the inputs' dtype and o(·) to the output's (x's and the weight's promoted).
// Float32 and bfloat16.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "vectors.h"

#include <algorithm>
#include <cmath>
#include <tuple>

namespace {

constexpr int64_t kGrainElements = 16384;

inline int64_t grain_rows(int64_t d) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(d, 1)); }

inline bool is_native_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; }

// ---- residual add + RMSNorm ----------------------------------------------------------------------

template <typename X, typename O, typename W>
void add_rms_norm_kernel(const X* h, const X* r, const W* w, O* out, X* sum, int64_t rows, int64_t d, float eps) {
  at::parallel_for(0, rows, grain_rows(d), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const X* hr = h + row * d;
      const X* rr = r + row * d;
      X* sr = sum + row * d;
      fVec a0(0.f), a1(0.f);
      fVec lo, hi, rlo, rhi;
      for (int64_t i = 0; i < d; i += kStep) {
        Pair<X>::load(hr + i, d - i, lo, hi);
        Pair<X>::load(rr + i, d - i, rlo, rhi);
        lo = rlo + lo;
        hi = rhi + hi;
        Pair<X>::round(lo, hi);  // the residual stream in x's dtype, as torch's add leaves it
        Pair<X>::store(sr + i, d - i, lo, hi);
        a0 = at::vec::fmadd(lo, lo, a0);
        a1 = at::vec::fmadd(hi, hi, a1);
      }
      const float s = 1.f / std::sqrt((a0 + a1).reduce_add() / static_cast<float>(d) + eps);
      scaled_row(static_cast<const X*>(sr), w, out + row * d, s, d);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& hidden, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(hidden.dim() >= 1 && hidden.sizes() == residual.sizes() && weight.dim() == 1 &&
                  weight.size(0) == hidden.size(-1),
              "add_rms_norm: hidden and residual (..., d), weight (d,)");
  TORCH_CHECK(hidden.scalar_type() == residual.scalar_type() && is_native_dtype(hidden.scalar_type()) &&
                  is_native_dtype(weight.scalar_type()),
              "add_rms_norm: hidden and residual of one dtype, float32 or bfloat16, and a float32 or bfloat16 weight");
  const auto out_type = at::result_type(hidden, weight);
  const auto h = hidden.contiguous();
  const auto r = residual.contiguous();
  const int64_t d = hidden.size(-1), rows = d == 0 ? 0 : hidden.numel() / d;
  auto sum = at::empty(hidden.sizes(), hidden.options());
  auto out = at::empty(hidden.sizes(), hidden.options().dtype(out_type));
  const float e = static_cast<float>(eps);
  if (out_type == at::kBFloat16) {  // bf16 states and a bf16 weight (a decode step's): the weight read as it is,
    // not cast to a float copy first (two casts a layer per step)
    const auto w = weight.contiguous();
    add_rms_norm_kernel(h.data_ptr<at::BFloat16>(), r.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(),
                        out.data_ptr<at::BFloat16>(), sum.data_ptr<at::BFloat16>(), rows, d, e);
    return {out, sum};
  }
  const auto w = weight.to(at::kFloat).contiguous();
  if (hidden.scalar_type() == at::kFloat) {
    add_rms_norm_kernel(h.data_ptr<float>(), r.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(),
                        sum.data_ptr<float>(), rows, d, e);
  } else {
    add_rms_norm_kernel(h.data_ptr<at::BFloat16>(), r.data_ptr<at::BFloat16>(), w.data_ptr<float>(),
                        out.data_ptr<float>(), sum.data_ptr<at::BFloat16>(), rows, d, e);
  }
  return {out, sum};
}

// ---- rotary embedding ----------------------------------------------------------------------------

// v as it stands, kept out of any multiply-add the compiler could otherwise fuse it into: a product and the sum
// after it stay two roundings in fp32, as torch's separate ops leave them (bf16 rounds in between anyway).
inline void settle(fVec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 raw = v;
  asm("" : "+v"(raw));
  v = raw;
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 raw = v;
  asm("" : "+x"(raw));
  v = raw;
#endif
}

// One head's d values at q (its halves q₁ = q[:d/2], q₂ = q[d/2:]) with the row's cos and sin.
template <typename T>
inline void rotate_head(const T* q, const T* cos, const T* sin, T* out, int64_t d) {
  const int64_t half = d / 2;
  fVec qlo, qhi, clo, chi, slo, shi, plo, phi;
  for (int64_t part = 0; part < 2; ++part) {  // out[:half] = q₁·cos − q₂·sin; out[half:] = q₂·cos + q₁·sin
    const T* own = q + part * half;
    const T* other = q + (1 - part) * half;
    for (int64_t i = 0; i < half; i += kStep) {
      const int64_t n = half - i;
      Pair<T>::load(own + i, n, qlo, qhi);
      Pair<T>::load(cos + part * half + i, n, clo, chi);
      fVec alo = qlo * clo, ahi = qhi * chi;
      Pair<T>::round(alo, ahi);
      Pair<T>::load(other + i, n, plo, phi);
      Pair<T>::load(sin + part * half + i, n, slo, shi);
      if (part == 0) {  // the rotated half's value, −q₂, as torch's neg writes it (exact), times sin
        plo = plo.neg();
        phi = phi.neg();
      }
      fVec blo = plo * slo, bhi = phi * shi;
      Pair<T>::round(blo, bhi);
      settle(alo);
      settle(ahi);
      settle(blo);
      settle(bhi);
      Pair<T>::store(out + part * half + i, n, alo + blo, ahi + bhi);
    }
  }
}

template <typename T>
void rotary_kernel(const T* states, int64_t row_stride, const T* cos, const T* sin, T* out, int64_t rows,
                   int64_t heads, int64_t d) {
  at::parallel_for(0, rows, grain_rows(heads * d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t h = 0; h < heads; ++h) {
        rotate_head(states + r * row_stride + h * d, cos + r * d, sin + r * d, out + (r * heads + h) * d, d);
      }
    }
  });
}

at::Tensor rotary(const at::Tensor& states, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(states.dim() == 3 && cos.dim() == 3 && cos.sizes() == sin.sizes() && cos.size(0) == states.size(0) &&
                  cos.size(1) == 1 && cos.size(2) == states.size(2) && states.size(2) % 2 == 0,
              "rotary: states (rows, heads, d), cos and sin (rows, 1, d), d even");
  TORCH_CHECK(states.scalar_type() == cos.scalar_type() && states.scalar_type() == sin.scalar_type() &&
                  is_native_dtype(states.scalar_type()),
              "rotary: states, cos and sin of one dtype, float32 or bfloat16");
  const int64_t rows = states.size(0), heads = states.size(1), d = states.size(2);
  // a row's heads one after another (a slice of a packed q/k/v product), rows at any stride
  const auto s = states.stride(2) == 1 && states.stride(1) == d ? states : states.contiguous();
  const auto c = cos.contiguous();
  const auto n = sin.contiguous();
  auto out = at::empty({rows, heads, d}, states.options());
  if (states.scalar_type() == at::kFloat) {
    rotary_kernel(s.data_ptr<float>(), s.stride(0), c.data_ptr<float>(), n.data_ptr<float>(), out.data_ptr<float>(),
                  rows, heads, d);
  } else {
    rotary_kernel(s.data_ptr<at::BFloat16>(), s.stride(0), c.data_ptr<at::BFloat16>(), n.data_ptr<at::BFloat16>(),
                  out.data_ptr<at::BFloat16>(), rows, heads, d);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(polo_native, m) {
  m.def("add_rms_norm(Tensor hidden, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary(Tensor states, Tensor cos, Tensor sin) -> Tensor");
}

TORCH_LIBRARY_IMPL(polo_native, CPU, m) {
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("rotary", rotary);
}
