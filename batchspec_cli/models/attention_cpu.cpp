// batchspec's CPU attention kernels; models/native.py builds them on the user's machine.
//
// attend: queries of a few tokens (a decode step, a verify). Per (row, KV head): every query that shares the KV head
// (its heads x its tokens) is scored against each key column once (float32, the keys converted as read), softmaxed
// over its allowed columns, and the values summed in column order. Every sum that could depend on where a row's
// columns start (its padding, so the batch beside it) is taken in column order or in lanes and blocks counted from
// the query's first allowed column: a row's output does not depend on the rows or padding beside it. A mask value at
// or below -1e30 (-inf, a dtype's finfo.min) masks its column; a query with no allowed column gets the mean of the
// values, as SDPA gives for a finite mask.
//
// causal: one row's bfloat16 prefill, each query attending to its own keys causally from the bottom right, on a CPU
// with AVX512-BF16: scores as float32 dot products of bfloat16 pairs (vdpbf16ps), a running max and sum over tiles of
// key columns, the probabilities rounded to bfloat16 for the product with the values (as SDPA's CPU flash kernel).
// In float32 on any CPU with AVX-512 the same tiles in float32 throughout: scores by fused multiply-adds over the head's
// dims, the probabilities kept in float32 (SDPA's CPU flash kernel ran a float32 prefill at a third of this core's
// float32 products); on a CPU with AVX2 and FMA but no AVX-512, the same tiles in 8-lane registers, each lane
// computed as the AVX-512 build computes it.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>
#include "native_cpu.h"

namespace {
#ifdef BATCHSPEC_AVX512
using batchspec::exp16;
using batchspec::load16;
#endif
#ifdef BATCHSPEC_AVX2
using batchspec::exp8;
#endif
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

constexpr float MASKED = -1e30f;
constexpr int64_t BLOCK = 32;  // columns of values summed before their sum joins the total
constexpr int64_t GROUPED_ROWS = 6;  // query rows from which attend_one scores 16 columns at a time

template <typename M>
inline float mask_add(M m) {
  if constexpr (std::is_same_v<M, bool>) return m ? 0.f : NEG_INF;
  else return static_cast<float>(m) <= MASKED ? NEG_INF : static_cast<float>(m);
}

inline void to_float(const float* src, float* dst, int64_t n) { std::copy(src, src + n, dst); }
inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t d = 0; d < n; ++d) out[d] = static_cast<uint32_t>(bits[d]) << 16;
}

#if defined(BATCHSPEC_AVX512) || defined(BATCHSPEC_AVX2)
// What attend_one does outside its vector loops, the same in both builds.

// A query row's scores before its softmax: with no allowed column, equal weights (returns false: nothing more to
// do); else the padding before its first allowed column zeroed, and its max in ``top``.
inline bool start_softmax(float* row, int64_t L, int64_t& first, float& total, float& top) {
  if (first == L) {
    std::fill(row, row + L, 1.f);
    first = 0;
    total = static_cast<float>(L);
    return false;
  }
  top = NEG_INF;
  for (int64_t j = first; j < L; ++j) top = std::max(top, row[j]);
  std::fill(row, row + std::min(first, L), 0.f);
  return true;
}

// The build's loop over the values for RN rows that start together (one per build, below)
template <int NC, int RN, typename T>
void weigh_values(const float* s, int64_t L, int64_t from, const T* vb, int64_t vs, float* acc);

// Rows r0 .. r0 + rn (rn <= RG) whose allowed columns start together (a decode step's, a verify's): their values
// weighed in one loop, no per-row branches. False where they start apart.
template <int NC, int RG, typename T>
bool weigh_together(const float* s, int64_t L, const std::vector<int64_t>& first, int64_t r0, int64_t rn,
                    const T* vb, int64_t vs, float* acc) {
  if (!std::all_of(first.begin() + r0, first.begin() + r0 + rn, [&](int64_t f) { return f == first[r0]; }))
    return false;
  constexpr int D = NC * 16;
  const float* sr = s + r0 * L;
  float* ar = acc + r0 * D;
  if (rn == 1) weigh_values<NC, 1>(sr, L, first[r0], vb, vs, ar);
  else if (rn == 2) weigh_values<NC, 2>(sr, L, first[r0], vb, vs, ar);
  else if constexpr (RG == 4) {
    if (rn == 3) weigh_values<NC, 3>(sr, L, first[r0], vb, vs, ar);
    else weigh_values<NC, 4>(sr, L, first[r0], vb, vs, ar);
  }
  return true;
}
#endif

