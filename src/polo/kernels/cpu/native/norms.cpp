// polo's RMSNorm and SwiGLU product for the CPU, forward and backward: the maths of polo.kernels.lean in
// one pass (or two) over each row.
//
// Written by hand because no maintained library provides fused CPU kernels for this torch: torch's
// CPU build runs lean.rms_norm as five element-wise ops and a reduction (each reading and writing
// the (tokens, d) tensor afresh, bf16 converted to fp32 and back each time), and silu(gate) · up as
// two ops; the backward formulas of LeanRMSNorm and SiluMul take as many again. Here each row is
// read once for its statistics and once for its output, in fp32 registers.
//
// The roundings are torch's, so that only the order of a row's sums differs from the torch path
// (an ulp of fp32 in rstd and in mean(g · x̂), which now and then moves a bf16 result by one ulp):
//   rms_norm:          rstd = 1 / sqrt(Σx² / d + eps) (fp32), out = o(w · x(x · rstd))
//   rms_norm_backward: x̂ = x · rstd, gn = o(dy · w), dx = x(rstd · (gn − x̂ · Σ(gn · x̂) / d)),
//                      dw = Σ_rows o(dy · x(x̂)) in fp32, per chunk of rows, the chunks added in order
//   silu_mul:          t(t(g / (1 + exp(−g))) · u)
//   silu_mul_backward: dg = t(t(dy · u) · σ · (1 + g · (1 − σ))), σ = 1 / (1 + exp(−g)); du = t(dy · t(silu(g)));
//                      silu_mul_backward_with_product also returns silu_mul(g, u), bit for bit the forward's
// where x(·), o(·) and t(·) round to the dtype of x, of the output (x's and the weight's promoted:
// also grad_out's) and of gate/up. Float32 and bfloat16; any leading shape, the last dim contiguous
// (other inputs are made contiguous).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "vectors.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <optional>
#include <tuple>

namespace {

// Rows (or elements) per task: about this many elements, so that a (64, 1, 576) decode step's norm
// is not split into tasks whose start costs more than their work.
constexpr int64_t kGrainElements = 16384;

inline int64_t grain_rows(int64_t d) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(d, 1)); }
// The most row chunks the RMSNorm backward splits dw's sum into (each its own d floats).
constexpr int64_t kMaxChunks = 64;

// ---- RMSNorm -------------------------------------------------------------------------------------

template <typename X, typename O>
void rms_norm_kernel(const X* x, const float* w, O* out, float* rstd, int64_t rows, int64_t d, float eps) {
  at::parallel_for(0, rows, grain_rows(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const X* xr = x + r * d;
      fVec a0(0.f), a1(0.f);
      fVec lo, hi;
      for (int64_t i = 0; i < d; i += kStep) {
        Pair<X>::load(xr + i, d - i, lo, hi);
        a0 = at::vec::fmadd(lo, lo, a0);
        a1 = at::vec::fmadd(hi, hi, a1);
      }
      const float s = 1.f / std::sqrt((a0 + a1).reduce_add() / static_cast<float>(d) + eps);
      rstd[r] = s;
      scaled_row(xr, w, out + r * d, s, d);
    }
  });
}

