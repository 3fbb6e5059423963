// Prefill attention in bf16 products (included by paged_cpu.cpp): a long prefill chunk against its contiguous,
// dequantized K/V (what qkv_gather_kv makes for torch's SDPA). Each item (query head, 16 query tokens) walks its
// visible keys 32 a step, transposed so that a vector holds the 16 query rows: S^T = K.Q^T (K's rows read in
// place), the online softmax with no horizontal reduction (the max, the rescale and the sums are per lane), then
// O^T += V^T.P^T, with V^T laid out once per kv head. Masking is by position (causal, window), so a chunk with
// earlier context works too.
//
// Why a kernel of our own: torch's flash SDPA for CPU multiplies in fp32 (bf16 inputs are widened), while a CPU
// with AVX512-BF16 does twice the products an instruction with VDPBF16PS, and one with AMX sixteen times more.
// The two products are a policy of the driver below: AMX tiles (amx_prefill.h) or VDPBF16PS on 16 lanes
// (Dp16 here, for CPUs with AVX512-BF16 and no AMX, such as AMD's Zen 4). Both round P to bf16, so rows are
// SDPA's to bf16 rounding, not bit for bit: the launcher takes these paths only outside --batch-invariant.
#pragma once
#include "avx512_common.h"

struct DenseArgs {
  const void* query;  // [T, H, D] bf16
  void* out;          // [T, H, D] bf16
  const void* kv;     // [2, Hkv, L, D] bf16, contiguous: positions [seq_len - L, seq_len)
  int64_t stride_qt, stride_qh, stride_ot, stride_oh, T, L;
  int32_t num_q_heads, num_kv_heads, head_dim, window, num_threads;
  float sm_scale;
};

#ifdef QKV_BF16DP
namespace dense {

constexpr int PK = 32, MAX_D = 256;  // keys a step; the largest head_dim

// V^T of one kv head, per 32-key step: [D channels][32 keys]; keys past L are zero.
static void pack_vt(const uint16_t* v, int64_t L, int D, int64_t steps, uint16_t* vt) {
  for (int64_t st = 0; st < steps; ++st)
    for (int d = 0; d < D; ++d) {
      uint16_t* dst = vt + ((size_t)st * D + d) * PK;
      for (int k = 0; k < PK; ++k) {
        const int64_t key = st * PK + k;
        dst[k] = key < L ? v[key * D + d] : 0;
      }
    }
}

// The products on 16 lanes with VDPBF16PS (2 bf16 products per fp32 lane and instruction). A lane is a query row:
// S^T's key k is the sum over channel pairs of Q^T's pair (a vector) times K[k]'s pair (a broadcast), and O^T's
// channel d adds P^T's key pairs times V^T[d]'s (broadcasts), so neither needs a horizontal reduction.
struct Dp16 {
  static bool supports(int D) { return D % 16 == 0 && D <= MAX_D; }
  static void begin() {}
  static void end() {}

  // sb[k][16 rows] = K[k] . Q^T for the step's 32 keys; qb is Q^T in channel pairs ([D/2][16 rows][2]).
  static void scores(const uint16_t* qb, const uint16_t* krows, int D, float* sb) {
    constexpr int NK = 8;  // keys in flight: enough independent sums to hide the instruction's latency
    for (int k0 = 0; k0 < PK; k0 += NK) {
      __m512 acc[NK];
      for (int j = 0; j < NK; ++j) acc[j] = _mm512_setzero_ps();
      for (int p = 0; p < D / 2; ++p) {
        const __m512bh q = (__m512bh)_mm512_load_si512(qb + p * 32);
        for (int j = 0; j < NK; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], q, vec16::bcast_pair(krows + (k0 + j) * D + 2 * p));
      }
      for (int j = 0; j < NK; ++j) _mm512_store_ps(sb + (k0 + j) * 16, acc[j]);
    }
  }