#ifdef BATCHSPEC_AVX512
// The sums of 16 vectors' lanes, lane j the sum of a[j]'s: the tree of _mm512_reduce_add_ps for each (lanes i and
// i + 8, then i and i + 4, i and i + 2, i and i + 1), taken for 16 vectors at once.
inline __m512 reduce16(const __m512* a) {
  __m512 s1[8], s2[4], s3[2];
  for (int p = 0; p < 8; ++p)
    s1[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                          _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)));
  for (int p = 0; p < 4; ++p)
    s2[p] = _mm512_add_ps(_mm512_shuffle_f32x4(s1[2 * p], s1[2 * p + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                          _mm512_shuffle_f32x4(s1[2 * p], s1[2 * p + 1], _MM_SHUFFLE(2, 0, 2, 0)));
  for (int p = 0; p < 2; ++p)
    s3[p] = _mm512_add_ps(_mm512_shuffle_ps(s2[2 * p], s2[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(s2[2 * p], s2[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 sum = _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // lane 4k + t holds vector 4t + k's sum
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), sum);
}

// The additive mask of 16 columns side by side as attend_one applies it: the masked lanes (a mask value at or below
// MASKED, a false boolean), and in ``add`` every lane's value (0 for a boolean).
inline __mmask16 masked16(const bool* m, __m512* add) {
  *add = _mm512_setzero_ps();
  return _mm_cmpeq_epi8_mask(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m)), _mm_setzero_si128());
}
template <typename M>
inline __mmask16 masked16(const M* m, __m512* add) {
  *add = load16(m);
  return _mm512_cmp_ps_mask(*add, _mm512_set1_ps(MASKED), _CMP_LE_OQ);
}

// Rows whose allowed columns start together at ``from``: each row's weights (``s``, row stride L) times the values,
// summed in blocks of BLOCK columns counted from ``from`` and the blocks' sums added to ``acc`` (row stride D) in
// order, as the general loop of attend_one sums them (a weight of 0 adds nothing there, and adds 0 here).
template <int NC, int RN, typename T>
void weigh_values(const float* s, int64_t L, int64_t from, const T* vb, int64_t vs, float* acc) {
  constexpr int D = NC * 16;
  __m512 a[RN][NC];
  for (int g = 0; g < RN; ++g)
    for (int c = 0; c < NC; ++c) a[g][c] = _mm512_setzero_ps();
  auto flush = [&]() {
    for (int g = 0; g < RN; ++g)
      for (int c = 0; c < NC; ++c) {
        float* out = acc + g * D + c * 16;
        _mm512_storeu_ps(out, _mm512_add_ps(_mm512_loadu_ps(out), a[g][c]));
        a[g][c] = _mm512_setzero_ps();
      }
  };
  for (int64_t j = from; j < L; ++j) {
    if (j > from && (j - from) % BLOCK == 0) flush();
    __m512 v[NC];
    for (int c = 0; c < NC; ++c) v[c] = load16(vb + j * vs + c * 16);
    for (int g = 0; g < RN; ++g) {
      const __m512 pv = _mm512_set1_ps(s[g * L + j]);
      for (int c = 0; c < NC; ++c) a[g][c] = _mm512_fmadd_ps(pv, v[c], a[g][c]);
    }
  }
  flush();
}

// One (row, KV head): scores, softmax and the weighted values, NC = head dim / 16.
template <int NC, typename T, typename M>
void attend_one(const float* qf, int64_t R, int64_t Q, int64_t rep, const T* kb, int64_t ks, const T* vb,
                int64_t vs, const M* mb, int64_t mq, int64_t ml, int64_t L, float scale, float* s,
                float* total, float* acc) {
  constexpr int D = NC * 16;
  std::vector<int64_t> first(R, L);
  // Scores: with many query rows (a verify's), 16 columns at a time, their lane sums taken together (reduce16);
  // with a few (a decode step's), column by column, each column's key loaded once for all rows. The same numbers.
  alignas(64) float kf[16 * D];  // 16 key columns as float32
  alignas(64) float dots[16];
  for (int64_t j0 = 0; j0 < L && R >= GROUPED_ROWS; j0 += 16) {
    const int64_t n = std::min<int64_t>(16, L - j0);
    for (int jj = 0; jj < 16; ++jj)
      for (int c = 0; c < NC; ++c)
        _mm512_store_ps(kf + jj * D + c * 16, jj < n ? load16(kb + (j0 + jj) * ks + c * 16) : _mm512_setzero_ps());
    for (int64_t i = 0; i < Q; ++i)
      for (int64_t h = 0; h < rep; ++h) {
        const int64_t r = h * Q + i;
        const float* q = qf + r * D;
        __m512 a[16];
        for (int jj = 0; jj < 16; ++jj) {
          a[jj] = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_load_ps(kf + jj * D));
          for (int c = 1; c < NC; ++c)
            a[jj] = _mm512_fmadd_ps(_mm512_loadu_ps(q + c * 16), _mm512_load_ps(kf + jj * D + c * 16), a[jj]);
        }
        const __m512 dv = reduce16(a);
        if (n == 16 && ml == 1) {  // the mask's 16 columns side by side: one vector
          __m512 add;
          const __mmask16 masked = masked16(mb + i * mq + j0, &add);
          const __m512 score = _mm512_add_ps(_mm512_mul_ps(dv, _mm512_set1_ps(scale)), add);
          _mm512_storeu_ps(s + r * L + j0, _mm512_mask_mov_ps(score, masked, _mm512_set1_ps(NEG_INF)));
          const unsigned allowed = static_cast<unsigned>(static_cast<__mmask16>(~masked));
          if (first[r] == L && allowed) first[r] = j0 + __builtin_ctz(allowed);
          continue;
        }
        _mm512_store_ps(dots, dv);
        for (int64_t jj = 0; jj < n; ++jj) {
          const int64_t j = j0 + jj;
          const float add = mask_add(mb[i * mq + j * ml]);
          if (add == NEG_INF) { s[r * L + j] = NEG_INF; continue; }
          if (first[r] == L) first[r] = j;
          s[r * L + j] = dots[jj] * scale + add;
        }
      }
  }
  for (int64_t j = 0; j < L && R < GROUPED_ROWS; ++j) {
    __m512 k[NC];
    for (int c = 0; c < NC; ++c) k[c] = load16(kb + j * ks + c * 16);
    for (int64_t i = 0; i < Q; ++i) {
      const float add = mask_add(mb[i * mq + j * ml]);
      for (int64_t h = 0; h < rep; ++h) {
        const int64_t r = h * Q + i;
        if (add == NEG_INF) { s[r * L + j] = NEG_INF; continue; }
        if (first[r] == L) first[r] = j;
        const float* q = qf + r * D;
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), k[0]);
        for (int c = 1; c < NC; ++c) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + c * 16), k[c], a);
        s[r * L + j] = _mm512_reduce_add_ps(a) * scale + add;
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    float* row = s + r * L;
    float top;
    if (!start_softmax(row, L, first[r], total[r], top)) continue;
    // summed in lanes counted from the row's first allowed column, so the total does not depend on its padding
    __m512 sum = _mm512_setzero_ps();
    const __m512 shift = _mm512_set1_ps(top);
    for (int64_t j = first[r]; j < L; j += 16) {
      const __mmask16 in = L - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (L - j)) - 1);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(in, row + j), shift));
      _mm512_mask_storeu_ps(row + j, in, e);
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(in, e));
    }
    total[r] = _mm512_reduce_add_ps(sum);
  }
  // The values are summed in blocks of BLOCK columns counted from each query's first allowed column, the blocks'
  // sums then added in order: the rounding of a sum of ~BLOCK + L / BLOCK terms, not of L.
  const int64_t from = *std::min_element(first.begin(), first.end());
  std::fill(acc, acc + R * D, 0.f);
  constexpr int RG = NC <= 4 ? 4 : 2;
  for (int64_t r0 = 0; r0 < R; r0 += RG) {
    const int64_t rn = std::min<int64_t>(RG, R - r0);
    if (weigh_together<NC, RG>(s, L, first, r0, rn, vb, vs, acc)) continue;
    __m512 a[RG][NC];
    for (int g = 0; g < RG; ++g)
      for (int c = 0; c < NC; ++c) a[g][c] = _mm512_setzero_ps();
    auto flush = [&](int g) {
      float* out = acc + (r0 + g) * D;
      for (int c = 0; c < NC; ++c) {
        _mm512_storeu_ps(out + c * 16, _mm512_add_ps(_mm512_loadu_ps(out + c * 16), a[g][c]));
        a[g][c] = _mm512_setzero_ps();
      }
    };
    for (int64_t j = from; j < L; ++j) {
      __m512 v[NC];
      bool loaded = false;
      for (int g = 0; g < rn; ++g) {
        const int64_t into = j - first[r0 + g];
        if (into > 0 && into % BLOCK == 0) flush(g);
        const float p = s[(r0 + g) * L + j];
        if (p == 0.f) continue;
        if (!loaded) {
          for (int c = 0; c < NC; ++c) v[c] = load16(vb + j * vs + c * 16);
          loaded = true;
        }
        const __m512 pv = _mm512_set1_ps(p);
        for (int c = 0; c < NC; ++c) a[g][c] = _mm512_fmadd_ps(pv, v[c], a[g][c]);
      }
    }
    for (int g = 0; g < rn; ++g) flush(g);
  }
}
#endif

