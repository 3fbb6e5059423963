// A 16-bit model's linear layer for decode's row counts: y[M, N] = x[M, K] . w[N, K]^T (+ bias), on CPUs without
// 16-bit matrix units. Included by paged_cpu.cpp (its load_f32 / store_f32 and dtype codes); launcher:
// kernels/cpu_gemm.py.
//
// Why: at one or two rows a linear layer is bound by reading its weights. torch's bf16 (and fp16) GEMM on such a
// CPU converts inside a loop that does not keep up with memory, and the fp32 copies that qkv's batched path
// multiplies (qkv/cpu_linear.py) are twice the bytes. Here each weight row is read from memory once, widened to
// fp32 in registers (a shift for bf16, F16C for fp16), and every row of x passes over it while it sits in L1.
// At a few dozen rows the product, not the read, is the bound: groups of three rows of x against four weight
// rows keep twelve accumulators in flight, with the x vectors held in registers, and from a handful of rows on
// each weight tile is widened once into a per-thread buffer rather than once per group. So the kernel stays
// ahead of oneDNN's fp32 inner product on the copies to about a hundred rows, where batched decode steps
// live (scripts/bench_few_rows.py measures where they cross). With AVX-512, from that handful of rows on, a
// register holds two weight rows side by side and a group is six rows of x (small_gemm_tile512, below): the same
// accumulators, so the same bits, at twice the products per instruction.
//
// Prefetch: a tile reads NB weight rows side by side, a few cache lines each (1,152 bytes for K = 576), so the
// hardware prefetcher sees NB short streams that end before it has ramped up, and a one-row call ran at about
// half the machine's read bandwidth. So below SMALL_GEMM_WIDEN_ROWS rows each tile prefetches the next tile's
// bytes, in memory order, while it multiplies; the order of arithmetic does not change. From there on the
// product is the bound, and the same prefetch in the widening pass measured within the noise.
//
// Arithmetic: the exact fp32 products of the 16-bit operands, summed in fp32 and rounded once to the model's
// dtype, what torch's 16-bit kernels compute, in this fixed order: lane l of eight accumulates k = l, l + 8, ...
// with fused multiply-adds, the lanes are added as ((0+4)+(2+6)) + ((1+5)+(3+7)), then the bias. The order
// depends on nothing but K, so a row's result is the same whatever M is, whatever rows share the call, and
// at any thread count (threads split N).
//
// fp32 operands take the same loops and order (products then round inside each fused multiply-add): not for
// speed, but so that --batch-invariant can run an fp32 model's linears with that row invariance and no padding
// (qkv/small_linear.py's KernelLinear).
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