  // o[d][16 rows] += V^T[d] . P^T for the step; pb is P^T in key pairs ([16 pairs][16 rows][2]), va the step's
  // V^T ([D][32 keys]).
  static void accumulate(const uint16_t* pb, const uint16_t* va, float* o, int D) {
    __m512bh p[PK / 2];
    for (int j = 0; j < PK / 2; ++j) p[j] = (__m512bh)_mm512_load_si512(pb + j * 32);
    constexpr int NC = 8;  // channels in flight
    for (int d0 = 0; d0 < D; d0 += NC) {
      __m512 acc[NC];
      for (int i = 0; i < NC; ++i) acc[i] = _mm512_load_ps(o + (d0 + i) * 16);
      for (int j = 0; j < PK / 2; ++j)
        for (int i = 0; i < NC; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], p[j], vec16::bcast_pair(va + (d0 + i) * PK + 2 * j));
      for (int i = 0; i < NC; ++i) _mm512_store_ps(o + (d0 + i) * 16, acc[i]);
    }
  }
};

// The driver: items, Q^T and V^T packing, masking, the online softmax and the output; Product computes S^T and
// accumulates O^T (Dp16 above, amx::Tiles in amx_prefill.h).
template <class Product>
static int attention(const DenseArgs* a) {
  using vec16::exp2_16;
  const int D = a->head_dim, H = a->num_q_heads, HK = a->num_kv_heads, G = H / HK;
  const int64_t T = a->T, L = a->L, steps = (L + PK - 1) / PK, tiles = (T + 15) / 16;
  if (!Product::supports(D) || T > L) return 1;
  const size_t per_head = (size_t)steps * PK * D;
  // not zero-filled first: pack_vt writes every element (zeros past L itself)
  std::unique_ptr<uint16_t[]> vt_buf(new uint16_t[per_head * HK + 32]);
  uint16_t* vt = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(vt_buf.get()) + 63) & ~uintptr_t(63));
  const uint16_t* kin = static_cast<const uint16_t*>(a->kv);
  const uint16_t* vin = kin + (size_t)HK * L * D;
#pragma omp parallel for schedule(static) num_threads(a->num_threads)
  for (int h = 0; h < HK; ++h) pack_vt(vin + (size_t)h * L * D, L, D, steps, vt + h * per_head);

  const int64_t q_pos0 = L - T;  // query i sits at key index q_pos0 + i
  const int64_t items = (int64_t)H * tiles;