#if defined(BATCHSPEC_AVX512) || defined(BATCHSPEC_AVX2)
constexpr int QB = 16;  // query rows per block of a causal prefill
constexpr int64_t T = 256;  // key columns per tile: the tile's K, V and scores stay in L1/L2
#endif

#ifdef BATCHSPEC_AVX512

// A causal tile's scores of one query row, in place: scaled, its columns from `allowed` on masked (-inf); the row's
// running max `m` taken over them too. Returns the factor for the sums before this tile (0 for the first).
inline float scale_row(float* row, int64_t width, int64_t allowed, float scale, float& m) {
  const __m512 sc = _mm512_set1_ps(scale);
  __m512 top = _mm512_set1_ps(NEG_INF);
  for (int64_t j = 0; j < width; j += 16) {
    const int64_t left = allowed - j;
    const __mmask16 in = left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
    const __m512 x = _mm512_mask_mul_ps(_mm512_set1_ps(NEG_INF), in, _mm512_loadu_ps(row + j), sc);
    _mm512_storeu_ps(row + j, x);
    top = _mm512_max_ps(top, x);
  }
  const float now = std::max(m, _mm512_reduce_max_ps(top));
  const float alpha = m == NEG_INF ? 0.f : std::exp(m - now);
  m = now;
  return alpha;
}

// A row's value sums so far (`vectors` x 16 floats) times `alpha`, as a tile with a higher max asks.
inline void rescale(float* o, int vectors, float alpha) {
  if (alpha == 1.f) return;
  const __m512 av = _mm512_set1_ps(alpha);
  for (int c = 0; c < vectors; ++c) _mm512_storeu_ps(o + c * 16, _mm512_mul_ps(av, _mm512_loadu_ps(o + c * 16)));
}
#endif

#ifdef BATCHSPEC_AVX2
// scale_row and rescale in 8 lanes, every lane as the AVX-512 ones compute it (``vectors`` counts 8 floats here)
inline float scale_row(float* row, int64_t width, int64_t allowed, float scale, float& m) {
  const __m256 sc = _mm256_set1_ps(scale), low = _mm256_set1_ps(NEG_INF);
  const __m256 lane = _mm256_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f);
  __m256 top = low;
  for (int64_t j = 0; j < width; j += 8) {
    const __m256 in = _mm256_cmp_ps(lane, _mm256_set1_ps(static_cast<float>(std::clamp<int64_t>(allowed - j, 0, 8))),
                                    _CMP_LT_OQ);
    const __m256 x = _mm256_blendv_ps(low, _mm256_mul_ps(_mm256_loadu_ps(row + j), sc), in);
    _mm256_storeu_ps(row + j, x);
    top = _mm256_max_ps(top, x);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top);
  const float now = std::max(m, *std::max_element(lanes, lanes + 8));
  const float alpha = m == NEG_INF ? 0.f : std::exp(m - now);
  m = now;
  return alpha;
}

inline void rescale(float* o, int vectors, float alpha) {
  if (alpha == 1.f) return;
  const __m256 av = _mm256_set1_ps(alpha);
  for (int c = 0; c < vectors; ++c) _mm256_storeu_ps(o + c * 8, _mm256_mul_ps(av, _mm256_loadu_ps(o + c * 8)));
}

// Keeps two loaded vectors in registers: GCC would otherwise load them again for every multiply-add that reads them
// (a memory operand each), and the loads, not the multiply-adds, would set the pace
inline void in_register(__m256& a, __m256& b) { asm("" : "+x"(a), "+x"(b)); }

