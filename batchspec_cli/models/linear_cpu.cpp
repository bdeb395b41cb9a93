// batchspec's linear layers for a CPU: bfloat16 weights where it has AVX512-BF16, float32 weights where it has AVX-512
// or AVX2 and FMA;
// models/native.py builds them with the other kernels and kernels.PackedLinear runs them (kernels.use_native) for the
// input sizes where this machine measured them faster.
//
// y[m, n] = sum_k x[m, k] w[n, k], a bfloat16 weight, summed in float32. A bfloat16 x gives a bfloat16 y; a float32 x
// is rounded to bfloat16 (nearest even, elementwise) and gives the float32 sums themselves (--dtype mixed: bfloat16
// weights and matmul inputs, float32 outputs and residual stream). `dtype` float32 asks for the float32 sums of a
// bfloat16 x too (mixed: a norm or SiLU that rounded its output to bfloat16 already, the next product's input). The
// weight is laid out once (pack_linear) in panels of 64 outputs whose k-pairs lie side by side, so one vdpbf16ps takes
// a pair of x's columns, broadcast, to 16 outputs; a forward streams the panels once, whatever its rows, and keeps a
// tile of up to 6 rows x 64 outputs in registers. Why: oneDNN's packed kernel streamed a decode step's weights at about
// half this CPU's memory bandwidth for 1-8 rows (a batch-1 step is all weight streaming), and at 16-512 rows ran below
// this loop too.
//
// Every output is one float32 sum over k in a fixed order (pairs, as vdpbf16ps adds them, then k upwards), rounded to
// bfloat16 at nearest even at the end where y is bfloat16: so a row's outputs never depend on the other rows of the
// product, on how many there are or on the threads, unlike oneDNN's and MKL's, whose order depends on the product's
// size. vdpbf16ps reads subnormal bfloat16 inputs (below 1.2e-38 in magnitude) as zero and flushes subnormal sums to
// zero.
//
// float32 (a float32 weight, x and y): the weight laid out once in panels of 64 outputs, a k's 64 outputs side by
// side; one fused multiply-add takes x[m, k], broadcast, to 16 outputs, the same tiles of up to 6 rows x 64 outputs,
// and the next panel lines fetched ahead of use. Why: on an AVX-512 Xeon without bfloat16 units, where a job runs
// float32, MKL and oneDNN ran 4-32 rows (a decode step's products) at a quarter to a half of what the core streams or
// computes. Each output is one float32 sum over k upwards, whatever the rows beside it: blocks of 64 k steps (a fused
// multiply-add a step), each block's sum added to the total in order (the error of 64 terms and k / 64, not of k).
//
// float32 with AVX2 and FMA (8 lanes, 16 registers): panels of 16 outputs, so that a panel streams as one run of
// memory, tiles of up to 6 rows x 16 outputs, and each 64-step block of a panel summed for every row (up to 48) before
// the next block, so that the panel streams from memory once while the rows' products go on. Why: on a Zen 3 core,
// decode steps of 4-16 rows ran at 1.5-1.7x this loop's time on oneDNN, 1.9-2.3x on MKL. Each output is summed in the
// order above, so it has the same bits as the AVX-512 build's.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <optional>
#include <type_traits>
#include "native_cpu.h"

namespace {
constexpr int64_t COLS = 64;  // outputs in a panel: 4 vectors of 16
#ifdef BATCHSPEC_AVX512
constexpr int64_t FLOAT_COLS = COLS;  // outputs in a float32 panel: 4 vectors of 16
#else
constexpr int64_t FLOAT_COLS = 16;    // 2 vectors of 8 (AVX2): a tile's accumulators and weights fill its 16 registers
#endif
constexpr int ROWS = 6;       // rows in a register tile: 6 x 4 accumulators, 4 weight vectors (AVX2: 6 x 2, 2)

bool has_linear() {
#ifdef BATCHSPEC_AVX512BF16
  return true;
#else
  return false;
#endif
}

bool has_linear_float() {
#if defined(BATCHSPEC_AVX512) || defined(BATCHSPEC_AVX2)
  return true;
#else
  return false;
#endif
}

// m rows in tiles of ROWS, then one tile of the rest: tile(std::integral_constant<int, R>, first row) for each
template <typename Tile>
inline void by_tiles(int64_t m, Tile tile) {
  int64_t r = 0;
  for (; r + ROWS <= m; r += ROWS) tile(std::integral_constant<int, ROWS>{}, r);
  switch (m - r) {
    case 5: tile(std::integral_constant<int, 5>{}, r); break;
    case 4: tile(std::integral_constant<int, 4>{}, r); break;
    case 3: tile(std::integral_constant<int, 3>{}, r); break;
    case 2: tile(std::integral_constant<int, 2>{}, r); break;
    case 1: tile(std::integral_constant<int, 1>{}, r); break;
    default: break;
  }
}

// A weight's rows of `words` words (a float32 weight: k floats; a bfloat16 one: k / 2 pairs) laid out in panels of
// `cols` outputs: [panels, words, cols], a word's outputs side by side (outputs past n are zeros)
template <typename W>
at::Tensor panels_of(const W* src, int64_t n, int64_t words, int64_t cols, at::Tensor out) {
  W* dst = reinterpret_cast<W*>(out.data_ptr());
  at::parallel_for(0, out.size(0), 1, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p)
      for (int64_t c = 0; c < cols && p * cols + c < n; ++c) {
        const W* row = src + (p * cols + c) * words;
        W* to = dst + p * words * cols + c;
        for (int64_t j = 0; j < words; ++j) to[j * cols] = row[j];
      }
  });
  return out;
}

