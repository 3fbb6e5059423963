// Decode attention on AMX tiles (included by paged_cpu.cpp, which defines CacheDesc, AttnArgs and the helpers).
//
// Why: the row loop of paged_cpu.cpp dequantizes every K/V block into fp32 and scores one query row at a
// time with 8-lane FMAs; at decode that is bound by instructions, not by the cache bytes. A decode row's GQA
// group (G query heads of one kv head) against a 16-token block is two small matrix products, which one AMX
// instruction each does in bf16 with fp32 accumulation:
//
//   S^T [16 keys x G] = K [16 x D] . Q^T      (K's rows are the cache rows: bf16 blocks load in place,
//                                               8-bit ones are widened to bf16 exactly: every fp8/int8 code is a bf16)
//   O   [G x D]      += P [G x 16] . V [16 x D] (P rounded to bf16, as vLLM's AMX path does; V pairs interleaved)
//
// The scales (per tensor, per head or per token) multiply the scores and P in fp32, the online softmax runs in
// 16-lane AVX-512. The result is not the row loop's bit for bit (P is rounded to bf16, the sums run in another
// order), so this path is only taken when the launcher asks for it: never under --batch-invariant, whose rows must
// not depend on whether they are computed as a decode or inside a prefill chunk. Machines without AMX build none of
// this (amx_common.h).
#pragma once
#include "amx_common.h"

#ifdef QKV_AMX
namespace amx {

// Tile registers: the QK product (S, K, Q) and the PV product (P, V, O). Macros, not constants: the tile
// intrinsics paste their register number into the instruction's text.
#define T_S 0
#define T_K 1
#define T_Q 2
#define T_P 3
#define T_V 4
#define T_O 5

static void configure(int G) {
  TileConfig cfg = {};
  cfg.palette_id = 1;
  auto set = [&](int t, int rows, int colsb) {
    cfg.rows[t] = (uint8_t)rows;
    cfg.colsb[t] = (uint16_t)colsb;
  };
  set(T_S, BS, 4 * G);
  set(T_K, BS, 64);
  set(T_Q, 16, 4 * G);
  set(T_P, G, 64);
  set(T_V, 16, 64);
  set(T_O, G, 64);
  _tile_loadconfig(&cfg);
}

// The layers this path computes: a bf16 query, a cache whose codes are bf16 values, scales that are one number
// per key (none, per head or per token); the GQA group fits a tile's rows.
static bool supports(const CacheDesc& c, int G, int32_t q_dtype) {
  return q_dtype == BF16 && !c.packed && c.block_size == BS && c.head_dim % 32 == 0 && c.head_dim <= MAX_D &&
         G >= 1 && G <= MAX_G && c.scale_mode != SCALE_CHANNEL &&
         (c.dtype == BF16 || c.dtype == E4M3 || c.dtype == E5M2 || c.dtype == I8);
}

// 32 stored codes as 32 bf16 of the same value, exactly (every fp8 and int8 value is a bf16).
template <int32_t DT>
static inline __m512i widen32(const void* base, int64_t i) {
  if constexpr (DT == BF16) {
    return _mm512_loadu_si512(static_cast<const uint16_t*>(base) + i);
  } else if constexpr (DT == I8) {
    const __m128i* p = reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(base) + i);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  } else if constexpr (DT == E4M3) {
    // bf16 bits directly: a normal code's 7 magnitude bits shifted into place, the exponent rebased by
    // 127 - 7; the 7 subnormal codes from a table; 0x7f is NaN; the sign bit copied (the byte sign-extended)
    const __m512i x = _mm512_cvtepi8_epi16(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint8_t*>(base) + i)));
    const __m512i mag = _mm512_and_si512(x, _mm512_set1_epi16(0x7f));
    const __m512i subnormal = _mm512_setr_epi32(0x3b000000, 0x3bc03b80, 0x3c203c00, 0x3c603c40, 0, 0, 0, 0, 0, 0,
                                                0, 0, 0, 0, 0, 0);  // m * 2^-9 for m = 0 .. 7
    __m512i r = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), _mm512_set1_epi16(0x3c00));
    r = _mm512_mask_permutexvar_epi16(r, _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8)), mag, subnormal);
    r = _mm512_mask_mov_epi16(r, _mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7f)), _mm512_set1_epi16(0x7fc0));
    return _mm512_or_si512(r, _mm512_and_si512(x, _mm512_set1_epi16((short)0x8000)));
  } else {  // e5m2 is the top byte of an fp16, widened through fp32
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint8_t*>(base) + i));
    const __m512i h = _mm512_slli_epi16(_mm512_cvtepu8_epi16(b), 8);
    const __m512 lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    const __m512 hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  }
}

