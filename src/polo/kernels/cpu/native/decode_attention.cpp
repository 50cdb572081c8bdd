// polo's decode-step attention for the CPU: one query token per row, read straight from the sampling cache.
//
// Written by hand because no maintained library provides it for torch's CPU build: the composite
// path (two oneDNN matmuls around a softmax) copies the cache's strided filled part into contiguous
// tensors before each matmul and spends most of its time in those copies and in the dispatch of
// ~10 small ops a layer. Here each (row, key/value head) task reads its keys and values once, in
// place, with the query heads that share them, and accumulates in fp32.
//
// Shapes (the Python side, polo.kernels.cpu.native.decode_attention, documents and checks them):
//   query         (B, H, d)            B = P * G rows, a group's G rows consecutive
//   keys, values  (P, Hkv, G, L, d)    each row's own cached tokens; any strides but a contiguous last dim
//   own_valid     (B, L) bool or none  false where a row's own position is padding
//   prompt_keys, prompt_values (P, Hkv, Lp, d) or none: each group's prompt, read once per group
//   prompt_bias   (P, Hkv, Lp) float   0 on a prompt's tokens, -inf on its left padding
//   result        (B, H, d)            softmax(q·K·scale [+ bias]) · V over the prompt, then the own tokens
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

constexpr int64_t kMaxHeadsPerKv = 16;  // query heads that share one key/value head (SmolLM2: 3; Llama 3 8B: 4)

// Copy d elements of `source` (float or bf16) into `out` as floats.
template <typename scalar_t>
inline void load_row(const scalar_t* source, float* out, int64_t d) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    std::copy(source, source + d, out);
  } else {
    at::vec::convert(source, out, d);
  }
}

inline float horizontal_sum(const fVec& x) { return x.reduce_add(); }

constexpr int64_t kPair = kStep;

// Load kPair elements at `source` as two float vectors (converted from bf16 in registers).
template <typename scalar_t>
inline void load_pair(const scalar_t* source, fVec& low, fVec& high) {
  Pair<scalar_t>::load(source, kStep, low, high);
}

// scores[j * stride] = scale · q_j · key (+ bias) for the `heads` queries q_j (heads × d, fp32); key in memory.
template <typename scalar_t>
inline void score_key(const float* q, const scalar_t* key, int64_t heads, int64_t d, float scale, float bias,
                      float* scores, int64_t stride) {
  fVec acc[kMaxHeadsPerKv];
  for (int64_t j = 0; j < heads; ++j) acc[j] = fVec(0.f);
  int64_t i = 0;
  for (; i + kPair <= d; i += kPair) {
    fVec low, high;
    load_pair(key + i, low, high);
    for (int64_t j = 0; j < heads; ++j) {
      acc[j] = at::vec::fmadd(fVec::loadu(q + j * d + i), low, acc[j]);
      acc[j] = at::vec::fmadd(fVec::loadu(q + j * d + i + fVec::size()), high, acc[j]);
    }
  }
  for (int64_t j = 0; j < heads; ++j) {
    float sum = horizontal_sum(acc[j]);
    for (int64_t t = i; t < d; ++t) sum += q[j * d + t] * static_cast<float>(key[t]);
    scores[j * stride] = sum * scale + bias;
  }
}

// acc_j += w_j · value for the `heads` rows acc_j (heads × d, fp32); value in memory.
template <typename scalar_t>
inline void add_value(float* acc, const scalar_t* value, const float* weights, int64_t stride, int64_t heads,
                      int64_t d) {
  int64_t i = 0;
  for (; i + kPair <= d; i += kPair) {
    fVec low, high;
    load_pair(value + i, low, high);
    for (int64_t j = 0; j < heads; ++j) {
      const fVec w(weights[j * stride]);
      float* a = acc + j * d + i;
      at::vec::fmadd(low, w, fVec::loadu(a)).store(a);
      at::vec::fmadd(high, w, fVec::loadu(a + fVec::size())).store(a + fVec::size());
    }
  }
  for (; i < d; ++i) {
    for (int64_t j = 0; j < heads; ++j) acc[j * d + i] += static_cast<float>(value[i]) * weights[j * stride];
  }
}