// dx for rows [begin, end); adds o(dy · x(x̂)) into dw (d floats) when dw is not null.
template <typename X, typename G>
void rms_norm_backward_rows(const G* dy, const X* x, const float* rstd, const float* w, X* dx, float* dw, int64_t begin,
                            int64_t end, int64_t d) {
  for (int64_t r = begin; r < end; ++r) {
    const X* xr = x + r * d;
    const G* gr = dy + r * d;
    const fVec sv(rstd[r]);
    fVec a0(0.f), a1(0.f);
    fVec xlo, xhi, glo, ghi, wlo, whi;
    for (int64_t i = 0; i < d; i += kStep) {
      Pair<X>::load(xr + i, d - i, xlo, xhi);
      Pair<G>::load(gr + i, d - i, glo, ghi);
      Pair<float>::load(w + i, d - i, wlo, whi);
      xlo = xlo * sv;  // x̂
      xhi = xhi * sv;
      fVec nlo = glo * wlo, nhi = ghi * whi;  // gn = o(dy · w)
      Pair<G>::round(nlo, nhi);
      a0 = at::vec::fmadd(nlo, xlo, a0);
      a1 = at::vec::fmadd(nhi, xhi, a1);
      if (dw != nullptr) {
        Pair<X>::round(xlo, xhi);
        fVec plo = glo * xlo, phi = ghi * xhi;
        Pair<G>::round(plo, phi);
        fVec dlo, dhi;
        Pair<float>::load(dw + i, d - i, dlo, dhi);
        Pair<float>::store(dw + i, d - i, dlo + plo, dhi + phi);
      }
    }
    const fVec mean((a0 + a1).reduce_add() / static_cast<float>(d));
    X* out = dx + r * d;
    for (int64_t i = 0; i < d; i += kStep) {
      Pair<X>::load(xr + i, d - i, xlo, xhi);
      Pair<G>::load(gr + i, d - i, glo, ghi);
      Pair<float>::load(w + i, d - i, wlo, whi);
      xlo = xlo * sv;
      xhi = xhi * sv;
      fVec nlo = glo * wlo, nhi = ghi * whi;
      Pair<G>::round(nlo, nhi);
      Pair<X>::store(out + i, d - i, sv * (nlo - xlo * mean), sv * (nhi - xhi * mean));
    }
  }
}

template <typename X, typename G>
void rms_norm_backward_kernel(const G* dy, const X* x, const float* rstd, const float* w, X* dx, float* partial,
                              int64_t chunks, int64_t rows, int64_t d) {
  if (partial == nullptr) {
    at::parallel_for(0, rows, grain_rows(d), [&](int64_t begin, int64_t end) {
      rms_norm_backward_rows(dy, x, rstd, w, dx, static_cast<float*>(nullptr), begin, end, d);
    });
    return;
  }
  // fixed chunks of rows, each with its own dw sum: the same result whatever thread runs which chunk
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      rms_norm_backward_rows(dy, x, rstd, w, dx, partial + c * d, c * rows / chunks, (c + 1) * rows / chunks, d);
    }
  });
}

inline bool is_native_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; }

std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.size(0) == x.size(-1), "rms_norm: x (..., d), weight (d,)");
  TORCH_CHECK(is_native_dtype(x.scalar_type()) && is_native_dtype(weight.scalar_type()),
              "rms_norm: float32 or bfloat16 only");
  const auto out_type = at::result_type(x, weight);
  const auto xc = x.contiguous();
  const auto w = weight.to(at::kFloat).contiguous();
  const int64_t d = x.size(-1), rows = d == 0 ? 0 : x.numel() / d;
  auto out = at::empty(x.sizes(), x.options().dtype(out_type));
  auto stats_shape = x.sizes().vec();
  stats_shape.back() = 1;
  auto rstd = at::empty(stats_shape, x.options().dtype(at::kFloat));
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kFloat) {
    rms_norm_kernel(xc.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), rstd.data_ptr<float>(), rows, d,
                    e);
  } else if (out_type == at::kBFloat16) {
    rms_norm_kernel(xc.data_ptr<at::BFloat16>(), w.data_ptr<float>(), out.data_ptr<at::BFloat16>(),
                    rstd.data_ptr<float>(), rows, d, e);
  } else {
    rms_norm_kernel(xc.data_ptr<at::BFloat16>(), w.data_ptr<float>(), out.data_ptr<float>(), rstd.data_ptr<float>(),
                    rows, d, e);
  }
  return {out, rstd};
}