// Eight weights as fp32: widened from bf16 (a shift) or fp16 (F16C), or read from a tile already widened (F32).
template <int32_t DT>
static inline __m256 widen8(const void* p) {
  if constexpr (DT == F32) return _mm256_loadu_ps(static_cast<const float*>(p));
  const __m128i h = _mm_loadu_si128(static_cast<const __m128i*>(p));
  if constexpr (DT == BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  return _mm256_cvtph_ps(h);
}

static inline float lane_sum(__m256 v) {  // ((0+4)+(2+6)) + ((1+5)+(3+7))
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

// NB weight rows (w, of type DT, row stride ldw elements; rows n0 .. n0 + NB of the layer) against MR rows of the
// fp32 x (xf, row stride K8, zero-padded to K8).
// PF: prefetch `next` (a template argument, so that the loops without it compile as they did: three rows of x
// leave no register to spare).
template <int MR, int NB, int32_t DT, bool PF = false>
static inline void small_gemm_tile(const SmallGemmArgs& a, const float* xf, int64_t K8, int64_t m0, const void* w,
                                   int64_t ldw, int64_t n0, const char* next = nullptr) {
  using W = std::conditional_t<DT == F32, float, uint16_t>;
  const W* wt = static_cast<const W*>(w);
  __m256 acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm256_setzero_ps();
  const int64_t K = a.K, full = DT == F32 ? K8 : K / 8 * 8;  // a widened tile is zero-padded to K8
  for (int64_t k = 0; k < full; k += 8) {
    if constexpr (PF) {  // the next tile's NB rows of 16-bit weights, in step: 16 * NB bytes per 8 columns of this one
      constexpr int LINES = NB * 16 / 64 > 0 ? NB * 16 / 64 : 1;
      for (int l = 0; l < LINES; ++l) __builtin_prefetch(next + k * 2 * NB + 64 * l);
    }
    __m256 xv[MR];
    for (int m = 0; m < MR; ++m) {
      xv[m] = _mm256_loadu_ps(xf + (m0 + m) * K8 + k);
      asm("" : "+x"(xv[m]));  // keep x in a register: folded into each multiply-add it would be loaded NB times
    }
    for (int j = 0; j < NB; ++j) {
      __m256 wv = widen8<DT>(wt + j * ldw + k);
      if constexpr (DT == F32) asm("" : "+x"(wv));  // likewise
      for (int m = 0; m < MR; ++m) acc[m][j] = _mm256_fmadd_ps(wv, xv[m], acc[m][j]);
    }
  }
  if (full < K8) {  // the last K % 8 columns, zero-padded: the lanes past K add 0 * 0
    for (int j = 0; j < NB; ++j) {
      alignas(32) W tail[8] = {};
      std::memcpy(tail, wt + j * ldw + full, (K - full) * sizeof(W));
      const __m256 wv = widen8<DT>(tail);
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

template <int NB, int32_t DT>
static inline void small_gemm_tile_rows(const SmallGemmArgs& a, const float* xf, int64_t K8, const void* w,
                                        int64_t ldw, int64_t n0, const char* next = nullptr) {
  int64_t m0 = 0;
  if (next) {  // the first group prefetches the next tile; the others find this one in L1
    if (a.M == 1) return small_gemm_tile<1, NB, DT, true>(a, xf, K8, 0, w, ldw, n0, next);
    if (a.M == 2) return small_gemm_tile<2, NB, DT, true>(a, xf, K8, 0, w, ldw, n0, next);
    small_gemm_tile<3, NB, DT, true>(a, xf, K8, 0, w, ldw, n0, next);
    m0 = 3;
  }
  for (; m0 + 3 <= a.M; m0 += 3) small_gemm_tile<3, NB, DT>(a, xf, K8, m0, w, ldw, n0);
  for (; m0 + 2 <= a.M; m0 += 2) small_gemm_tile<2, NB, DT>(a, xf, K8, m0, w, ldw, n0);
  if (m0 < a.M) small_gemm_tile<1, NB, DT>(a, xf, K8, m0, w, ldw, n0);
}

// Rows at which a tile is widened to fp32 once rather than in every group of three rows of x.
constexpr int64_t SMALL_GEMM_WIDEN_ROWS = 6;

// One tile of NB weight rows against every row of x: the tile is read from memory once and stays in L1 while the
// groups of (up to) three rows of x pass over it, so a call of many rows still reads each weight once. The group
// shape, and whether the tile was widened first (exactly), change no (m, n)'s order of operations.
template <int NB, int32_t DT>
static inline void small_gemm_tile_all_rows(const SmallGemmArgs& a, const float* xf, int64_t K8, float* wide,
                                            int64_t n0) {
  if constexpr (DT == F32) {  // fp32 weights: the F32 tile reads rows of K8, so a K of no whole vectors is padded
    const float* w = static_cast<const float*>(a.w) + n0 * a.K;
    if (a.K == K8) return small_gemm_tile_rows<NB, F32>(a, xf, K8, w, a.K, n0);
    for (int j = 0; j < NB; ++j) {
      std::memcpy(wide + j * K8, w + j * a.K, a.K * sizeof(float));
      std::fill(wide + j * K8 + a.K, wide + (j + 1) * K8, 0.0f);
    }
    return small_gemm_tile_rows<NB, F32>(a, xf, K8, wide, K8, n0);
  }
  const uint16_t* w = static_cast<const uint16_t*>(a.w) + n0 * a.K;
  if (a.M < SMALL_GEMM_WIDEN_ROWS) {  // bound by the read: prefetch the next tile (none past the last)
    const char* next = n0 + 2 * NB <= a.N ? reinterpret_cast<const char*>(w + NB * a.K) : nullptr;
    return small_gemm_tile_rows<NB, DT>(a, xf, K8, w, a.K, n0, next);
  }
  for (int j = 0; j < NB; ++j) {
    int64_t k = 0;
    for (; k + 8 <= a.K; k += 8) _mm256_storeu_ps(wide + j * K8 + k, widen8<DT>(w + j * a.K + k));
    for (; k < K8; ++k) wide[j * K8 + k] = k < a.K ? load_f32(w, j * a.K + k, DT) : 0.0f;
  }
  small_gemm_tile_rows<NB, F32>(a, xf, K8, wide, K8, n0);
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
// AVX-512, from SMALL_GEMM_WIDEN_ROWS rows on, where the product is the bound: the same lanes in a register twice
// as wide. A zmm holds two weight rows side by side (lanes 0-7 row n's eight columns, lanes 8-15 row n + 1's same
// eight), times the row of x's eight broadcast to both halves, so each half is exactly one of the AVX2 tile's
// accumulators, and the same lane sums finish it: the bits are the AVX2 path's, with twice the products per
// instruction. The tile is widened into pairs interleaved by eight columns, so that one aligned load feeds a zmm.
constexpr int SMALL_GEMM_PAIRS = 4;  // eight weight rows a tile: 6 x-rows x 4 pairs = 24 accumulators of 32 zmm

template <int MR>
static inline void small_gemm_tile512(const SmallGemmArgs& a, const float* xf, int64_t K8, int64_t m0,
                                      const float* wide, int64_t n0) {
  __m512 acc[MR][SMALL_GEMM_PAIRS];
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < SMALL_GEMM_PAIRS; ++p) acc[m][p] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K8; k += 8) {
    __m512 xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = _mm512_broadcast_f32x8(_mm256_loadu_ps(xf + (m0 + m) * K8 + k));
    for (int p = 0; p < SMALL_GEMM_PAIRS; ++p) {
      const __m512 wv = _mm512_load_ps(wide + p * 2 * K8 + 2 * k);
      for (int m = 0; m < MR; ++m) acc[m][p] = _mm512_fmadd_ps(wv, xv[m], acc[m][p]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int p = 0; p < SMALL_GEMM_PAIRS; ++p)
      for (int h = 0; h < 2; ++h) {
        const __m256 half = h ? _mm512_extractf32x8_ps(acc[m][p], 1) : _mm512_castps512_ps256(acc[m][p]);
        const int64_t n = n0 + 2 * p + h;
        float s = lane_sum(half);
        if (a.bias) s += load_f32(a.bias, n, a.dtype);
        store_f32(a.y, (m0 + m) * a.N + n, s, a.dtype);
      }
}

// Widens (or copies, for fp32) the 2 * SMALL_GEMM_PAIRS weight rows from n0 into `wide`, pairs interleaved by
// eight columns and zero-padded to K8, then passes every row of x over them.
template <int32_t DT>
static inline void small_gemm_tile512_all_rows(const SmallGemmArgs& a, const float* xf, int64_t K8, float* wide,
                                               int64_t n0) {
  using W = std::conditional_t<DT == F32, float, uint16_t>;
  const W* w = static_cast<const W*>(a.w) + n0 * a.K;
  for (int j = 0; j < 2 * SMALL_GEMM_PAIRS; ++j) {
    float* dst = wide + (j / 2) * 2 * K8 + (j % 2) * 8;
    int64_t k = 0;
    for (; k + 8 <= a.K; k += 8) _mm256_store_ps(dst + 2 * k, widen8<DT>(w + j * a.K + k));
    for (; k < K8; ++k) dst[2 * (k / 8 * 8) + k % 8] = k < a.K ? load_f32(w, j * a.K + k, DT) : 0.0f;
  }
  int64_t m0 = 0;
  for (; m0 + 6 <= a.M; m0 += 6) small_gemm_tile512<6>(a, xf, K8, m0, wide, n0);
  switch (a.M - m0) {  // the last 1-5 rows
    case 5: small_gemm_tile512<5>(a, xf, K8, m0, wide, n0); break;
    case 4: small_gemm_tile512<4>(a, xf, K8, m0, wide, n0); break;
    case 3: small_gemm_tile512<3>(a, xf, K8, m0, wide, n0); break;
    case 2: small_gemm_tile512<2>(a, xf, K8, m0, wide, n0); break;
    case 1: small_gemm_tile512<1>(a, xf, K8, m0, wide, n0); break;
    default: break;
  }
}

template <int32_t DT>
static void small_gemm_all512(const SmallGemmArgs& a, const float* xf, int64_t K8) {
  constexpr int NB = 2 * SMALL_GEMM_PAIRS;
  const int64_t tiles = a.N / NB;
#pragma omp parallel num_threads(a.num_threads) if (a.N * a.K > (1 << 15))
  {
    float* wide = static_cast<float*>(std::aligned_alloc(64, NB * K8 * sizeof(float)));  // K8 * 32 bytes: whole lines
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) small_gemm_tile512_all_rows<DT>(a, xf, K8, wide, t * NB);
#pragma omp single
    for (int64_t n = tiles * NB; n < a.N; ++n) small_gemm_tile_all_rows<1, DT>(a, xf, K8, wide, n);
    std::free(wide);
  }
}
#define QKV_SMALL_GEMM_512 1
#endif

template <int NB, int32_t DT>
static void small_gemm_all(const SmallGemmArgs& a, const float* xf, int64_t K8) {
  const int64_t tiles = a.N / NB;
#pragma omp parallel num_threads(a.num_threads) if (a.N * a.K > (1 << 15))
  {
    // this thread's widened tile: 16-bit weights from SMALL_GEMM_WIDEN_ROWS rows on, fp32 ones only to pad K
    const bool widen = DT == F32 ? a.K != K8 : a.M >= SMALL_GEMM_WIDEN_ROWS;
    std::vector<float> wide(widen ? NB * K8 : 0);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; ++t) small_gemm_tile_all_rows<NB, DT>(a, xf, K8, wide.data(), t * NB);
#pragma omp single
    for (int64_t n = tiles * NB; n < a.N; ++n) small_gemm_tile_all_rows<1, DT>(a, xf, K8, wide.data(), n);
  }
}

extern "C" int qkv_small_gemm(const SmallGemmArgs* a) {
  if (a->M <= 0 || a->N <= 0 || a->K <= 0 || (a->dtype != BF16 && a->dtype != F16 && a->dtype != F32)) return 1;
  const int64_t K8 = (a->K + 7) / 8 * 8;
  std::vector<float> xf(a->M * K8, 0.0f);  // x widened once (exactly), zero-padded to whole vectors
  for (int64_t m = 0; m < a->M; ++m)
    for (int64_t k = 0; k < a->K; ++k) xf[m * K8 + k] = load_f32(a->x, m * a->K + k, a->dtype);
#ifdef QKV_SMALL_GEMM_512
  if (a->M >= SMALL_GEMM_WIDEN_ROWS) {
    if (a->dtype == BF16)
      small_gemm_all512<BF16>(*a, xf.data(), K8);
    else if (a->dtype == F16)
      small_gemm_all512<F16>(*a, xf.data(), K8);
    else
      small_gemm_all512<F32>(*a, xf.data(), K8);
    return 0;
  }
#endif
  // Four weight rows a tile: 3 x 4 accumulators, three rows of x and one weight vector fill the 16 registers.
  if (a->dtype == BF16)
    small_gemm_all<4, BF16>(*a, xf.data(), K8);
  else if (a->dtype == F16)
    small_gemm_all<4, F16>(*a, xf.data(), K8);
  else
    small_gemm_all<4, F32>(*a, xf.data(), K8);
  return 0;
}

// The widest vectors the kernel multiplies on in this build: 512 where -march enabled AVX-512 F and DQ, else 256.
extern "C" int qkv_small_gemm_vector_bits() {
#ifdef QKV_SMALL_GEMM_512
  return 512;
#else
  return 256;
#endif
}

#else

extern "C" int qkv_small_gemm_vector_bits() { return 0; }
extern "C" int qkv_small_gemm(const void*) { return 2; }  // built without AVX2, FMA and F16C: the launcher falls back

#endif