// s[0..n) := exp(s - max) in place; returns 1 / sum (0 when every entry is -inf: a query that sees nothing).
inline float softmax_in_place(float* s, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t l = 0; l < n; ++l) top = std::max(top, s[l]);
  if (std::isinf(top)) {
    std::fill(s, s + n, 0.f);
    return 0.f;
  }
  int64_t l = 0;
  fVec total(0.f);
  const fVec shift(top);
  for (; l + fVec::size() <= n; l += fVec::size()) {
    const fVec e = (fVec::loadu(s + l) - shift).exp();
    e.store(s + l);
    total = total + e;
  }
  float sum = horizontal_sum(total);
  for (; l < n; ++l) {
    s[l] = std::exp(s[l] - top);
    sum += s[l];
  }
  return 1.f / sum;
}

// The same task with the head dim a compile-time multiple of kPair (d = kPair · DV) and N query heads at a
// time: the queries and the output rows stay in registers, and each key and value row is read once for all N.
template <typename scalar_t, int N, int DV>
struct FastTask {
  fVec q[N][2 * DV];
  fVec o[N][2 * DV];

  void load_queries(const scalar_t* query, int64_t d, float scale) {
    for (int j = 0; j < N; ++j) {
      for (int c = 0; c < DV; ++c) {
        load_pair(query + j * d + c * kPair, q[j][2 * c], q[j][2 * c + 1]);
        q[j][2 * c] = q[j][2 * c] * fVec(scale);
        q[j][2 * c + 1] = q[j][2 * c + 1] * fVec(scale);
      }
    }
  }

  // scores[j * stride] = q_j · key + bias
  void score(const scalar_t* key, float bias, float* scores, int64_t stride) const {
    fVec k[2 * DV];
    for (int c = 0; c < DV; ++c) load_pair(key + c * kPair, k[2 * c], k[2 * c + 1]);
    for (int j = 0; j < N; ++j) {
      fVec acc = q[j][0] * k[0];
      for (int c = 1; c < 2 * DV; ++c) acc = at::vec::fmadd(q[j][c], k[c], acc);
      scores[j * stride] = acc.reduce_add() + bias;
    }
  }

  void clear() {
    for (int j = 0; j < N; ++j)
      for (int c = 0; c < 2 * DV; ++c) o[j][c] = fVec(0.f);
  }

  // o_j += w_j · value
  void add(const scalar_t* value, const float* weights, int64_t stride) {
    fVec v[2 * DV];
    for (int c = 0; c < DV; ++c) load_pair(value + c * kPair, v[2 * c], v[2 * c + 1]);
    for (int j = 0; j < N; ++j) {
      const fVec w(weights[j * stride]);
      for (int c = 0; c < 2 * DV; ++c) o[j][c] = at::vec::fmadd(v[c], w, o[j][c]);
    }
  }

  void store(scalar_t* out, int64_t d, const float* norm) const {
    for (int j = 0; j < N; ++j) {
      const fVec n(norm[j]);
      for (int c = 0; c < DV; ++c) {
        Pair<scalar_t>::store(out + j * d + c * kPair, kStep, o[j][2 * c] * n, o[j][2 * c + 1] * n);
      }
    }
  }
};

struct Layout {  // where a task's keys, values, mask and prompt live (the kernels' shared arguments)
  int64_t P, Hkv, G, L, d, H, per_kv, Lp, total;
  c10::IntArrayRef ks, vs, pks, pvs;
  const bool* valid;
  int64_t valid_row;
  const float* prompt_bias;
};