// The sum of 16 lanes (lo: 0-7, hi: 8-15) in _mm512_reduce_add_ps's order: i + (i + 8), then + 4, + 2, + 1
inline float reduce_add16(__m256 lo, __m256 hi) {
  const __m256 eight = _mm256_add_ps(hi, lo);
  const __m128 four = _mm_add_ps(_mm256_extractf128_ps(eight, 1), _mm256_castps256_ps128(eight));
  const __m128 two = _mm_add_ps(four, _mm_shuffle_ps(four, four, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(two) + _mm_cvtss_f32(_mm_shuffle_ps(two, two, _MM_SHUFFLE(1, 1, 1, 1)));
}
#endif

#ifdef BATCHSPEC_AVX512BF16
inline uint16_t bf16_bits(float f) {  // round to nearest even, as c10 does
  return c10::BFloat16(f).x;
}
// One (KV head): all its query heads' rows, causal from the bottom right (query i sees keys 0 .. shift + i).
// K of one KV head as 16-column blocks of [pair][column] words, V as [column pair][d] words: what vdpbf16ps takes.
template <int NP>
void pack_kv(const uint16_t* k, int64_t ks, const uint16_t* v, int64_t vs, int64_t nk, int64_t nk2, uint32_t* kp,
             uint32_t* vp) {
  constexpr int D = NP * 2;
  for (int64_t j = 0; j < nk; ++j)
    for (int p = 0; p < NP; ++p)
      kp[(j / 16) * (NP * 16) + p * 16 + j % 16] =
          uint32_t(k[j * ks + 2 * p]) | (uint32_t(k[j * ks + 2 * p + 1]) << 16);
  for (int64_t j = 0; j < nk; ++j)
    for (int d = 0; d < D; ++d) vp[(j / 2) * D + d] |= uint32_t(v[j * vs + d]) << (16 * (j & 1));
}

// One block of QB query rows of one head, causal from the bottom right (query i sees keys 0 .. shift + i), over
// tiles of T key columns with a running max and sum (the scores float32, the probabilities rounded to bfloat16 for
// the product with V, as SDPA's CPU flash kernel does).
template <int NP>
void causal_block(const uint16_t* q, int64_t qs_i, int64_t i0, int64_t rows, const uint32_t* kp, const uint32_t* vp,
                  int64_t nk, int64_t shift, float scale, uint16_t* out, int64_t os_i, float* s, uint32_t* pp,
                  float* o) {
  constexpr int D = NP * 2, NC = D / 16;
  uint32_t qq[QB * NP];
  float m[QB], l[QB];
  const int64_t kmax = std::min(nk, shift + i0 + rows);  // columns any row of the block sees
  for (int64_t r = 0; r < QB; ++r)
    for (int p = 0; p < NP; ++p) {
      const uint16_t* qr = q + (i0 + std::min(r, rows - 1)) * qs_i;
      qq[r * NP + p] = uint32_t(qr[2 * p]) | (uint32_t(qr[2 * p + 1]) << 16);
    }
  std::fill(o, o + QB * D, 0.f);
  std::fill(m, m + QB, NEG_INF);
  std::fill(l, l + QB, 0.f);
  for (int64_t t0 = 0; t0 < kmax; t0 += T) {
    const int64_t width = std::min(T, (kmax - t0 + 31) / 32 * 32);  // a multiple of 32 (pairs of 16)
    for (int64_t c0 = 0; c0 < width; c0 += 16) {
      __m512 acc[QB];
      for (int r = 0; r < QB; ++r) acc[r] = _mm512_setzero_ps();
      const uint32_t* kc = &kp[((t0 + c0) / 16) * (NP * 16)];
      for (int p = 0; p < NP; ++p) {
        const __m512bh kv = (__m512bh)_mm512_loadu_si512(kc + p * 16);
        for (int r = 0; r < QB; ++r)
          acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(int(qq[r * NP + p])), kv);
      }
      for (int r = 0; r < QB; ++r) _mm512_storeu_ps(&s[r * T + c0], acc[r]);
    }
    for (int64_t r = 0; r < rows; ++r) {
      float* row = &s[r * T];
      const float alpha = scale_row(row, width, std::min(width, shift + i0 + r + 1 - t0), scale, m[r]);
      const __m512 shiftv = _mm512_set1_ps(m[r]);
      __m512 sum = _mm512_setzero_ps();
      uint32_t* pr = &pp[r * (T / 2)];
      for (int64_t j = 0; j < width; j += 32) {
        const __m512 e0 = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j), shiftv));
        const __m512 e1 = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j + 16), shiftv));
        sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
        _mm512_storeu_si512(pr + j / 2, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));  // 16 pairs, in order
      }
      l[r] = l[r] * alpha + _mm512_reduce_add_ps(sum);
      rescale(&o[r * D], NC, alpha);
    }
    // every row of the block, in groups the registers hold (rows past ``rows`` too, harmlessly: a loop bound the
    // compiler knows keeps the accumulators in registers, which a bound known only at run time did not)
    constexpr int RG = NC <= 4 ? 4 : 2;
    static_assert(QB % RG == 0, "whole groups");
    for (int r0 = 0; r0 < QB; r0 += RG) {
      __m512 a[RG][NC];
      for (int g = 0; g < RG; ++g)
        for (int c = 0; c < NC; ++c) a[g][c] = _mm512_loadu_ps(&o[(r0 + g) * D + c * 16]);
      const uint32_t* vt = &vp[(t0 / 2) * D];
      for (int64_t t = 0; t < width / 2; ++t) {
        __m512bh vv[NC];
        for (int c = 0; c < NC; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vt + t * D + c * 16);
        for (int g = 0; g < RG; ++g) {
          const __m512bh pv = (__m512bh)_mm512_set1_epi32(int(pp[(r0 + g) * (T / 2) + t]));
          for (int c = 0; c < NC; ++c) a[g][c] = _mm512_dpbf16_ps(a[g][c], pv, vv[c]);
        }
      }
      for (int g = 0; g < RG; ++g)
        for (int c = 0; c < NC; ++c) _mm512_storeu_ps(&o[(r0 + g) * D + c * 16], a[g][c]);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.f / l[r];
    uint16_t* out_r = out + (i0 + r) * os_i;
    for (int d = 0; d < D; ++d) out_r[d] = bf16_bits(o[r * D + d] * inv);
  }
}

template <int NP>
void causal_all(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, double scale,
                at::Tensor& out) {
  constexpr int D = NP * 2;
  const int64_t H = query.size(1), n = query.size(2), G = key.size(1), nk = key.size(2);
  const int64_t rep = H / G, shift = nk - n, nk2 = (nk + 31) / 32 * 32, blocks = (n + QB - 1) / QB;
  const auto qs = query.strides(), ks = key.strides(), vs = value.strides();
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(query.data_ptr<at::BFloat16>());
  const uint16_t* kb = reinterpret_cast<const uint16_t*>(key.data_ptr<at::BFloat16>());
  const uint16_t* vb = reinterpret_cast<const uint16_t*>(value.data_ptr<at::BFloat16>());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  std::vector<uint32_t> kp(G * NP * nk2, 0), vp(G * (nk2 / 2) * D, 0);
  at::parallel_for(0, G, 1, [&](int64_t b, int64_t e) {
    for (int64_t g = b; g < e; ++g)
      pack_kv<NP>(kb + g * ks[1], ks[2], vb + g * vs[1], vs[2], nk, nk2, &kp[g * NP * nk2], &vp[g * (nk2 / 2) * D]);
  });
  at::parallel_for(0, H * blocks, 1, [&](int64_t b, int64_t e) {
    std::vector<float> s(QB * T), o(QB * D);
    std::vector<uint32_t> pp(QB * (T / 2));
    for (int64_t item = b; item < e; ++item) {
      const int64_t h = item / blocks, i0 = (item % blocks) * QB, g = h / rep;
      causal_block<NP>(qp + h * qs[1], qs[2], i0, std::min<int64_t>(QB, n - i0), &kp[g * NP * nk2],
                       &vp[g * (nk2 / 2) * D], nk, shift, static_cast<float>(scale), op + h * D, H * D, s.data(),
                       pp.data(), o.data());
    }
  });
}
#endif

#if defined(BATCHSPEC_AVX512) || defined(BATCHSPEC_AVX2)
constexpr int SUM_BLOCK = 16;  // float32: terms (dims of a score, columns of the values) summed apart, then added

// float32: K of one KV head as 16-column blocks of [d][column] (columns past nk are zeros)
template <int D>
void pack_k_float(const float* k, int64_t ks, int64_t nk, float* kp) {
  for (int64_t j = 0; j < nk; ++j)
    for (int d = 0; d < D; ++d) kp[(j / 16) * (D * 16) + d * 16 + j % 16] = k[j * ks + d];
}
#endif

