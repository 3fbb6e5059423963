// A 16-bit model's linear layer for a few rows: y[M, N] = x[M, K] . w[N, K]^T (+ bias), on CPUs without 16-bit
// matrix units. Included by paged_cpu.cpp (its load_f32 / store_f32 and dtype codes); launcher:
// kernels/cpu_gemm.py.
//
// Why: at decode's one or two rows a linear layer is bound by reading its weights. torch's bf16 (and fp16) GEMM
// on such a CPU converts inside a loop that does not keep up with memory, and the fp32 copies that qkv's batched
// path multiplies (qkv/cpu_linear.py) are twice the bytes. Here each weight row is read once, widened to fp32 in
// registers (a shift for bf16, F16C for fp16) and multiplied into every row of x.
//
// Arithmetic: the exact fp32 products of the 16-bit operands, summed in fp32 and rounded once to the model's
// dtype, what torch's 16-bit kernels compute, in this fixed order: lane l of eight accumulates k = l, l + 8, ...
// with fused multiply-adds, the lanes are added as ((0+4)+(2+6)) + ((1+5)+(3+7)), then the bias. The order
// depends on nothing but K, so a row's result is the same whatever M is, whatever rows share the call, and
// at any thread count (threads split N).
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

struct SmallGemmArgs {
  const void* x;     // [M, K], model dtype, rows contiguous
  const void* w;     // [N, K], model dtype, rows contiguous
  const void* bias;  // [N] model dtype, or null
  void* y;           // [M, N], model dtype
  int64_t M, N, K;
  int32_t dtype;  // BF16 or F16
  int32_t num_threads;
};

static inline __m256 widen8(const uint16_t* p, int32_t dtype) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if (dtype == BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  return _mm256_cvtph_ps(h);
}

static inline float lane_sum(__m256 v) {  // ((0+4)+(2+6)) + ((1+5)+(3+7))
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

// Rows n0 .. n0 + NB of w against MR rows of the fp32 x (xf, row stride K8, zero-padded to K8).
template <int MR, int NB>
static inline void small_gemm_tile(const SmallGemmArgs& a, const float* xf, int64_t K8, int64_t m0, int64_t n0) {
  const uint16_t* w = static_cast<const uint16_t*>(a.w);
  __m256 acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm256_setzero_ps();
  const int64_t K = a.K, full = K / 8 * 8;
  for (int64_t k = 0; k < full; k += 8) {
    __m256 wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = widen8(w + (n0 + j) * K + k, a.dtype);
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_loadu_ps(xf + (m0 + m) * K8 + k);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm256_fmadd_ps(wv[j], xv, acc[m][j]);
    }
  }
  if (full < K) {  // the last K % 8 columns, zero-padded: the lanes past K add 0 * 0
    for (int j = 0; j < NB; ++j) {
      alignas(32) uint16_t tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      std::memcpy(tail, w + (n0 + j) * K + full, (K - full) * sizeof(uint16_t));
      const __m256 wv = widen8(tail, a.dtype);
      for (int m = 0; m < MR; ++m)
        acc[m][j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xf + (m0 + m) * K8 + full), acc[m][j]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) {
      float s = lane_sum(acc[m][j]);
      if (a.bias) s += load_f32(a.bias, n0 + j, a.dtype);
      store_f32(a.y, (m0 + m) * a.N + n0 + j, s, a.dtype);
    }
}

template <int MR>
static void small_gemm_rows(const SmallGemmArgs& a, const float* xf, int64_t K8, int64_t m0) {
  // Weight rows per tile: MR x NB accumulators, NB widened weight vectors and one x vector stay within the 16
  // vector registers. The tile shape does not change any (m, n)'s order of operations.
  constexpr int NB = MR >= 4 ? 2 : 4;
  const int64_t tiles = a.N / NB;
#pragma omp parallel for schedule(static) num_threads(a.num_threads) if (a.N * a.K > (1 << 15))
  for (int64_t t = 0; t < tiles; ++t) small_gemm_tile<MR, NB>(a, xf, K8, m0, t * NB);
  for (int64_t n = tiles * NB; n < a.N; ++n) small_gemm_tile<MR, 1>(a, xf, K8, m0, n);
}

extern "C" int qkv_small_gemm(const SmallGemmArgs* a) {
  if (a->M <= 0 || a->N <= 0 || a->K <= 0 || (a->dtype != BF16 && a->dtype != F16)) return 1;
  const int64_t K8 = (a->K + 7) / 8 * 8;
  std::vector<float> xf(a->M * K8, 0.0f);  // x widened once (exactly), zero-padded to whole vectors
  for (int64_t m = 0; m < a->M; ++m)
    for (int64_t k = 0; k < a->K; ++k) xf[m * K8 + k] = load_f32(a->x, m * a->K + k, a->dtype);
  int64_t m0 = 0;  // up to four rows share one read of the weights
  for (; m0 + 4 <= a->M; m0 += 4) small_gemm_rows<4>(*a, xf.data(), K8, m0);
  for (; m0 + 2 <= a->M; m0 += 2) small_gemm_rows<2>(*a, xf.data(), K8, m0);
  if (m0 < a->M) small_gemm_rows<1>(*a, xf.data(), K8, m0);
  return 0;
}

#else

extern "C" int qkv_small_gemm(const void*) { return 2; }  // built without AVX2, FMA and F16C: the launcher falls back

#endif