template <typename scalar_t, int N, int DV>
void fast_heads(const Layout& a, const scalar_t* q_row, const scalar_t* k_data, const scalar_t* v_data,
                const scalar_t* pk, const scalar_t* pv, int64_t b, int64_t h, float scale, float* scores,
                scalar_t* out_row) {
  const int64_t p = b / a.G, g = b % a.G, total = a.total;
  const float hidden = -std::numeric_limits<float>::infinity();
  FastTask<scalar_t, N, DV> task;
  task.load_queries(q_row, a.d, scale);
  const float* bias = a.prompt_bias ? a.prompt_bias + (p * a.Hkv + h) * a.Lp : nullptr;
  for (int64_t l = 0; l < a.Lp; ++l) {
    if (std::isinf(bias[l])) {
      for (int j = 0; j < N; ++j) scores[j * total + l] = hidden;
    } else {
      task.score(pk + p * a.pks[0] + h * a.pks[1] + l * a.pks[2], bias[l], scores + l, total);
    }
  }
  const scalar_t* keys = k_data + p * a.ks[0] + h * a.ks[1] + g * a.ks[2];
  const bool* valid = a.valid ? a.valid + b * a.valid_row : nullptr;
  for (int64_t l = 0; l < a.L; ++l) {
    if (valid && !valid[l]) {
      for (int j = 0; j < N; ++j) scores[j * total + a.Lp + l] = hidden;
    } else {
      task.score(keys + l * a.ks[3], 0.f, scores + a.Lp + l, total);
    }
  }
  float norm[N];
  for (int j = 0; j < N; ++j) norm[j] = softmax_in_place(scores + j * total, total);
  task.clear();
  for (int64_t l = 0; l < a.Lp; ++l) {
    if (!std::isinf(bias[l])) task.add(pv + p * a.pvs[0] + h * a.pvs[1] + l * a.pvs[2], scores + l, total);
  }
  const scalar_t* values = v_data + p * a.vs[0] + h * a.vs[1] + g * a.vs[2];
  for (int64_t l = 0; l < a.L; ++l) {
    if (!valid || valid[l]) task.add(values + l * a.vs[3], scores + a.Lp + l, total);
  }
  task.store(out_row, a.d, norm);
}

template <typename scalar_t>
void decode_attention_kernel(
    const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, const at::Tensor* own_valid,
    const at::Tensor* prompt_keys, const at::Tensor* prompt_values, const at::Tensor* prompt_bias, double scale,
    at::Tensor& out) {
  const int64_t P = keys.size(0), Hkv = keys.size(1), G = keys.size(2), L = keys.size(3), d = keys.size(4);
  const int64_t H = query.size(1), per_kv = H / Hkv, Lp = prompt_keys ? prompt_keys->size(2) : 0;
  const int64_t total = Lp + L;
  const scalar_t* q_data = query.data_ptr<scalar_t>();
  const scalar_t* k_data = keys.data_ptr<scalar_t>();
  const scalar_t* v_data = values.data_ptr<scalar_t>();
  const auto ks = keys.strides();
  const auto vs = values.strides();
  const bool* valid = own_valid ? own_valid->data_ptr<bool>() : nullptr;
  const int64_t valid_row = own_valid ? own_valid->stride(0) : 0;
  const scalar_t* pk = prompt_keys ? prompt_keys->data_ptr<scalar_t>() : nullptr;
  const scalar_t* pv = prompt_values ? prompt_values->data_ptr<scalar_t>() : nullptr;
  const float* pb = prompt_bias ? prompt_bias->data_ptr<float>() : nullptr;
  const auto pks = prompt_keys ? prompt_keys->strides() : ks;
  const auto pvs = prompt_values ? prompt_values->strides() : vs;
  scalar_t* o_data = out.data_ptr<scalar_t>();
  const float scale_f = static_cast<float>(scale);
  const float hidden = -std::numeric_limits<float>::infinity();

  const Layout layout{P, Hkv, G, L, d, H, per_kv, Lp, total, ks, vs, pks, pvs, valid, valid_row, pb};
  const int64_t dv = d % kPair == 0 ? d / kPair : 0;
  const bool fast = dv == 2 || dv == 4;  // head dims 64 and 128 (with AVX-512; 32 and 64 with AVX2)
  at::parallel_for(0, P * G * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(per_kv * d), scores(per_kv * total), acc(per_kv * d), norm(per_kv);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv, p = b / G, g = b % G;
      if (fast) {
        for (int64_t j0 = 0; j0 < per_kv; j0 += 4) {
          const int64_t n = std::min<int64_t>(4, per_kv - j0), offset = (b * H + h * per_kv + j0) * d;
          const auto run = [&](auto heads, auto vectors) {
            fast_heads<scalar_t, decltype(heads)::value, decltype(vectors)::value>(
                layout, q_data + offset, k_data, v_data, pk, pv, b, h, scale_f, scores.data(), o_data + offset);
          };
          const auto with_heads = [&](auto vectors) {
            switch (n) {
              case 1: run(std::integral_constant<int, 1>{}, vectors); break;
              case 2: run(std::integral_constant<int, 2>{}, vectors); break;
              case 3: run(std::integral_constant<int, 3>{}, vectors); break;
              default: run(std::integral_constant<int, 4>{}, vectors); break;
            }
          };
          if (dv == 2) {
            with_heads(std::integral_constant<int, 2>{});
          } else {
            with_heads(std::integral_constant<int, 4>{});
          }
        }
        continue;
      }
      for (int64_t j = 0; j < per_kv; ++j) load_row(q_data + (b * H + h * per_kv + j) * d, q.data() + j * d, d);
      // scores (per_kv × total): the prompt's positions first, then the row's own
      for (int64_t l = 0; l < Lp; ++l) {
        const float bias = pb[(p * Hkv + h) * Lp + l];
        if (std::isinf(bias)) {
          for (int64_t j = 0; j < per_kv; ++j) scores[j * total + l] = hidden;
          continue;
        }
        score_key(q.data(), pk + p * pks[0] + h * pks[1] + l * pks[2], per_kv, d, scale_f, bias, scores.data() + l, total);
      }
      for (int64_t l = 0; l < L; ++l) {
        if (valid && !valid[b * valid_row + l]) {
          for (int64_t j = 0; j < per_kv; ++j) scores[j * total + Lp + l] = hidden;
          continue;
        }
        score_key(q.data(), k_data + p * ks[0] + h * ks[1] + g * ks[2] + l * ks[3], per_kv, d, scale_f, 0.f,
                  scores.data() + Lp + l, total);
      }
      for (int64_t j = 0; j < per_kv; ++j) norm[j] = softmax_in_place(scores.data() + j * total, total);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t l = 0; l < Lp; ++l) {
        if (std::isinf(pb[(p * Hkv + h) * Lp + l])) continue;
        add_value(acc.data(), pv + p * pvs[0] + h * pvs[1] + l * pvs[2], scores.data() + l, total, per_kv, d);
      }
      for (int64_t l = 0; l < L; ++l) {
        if (valid && !valid[b * valid_row + l]) continue;
        add_value(acc.data(), v_data + p * vs[0] + h * vs[1] + g * vs[2] + l * vs[3], scores.data() + Lp + l, total,
                  per_kv, d);
      }
      for (int64_t j = 0; j < per_kv; ++j) {
        const float* a = acc.data() + j * d;
        scalar_t* o = o_data + (b * H + h * per_kv + j) * d;
        for (int64_t i = 0; i < d; ++i) o[i] = static_cast<scalar_t>(a[i] * norm[j]);
      }
    }
  });
}

