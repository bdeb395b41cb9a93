// batchspec's CPU kernels for a Llama decoder layer's elementwise steps; models/native.py builds them with
// attention_cpu.cpp and runs them in its own layer forward (native.LlamaLayer).
//
// Each computes what transformers' Llama modules compute, in the same order of operations and with the same roundings
// to the model's dtype, in one pass over the data instead of one pass an operation: rms_norm (LlamaRMSNorm, and
// add_rms_norm: the residual sum before it), silu_mul (LlamaMLP's act(gate) * up over a fused gate|up product), rope
// (apply_rotary_pos_emb over a fused q|k|v product). Each takes an output dtype: the input's, or bfloat16 for a float32
// input (--dtype mixed: a norm's, SiLU's or rotary's float32 result rounded to bfloat16 as it is written, which is what
// the bfloat16 product or attention that reads it next would round it to). Where the numbers can differ from
// transformers': the sum of squares is taken in 16 lanes (a row's own fixed order, whatever the rows beside it), and
// exp is a polynomial within an ulp or two of the library's. The build turns off contraction into fused multiply-adds
// (-ffp-contract=off), so every product is rounded before its sum, as transformers rounds it.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <optional>
#include <tuple>
#include <type_traits>
#include "native_cpu.h"

namespace {
constexpr int LANES = 16;
constexpr int64_t GRAIN = 16;  // rows a thread takes at least

// x rounded to T (c10's own rounding: nearest even for bfloat16), kept as float: the next operation reads it as T.
template <typename T>
inline float rounded(float x) {
  return static_cast<float>(static_cast<T>(x));
}

#ifdef BATCHSPEC_AVX512
using batchspec::load16;
// 16 lanes rounded to T as ``rounded`` rounds one
template <typename T>
inline __m512 rounded16(__m512 x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
    const __m512 even = _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
    return _mm512_mask_mov_ps(even, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);  // NaN stays NaN
  }
}
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(c10::BFloat16* p, __m512 x) {  // x already rounded: its upper halves
  const __m256i halves = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), halves);
}
#endif

#ifdef BATCHSPEC_AVX2
using batchspec::load8;
// 8 lanes rounded to T as ``rounded`` rounds one
template <typename T>
inline __m256 rounded8(__m256 x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
    const __m256 even = _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
    return _mm256_blendv_ps(even, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));  // NaN stays NaN
  }
}
inline void store8(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
inline void store8(c10::BFloat16* p, __m256 x) {  // x already rounded: its upper halves
  alignas(32) uint32_t bits[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(bits), _mm256_castps_si256(x));
  uint16_t* out = reinterpret_cast<uint16_t*>(p);
  for (int l = 0; l < 8; ++l) out[l] = static_cast<uint16_t>(bits[l] >> 16);
}
#endif

// One row: out = w * T(x * rsqrt(mean(x^2) + eps)), as LlamaRMSNorm computes it.
template <typename T, typename O>
void norm_row(const T* x, const T* w, O* out, int64_t n, float eps) {
  float lane[LANES] = {};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES)
    for (int l = 0; l < LANES; ++l) {
      const float v = static_cast<float>(x[i + l]);
      lane[l] += v * v;
    }
  for (int l = 0; i < n; ++i, ++l) {
    const float v = static_cast<float>(x[i]);
    lane[l] += v * v;
  }
  for (int width = LANES / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) lane[l] += lane[l + width];
  const float inv = 1.f / std::sqrt(lane[0] / static_cast<float>(n) + eps);
  for (int64_t j = 0; j < n; ++j)
    out[j] = static_cast<O>(rounded<T>(static_cast<float>(w[j]) * rounded<T>(static_cast<float>(x[j]) * inv)));
}

template <typename T, typename O>
void norm_rows(const at::Tensor& x, const at::Tensor& w, at::Tensor& out, double eps, const at::Tensor* add,
               at::Tensor* sum) {
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(n, 1);
  const T *xs = x.data_ptr<T>(), *ws = w.data_ptr<T>();
  const T* as = add ? add->data_ptr<T>() : nullptr;
  O* os = out.data_ptr<O>();
  T* ss = sum ? sum->data_ptr<T>() : nullptr;
  at::parallel_for(0, rows, GRAIN, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = xs + r * n;
      if (as) {  // the residual sum first, rounded as the layer's own addition rounds it
        T* s = ss + r * n;
        for (int64_t j = 0; j < n; ++j)
          s[j] = static_cast<T>(static_cast<float>(as[r * n + j]) + static_cast<float>(row[j]));
        row = s;
      }
      norm_row(row, ws, os + r * n, n, static_cast<float>(eps));
    }
  });
}