#pragma omp parallel num_threads(a->num_threads)
  {
    Product::begin();
    alignas(64) uint16_t qb[MAX_D * 16], kpad[PK * MAX_D], pb[PK * 16];
    alignas(64) float sb[PK * 16], o[MAX_D * 16];
    const float ninf = -std::numeric_limits<float>::infinity();
    const __m512i rows16 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {
      const int head = (int)(it % H), h = head / G;
      const int64_t t0 = (it / H) * 16, rows = std::min<int64_t>(16, T - t0);
      // Q^T in pairs of channels: qb[D/2][16 rows][2]
      const uint16_t* q = static_cast<const uint16_t*>(a->query);
      for (int r = 0; r < 16; ++r) {
        const uint32_t* src = reinterpret_cast<const uint32_t*>(q + (t0 + r) * a->stride_qt + head * a->stride_qh);
        for (int p = 0; p < D / 2; ++p) reinterpret_cast<uint32_t*>(qb)[p * 16 + r] = r < rows ? src[p] : 0u;
      }
      const __m512i qpos = _mm512_add_epi32(rows16, _mm512_set1_epi32((int)(q_pos0 + t0)));
      const __mmask16 live = (__mmask16)((1u << rows) - 1);
      __m512 m = _mm512_set1_ps(ninf), l = _mm512_setzero_ps();
      std::fill(o, o + 16 * D, 0.0f);
      const int64_t first = q_pos0 + t0, last = q_pos0 + t0 + rows - 1;  // key indices of the tile's queries
      const int64_t lo = a->window > 0 ? std::max<int64_t>(0, first - a->window + 1) : 0;
      const uint16_t* k_h = kin + (size_t)h * L * D;
      const uint16_t* vt_h = vt + h * per_head;
      for (int64_t st = lo / PK; st * PK <= last; ++st) {
        const uint16_t* krows = k_h + st * PK * D;
        if (st * PK + PK > L) {  // the last step: K rows past L are zero, not whatever follows the buffer
          std::fill(kpad, kpad + PK * D, (uint16_t)0);
          std::copy(krows, krows + (L - st * PK) * D, kpad);
          krows = kpad;
        }
        Product::scores(qb, krows, D, sb);
        // the online softmax, lanes = query rows, in the log2 domain (the scale carries log2(e), so P = 2^(s - m)
        // needs no multiplication: a few percent of the kernel); masks only where the step meets the diagonal or
        // the window
        const bool edge = st * PK + PK - 1 > first || rows < 16 || (a->window > 0 && st * PK <= last - a->window);
        __m512 sv[PK];
        __mmask16 vk[PK];
        __m512 mx = m;
        const __m512 sc = _mm512_set1_ps(a->sm_scale * 1.44269504088896341f);  // log2 domain
        for (int k = 0; k < PK; ++k) {
          vk[k] = live;
          if (edge) {
            const __m512i kp = _mm512_set1_epi32((int)(st * PK + k));
            vk[k] &= _mm512_cmple_epi32_mask(kp, qpos);  // key <= query
            if (a->window > 0) vk[k] &= _mm512_cmpgt_epi32_mask(kp, _mm512_sub_epi32(qpos, _mm512_set1_epi32(a->window)));
          }
          sv[k] = _mm512_mask_mul_ps(_mm512_set1_ps(ninf), vk[k], _mm512_load_ps(sb + k * 16), sc);
          mx = _mm512_max_ps(mx, sv[k]);
        }
        // lazy rescaling: a row's reference max moves only when its scores pass it by more than 11 in the log2
        // domain (2^11 is far inside fp32's range), so most steps add P.V straight into O^T
        const __mmask16 grow = _mm512_cmplt_ps_mask(_mm512_add_ps(m, _mm512_set1_ps(11.0f)), mx) &
                               _mm512_cmpneq_ps_mask(mx, _mm512_set1_ps(ninf));
        if (grow) {
          const __m512 m_new = _mm512_mask_mov_ps(m, grow, mx);
          const __m512 alpha = _mm512_maskz_mov_ps(_mm512_cmpneq_ps_mask(m, _mm512_set1_ps(ninf)),
                                                   exp2_16(_mm512_sub_ps(m, m_new)));
          const __m512 al = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), grow, alpha);
          l = _mm512_mul_ps(l, al);
          for (int d = 0; d < D; ++d) _mm512_store_ps(o + d * 16, _mm512_mul_ps(_mm512_load_ps(o + d * 16), al));
          m = m_new;
        }
        const __m512 shift = _mm512_mask_mov_ps(_mm512_setzero_ps(), _mm512_cmpneq_ps_mask(m, _mm512_set1_ps(ninf)), m);
        __m512 sum = _mm512_setzero_ps();
        for (int k = 0; k < PK; k += 2) {
          const __m512 p0 = _mm512_maskz_mov_ps(vk[k], exp2_16(_mm512_sub_ps(sv[k], shift)));
          const __m512 p1 = _mm512_maskz_mov_ps(vk[k + 1], exp2_16(_mm512_sub_ps(sv[k + 1], shift)));
          sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
          // P^T in pairs of keys: pb[16 key pairs][16 rows][2]
          const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
          _mm512_store_si512(pb + k * 16, _mm512_permutexvar_epi16(pairs, both));
        }
        l = _mm512_add_ps(l, sum);
        Product::accumulate(pb, vt_h + (size_t)st * D * PK, o, D);
      }
      // O^T / l, row by row (a gather of each row's channels), rounded to bf16
      const __m512 inv = _mm512_maskz_div_ps(_mm512_cmpneq_ps_mask(l, _mm512_setzero_ps()), _mm512_set1_ps(1.0f), l);
      alignas(64) float iv[16];
      _mm512_store_ps(iv, inv);
      const __m512i col = _mm512_mullo_epi32(rows16, _mm512_set1_epi32(16));
      uint16_t* out = static_cast<uint16_t*>(a->out);
      for (int r = 0; r < rows; ++r) {
        uint16_t* dst = out + (t0 + r) * a->stride_ot + head * a->stride_oh;
        for (int d = 0; d < D; d += 16) {
          const __m512 x = _mm512_mul_ps(_mm512_i32gather_ps(col, o + d * 16 + r, 4), _mm512_set1_ps(iv[r]));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), (__m256i)_mm512_cvtneps_pbh(x));
        }
      }
    }
    Product::end();
  }
  return 0;
}

}  // namespace dense

extern "C" int qkv_dense_attention_dp(const DenseArgs* a) { return dense::attention<dense::Dp16>(a); }
extern "C" int qkv_bf16dp_available() { return 1; }
#else
extern "C" int qkv_dense_attention_dp(const DenseArgs*) { return 1; }
extern "C" int qkv_bf16dp_available() { return 0; }
#endif