// Per-key multipliers of one side's codes in a block: (1 | the head's | each token's scale) x extra;
// 0 for the keys no query sees (a stale slot's scale is never read).
static inline __m512 key_scales(const CacheDesc& c, int kv, int64_t block, int h, float extra,
                                __mmask16 valid) {
  if (c.scale_mode == SCALE_DYNAMIC) {
    const float* s = c.scale_cache + block * c.s_stride_block + kv * c.s_stride_kv + h;
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32((int)c.s_stride_slot));
    const __m512 v = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, idx, s, 4);
    return _mm512_mul_ps(v, _mm512_set1_ps(extra));
  }
  const float s = c.scale_mode == SCALE_HEAD ? (kv == 0 ? c.k_scale : c.v_scale)[h] : 1.0f;
  return _mm512_set1_ps(s * extra);
}

// Keys per softmax round: four blocks, two 32-key steps of the P.V product (the tile's K dimension).
constexpr int NB = 4, RK = NB * BS;
// kv heads an item walks together: their rows of a block are neighbours, so a block is read front to back.
constexpr int MAX_NH = 8;

// One kv head's running state: its group's queries as Q^T in pairs of channels ([D/2][G][2]), the online
// softmax's max and sum, and the unnormalized output ([G][D]).
struct HeadState {
  alignas(64) uint16_t qb[MAX_D * MAX_G];
  alignas(64) float o[MAX_G * MAX_D];
  float m[MAX_G], l[MAX_G];
};

// Work space of one thread (about 250 KiB; what one round touches stays in L1/L2).
struct Work {
  HeadState head[MAX_NH];
  alignas(64) uint16_t kb[RK * MAX_D];        // a round's K rows widened to bf16 (8-bit caches)
  alignas(64) uint16_t vr[RK * MAX_D];        // its V rows widened to bf16
  alignas(64) uint16_t vb[RK * MAX_D];        // V in pairs of keys: [D/16][RK/2][32]
  alignas(64) uint16_t pb[MAX_G * RK];        // P as bf16: [G][RK]
  alignas(64) float sb[RK * 16];              // S^T: [RK keys][16]
  alignas(64) float pv[MAX_G * MAX_D];        // this round's P.V: [G][D]
  alignas(64) uint16_t zero[MAX_D];           // the V row of a key no row sees
};

// A round's blocks: their ids and which of their keys the decode row sees.
struct Round {
  int nb;
  int64_t block[NB];
  __mmask16 valid[NB];
};