void check_rows(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "a float32 or bfloat16 CPU tensor");
  TORCH_CHECK(x.is_contiguous() && x.dim() >= 1, "a contiguous tensor");
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.dim() == 1 && w.size(0) == x.size(-1) && w.is_contiguous(),
              "a weight of the input's dtype and last dimension");
}

// silu(gate) * up over [rows, 2n] = gate | up, each product rounded to T as act_fn(gate) * up_proj(x) rounds it.
template <typename T, typename O>
void silu_mul_rows(const T* gu, O* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, GRAIN, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T *g = gu + r * 2 * n, *u = g + n;
      O* o = out + r * n;
      int64_t j = 0;
#ifdef BATCHSPEC_AVX512
      for (; j + LANES <= n; j += LANES) {
        const __m512 x = load16(g + j);
        const __m512 e = batchspec::exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
        const __m512 act = rounded16<T>(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
        store16(o + j, rounded16<O>(rounded16<T>(_mm512_mul_ps(act, load16(u + j)))));
      }
#endif
#ifdef BATCHSPEC_AVX2
      for (; j + 8 <= n; j += 8) {  // each lane as the AVX-512 loop above computes it
        const __m256 x = load8(g + j);
        const __m256 e = batchspec::exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
        const __m256 act = rounded8<T>(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e)));
        store8(o + j, rounded8<O>(rounded8<T>(_mm256_mul_ps(act, load8(u + j)))));
      }
#endif
      for (; j < n; ++j) {
        const float x = static_cast<float>(g[j]);
        o[j] = static_cast<O>(rounded<T>(rounded<T>(x / (1.f + std::exp(-x))) * static_cast<float>(u[j])));
      }
    }
  });
}

// Rotary embedding of q and k, read from a fused [B, T, (H + G) * D + G * D] = q | k | v product:
// x * cos + rotate_half(x) * sin, each product and the sum rounded to T.
template <typename T, typename O>
void rope_rows(const T* qkv, const T* cos, const T* sin, bool cos_per_row, O* q, O* k, int64_t B, int64_t L,
               int64_t H, int64_t G, int64_t D) {
  const int64_t width = (H + 2 * G) * D, half = D / 2;
  at::parallel_for(0, B * L, GRAIN, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t b = p / L, t = p % L;
      const T* c = cos + ((cos_per_row ? b : 0) * L + t) * D;
      const T* s = sin + ((cos_per_row ? b : 0) * L + t) * D;
      for (int64_t h = 0; h < H + G; ++h) {
        const T* x = qkv + p * width + h * D;
        O* o = h < H ? q + (p * H + h) * D : k + (p * G + h - H) * D;
        for (int64_t d = 0; d < half; ++d) {
          const float a = rounded<T>(static_cast<float>(x[d]) * static_cast<float>(c[d]));
          const float r = rounded<T>(-static_cast<float>(x[d + half]) * static_cast<float>(s[d]));
          o[d] = static_cast<O>(rounded<T>(a + r));
        }
        for (int64_t d = half; d < D; ++d) {
          const float a = rounded<T>(static_cast<float>(x[d]) * static_cast<float>(c[d]));
          const float r = rounded<T>(static_cast<float>(x[d - half]) * static_cast<float>(s[d]));
          o[d] = static_cast<O>(rounded<T>(a + r));
        }
      }
    }
  });
}

// The output dtype asked for (`dtype`, else the input's): the input's, or bfloat16 for a float32 input
at::ScalarType output_dtype(const at::Tensor& x, std::optional<at::ScalarType> dtype) {
  const at::ScalarType out = dtype.value_or(x.scalar_type());
  TORCH_CHECK(out == x.scalar_type() || (x.scalar_type() == at::kFloat && out == at::kBFloat16),
              "the output is in the input's dtype, or bfloat16 for a float32 input");
  return out;
}