#ifdef BATCHSPEC_AVX512
// One block of QB query rows of one head in float32, causal from the bottom right (query i sees keys 0 .. shift + i),
// over tiles of T key columns with a running max and sum; the values read in place (row j at v + j * vs).
template <int D>
void causal_block_float(const float* q, int64_t qs_i, int64_t i0, int64_t rows, const float* kp, const float* v,
                        int64_t vs, int64_t nk, int64_t shift, float scale, float* out, int64_t os_i, float* s,
                        float* o) {
  constexpr int NC = D / 16;
  float m[QB], l[QB];
  const int64_t kmax = std::min(nk, shift + i0 + rows);  // columns any row of the block sees
  const float* qr[QB];
  for (int r = 0; r < QB; ++r) qr[r] = q + (i0 + std::min<int64_t>(r, rows - 1)) * qs_i;
  std::fill(o, o + QB * D, 0.f);
  std::fill(m, m + QB, NEG_INF);
  std::fill(l, l + QB, 0.f);
  for (int64_t t0 = 0; t0 < kmax; t0 += T) {
    const int64_t width = std::min(T, (kmax - t0 + 15) / 16 * 16);  // whole 16-column blocks of the packed K
    for (int64_t c0 = 0; c0 < width; c0 += 16) {
      const float* kc = &kp[((t0 + c0) / 16) * (D * 16)];
      for (int d0 = 0; d0 < D; d0 += SUM_BLOCK) {  // each block of dims summed apart, then added in order
        __m512 acc[QB];
        for (int r = 0; r < QB; ++r) acc[r] = _mm512_setzero_ps();
        for (int d = d0; d < d0 + SUM_BLOCK; ++d) {
          const __m512 kv = _mm512_loadu_ps(kc + d * 16);
          for (int r = 0; r < QB; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(qr[r][d]), kv, acc[r]);
        }
        for (int r = 0; r < QB; ++r)
          _mm512_storeu_ps(&s[r * T + c0], d0 ? _mm512_add_ps(_mm512_loadu_ps(&s[r * T + c0]), acc[r]) : acc[r]);
      }
    }
    const int64_t live = std::min(width, nk - t0);  // the tile's columns that exist (the values read)
    for (int64_t r = 0; r < rows; ++r) {
      float* row = &s[r * T];
      const float alpha = scale_row(row, width, std::min(width, shift + i0 + r + 1 - t0), scale, m[r]);
      const __m512 shiftv = _mm512_set1_ps(m[r]);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t j = 0; j < width; j += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j), shiftv));
        sum = _mm512_add_ps(sum, e);
        _mm512_storeu_ps(row + j, e);
      }
      l[r] = l[r] * alpha + _mm512_reduce_add_ps(sum);
      rescale(&o[r * D], NC, alpha);
    }
    // every row of the block, in groups the registers hold (rows past ``rows`` too, harmlessly)
    constexpr int RG = NC <= 4 ? 4 : 2;
    static_assert(QB % RG == 0, "whole groups");
    for (int r0 = 0; r0 < QB; r0 += RG) {
      for (int64_t b0 = 0; b0 < live; b0 += SUM_BLOCK) {  // each block of columns summed apart, then added in order
        __m512 part[RG][NC];
        for (int g = 0; g < RG; ++g)
          for (int c = 0; c < NC; ++c) part[g][c] = _mm512_setzero_ps();
        for (int64_t t = b0; t < std::min(live, b0 + SUM_BLOCK); ++t) {
          const float* vt = v + (t0 + t) * vs;
          __m512 vv[NC];
          for (int c = 0; c < NC; ++c) vv[c] = _mm512_loadu_ps(vt + c * 16);
          for (int g = 0; g < RG; ++g) {
            const __m512 pv = _mm512_set1_ps(s[(r0 + g) * T + t]);
            for (int c = 0; c < NC; ++c) part[g][c] = _mm512_fmadd_ps(pv, vv[c], part[g][c]);
          }
        }
        for (int g = 0; g < RG; ++g)
          for (int c = 0; c < NC; ++c) {
            float* to = &o[(r0 + g) * D + c * 16];
            _mm512_storeu_ps(to, _mm512_add_ps(_mm512_loadu_ps(to), part[g][c]));
          }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.f / l[r];
    float* out_r = out + (i0 + r) * os_i;
    for (int d = 0; d < D; ++d) out_r[d] = o[r * D + d] * inv;
  }
}

#endif

#ifdef BATCHSPEC_AVX2
// The same block in 8 lanes (AVX2): a score's lane, a value sum's lane, each running max and sum computed as the
// AVX-512 block computes them, only grouped into fewer registers.
template <int D>
void causal_block_float(const float* q, int64_t qs_i, int64_t i0, int64_t rows, const float* kp, const float* v,
                        int64_t vs, int64_t nk, int64_t shift, float scale, float* out, int64_t os_i, float* s,
                        float* o) {
  constexpr int NV = D / 8;  // 8-float vectors of a head row
  constexpr int SR = 4;  // query rows scored at once, 16 columns each (8 accumulators)
  constexpr int RG = 4, CG = 2;  // rows x vectors of a value sum held at once (8 accumulators)
  static_assert(QB % SR == 0 && QB % RG == 0 && NV % CG == 0, "whole groups");
  float m[QB], l[QB];
  const int64_t kmax = std::min(nk, shift + i0 + rows);  // columns any row of the block sees
  const float* qr[QB];
  for (int r = 0; r < QB; ++r) qr[r] = q + (i0 + std::min<int64_t>(r, rows - 1)) * qs_i;
  std::fill(o, o + QB * D, 0.f);
  std::fill(m, m + QB, NEG_INF);
  std::fill(l, l + QB, 0.f);
  for (int64_t t0 = 0; t0 < kmax; t0 += T) {
    const int64_t width = std::min(T, (kmax - t0 + 15) / 16 * 16);
    for (int64_t c0 = 0; c0 < width; c0 += 16) {  // a packed block of 16 columns, as two halves
      const float* kc = &kp[((t0 + c0) / 16) * (D * 16)];
      for (int d0 = 0; d0 < D; d0 += SUM_BLOCK)
        for (int r0 = 0; r0 < QB; r0 += SR) {
          __m256 acc[SR][2];
          for (int r = 0; r < SR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
          for (int d = d0; d < d0 + SUM_BLOCK; ++d) {
            __m256 k0 = _mm256_loadu_ps(kc + d * 16), k1 = _mm256_loadu_ps(kc + d * 16 + 8);
            in_register(k0, k1);
            for (int r = 0; r < SR; ++r) {
              const __m256 qv = _mm256_set1_ps(qr[r0 + r][d]);
              acc[r][0] = _mm256_fmadd_ps(qv, k0, acc[r][0]);
              acc[r][1] = _mm256_fmadd_ps(qv, k1, acc[r][1]);
            }
          }
          for (int r = 0; r < SR; ++r)
            for (int h = 0; h < 2; ++h) {
              float* to = &s[(r0 + r) * T + c0 + 8 * h];
              _mm256_storeu_ps(to, d0 ? _mm256_add_ps(_mm256_loadu_ps(to), acc[r][h]) : acc[r][h]);
            }
        }
    }
    const int64_t live = std::min(width, nk - t0);  // the tile's columns that exist (the values read)
    for (int64_t r = 0; r < rows; ++r) {
      float* row = &s[r * T];
      const float alpha = scale_row(row, width, std::min(width, shift + i0 + r + 1 - t0), scale, m[r]);
      const __m256 shiftv = _mm256_set1_ps(m[r]);
      __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();  // the 16 lanes of the AVX-512 block's sum
      for (int64_t j = 0; j < width; j += 16) {
        const __m256 e0 = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), shiftv));
        const __m256 e1 = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j + 8), shiftv));
        lo = _mm256_add_ps(lo, e0);
        hi = _mm256_add_ps(hi, e1);
        _mm256_storeu_ps(row + j, e0);
        _mm256_storeu_ps(row + j + 8, e1);
      }
      l[r] = l[r] * alpha + reduce_add16(lo, hi);
      rescale(&o[r * D], NV, alpha);
    }
    for (int r0 = 0; r0 < QB; r0 += RG)
      for (int c0 = 0; c0 < NV; c0 += CG)
        for (int64_t b0 = 0; b0 < live; b0 += SUM_BLOCK) {  // each block of columns summed apart, then added
          __m256 part[RG][CG];
          for (int g = 0; g < RG; ++g)
            for (int c = 0; c < CG; ++c) part[g][c] = _mm256_setzero_ps();
          for (int64_t t = b0; t < std::min(live, b0 + SUM_BLOCK); ++t) {
            const float* vt = v + (t0 + t) * vs + c0 * 8;
            __m256 v0 = _mm256_loadu_ps(vt), v1 = _mm256_loadu_ps(vt + 8);
            in_register(v0, v1);
            for (int g = 0; g < RG; ++g) {
              const __m256 pv = _mm256_set1_ps(s[(r0 + g) * T + t]);
              part[g][0] = _mm256_fmadd_ps(pv, v0, part[g][0]);
              part[g][1] = _mm256_fmadd_ps(pv, v1, part[g][1]);
            }
          }
          for (int g = 0; g < RG; ++g)
            for (int c = 0; c < CG; ++c) {
              float* to = &o[(r0 + g) * D + (c0 + c) * 8];
              _mm256_storeu_ps(to, _mm256_add_ps(_mm256_loadu_ps(to), part[g][c]));
            }
        }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.f / l[r];
    float* out_r = out + (i0 + r) * os_i;
    for (int d = 0; d < D; ++d) out_r[d] = o[r * D + d] * inv;
  }
}
#endif