std::tuple<at::Tensor, std::optional<at::Tensor>> rms_norm_backward(const at::Tensor& grad_out, const at::Tensor& x,
                                                                    const at::Tensor& rstd, const at::Tensor& weight,
                                                                    bool weight_grad) {
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && grad_out.sizes() == x.sizes(),
              "rms_norm_backward: grad_out and x (..., d), weight (d,)");
  TORCH_CHECK(rstd.scalar_type() == at::kFloat && rstd.numel() * x.size(-1) == x.numel(),
              "rms_norm_backward: rstd (..., 1) float32");
  TORCH_CHECK(is_native_dtype(x.scalar_type()) && is_native_dtype(weight.scalar_type()),
              "rms_norm_backward: float32 or bfloat16 only");
  TORCH_CHECK(grad_out.scalar_type() == at::result_type(x, weight),
              "rms_norm_backward: grad_out must have the forward output's dtype");
  const auto dy = grad_out.contiguous();
  const auto xc = x.contiguous();
  const auto rs = rstd.contiguous();
  const auto w = weight.to(at::kFloat).contiguous();
  const int64_t d = x.size(-1), rows = d == 0 ? 0 : x.numel() / d;
  auto dx = at::empty(x.sizes(), x.options());
  at::Tensor partial;
  int64_t chunks = 0;
  float* partial_data = nullptr;
  if (weight_grad) {
    // as many chunks as the rows fill, never as many as there are threads: the sum's order, and so dw to the
    // last bit, is the same whatever the thread count
    chunks = std::max<int64_t>(1, std::min<int64_t>(kMaxChunks, rows / grain_rows(d)));
    partial = at::zeros({chunks, d}, x.options().dtype(at::kFloat));
    partial_data = partial.data_ptr<float>();
  }
  const float* r = rs.data_ptr<float>();
  const float* wd = w.data_ptr<float>();
  if (x.scalar_type() == at::kFloat) {
    rms_norm_backward_kernel(dy.data_ptr<float>(), xc.data_ptr<float>(), r, wd, dx.data_ptr<float>(), partial_data,
                             chunks, rows, d);
  } else if (dy.scalar_type() == at::kBFloat16) {
    rms_norm_backward_kernel(dy.data_ptr<at::BFloat16>(), xc.data_ptr<at::BFloat16>(), r, wd,
                             dx.data_ptr<at::BFloat16>(), partial_data, chunks, rows, d);
  } else {
    rms_norm_backward_kernel(dy.data_ptr<float>(), xc.data_ptr<at::BFloat16>(), r, wd, dx.data_ptr<at::BFloat16>(),
                             partial_data, chunks, rows, d);
  }
  std::optional<at::Tensor> grad_weight;
  if (weight_grad) grad_weight = partial.sum(0).to(weight.scalar_type());
  return {dx, grad_weight};
}

// ---- SwiGLU product ------------------------------------------------------------------------------

// out[i] = t(t(g / (1 + exp(−g))) · u) for i in [begin, end) of n values, on the calling thread.
template <typename T>
inline void silu_mul_span(const T* gate, const T* up, T* out, int64_t begin, int64_t end, int64_t n) {
  const fVec one(1.f);
  fVec glo, ghi, ulo, uhi;
  for (int64_t i = begin; i < end; i += kStep) {
    Pair<T>::load(gate + i, n - i, glo, ghi);
    Pair<T>::load(up + i, n - i, ulo, uhi);
    fVec slo = glo / (one + glo.neg().exp()), shi = ghi / (one + ghi.neg().exp());
    Pair<T>::round(slo, shi);
    Pair<T>::store(out + i, n - i, slo * ulo, shi * uhi);
  }
}

template <typename T>
void silu_mul_kernel(const T* gate, const T* up, T* out, int64_t n) {
  at::parallel_for(0, (n + kStep - 1) / kStep, std::max<int64_t>(1, kGrainElements / kStep), [=](int64_t b, int64_t e) {
    silu_mul_span(gate, up, out, b * kStep, std::min(n, e * kStep), n);
  });
}