// weight [n, k] -> bfloat16: [ceil(n / 64), k / 2, 64, 2], for each panel and k-pair the 64 outputs' pairs side by
// side; float32: [ceil(n / FLOAT_COLS), k, FLOAT_COLS]
at::Tensor pack_linear(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat) &&
                  weight.device().is_cpu(),
              "pack_linear takes a 2-D bfloat16 or float32 CPU weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  const at::Tensor dense = weight.contiguous();
  if (weight.scalar_type() == at::kFloat) {
    TORCH_CHECK(has_linear_float(), "the float32 linear kernel needs a CPU with AVX-512, or AVX2 and FMA");
    return panels_of(dense.data_ptr<float>(), n, k, FLOAT_COLS,
                     at::zeros({(n + FLOAT_COLS - 1) / FLOAT_COLS, k, FLOAT_COLS}, weight.options()));
  }
  TORCH_CHECK(has_linear(), "the linear kernel needs a CPU with AVX512-BF16");
  TORCH_CHECK(k % 2 == 0, "pack_linear takes an even number of input features");
  return panels_of(reinterpret_cast<const int32_t*>(dense.data_ptr<c10::BFloat16>()), n, k / 2, COLS,  // a pair: a word
                   at::zeros({(n + COLS - 1) / COLS, k / 2, COLS, 2}, weight.options()));
}

#ifdef BATCHSPEC_AVX512BF16
// R rows of x (pairs words each) times one panel; writes the panel's `cols` outputs of each row
inline void store(c10::BFloat16* y, __mmask16 mask, __m512 sums) {
  _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(sums));
}
inline void store(float* y, __mmask16 mask, __m512 sums) { _mm512_mask_storeu_ps(y, mask, sums); }

template <int R, typename Out>
inline void tile(const int32_t* x, int64_t pairs, const c10::BFloat16* panel, Out* y, int64_t stride, int64_t cols) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < 4; ++b) acc[r][b] = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
    const c10::BFloat16* w = panel + j * COLS * 2;
    __m512bh wv[4];
    for (int b = 0; b < 4; ++b) wv[b] = (__m512bh)_mm512_loadu_si512(w + b * 32);
    for (int r = 0; r < R; ++r) {
      const __m512bh xr = (__m512bh)_mm512_set1_epi32(x[r * pairs + j]);
      for (int b = 0; b < 4; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], xr, wv[b]);
    }
  }
  for (int b = 0; b < 4 && b * 16 < cols; ++b) {
    const int64_t live = std::min<int64_t>(16, cols - b * 16);
    const __mmask16 mask = live == 16 ? __mmask16(0xFFFF) : __mmask16((1u << live) - 1);
    for (int r = 0; r < R; ++r) store(y + r * stride + b * 16, mask, acc[r][b]);
  }
}

template <typename Out>
void rows_by_panel(const int32_t* x, int64_t m, int64_t pairs, const c10::BFloat16* panel, Out* y, int64_t stride,
                   int64_t cols) {
  by_tiles(m, [&](auto rows, int64_t r) {
    tile<decltype(rows)::value>(x + r * pairs, pairs, panel, y + r * stride, stride, cols);
  });
}
#endif