#if defined(BATCHSPEC_AVX512) || defined(BATCHSPEC_AVX2)
template <int D>
void causal_all_float(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, double scale,
                      at::Tensor& out) {
  const int64_t H = query.size(1), n = query.size(2), G = key.size(1), nk = key.size(2);
  const int64_t rep = H / G, shift = nk - n, nk16 = (nk + 15) / 16 * 16, blocks = (n + QB - 1) / QB;
  const auto qs = query.strides(), ks = key.strides(), vs = value.strides();
  const float* qp = query.data_ptr<float>();
  const float* kb = key.data_ptr<float>();
  const float* vb = value.data_ptr<float>();
  float* op = out.data_ptr<float>();
  std::vector<float> kp(G * D * nk16, 0.f);
  at::parallel_for(0, G, 1, [&](int64_t b, int64_t e) {
    for (int64_t g = b; g < e; ++g) pack_k_float<D>(kb + g * ks[1], ks[2], nk, &kp[g * D * nk16]);
  });
  at::parallel_for(0, H * blocks, 1, [&](int64_t b, int64_t e) {
    std::vector<float> s(QB * T), o(QB * D);
    for (int64_t item = b; item < e; ++item) {
      const int64_t h = item / blocks, i0 = (item % blocks) * QB, g = h / rep;
      causal_block_float<D>(qp + h * qs[1], qs[2], i0, std::min<int64_t>(QB, n - i0), &kp[g * D * nk16],
                            vb + g * vs[1], vs[2], nk, shift, static_cast<float>(scale), op + h * D, H * D, s.data(),
                            o.data());
    }
  });
}
#endif

