// What the 16-lane AVX-512 kernels share (amx_*.h and dense_prefill.h): the exp of their online softmax. Built
// only where -march enables AVX512-BF16 (with F and BW); elsewhere QKV_BF16DP stays undefined and the launcher
// keeps SDPA and the row loop.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define QKV_BF16DP 1

namespace vec16 {

// exp(x) for the softmax's x <= 0: vexp's range reduction and polynomial on 16 lanes.
static inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
  const __m512 tf = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(tf, _mm512_set1_ps(0.693359375f))),
                    _mm512_mul_ps(tf, _mm512_set1_ps(-2.12194440e-4f)));
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(y, z, x), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(tf), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// 2^x, for the softmax in the log2 domain (scores scaled by log2(e) with the softmax scale, so that no
// multiplication is left for the exponential): round-to-nearest range reduction to f in [-0.5, 0.5], a degree-5
// polynomial fitted to 2^f (relative error 1e-7, fp32's rounding) and one vscalefps for the power of two.
static inline __m512 exp2_16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 y = _mm512_set1_ps(1.3264729641e-3f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6715139225e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5507335812e-2f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022242427e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314700365e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

// Two adjacent bf16 (a channel pair or a key pair) broadcast to all 16 lanes: VDPBF16PS's B operand.
static inline __m512bh bcast_pair(const uint16_t* p) {
  uint32_t x;
  std::memcpy(&x, p, 4);
  return (__m512bh)_mm512_set1_epi32((int)x);
}

}  // namespace vec16

#endif