template <typename T>
void silu_mul_backward_kernel(const T* dy, const T* gate, const T* up, T* dgate, T* dup, T* product, int64_t n) {
  const fVec one(1.f);
  at::parallel_for(0, (n + kStep - 1) / kStep, std::max<int64_t>(1, kGrainElements / kStep), [=](int64_t b, int64_t e) {
    fVec dlo, dhi, glo, ghi, ulo, uhi;
    for (int64_t i = b * kStep; i < std::min(n, e * kStep); i += kStep) {
      Pair<T>::load(dy + i, n - i, dlo, dhi);
      Pair<T>::load(gate + i, n - i, glo, ghi);
      const fVec elo = one + glo.neg().exp(), ehi = one + ghi.neg().exp();
      if (dgate != nullptr || product != nullptr) Pair<T>::load(up + i, n - i, ulo, uhi);
      if (dgate != nullptr) {
        fVec plo = dlo * ulo, phi = dhi * uhi;  // dy · up, in T as torch's product is
        Pair<T>::round(plo, phi);
        const fVec sig_lo = one / elo, sig_hi = one / ehi;
        Pair<T>::store(dgate + i, n - i, plo * sig_lo * (one + glo * (one - sig_lo)),
                       phi * sig_hi * (one + ghi * (one - sig_hi)));
      }
      if (dup != nullptr || product != nullptr) {
        fVec slo = glo / elo, shi = ghi / ehi;  // silu(gate) as the forward rounds it
        Pair<T>::round(slo, shi);
        if (dup != nullptr) Pair<T>::store(dup + i, n - i, dlo * slo, dhi * shi);
        if (product != nullptr) Pair<T>::store(product + i, n - i, slo * ulo, shi * uhi);  // silu_mul's output
      }
    }
  });
}

void check_silu_mul(const at::Tensor& gate, const at::Tensor& up, const char* name) {
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type(), name,
              ": gate and up must share a shape and a dtype");
  TORCH_CHECK(is_native_dtype(gate.scalar_type()), name, ": float32 or bfloat16 only");
}