#if defined(BATCHSPEC_AVX512) || defined(BATCHSPEC_AVX2)
constexpr int64_t AHEAD = 4096 / (FLOAT_COLS * 4);  // k steps fetched ahead of the one summed: 4 KB of the panel
constexpr int64_t KB = 64;                          // k steps summed apart before their sum joins the total
#endif

#ifdef BATCHSPEC_AVX512
// R rows of x (k floats each) times one float32 panel; writes the panel's `cols` outputs of each row
template <int R>
inline void tile_float(const float* x, int64_t k, const float* panel, float* y, int64_t stride, int64_t cols) {
  __m512 total[R][4];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < 4; ++b) total[r][b] = _mm512_setzero_ps();
  for (int64_t j0 = 0; j0 < k; j0 += KB) {  // a block's sum joins the total: the error of 64 terms, not of k
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < 4; ++b) acc[r][b] = _mm512_setzero_ps();
    for (int64_t j = j0; j < std::min(k, j0 + KB); ++j) {
      const float* w = panel + j * COLS;
      for (int b = 0; b < 4; ++b) _mm_prefetch(reinterpret_cast<const char*>(w + AHEAD * COLS + b * 16), _MM_HINT_T0);
      __m512 wv[4];
      for (int b = 0; b < 4; ++b) wv[b] = _mm512_loadu_ps(w + b * 16);
      for (int r = 0; r < R; ++r) {
        const __m512 xr = _mm512_set1_ps(x[r * k + j]);
        for (int b = 0; b < 4; ++b) acc[r][b] = _mm512_fmadd_ps(xr, wv[b], acc[r][b]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int b = 0; b < 4; ++b) total[r][b] = _mm512_add_ps(total[r][b], acc[r][b]);
  }
  for (int b = 0; b < 4 && b * 16 < cols; ++b) {
    const int64_t live = std::min<int64_t>(16, cols - b * 16);
    const __mmask16 mask = live == 16 ? __mmask16(0xFFFF) : __mmask16((1u << live) - 1);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * stride + b * 16, mask, total[r][b]);
  }
}

void rows_by_panel_float(const float* x, int64_t m, int64_t k, const float* panel, float* y, int64_t stride,
                         int64_t cols) {
  by_tiles(m, [&](auto rows, int64_t r) {
    tile_float<decltype(rows)::value>(x + r * k, k, panel, y + r * stride, stride, cols);
  });
}

#elif defined(BATCHSPEC_AVX2)
constexpr int64_t CHUNK = 48;  // rows whose totals a panel keeps (3 KB) while its k-blocks go by

// R rows of x (k floats each) times the panel's k steps [j0, j1) (16 outputs: R x 2 accumulators, 2 weight vectors and
// x's broadcast fill the 16 registers at R = 6); adds each row's block sum to its 16 totals
template <int R>
inline void block_float(const float* x, int64_t k, const float* panel, int64_t j0, int64_t j1, float* totals) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < 2; ++b) acc[r][b] = _mm256_setzero_ps();
  for (int64_t j = j0; j < j1; ++j) {
    const float* w = panel + j * FLOAT_COLS;
    _mm_prefetch(reinterpret_cast<const char*>(w + AHEAD * FLOAT_COLS), _MM_HINT_T0);
    const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + r * k + j);
      acc[r][0] = _mm256_fmadd_ps(xr, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xr, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < 2; ++b) {
      float* t = totals + r * FLOAT_COLS + b * 8;
      _mm256_storeu_ps(t, _mm256_add_ps(_mm256_loadu_ps(t), acc[r][b]));
    }
}

// Each 64-step block of the panel is summed for every row of a chunk of 48 before the next block: it streams from
// memory once, while the rows' products go on (a panel per row tile would read memory only in its first tile); each
// output is summed as the AVX-512 tile sums it (blocks of 64 k steps, each block's sum added to the total in order)
void rows_by_panel_float(const float* x, int64_t m, int64_t k, const float* panel, float* y, int64_t stride,
                         int64_t cols) {
  alignas(32) float totals[CHUNK * FLOAT_COLS];
  for (int64_t r0 = 0; r0 < m; r0 += CHUNK) {
    const int64_t rows = std::min(CHUNK, m - r0);
    std::fill(totals, totals + rows * FLOAT_COLS, 0.f);
    for (int64_t j0 = 0; j0 < k; j0 += KB)
      by_tiles(rows, [&](auto tile, int64_t r) {
        block_float<decltype(tile)::value>(x + (r0 + r) * k, k, panel, j0, std::min(k, j0 + KB),
                                           totals + r * FLOAT_COLS);
      });
    for (int64_t r = 0; r < rows; ++r)
      std::copy(totals + r * FLOAT_COLS, totals + r * FLOAT_COLS + cols, y + (r0 + r) * stride);
  }
}
#endif