// The round's work for kv head h: S^T = K.Q^T block by block, the online softmax, then O += P.V.
template <int32_t DT>
static void attend_round(const AttnArgs& a, const Round& rd, int h, HeadState& hs, Work& w) {
  const CacheDesc& c = a.cache;
  const int D = c.head_dim, G = a.num_q_heads / c.num_kv_heads;
  const float ninf = -std::numeric_limits<float>::infinity();
  const int nb = rd.nb;
  const uint16_t* vrow[RK];
  for (int i = 0; i < NB; ++i) {
    if (i >= nb) {  // a short round: its missing keys have zero P and zero V
      for (int j = 0; j < BS; ++j) vrow[i * BS + j] = w.zero;
      continue;
    }
    const __mmask16 valid = rd.valid[i];
    const int64_t kbase = row_base(c, rd.block[i], 0, 0, h), vbase = row_base(c, rd.block[i], 1, 0, h);
    // K rows: the cache's own (bf16) or widened into kb; the rows no query sees are masked out of the scores
    const uint16_t* krows;
    int64_t kstride;
    if constexpr (DT == BF16) {
      krows = static_cast<const uint16_t*>(c.data) + kbase;
      kstride = c.stride_slot * 2;
    } else {
      uint16_t* kb = w.kb + (size_t)i * BS * D;
      for (int j = 0; j < BS; ++j)
        if (valid >> j & 1)
          for (int d = 0; d < D; d += 32)
            _mm512_store_si512(kb + j * D + d, widen32<DT>(c.data, kbase + j * c.stride_slot + d));
      krows = kb;
      kstride = (int64_t)D * 2;
    }
    _tile_zero(T_S);
    for (int d = 0; d < D; d += 32) {
      _tile_loadd(T_K, krows + d, kstride);
      _tile_loadd(T_Q, hs.qb + (size_t)d * G, 4 * G);
      _tile_dpbf16ps(T_S, T_K, T_Q);
    }
    _tile_stored(T_S, w.sb + i * BS * 16, 64);
    // V rows, so that stale bytes never count: keys no query sees read a zero row
    for (int j = 0; j < BS; ++j) {
      if (!(valid >> j & 1)) {
        vrow[i * BS + j] = w.zero;
      } else if constexpr (DT == BF16) {
        vrow[i * BS + j] = static_cast<const uint16_t*>(c.data) + vbase + j * c.stride_slot;
      } else {
        uint16_t* vr = w.vr + ((size_t)i * BS + j) * D;
        for (int d = 0; d < D; d += 32) _mm512_store_si512(vr + d, widen32<DT>(c.data, vbase + j * c.stride_slot + d));
        vrow[i * BS + j] = vr;
      }
    }
  }
  // the online softmax of the round, 16 keys a vector; P carries the V scales
  __m512 ks[NB], vs[NB];
  for (int i = 0; i < nb; ++i) {
    ks[i] = key_scales(c, 0, rd.block[i], h, a.sm_scale, rd.valid[i]);
    vs[i] = key_scales(c, 1, rd.block[i], h, 1.0f, rd.valid[i]);
  }
  const __m512i rows16 = _mm512_slli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 4);
  float alpha[MAX_G];
  for (int g = 0; g < G; ++g) {
    __m512 sc[NB];
    __m512 mx = _mm512_set1_ps(ninf);
    for (int i = 0; i < nb; ++i) {
      const __m512 raw = _mm512_i32gather_ps(_mm512_add_epi32(rows16, _mm512_set1_epi32(g)), w.sb + i * BS * 16, 4);
      sc[i] = _mm512_mask_mul_ps(_mm512_set1_ps(ninf), rd.valid[i], raw, ks[i]);
      mx = _mm512_max_ps(mx, sc[i]);
    }
    const float m_new = std::max(hs.m[g], _mm512_reduce_max_ps(mx));
    alpha[g] = hs.m[g] == ninf ? 0.0f : std::exp(hs.m[g] - m_new);
    __m512 sum = _mm512_setzero_ps();
    for (int i = 0; i < NB; ++i) {
      __m256i pbits = _mm256_setzero_si256();
      if (i < nb) {
        const __m512 p = _mm512_maskz_mov_ps(rd.valid[i], exp16(_mm512_sub_ps(sc[i], _mm512_set1_ps(m_new))));
        sum = _mm512_add_ps(sum, p);
        pbits = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(p, vs[i]));
      }
      _mm256_store_si256(reinterpret_cast<__m256i*>(w.pb + g * RK + i * BS), pbits);
    }
    hs.l[g] = hs.l[g] * alpha[g] + _mm512_reduce_add_ps(sum);
    hs.m[g] = m_new;
  }
  // V in pairs of keys, the B operand's layout: vb[D/16][RK/2][32]
  const __m512i pair_lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                           6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i pair_hi = _mm512_add_epi16(pair_lo, _mm512_set1_epi16(16));
  const int pairs = (nb + 1) / 2 * BS;  // whole 32-key steps
  for (int r = 0; r < pairs; ++r)
    for (int d = 0; d < D; d += 32) {
      const __m512i x = _mm512_loadu_si512(vrow[2 * r] + d), y = _mm512_loadu_si512(vrow[2 * r + 1] + d);
      _mm512_store_si512(w.vb + ((size_t)(d / 16) * (RK / 2) + r) * 32, _mm512_permutex2var_epi16(x, pair_lo, y));
      _mm512_store_si512(w.vb + ((size_t)(d / 16 + 1) * (RK / 2) + r) * 32, _mm512_permutex2var_epi16(x, pair_hi, y));
    }
  const int steps = (nb + 1) / 2;  // 32 keys a step
  for (int d = 0; d < D; d += 16) {
    _tile_zero(T_O);
    for (int k = 0; k < steps; ++k) {
      _tile_loadd(T_P, w.pb + k * 32, 2 * RK);
      _tile_loadd(T_V, w.vb + ((size_t)(d / 16) * (RK / 2) + k * 16) * 32, 64);
      _tile_dpbf16ps(T_O, T_P, T_V);
    }
    _tile_stored(T_O, w.pv + d, D * 4);
  }
  for (int g = 0; g < G; ++g) {
    const __m512 al = _mm512_set1_ps(alpha[g]);
    for (int d = 0; d < D; d += 16) {
      float* o = hs.o + (size_t)g * D + d;
      _mm512_store_ps(o, _mm512_fmadd_ps(_mm512_load_ps(o), al, _mm512_load_ps(w.pv + (size_t)g * D + d)));
    }
  }
}