at::Tensor decode_attention(
    const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, const std::optional<at::Tensor>& own_valid,
    const std::optional<at::Tensor>& prompt_keys, const std::optional<at::Tensor>& prompt_values,
    const std::optional<at::Tensor>& prompt_bias, double scale) {
  TORCH_CHECK(query.dim() == 3 && keys.dim() == 5 && values.sizes() == keys.sizes(), "decode_attention: bad shapes");
  TORCH_CHECK(keys.stride(4) == 1 && values.stride(4) == 1, "decode_attention: the head dim must be contiguous");
  TORCH_CHECK(query.size(1) % keys.size(1) == 0 && query.size(1) / keys.size(1) <= kMaxHeadsPerKv,
              "decode_attention: at most 16 query heads per key/value head");
  TORCH_CHECK(query.scalar_type() == keys.scalar_type() && keys.scalar_type() == values.scalar_type(),
              "decode_attention: query, keys and values must share a dtype");
  auto q = query.contiguous();
  auto out = at::empty_like(q);
  std::optional<at::Tensor> valid, bias;
  if (own_valid) valid = own_valid->to(at::kBool).contiguous();
  if (prompt_bias) bias = prompt_bias->to(at::kFloat).contiguous();
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "decode_attention: float32 or bfloat16 only");
  const at::Tensor* valid_p = valid ? &*valid : nullptr;
  const at::Tensor* pk = prompt_keys ? &*prompt_keys : nullptr;
  const at::Tensor* pv = prompt_values ? &*prompt_values : nullptr;
  const at::Tensor* pb = bias ? &*bias : nullptr;
  if (q.scalar_type() == at::kFloat) {
    decode_attention_kernel<float>(q, keys, values, valid_p, pk, pv, pb, scale, out);
  } else {
    decode_attention_kernel<at::BFloat16>(q, keys, values, valid_p, pk, pv, pb, scale, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(polo_native, m) {
  m.def(
      "decode_attention(Tensor query, Tensor keys, Tensor values, Tensor? own_valid, Tensor? prompt_keys, "
      "Tensor? prompt_values, Tensor? prompt_bias, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(polo_native, CPU, m) { m.impl("decode_attention", decode_attention); }