// float32 x [..., k] times a float32 packed weight -> float32 [..., out_features]
at::Tensor linear_float(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(has_linear_float(), "the float32 linear kernel needs a CPU with AVX-512, or AVX2 and FMA");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), "a float32 packed weight takes a float32 input");
  const int64_t k = x.size(-1);
  const int64_t width = packed.dim() == 3 ? packed.size(0) * FLOAT_COLS : 0;  // the panels' outputs
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == k && packed.size(2) == FLOAT_COLS && width >= out_features &&
                  width < out_features + FLOAT_COLS,
              "linear: the input and the packed weight do not match");
  const at::Tensor flat = x.reshape({-1, k}).contiguous();
  const int64_t m = flat.size(0), panels = packed.size(0);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = out_features;
  at::Tensor y = at::empty({m, out_features}, x.options());
#if defined(BATCHSPEC_AVX512) || defined(BATCHSPEC_AVX2)
  if (m > 0) {
    const float* xs = flat.data_ptr<float>();
    const float* ws = packed.data_ptr<float>();
    float* ys = y.data_ptr<float>();
    at::parallel_for(0, panels, 1, [&](int64_t first, int64_t last) {
      for (int64_t p = first; p < last; ++p)
        rows_by_panel_float(xs, m, k, ws + p * k * FLOAT_COLS, ys + p * FLOAT_COLS, out_features,
                            std::min<int64_t>(FLOAT_COLS, out_features - p * FLOAT_COLS));
    });
  }
#endif
  return y.view(shape);
}

// x [..., k] bfloat16 or float32 times a packed weight of `out_features` outputs -> [..., out_features] in `dtype`:
// x's dtype, or float32
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                  std::optional<at::ScalarType> dtype) {
  if (packed.scalar_type() == at::kFloat) {
    TORCH_CHECK(dtype.value_or(at::kFloat) == at::kFloat, "a float32 packed weight gives float32");
    return linear_float(x, packed, out_features);
  }
  TORCH_CHECK(has_linear(), "the linear kernel needs a CPU with AVX512-BF16");
  TORCH_CHECK((x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) &&
                  packed.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "linear takes a bfloat16 or float32 CPU input and a bfloat16 packed weight");
  const at::ScalarType out_dtype = dtype.value_or(x.scalar_type());
  TORCH_CHECK(out_dtype == x.scalar_type() || out_dtype == at::kFloat, "linear gives x's dtype or float32");
  const int64_t k = x.size(-1);
  TORCH_CHECK(packed.dim() == 4 && packed.size(1) * 2 == k && packed.size(2) == COLS && packed.size(3) == 2 &&
                  packed.size(0) * COLS >= out_features && packed.size(0) * COLS < out_features + COLS,
              "linear: the input and the packed weight do not match");
  const at::Tensor flat = x.reshape({-1, k}).to(at::kBFloat16).contiguous();
  const int64_t m = flat.size(0), panels = packed.size(0), pairs = k / 2;
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = out_features;
  at::Tensor y = at::empty({m, out_features}, x.options().dtype(out_dtype));
#ifdef BATCHSPEC_AVX512BF16
  if (m > 0) {
    const auto* xs = reinterpret_cast<const int32_t*>(flat.data_ptr<c10::BFloat16>());
    const auto* ws = packed.data_ptr<c10::BFloat16>();
    auto run = [&](auto* ys) {
      at::parallel_for(0, panels, 1, [&](int64_t first, int64_t last) {
        for (int64_t p = first; p < last; ++p)
          rows_by_panel(xs, m, pairs, ws + p * pairs * COLS * 2, ys + p * COLS, out_features,
                        std::min<int64_t>(COLS, out_features - p * COLS));
      });
    };
    if (y.scalar_type() == at::kFloat)
      run(y.data_ptr<float>());
    else
      run(y.data_ptr<c10::BFloat16>());
  }
#endif
  return y.view(shape);
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(batchspec, m) {
  m.def("has_linear() -> bool", &has_linear);
  m.def("has_linear_float() -> bool", &has_linear_float);
  m.def("pack_linear(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, int out_features, ScalarType? dtype=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(batchspec, CPU, m) {
  m.impl("pack_linear", &pack_linear);
  m.impl("linear", &linear);
}