// The decode row of sequence s, kv heads [h0, h1) (at most MAX_NH) and their query heads.
template <int32_t DT>
static void attend_heads(const AttnArgs& a, int s, int h0, int h1, Work& w) {
  const CacheDesc& c = a.cache;
  const int D = c.head_dim, G = a.num_q_heads / c.num_kv_heads;
  const int64_t q_row = a.query_start_loc[s], pos = a.seq_lens[s] - 1;
  const int64_t lo = a.window > 0 ? std::max<int64_t>(0, pos - a.window + 1) : 0, hi = pos + 1;
  const int32_t* table = a.block_tables + (int64_t)s * a.stride_bt;
  float q[MAX_D];
  for (int h = h0; h < h1; ++h) {
    HeadState& hs = w.head[h - h0];
    for (int g = 0; g < G; ++g) {
      const int64_t head = (int64_t)h * G + g;
      const uint16_t* src = static_cast<const uint16_t*>(a.query) + q_row * a.stride_qt + head * a.stride_qh;
      if (c.rotate) {  // (qH).(kH) = q.k, the rotated query rounded to bf16 like the reference
        for (int d = 0; d < D; ++d) q[d] = bits_f32((uint32_t)src[d] << 16);
        fwht(q, D, c.rot_norm);
      }
      for (int d = 0; d < D; ++d) hs.qb[((d / 2) * G + g) * 2 + d % 2] = c.rotate ? f32_to_bf16(q[d]) : src[d];
      hs.m[g] = -std::numeric_limits<float>::infinity();
      hs.l[g] = 0.0f;
    }
    std::fill(hs.o, hs.o + (size_t)G * D, 0.0f);
  }
  const int64_t b_end = (hi + BS - 1) / BS;
  for (int64_t b0 = lo / BS; b0 < b_end; b0 += NB) {
    Round rd;
    rd.nb = (int)std::min<int64_t>(NB, b_end - b0);
    for (int i = 0; i < rd.nb; ++i) {
      const int64_t start = (b0 + i) * BS;
      const int a0 = (int)(std::max(start, lo) - start), a1 = (int)(std::min(start + BS, hi) - start);
      rd.block[i] = table[b0 + i];
      rd.valid[i] = (__mmask16)(((1u << a1) - 1) & ~((1u << a0) - 1));
    }
    for (int h = h0; h < h1; ++h) attend_round<DT>(a, rd, h, w.head[h - h0], w);
  }
  for (int h = h0; h < h1; ++h) {
    HeadState& hs = w.head[h - h0];
    for (int g = 0; g < G; ++g) {
      const int64_t head = (int64_t)h * G + g;
      float* o = hs.o + (size_t)g * D;
      for (int d = 0; d < D; ++d) o[d] = hs.l[g] == 0.0f ? 0.0f : o[d] / hs.l[g];
      if (c.rotate) fwht(o, D, c.rot_norm);
      for (int d = 0; d < D; ++d) store_f32(a.out, q_row * a.stride_ot + head * a.stride_oh + d, o[d], a.q_dtype);
    }
  }
}

// The decode row of one work item (a sequence with one query token, kv heads [h0, h1)).
static void attend_item(const AttnArgs& a, int s, int h0, int h1, Work& w) {
  for (int h = h0; h < h1; h += MAX_NH) {
    const int e = std::min(h1, h + MAX_NH);
    switch (a.cache.dtype) {
      case BF16: attend_heads<BF16>(a, s, h, e, w); break;
      case E4M3: attend_heads<E4M3>(a, s, h, e, w); break;
      case E5M2: attend_heads<E5M2>(a, s, h, e, w); break;
      default: attend_heads<I8>(a, s, h, e, w); break;
    }
  }
}

}  // namespace amx
#undef T_S
#undef T_K
#undef T_Q
#undef T_P
#undef T_V
#undef T_O
#endif