// f(T{}, O{}) for the input dtype T (float32 or bfloat16) and output dtype O of ``output_dtype``
template <typename F>
void dispatch_io(const at::Tensor& x, at::ScalarType out, F&& f) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "float32 or bfloat16");
  if (x.scalar_type() == at::kBFloat16)
    f(c10::BFloat16{}, c10::BFloat16{});
  else if (out == at::kBFloat16)
    f(float{}, c10::BFloat16{});
  else
    f(float{}, float{});
}
}  // namespace

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps, std::optional<at::ScalarType> dtype) {
  check_rows(x, weight);
  const at::ScalarType out_dtype = output_dtype(x, dtype);
  auto out = at::empty_like(x, x.options().dtype(out_dtype));
  dispatch_io(x, out_dtype, [&](auto t, auto o) {
    norm_rows<decltype(t), decltype(o)>(x, weight, out, eps, nullptr, nullptr);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps,
                                                std::optional<at::ScalarType> dtype) {
  // (rms_norm(residual + x) in `dtype`, residual + x in x's)
  check_rows(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() && residual.is_contiguous(),
              "a contiguous residual of the input's shape and dtype");
  const at::ScalarType out_dtype = output_dtype(x, dtype);
  auto out = at::empty_like(x, x.options().dtype(out_dtype)), sum = at::empty_like(x);
  dispatch_io(x, out_dtype, [&](auto t, auto o) {
    norm_rows<decltype(t), decltype(o)>(x, weight, out, eps, &residual, &sum);
  });
  return {out, sum};
}

at::Tensor silu_mul(at::Tensor gate_up, std::optional<at::ScalarType> dtype) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.is_contiguous() && gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
              "a contiguous CPU tensor whose last dimension is gate | up");
  TORCH_CHECK(gate_up.scalar_type() == at::kFloat || gate_up.scalar_type() == at::kBFloat16, "float32 or bfloat16");
  auto sizes = gate_up.sizes().vec();
  const int64_t n = sizes.back() / 2;
  sizes.back() = n;
  const at::ScalarType out_dtype = output_dtype(gate_up, dtype);
  auto out = at::empty(sizes, gate_up.options().dtype(out_dtype));
  dispatch_io(gate_up, out_dtype, [&](auto t, auto o) {
    using T = decltype(t);
    using O = decltype(o);
    silu_mul_rows<T, O>(gate_up.data_ptr<T>(), out.data_ptr<O>(), gate_up.numel() / (2 * n), n);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> rope(at::Tensor qkv, at::Tensor cos, at::Tensor sin, int64_t heads,
                                        int64_t kv_heads, std::optional<at::ScalarType> dtype) {
  // qkv [B, T, (heads + 2 kv_heads) D], cos and sin [B or 1, T, D]: q [B, T, heads, D], k [B, T, kv_heads, D] in
  // `dtype`
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 3 && qkv.is_contiguous() && heads > 0 && kv_heads > 0 &&
              qkv.size(2) % (heads + 2 * kv_heads) == 0, "a contiguous [B, T, (H + 2 G) D] CPU tensor");
  TORCH_CHECK(qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16, "float32 or bfloat16");
  const int64_t B = qkv.size(0), L = qkv.size(1), D = qkv.size(2) / (heads + 2 * kv_heads);
  TORCH_CHECK(D % 2 == 0, "an even head dimension");
  for (const auto& t : {cos, sin})
    TORCH_CHECK(t.dim() == 3 && (t.size(0) == 1 || t.size(0) == B) && t.size(1) == L && t.size(2) == D &&
                t.is_contiguous() && t.scalar_type() == qkv.scalar_type() && t.size(0) == cos.size(0),
                "cos and sin [B or 1, T, D], contiguous, in the input's dtype");
  const auto options = qkv.options().dtype(output_dtype(qkv, dtype));
  auto q = at::empty({B, L, heads, D}, options), k = at::empty({B, L, kv_heads, D}, options);
  dispatch_io(qkv, options.dtype().toScalarType(), [&](auto t, auto o) {
    using T = decltype(t);
    using O = decltype(o);
    rope_rows<T, O>(qkv.data_ptr<T>(), cos.data_ptr<T>(), sin.data_ptr<T>(), cos.size(0) == B && B > 1,
                    q.data_ptr<O>(), k.data_ptr<O>(), B, L, heads, kv_heads, D);
  });
  return {q, k};
}

TORCH_LIBRARY_FRAGMENT(batchspec, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, ScalarType? dtype=None) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, ScalarType? dtype=None)"
        " -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up, ScalarType? dtype=None) -> Tensor");
  m.def("rope(Tensor qkv, Tensor cos, Tensor sin, int heads, int kv_heads, ScalarType? dtype=None)"
        " -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(batchspec, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope", &rope);
}