// The same in plain C++ (any head dim, any CPU): the sums run in column order, so padding changes nothing either.
template <typename T, typename M>
void attend_any(const float* qf, int64_t R, int64_t Q, int64_t rep, int64_t D, const T* kb, int64_t ks, const T* vb,
                int64_t vs, const M* mb, int64_t mq, int64_t ml, int64_t L, float scale, float* s, float* total,
                float* acc) {
  std::vector<float> kf(D);
  for (int64_t j = 0; j < L; ++j) {
    to_float(kb + j * ks, kf.data(), D);
    for (int64_t i = 0; i < Q; ++i) {
      const float add = mask_add(mb[i * mq + j * ml]);
      for (int64_t h = 0; h < rep; ++h) {
        const int64_t r = h * Q + i;
        float dot = 0.f;
        if (add != NEG_INF) {  // in 16 partial sums, then added up: the error of a tree, not of a chain
          float part[16] = {0.f};
          for (int64_t d = 0; d < D; ++d) part[d % 16] += qf[r * D + d] * kf[d];
          for (float p : part) dot += p;
        }
        s[r * L + j] = add == NEG_INF ? NEG_INF : dot * scale + add;
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    float* row = s + r * L;
    const float top = *std::max_element(row, row + L);
    float sum = 0.f;
    for (int64_t j = 0; j < L; ++j) {
      row[j] = top == NEG_INF ? 1.f : row[j] == NEG_INF ? 0.f : std::exp(row[j] - top);
      sum += row[j];
    }
    total[r] = sum;
  }
  std::vector<int64_t> first(R, 0);  // each query's first allowed column: where its blocks of values start
  for (int64_t r = 0; r < R; ++r)
    while (first[r] < L - 1 && s[r * L + first[r]] == 0.f) ++first[r];
  std::fill(acc, acc + R * D, 0.f);
  std::vector<float> part(R * D, 0.f);
  auto flush = [&](int64_t r) {
    for (int64_t d = 0; d < D; ++d) {
      acc[r * D + d] += part[r * D + d];
      part[r * D + d] = 0.f;
    }
  };
  for (int64_t j = 0; j < L; ++j) {
    to_float(vb + j * vs, kf.data(), D);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t into = j - first[r];
      if (into > 0 && into % BLOCK == 0) flush(r);
      const float p = s[r * L + j];
      if (p != 0.f)
        for (int64_t d = 0; d < D; ++d) part[r * D + d] += p * kf[d];
    }
  }
  for (int64_t r = 0; r < R; ++r) flush(r);
}

#ifdef BATCHSPEC_AVX2
using batchspec::load8;

// attend_one in 8 lanes (AVX2), NC = head dim / 16: every score, softmax sum and value sum computed lane for lane as
// the AVX-512 attend_one computes it (a 16-lane vector held as two halves, its lanes summed in the same tree), so its
// row independence and a verify's query computing a one-token step's numbers hold as they do there.
template <int NC, int RN, typename T>
void weigh_values(const float* s, int64_t L, int64_t from, const T* vb, int64_t vs, float* acc) {
  constexpr int NV = NC * 2, D = NC * 16;
  constexpr int CG = RN == 1 ? 8 : RN <= 3 ? 4 : 2;  // 8-float vectors of a row held at once (at most 12 sums)
  static_assert(NV % CG == 0, "whole groups");
  for (int c0 = 0; c0 < NV; c0 += CG) {
    __m256 a[RN][CG];
    for (int g = 0; g < RN; ++g)
      for (int c = 0; c < CG; ++c) a[g][c] = _mm256_setzero_ps();
    auto flush = [&]() {
      for (int g = 0; g < RN; ++g)
        for (int c = 0; c < CG; ++c) {
          float* out = acc + g * D + (c0 + c) * 8;
          _mm256_storeu_ps(out, _mm256_add_ps(_mm256_loadu_ps(out), a[g][c]));
          a[g][c] = _mm256_setzero_ps();
        }
    };
    for (int64_t j = from; j < L; ++j) {
      if (j > from && (j - from) % BLOCK == 0) flush();
      __m256 v[CG];
      for (int c = 0; c < CG; ++c) v[c] = load8(vb + j * vs + (c0 + c) * 8);
      for (int g = 0; g < RN; ++g) {
        const __m256 pv = _mm256_set1_ps(s[g * L + j]);
        for (int c = 0; c < CG; ++c) a[g][c] = _mm256_fmadd_ps(pv, v[c], a[g][c]);
      }
    }
    flush();
  }
}

template <int NC, typename T, typename M>
void attend_one(const float* qf, int64_t R, int64_t Q, int64_t rep, const T* kb, int64_t ks, const T* vb,
                int64_t vs, const M* mb, int64_t mq, int64_t ml, int64_t L, float scale, float* s,
                float* total, float* acc) {
  constexpr int D = NC * 16;
  std::vector<int64_t> first(R, L);
  alignas(32) float kf[D];  // a key column as float32
  for (int64_t j = 0; j < L; ++j) {  // scores column by column, the key loaded once for every query row
    for (int c = 0; c < 2 * NC; ++c) _mm256_store_ps(kf + c * 8, load8(kb + j * ks + c * 8));
    for (int64_t i = 0; i < Q; ++i) {
      const float add = mask_add(mb[i * mq + j * ml]);
      for (int64_t h = 0; h < rep; ++h) {
        const int64_t r = h * Q + i;
        if (add == NEG_INF) { s[r * L + j] = NEG_INF; continue; }
        if (first[r] == L) first[r] = j;
        const float* q = qf + r * D;
        __m256 lo = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_load_ps(kf));
        __m256 hi = _mm256_mul_ps(_mm256_loadu_ps(q + 8), _mm256_load_ps(kf + 8));
        for (int c = 1; c < NC; ++c) {
          lo = _mm256_fmadd_ps(_mm256_loadu_ps(q + c * 16), _mm256_load_ps(kf + c * 16), lo);
          hi = _mm256_fmadd_ps(_mm256_loadu_ps(q + c * 16 + 8), _mm256_load_ps(kf + c * 16 + 8), hi);
        }
        s[r * L + j] = reduce_add16(lo, hi) * scale + add;
      }
    }
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t r = 0; r < R; ++r) {
    float* row = s + r * L;
    float top;
    if (!start_softmax(row, L, first[r], total[r], top)) continue;
    // summed in lanes counted from the row's first allowed column, so the total does not depend on its padding
    __m256 sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    const __m256 shift = _mm256_set1_ps(top);
    for (int64_t j = first[r]; j < L; j += 16)
      for (int half = 0; half < 2; ++half) {
        const int64_t left = std::min<int64_t>(L - j - 8 * half, 8);  // columns of this half that exist
        const __m256i in = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::max<int64_t>(left, 0))), lane);
        float* at = row + j + 8 * half;
        const __m256 e = exp8(_mm256_sub_ps(_mm256_maskload_ps(at, in), shift));
        _mm256_maskstore_ps(at, in, e);
        sum[half] = _mm256_add_ps(sum[half], _mm256_and_ps(e, _mm256_castsi256_ps(in)));
      }
    total[r] = reduce_add16(sum[0], sum[1]);
  }
  // The values are summed in blocks of BLOCK columns counted from each query's first allowed column, the blocks'
  // sums then added in order: the rounding of a sum of ~BLOCK + L / BLOCK terms, not of L.
  const int64_t from = *std::min_element(first.begin(), first.end());
  std::fill(acc, acc + R * D, 0.f);
  constexpr int RG = NC <= 4 ? 4 : 2;
  for (int64_t r0 = 0; r0 < R; r0 += RG) {
    const int64_t rn = std::min<int64_t>(RG, R - r0);
    if (weigh_together<NC, RG>(s, L, first, r0, rn, vb, vs, acc)) continue;
    for (int64_t g = 0; g < rn; ++g) {  // rows that start apart: each its own blocks, a zero weight skipped
      const int64_t start = first[r0 + g];
      const float* sr = s + (r0 + g) * L;
      float* out = acc + (r0 + g) * D;
      for (int c0 = 0; c0 < 2 * NC; c0 += 4) {
        __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        auto flush = [&]() {
          for (int c = 0; c < 4; ++c) {
            float* to = out + (c0 + c) * 8;
            _mm256_storeu_ps(to, _mm256_add_ps(_mm256_loadu_ps(to), a[c]));
            a[c] = _mm256_setzero_ps();
          }
        };
        for (int64_t j = from; j < L; ++j) {
          const int64_t into = j - start;
          if (into > 0 && into % BLOCK == 0) flush();
          const float p = sr[j];
          if (p == 0.f) continue;
          const __m256 pv = _mm256_set1_ps(p);
          for (int c = 0; c < 4; ++c) a[c] = _mm256_fmadd_ps(pv, load8(vb + j * vs + (c0 + c) * 8), a[c]);
        }
        flush();
      }
    }
  }
}
#endif