// silu_mul over `rows` rows of `width` values whose rows lie `gate_row` and `up_row` elements apart (slices of one
// merged gate/up product, as a decode step's packed projection leaves them), into a contiguous (rows, width) `out`:
// the same values as the flat kernel on contiguous copies, without making the copies.
template <typename T>
void silu_mul_rows_kernel(const T* gate, int64_t gate_row, const T* up, int64_t up_row, T* out, int64_t rows,
                          int64_t width) {
  at::parallel_for(0, rows, grain_rows(width), [=](int64_t b, int64_t e) {
    for (int64_t row = b; row < e; ++row) {
      silu_mul_span(gate + row * gate_row, up + row * up_row, out + row * width, 0, width, width);
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  check_silu_mul(gate, up, "silu_mul");
  if (gate.dim() == 2 && gate.size(0) > 1 && gate.stride(1) == 1 && up.stride(1) == 1 &&
      !(gate.is_contiguous() && up.is_contiguous())) {  // rows of a wider tensor: read in place
    auto out = at::empty(gate.sizes(), gate.options().memory_format(at::MemoryFormat::Contiguous));
    if (gate.scalar_type() == at::kFloat) {
      silu_mul_rows_kernel(gate.data_ptr<float>(), gate.stride(0), up.data_ptr<float>(), up.stride(0),
                           out.data_ptr<float>(), gate.size(0), gate.size(1));
    } else {
      silu_mul_rows_kernel(gate.data_ptr<at::BFloat16>(), gate.stride(0), up.data_ptr<at::BFloat16>(), up.stride(0),
                           out.data_ptr<at::BFloat16>(), gate.size(0), gate.size(1));
    }
    return out;
  }
  const auto g = gate.contiguous();
  const auto u = up.contiguous();
  auto out = at::empty(g.sizes(), g.options());
  if (g.scalar_type() == at::kFloat) {
    silu_mul_kernel(g.data_ptr<float>(), u.data_ptr<float>(), out.data_ptr<float>(), g.numel());
  } else {
    silu_mul_kernel(g.data_ptr<at::BFloat16>(), u.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), g.numel());
  }
  return out;
}

// The gradients silu_mul_backward returns and, with `product`, silu_mul's forward output as well, recomputed in
// the same pass (a backward that did not keep the product, such as polo.kernels.lean.SwiGLUDown's, needs it).
std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>, std::optional<at::Tensor>> silu_mul_backward_impl(
    const at::Tensor& grad_out, const at::Tensor& gate, const at::Tensor& up, std::array<bool, 2> needs, bool product,
    const char* name) {
  check_silu_mul(gate, up, name);
  TORCH_CHECK(grad_out.sizes() == gate.sizes() && grad_out.scalar_type() == gate.scalar_type(), name,
              ": grad_out must have gate's shape and dtype");
  const auto dy = grad_out.contiguous();
  const auto g = gate.contiguous();
  const auto u = up.contiguous();
  std::optional<at::Tensor> dgate, dup, out;
  if (needs[0]) dgate = at::empty(g.sizes(), g.options());
  if (needs[1]) dup = at::empty(g.sizes(), g.options());
  if (product) out = at::empty(g.sizes(), g.options());
  if (!needs[0] && !needs[1] && !product) return {dgate, dup, out};
  if (g.scalar_type() == at::kFloat) {
    silu_mul_backward_kernel(dy.data_ptr<float>(), g.data_ptr<float>(), u.data_ptr<float>(),
                             dgate ? dgate->data_ptr<float>() : nullptr, dup ? dup->data_ptr<float>() : nullptr,
                             out ? out->data_ptr<float>() : nullptr, g.numel());
  } else {
    silu_mul_backward_kernel(dy.data_ptr<at::BFloat16>(), g.data_ptr<at::BFloat16>(), u.data_ptr<at::BFloat16>(),
                             dgate ? dgate->data_ptr<at::BFloat16>() : nullptr,
                             dup ? dup->data_ptr<at::BFloat16>() : nullptr,
                             out ? out->data_ptr<at::BFloat16>() : nullptr, g.numel());
  }
  return {dgate, dup, out};
}

std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>> silu_mul_backward(const at::Tensor& grad_out,
                                                                                   const at::Tensor& gate,
                                                                                   const at::Tensor& up,
                                                                                   std::array<bool, 2> needs) {
  auto [dgate, dup, unused] = silu_mul_backward_impl(grad_out, gate, up, needs, false, "silu_mul_backward");
  return {dgate, dup};
}

std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>, at::Tensor> silu_mul_backward_with_product(
    const at::Tensor& grad_out, const at::Tensor& gate, const at::Tensor& up, std::array<bool, 2> needs) {
  auto [dgate, dup, product] = silu_mul_backward_impl(grad_out, gate, up, needs, true, "silu_mul_backward_with_product");
  return {dgate, dup, *product};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(polo_native, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def(
      "rms_norm_backward(Tensor grad_out, Tensor x, Tensor rstd, Tensor weight, bool weight_grad) -> (Tensor, "
      "Tensor?)");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
  m.def("silu_mul_backward(Tensor grad_out, Tensor gate, Tensor up, bool[2] needs) -> (Tensor?, Tensor?)");
  m.def(
      "silu_mul_backward_with_product(Tensor grad_out, Tensor gate, Tensor up, bool[2] needs) -> (Tensor?, Tensor?, "
      "Tensor)");
}

TORCH_LIBRARY_IMPL(polo_native, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("rms_norm_backward", rms_norm_backward);
  m.impl("silu_mul", silu_mul);
  m.impl("silu_mul_backward", silu_mul_backward);
  m.impl("silu_mul_backward_with_product", silu_mul_backward_with_product);
}
