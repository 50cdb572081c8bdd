// polo's masked softmax for attention scores on the CPU: the mask's bias and the softmax in one pass.
//
// Written by hand because no maintained library provides it for torch's CPU build: there, a masked
// softmax is a bias built from the mask, an add, and torch's softmax, whose bf16 kernel over a row
// whose length is not a multiple of the vector width (86 keys: 1.7 ms for 64 x 9 x 32 rows) is slow.
//
//   scores  (B, H, q, k) float32 or bfloat16, contiguous
//   mask    (B or 1, q, k) bool or none: true where a query may attend; shared by the H heads
//   result  (B, H, q, k) in the scores' dtype: softmax over k in fp32, rounded once; a row with
//           nothing to attend to is all zeros
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include "vectors.h"

#include <cmath>
#include <limits>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kWidth = kV;

// n elements of `source` into out[0, n rounded up to kStep) as floats (zeros past n).
template <typename scalar_t>
inline void to_float(const scalar_t* source, float* out, int64_t n) {
  fVec low, high;
  for (int64_t i = 0; i < n; i += kStep) {
    Pair<scalar_t>::load(source + i, n - i, low, high);
    low.store(out + i);
    high.store(out + i + kV);
  }
}

// The first n floats of `source` into `out`, rounded to scalar_t.
template <typename scalar_t>
inline void from_float(const float* source, scalar_t* out, int64_t n) {
  for (int64_t i = 0; i < n; i += kStep) {
    Pair<scalar_t>::store(out + i, n - i, fVec::loadu(source + i), fVec::loadu(source + i + kV));
  }
}

// row[0, padded) := softmax(row + bias) in place, fp32, padded a multiple of kWidth (the bias -inf past the row's
// end); all zeros when every entry is -inf.
inline void softmax_row(float* row, const float* bias, int64_t padded) {
  const float hidden = -std::numeric_limits<float>::infinity();
  fVec top(hidden);
  for (int64_t i = 0; i < padded; i += kWidth) {
    const fVec z = fVec::loadu(row + i) + fVec::loadu(bias + i);
    z.store(row + i);
    top = at::vec::maximum(top, z);
  }
  float lanes[kWidth];
  top.store(lanes);
  float peak = hidden;
  for (int64_t l = 0; l < kWidth; ++l) peak = std::max(peak, lanes[l]);
  if (std::isinf(peak)) {
    std::fill(row, row + padded, 0.f);
    return;
  }
  const fVec shift(peak);
  fVec total(0.f);
  for (int64_t i = 0; i < padded; i += kWidth) {
    const fVec e = (fVec::loadu(row + i) - shift).exp();
    e.store(row + i);
    total = total + e;
  }
  const fVec scale(1.f / total.reduce_add());
  for (int64_t i = 0; i < padded; i += kWidth) (fVec::loadu(row + i) * scale).store(row + i);
}

template <typename scalar_t>
void masked_softmax_kernel(const at::Tensor& scores, const at::Tensor* mask, at::Tensor& out) {
  const int64_t B = scores.size(0), H = scores.size(1), Q = scores.size(2), K = scores.size(3);
  const scalar_t* in = scores.data_ptr<scalar_t>();
  scalar_t* result = out.data_ptr<scalar_t>();
  const bool* allowed = mask ? mask->data_ptr<bool>() : nullptr;
  const int64_t mask_batch = mask && mask->size(0) > 1 ? Q * K : 0;
  const float hidden = -std::numeric_limits<float>::infinity();
  // One task per (batch, query): its bias row, built once, serves the H heads' rows.
  const int64_t padded = (K + 2 * kWidth - 1) / (2 * kWidth) * (2 * kWidth);  // whole bf16 vectors
  at::parallel_for(0, B * Q, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> bias(padded, hidden), row(padded, 0.f);
    std::fill(bias.begin(), bias.begin() + K, 0.f);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Q, q = task % Q;
      if (allowed) {
        const bool* m = allowed + b * mask_batch + q * K;
        for (int64_t i = 0; i < K; ++i) bias[i] = m[i] ? 0.f : hidden;
      }
      for (int64_t h = 0; h < H; ++h) {
        const int64_t offset = ((b * H + h) * Q + q) * K;
        to_float(in + offset, row.data(), K);
        softmax_row(row.data(), bias.data(), padded);
        from_float(row.data(), result + offset, K);
      }
    }
  });
}

at::Tensor masked_softmax(const at::Tensor& scores_, const std::optional<at::Tensor>& mask_) {
  TORCH_CHECK(scores_.dim() == 4, "masked_softmax: scores must be (B, H, q, k)");
  TORCH_CHECK(scores_.scalar_type() == at::kFloat || scores_.scalar_type() == at::kBFloat16,
              "masked_softmax: float32 or bfloat16 only");
  auto scores = scores_.contiguous();
  auto out = at::empty_like(scores);
  std::optional<at::Tensor> mask;
  if (mask_) {
    TORCH_CHECK(mask_->dim() == 3 && mask_->size(1) == scores.size(2) && mask_->size(2) == scores.size(3) &&
                    (mask_->size(0) == 1 || mask_->size(0) == scores.size(0)),
                "masked_softmax: mask must be (B or 1, q, k)");
    mask = mask_->to(at::kBool).contiguous();
  }
  if (scores.scalar_type() == at::kFloat) {
    masked_softmax_kernel<float>(scores, mask ? &*mask : nullptr, out);
  } else {
    masked_softmax_kernel<at::BFloat16>(scores, mask ? &*mask : nullptr, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(polo_native, m) { m.def("masked_softmax(Tensor scores, Tensor? mask) -> Tensor"); }

TORCH_LIBRARY_IMPL(polo_native, CPU, m) { m.impl("masked_softmax", masked_softmax); }