template <typename T, typename M>
void attend_all(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
            const at::Tensor& mask, double scale, at::Tensor& out) {
  const int64_t B = query.size(0), H = query.size(1), Q = query.size(2), D = query.size(3);
  const int64_t G = key.size(1), L = key.size(2), rep = H / G, R = rep * Q;
  const T* qp = query.data_ptr<T>();
  const T* kp = key.data_ptr<T>();
  const T* vp = value.data_ptr<T>();
  const M* mp = mask.data_ptr<M>();
  T* op = out.data_ptr<T>();
  const auto qs = query.strides(), ks = key.strides(), vs = value.strides(), ms = mask.strides();
  const int64_t mq = mask.size(2) == 1 ? 0 : ms[2];
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * G, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(R * D), s(R * L), total(R), acc(R * D);
    for (int64_t bg = begin; bg < end; ++bg) {
      const int64_t b = bg / G, g = bg % G;
      for (int64_t h = 0; h < rep; ++h)
        for (int64_t i = 0; i < Q; ++i)
          to_float(qp + b * qs[0] + (g * rep + h) * qs[1] + i * qs[2], &qf[(h * Q + i) * D], D);
      // The row's left padding, the columns no query of it may attend, is never read: every sum is counted from a
      // query's first allowed column, so the numbers are those of the whole row (a row with none allowed: all read)
      int64_t skip = 0;
      while (skip < L && [&] {
        for (int64_t i = 0; i < Q; ++i)
          if (mask_add(mp[b * ms[0] + i * mq + skip * ms[3]]) != NEG_INF) return false;
        return true;
      }()) ++skip;
      if (skip == L) skip = 0;
      const int64_t cols = L - skip;
      const T* kb = kp + b * ks[0] + g * ks[1] + skip * ks[2];
      const T* vb = vp + b * vs[0] + g * vs[1] + skip * vs[2];
      const M* mb = mp + b * ms[0] + skip * ms[3];
      bool done = false;
#if defined(BATCHSPEC_AVX512) || defined(BATCHSPEC_AVX2)
      if (D == 64) {
        attend_one<4>(qf.data(), R, Q, rep, kb, ks[2], vb, vs[2], mb, mq, ms[3], cols, sc, s.data(), total.data(),
                      acc.data());
        done = true;
      } else if (D == 128) {
        attend_one<8>(qf.data(), R, Q, rep, kb, ks[2], vb, vs[2], mb, mq, ms[3], cols, sc, s.data(), total.data(),
                      acc.data());
        done = true;
      }
#endif
      if (!done)
        attend_any(qf.data(), R, Q, rep, D, kb, ks[2], vb, vs[2], mb, mq, ms[3], cols, sc, s.data(), total.data(),
                   acc.data());
      for (int64_t h = 0; h < rep; ++h)
        for (int64_t i = 0; i < Q; ++i) {
          const int64_t r = h * Q + i;
          T* o = op + ((b * Q + i) * H + g * rep + h) * D;
          const float inv = 1.f / total[r];
          for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[r * D + d] * inv);
        }
    }
  });
}
}  // namespace

// The shapes each kernel reads through its raw pointers: anything else is an error, never a read out of bounds.
void check_shapes(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && key.sizes() == value.sizes(), "query, key, value: 4D, k ~ v");
  TORCH_CHECK(key.size(0) == query.size(0) && key.size(1) > 0 && query.size(1) % key.size(1) == 0 &&
              key.size(3) == query.size(3), "key and value [B, KV, L, D] for a query [B, H, q, D], KV dividing H");
  TORCH_CHECK(query.stride(3) == 1 && key.stride(3) == 1 && value.stride(3) == 1, "a head's dims side by side");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(), "one dtype");
}

at::Tensor attend(at::Tensor query, at::Tensor key, at::Tensor value, at::Tensor mask, double scale) {
  check_shapes(query, key, value);
  TORCH_CHECK(mask.dim() == 4 && mask.size(0) == query.size(0) && mask.size(1) == 1 &&
              (mask.size(2) == 1 || mask.size(2) == query.size(2)) && mask.size(3) == key.size(2),
              "the mask [B, 1, q or 1, L]");
  auto out = at::empty({query.size(0), query.size(2), query.size(1), query.size(3)}, query.options());
  AT_DISPATCH_SWITCH(query.scalar_type(), "batchspec_attend",
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      if (mask.scalar_type() == at::kBool) attend_all<scalar_t, bool>(query, key, value, mask, scale, out);
      else if (mask.scalar_type() == at::kFloat) attend_all<scalar_t, float>(query, key, value, mask, scale, out);
      else attend_all<scalar_t, c10::BFloat16>(query, key, value, mask, scale, out); })
    AT_DISPATCH_CASE(at::kFloat, [&] {
      if (mask.scalar_type() == at::kBool) attend_all<scalar_t, bool>(query, key, value, mask, scale, out);
      else attend_all<scalar_t, float>(query, key, value, mask, scale, out); }));
  return out;
}

bool has_causal() {
#ifdef BATCHSPEC_AVX512BF16
  return true;
#else
  return false;
#endif
}

bool has_causal_float() {
#if defined(BATCHSPEC_AVX512) || defined(BATCHSPEC_AVX2)
  return true;
#else
  return false;
#endif
}

at::Tensor causal(at::Tensor query, at::Tensor key, at::Tensor value, double scale) {
  // query [1, H, n, D], key and value [1, G, nk, D], bfloat16 or float32, the last dims contiguous; returns [n, H, D]
  check_shapes(query, key, value);
  TORCH_CHECK(query.size(3) == 64 || query.size(3) == 128, "the causal kernel takes heads of 64 or 128");
  TORCH_CHECK(query.size(0) == 1 && key.size(2) >= query.size(2), "one row, at least as many keys as queries");
  auto out = at::empty({query.size(2), query.size(1), query.size(3)}, query.options());
  if (query.scalar_type() == at::kFloat) {
    TORCH_CHECK(has_causal_float(), "the float32 causal kernel needs a CPU with AVX-512, or AVX2 and FMA");
#if defined(BATCHSPEC_AVX512) || defined(BATCHSPEC_AVX2)
    if (query.size(3) == 64) causal_all_float<64>(query, key, value, scale, out);
    else causal_all_float<128>(query, key, value, scale, out);
#endif
    return out;
  }
  TORCH_CHECK(has_causal() && query.scalar_type() == at::kBFloat16,
              "the causal kernel takes bfloat16 on a CPU with AVX512-BF16, or float32");
#ifdef BATCHSPEC_AVX512BF16
  if (query.size(3) == 64) causal_all<32>(query, key, value, scale, out);
  else causal_all<64>(query, key, value, scale, out);
#endif
  return out;
}

// Operators, not a Python module: the build needs ATen's headers only (seconds, not the half minute of
// torch/extension.h). native.py calls them as torch.ops.batchspec.*.
TORCH_LIBRARY(batchspec, m) {
  m.def("attend(Tensor query, Tensor key, Tensor value, Tensor mask, float scale) -> Tensor");
  m.def("causal(Tensor query, Tensor key, Tensor value, float scale) -> Tensor");
  m.def("has_causal() -> bool", &has_causal);
  m.def("has_causal_float() -> bool", &has_causal_float);
}

TORCH_LIBRARY_IMPL(batchspec, CPU, m) {
  m.impl("attend", &attend);
  m.impl("causal", &causal);
}
