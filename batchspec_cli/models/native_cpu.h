// What batchspec's CPU kernels share (attention_cpu.cpp, layers_cpu.cpp): the instruction sets this build targets
// 16 float32 lanes loaded from float32 or bfloat16, and a 16-lane exp (AVX-512); 8 lanes and an 8-lane exp that
// computes each lane as the 16-lane one does (AVX2 with FMA, no AVX-512).
#pragma once
#include <c10/util/BFloat16.h>
#include <cmath>
#include <limits>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define BATCHSPEC_AVX512 1
#if defined(__AVX512BF16__)
#define BATCHSPEC_AVX512BF16 1  // the causal prefill kernel: bfloat16 pairs dotted into float32 (vdpbf16ps)
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define BATCHSPEC_AVX2 1  // 8 lanes: attention, the float32 causal prefill and SiLU, lane for lane as with AVX-512
#endif

#ifdef BATCHSPEC_AVX512
namespace batchspec {
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
// exp on 16 lanes: 2^n * p(r), r = x - n ln2 in two parts, p of degree 6; exactly 0 below -87.
inline __m512 exp16(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}
}  // namespace batchspec
#endif

#ifdef BATCHSPEC_AVX2
namespace batchspec {
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
// exp on 8 lanes, each lane as exp16 computes it: the same reduction and polynomial, and 2^n applied as its scalef
// rounds (one rounding: 2^n built in the exponent field, for n = 128 2^127 then doubled; inf from n = 129)
inline __m256 exp8(__m256 x) {
  const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256 top = _mm256_cmp_ps(n, _mm256_set1_ps(127.f), _CMP_GT_OQ);  // n = 128: 2^127, then times 2
  const __m256 over = _mm256_cmp_ps(n, _mm256_set1_ps(128.f), _CMP_GT_OQ);  // p * 2^n overflows
  const __m256i e = _mm256_cvtps_epi32(_mm256_min_ps(n, _mm256_set1_ps(127.f)));
  const __m256 pow2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23));
  __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, pow2), _mm256_blendv_ps(_mm256_set1_ps(1.f), _mm256_set1_ps(2.f), top));
  y = _mm256_blendv_ps(y, _mm256_set1_ps(std::numeric_limits<float>::infinity()), over);
  return _mm256_and_ps(y, live);
}
}  // namespace batchspec
#endif
