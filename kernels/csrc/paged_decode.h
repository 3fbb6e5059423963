// Decode attention in bf16 products (included by paged_cpu.cpp, which defines CacheDesc, AttnArgs and the helpers).
//
// Why: the row loop of paged_cpu.cpp dequantizes every K/V block into fp32 and scores one query row at a
// time with 8-lane FMAs; at decode that is bound by instructions, not by the cache bytes. A decode row's GQA
// group (G query heads of one kv head) against a 16-token block is two small matrix products, which bf16 units
// do with fp32 accumulation: S [G x 16 keys] = Q . K^T (K's rows are the cache rows: bf16 blocks are read in
// place, 8-bit ones widened to bf16 exactly, as every fp8/int8 code is a bf16), and O [G x D] += P . V with P
// rounded to bf16, as vLLM's AMX path does.
//
// The driver below walks a decode row's visible blocks in rounds of NB, for up to MAX_NH kv heads together
// (their rows of a block are neighbours), and runs the online softmax of each round in 16-lane AVX-512; the
// scales (per tensor, per head or per token) multiply the scores and P in fp32. The products are a policy:
// AMX tiles (amx_decode.h) or VDPBF16PS on 16 lanes (Dp16 here, for CPUs with AVX512-BF16 and no AMX, such
// as AMD's Zen 4). The result is not the row loop's bit for bit (P is rounded to bf16, the sums run in another
// order), so these paths are only taken when the launcher asks for them: never under --batch-invariant, whose
// rows must not depend on whether they are computed as a decode or inside a prefill chunk.
#pragma once
#include "avx512_common.h"

#ifdef QKV_BF16DP
namespace decode {

constexpr int BS = 16, MAX_D = 256, MAX_G = 16;  // the block size these paths take; the largest head_dim, group
// Keys per softmax round: four blocks, two 32-key steps of AMX's P.V product (the tile's K dimension).
constexpr int NB = 4, RK = NB * BS;
// kv heads an item walks together: their rows of a block are neighbours, so a block is read front to back.
constexpr int MAX_NH = 8;

// The layers these paths compute: a bf16 query, a cache whose codes are bf16 values (the packed 4-bit ones too,
// with whole 32-channel chunks per half row), scales that are one number per key (none, per head or per token);
// the GQA group fits a tile's rows.
static bool supports(const CacheDesc& c, int G, int32_t q_dtype) {
  const bool codes = c.packed ? c.head_dim % 64 == 0 && c.scale_mode == SCALE_DYNAMIC
                              : c.dtype == BF16 || c.dtype == E4M3 || c.dtype == E5M2 || c.dtype == I8;
  return q_dtype == BF16 && codes && c.block_size == BS && c.head_dim % 32 == 0 && c.head_dim <= MAX_D && G >= 1 &&
         G <= MAX_G && c.scale_mode != SCALE_CHANNEL;
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

// Channels [d, d + 32) of a packed row (side kv, whose row starts at byte `row`) as 32 bf16, exactly: an int4
// side's low nibbles hold channels [0, D/2) and the same bytes' high nibbles [D/2, D); an int8 side's second
// half row lies side_hi bytes on (the next plane).
template <int32_t DT>
static inline __m512i widen32_packed(const CacheDesc& c, int kv, int64_t row, int d) {
  const int half = c.head_dim / 2;
  const int64_t at = d < half ? row + d : row + c.side_hi[kv] + d - half;
  if constexpr (DT == I8) {
    return widen32<I8>(c.data, at);
  } else {
    const __m512i x = _mm512_cvtepi8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint8_t*>(c.data) + at)));
    const __m512i v = _mm512_srai_epi16(d < half ? _mm512_slli_epi16(x, 12) : _mm512_slli_epi16(x, 8), 12);
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(v)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(v, 1)));
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
  }
}

// Channels [d, d + 32) of the row at element `row` of side kv: the codes of dtype DT (a packed side's if PK).
template <int32_t DT, bool PK>
static inline __m512i chunk32(const CacheDesc& c, int kv, int64_t row, int d) {
  if constexpr (PK)
    return widen32_packed<DT>(c, kv, row, d);
  else
    return widen32<DT>(c.data, row + d);
}

// Per-key multipliers of one side's codes in a block: (1 | the head's | each token's scale) x extra;
// 0 for the keys no query sees (a stale slot's scale is never read).
static inline __m512 key_scales(const CacheDesc& c, int kv, int64_t block, int h, float extra, __mmask16 valid) {
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

// One kv head's running state: its group's queries in the product's layout (qb), the online softmax's max and
// sum, and the unnormalized output ([G][D]).
struct HeadState {
  alignas(64) uint16_t qb[MAX_D * MAX_G];
  alignas(64) float o[MAX_G * MAX_D];
  float m[MAX_G], l[MAX_G];
};

// Work space of one thread (about 250 KiB; what one round touches stays in L1/L2).
struct Work {
  HeadState head[MAX_NH];
  alignas(64) uint16_t kb[RK * MAX_D];  // a round's K rows widened to bf16 (8-bit caches)
  alignas(64) uint16_t vr[RK * MAX_D];  // its V rows widened to bf16
  alignas(64) uint16_t vb[RK * MAX_D];  // AMX: V in pairs of keys, [D/16][RK/2][32]
  alignas(64) uint16_t pb[MAX_G * RK];  // P as bf16: [G][RK]
  alignas(64) float sb[RK * 16];        // the scores: AMX [RK keys][16 heads], Dp16 [NB][G][16 keys]
  alignas(64) float pv[MAX_G * MAX_D];  // AMX: this round's P.V, [G][D]
  alignas(64) uint16_t zero[MAX_D];     // the V row of a key no row sees
};

// A round's blocks: their ids and which of their keys the decode row sees.
struct Round {
  int nb;
  int64_t block[NB];
  __mmask16 valid[NB];
  int64_t next[NB];  // the blocks of the round after, or -1
};

// Block i of the round for kv head h: its K rows (the cache's own for bf16, else widened into w.kb; rows no
// query sees are left as they are and masked out of the scores), with their stride in elements, and its V
// rows in vrow[0, BS) (a zero row for the keys no query sees, so that stale bytes never count). DK and DV are
// the sides' dtypes, PK a packed cache's.
//
// It first asks for the same head's rows of block i of the next round. Blocks sit anywhere in the pool and a
// round reads one head's rows of each at a stride, which the hardware prefetcher does not follow; without the
// hint an 8-bit cache, whose rows are widened through stores, keeps few misses in flight and runs at a fraction
// of the memory's bandwidth. One head's rows at a time keeps the requests spread over the round, not in a burst
// that overflows the miss buffers. The hint is for L2, not L1: an L1 prefetch holds one of the core's few L1
// fill buffers until its line arrives, and the current block's own loads then queue behind the next round's.
template <int32_t DK, int32_t DV, bool PK>
static const uint16_t* block_rows(const CacheDesc& c, const Round& rd, int i, int h, Work& w, int64_t& kstride,
                                  const uint16_t** vrow) {
  const int D = c.head_dim;
  const __mmask16 valid = rd.valid[i];
  if (rd.next[i] >= 0) {
    constexpr int64_t bytes = DK == BF16 ? 2 : 1;
    const char* base = static_cast<const char*>(c.data);
    for (int kv = 0; kv < 2; ++kv)
      for (int j = 0; j < BS; ++j) {
        const char* p = base + row_base(c, rd.next[i], kv, j, h) * bytes;
        for (int64_t off = 0; off < c.row_elems * bytes; off += 64) {  // a packed side's half row, and its
          _mm_prefetch(p + off, _MM_HINT_T1);                           // second plane if it has one
          if (PK && c.side_hi[kv] != 0) _mm_prefetch(p + c.side_hi[kv] + off, _MM_HINT_T1);
        }
      }
  }
  const int64_t kbase = row_base(c, rd.block[i], 0, 0, h), vbase = row_base(c, rd.block[i], 1, 0, h);
  const uint16_t* krows;
  if constexpr (DK == BF16 && !PK) {
    krows = static_cast<const uint16_t*>(c.data) + kbase;
    kstride = c.stride_slot;
  } else {
    uint16_t* kb = w.kb + (size_t)i * BS * D;
    for (int j = 0; j < BS; ++j)
      if (valid >> j & 1)
        for (int d = 0; d < D; d += 32)
          _mm512_store_si512(kb + j * D + d, chunk32<DK, PK>(c, 0, kbase + j * c.stride_slot, d));
    krows = kb;
    kstride = D;
  }
  for (int j = 0; j < BS; ++j) {
    if (!(valid >> j & 1)) {
      vrow[j] = w.zero;
    } else if constexpr (DV == BF16 && !PK) {
      vrow[j] = static_cast<const uint16_t*>(c.data) + vbase + j * c.stride_slot;
    } else {
      uint16_t* vr = w.vr + ((size_t)i * BS + j) * D;
      for (int d = 0; d < D; d += 32) _mm512_store_si512(vr + d, chunk32<DV, PK>(c, 1, vbase + j * c.stride_slot, d));
      vrow[j] = vr;
    }
  }
  return krows;
}

// The permutation that interleaves two V rows' channels [0, 16) into key pairs (x[c], y[c]) with
// _mm512_permutex2var_epi16(x, idx, y); adding 16 to it takes channels [16, 32).
static inline __m512i pairs_lo() {
  return _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5, 36, 4, 35,
                          3, 34, 2, 33, 1, 32, 0);
}

// The online softmax of a round for kv head h, 16 keys a vector: raw(i, g) is the product's S for block i and
// query head g; writes P (times the V scales) as bf16 into w.pb ([G][RK], zero past the round's blocks) and
// each query head's rescale of its earlier output into alpha.
template <class Raw>
static void softmax(const AttnArgs& a, const Round& rd, int h, HeadState& hs, Work& w, float* alpha, Raw raw) {
  const CacheDesc& c = a.cache;
  const int G = a.num_q_heads / c.num_kv_heads, nb = rd.nb;
  const float ninf = -std::numeric_limits<float>::infinity();
  __m512 ks[NB], vs[NB];
  for (int i = 0; i < nb; ++i) {
    ks[i] = key_scales(c, 0, rd.block[i], h, a.sm_scale, rd.valid[i]);
    vs[i] = key_scales(c, 1, rd.block[i], h, 1.0f, rd.valid[i]);
  }
  for (int g = 0; g < G; ++g) {
    __m512 sc[NB];
    __m512 mx = _mm512_set1_ps(ninf);
    for (int i = 0; i < nb; ++i) {
      sc[i] = _mm512_mask_mul_ps(_mm512_set1_ps(ninf), rd.valid[i], raw(i, g), ks[i]);
      mx = _mm512_max_ps(mx, sc[i]);
    }
    const float m_new = std::max(hs.m[g], _mm512_reduce_max_ps(mx));
    alpha[g] = hs.m[g] == ninf ? 0.0f : std::exp(hs.m[g] - m_new);
    __m512 sum = _mm512_setzero_ps();
    for (int i = 0; i < NB; ++i) {
      __m256i pbits = _mm256_setzero_si256();
      if (i < nb) {
        const __m512 p = _mm512_maskz_mov_ps(rd.valid[i], vec16::exp16(_mm512_sub_ps(sc[i], _mm512_set1_ps(m_new))));
        sum = _mm512_add_ps(sum, p);
        pbits = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(p, vs[i]));
      }
      _mm256_store_si256(reinterpret_cast<__m256i*>(w.pb + g * RK + i * BS), pbits);
    }
    hs.l[g] = hs.l[g] * alpha[g] + _mm512_reduce_add_ps(sum);
    hs.m[g] = m_new;
  }
}

// The products on 16 lanes with VDPBF16PS (2 bf16 products per fp32 lane and instruction), for CPUs with
// AVX512-BF16 and no AMX. S: each key's row times the query in channel pairs (16 partial sums per key), the 16
// keys' sums reduced together by a transposing tree into one vector of keys. O: lanes are 16 channels, each
// key pair's V rows interleaved once, P's pair broadcast per query head, so there is no reduction.
struct Dp16 {
  static int qb_index(int d, int g, int, int D) { return g * D + d; }  // the group's query rows, [G][D]

  // v[k]'s 16 lanes summed, for k = 0 .. 15, as one vector (lane k): four levels of interleave and add.
  static inline __m512 reduce16(const __m512* v) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; ++i)
      t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {
      const __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
      u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xdd));
    const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xdd));
  }

  template <int32_t DK, int32_t DV, bool PK>
  static void round(const AttnArgs& a, const Round& rd, int h, HeadState& hs, Work& w) {
    const CacheDesc& c = a.cache;
    const int D = c.head_dim, G = a.num_q_heads / c.num_kv_heads;
    const uint16_t* vrow[RK];
    for (int i = 0; i < rd.nb; ++i) {
      int64_t ks;
      const uint16_t* k = block_rows<DK, DV, PK>(c, rd, i, h, w, ks, vrow + i * BS);
      for (int g = 0; g < G; ++g) {
        const uint16_t* q = hs.qb + (size_t)g * D;
        __m512 acc[BS];
        for (int j = 0; j < BS; ++j) acc[j] = _mm512_setzero_ps();
        for (int d = 0; d < D; d += 32) {
          const __m512bh qv = (__m512bh)_mm512_load_si512(q + d);
          for (int j = 0; j < BS; ++j)
            acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_loadu_si512(k + j * ks + d), qv);
        }
        _mm512_store_ps(w.sb + ((size_t)i * G + g) * 16, reduce16(acc));
      }
    }
    float alpha[MAX_G];
    softmax(a, rd, h, hs, w, alpha, [&](int i, int g) { return _mm512_load_ps(w.sb + ((size_t)i * G + g) * 16); });
    // O = alpha O + P.V, 32 channels and up to 8 query heads at a time in registers
    const __m512i pair_lo = pairs_lo(), pair_hi = _mm512_add_epi16(pair_lo, _mm512_set1_epi16(16));
    const int pairs = rd.nb * BS / 2;
    for (int d = 0; d < D; d += 32)
      for (int g0 = 0; g0 < G; g0 += 8) {
        const int ng = std::min(8, G - g0);
        __m512 lo[8], hi[8];
        for (int j = 0; j < ng; ++j) {
          const __m512 al = _mm512_set1_ps(alpha[g0 + j]);
          const float* o = hs.o + (size_t)(g0 + j) * D + d;
          lo[j] = _mm512_mul_ps(_mm512_load_ps(o), al);
          hi[j] = _mm512_mul_ps(_mm512_load_ps(o + 16), al);
        }
        for (int r = 0; r < pairs; ++r) {
          const __m512i x = _mm512_loadu_si512(vrow[2 * r] + d), y = _mm512_loadu_si512(vrow[2 * r + 1] + d);
          const __m512bh vlo = (__m512bh)_mm512_permutex2var_epi16(x, pair_lo, y);
          const __m512bh vhi = (__m512bh)_mm512_permutex2var_epi16(x, pair_hi, y);
          for (int j = 0; j < ng; ++j) {
            const __m512bh p = vec16::bcast_pair(w.pb + (g0 + j) * RK + 2 * r);
            lo[j] = _mm512_dpbf16_ps(lo[j], vlo, p);
            hi[j] = _mm512_dpbf16_ps(hi[j], vhi, p);
          }
        }
        for (int j = 0; j < ng; ++j) {
          float* o = hs.o + (size_t)(g0 + j) * D + d;
          _mm512_store_ps(o, lo[j]);
          _mm512_store_ps(o + 16, hi[j]);
        }
      }
  }
};

// The decode row of sequence s, kv heads [h0, h1) (at most MAX_NH) and their query heads.
template <class Product, int32_t DK, int32_t DV, bool PK>
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
      for (int d = 0; d < D; ++d) hs.qb[Product::qb_index(d, g, G, D)] = c.rotate ? f32_to_bf16(q[d]) : src[d];
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
      rd.next[i] = b0 + NB + i < b_end ? table[b0 + NB + i] : -1;
      rd.valid[i] = (__mmask16)(((1u << a1) - 1) & ~((1u << a0) - 1));
    }
    for (int h = h0; h < h1; ++h) Product::template round<DK, DV, PK>(a, rd, h, w.head[h - h0], w);
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
template <class Product>
static void attend_item(const AttnArgs& a, int s, int h0, int h1, Work& w) {
  for (int h = h0; h < h1; h += MAX_NH) {
    const int e = std::min(h1, h + MAX_NH);
    if (a.cache.packed) {  // V is int4; K int4 or int8
      if (a.cache.side_dtype[0] == I4)
        attend_heads<Product, I4, I4, true>(a, s, h, e, w);
      else
        attend_heads<Product, I8, I4, true>(a, s, h, e, w);
      continue;
    }
    switch (a.cache.dtype) {
      case BF16: attend_heads<Product, BF16, BF16, false>(a, s, h, e, w); break;
      case E4M3: attend_heads<Product, E4M3, E4M3, false>(a, s, h, e, w); break;
      case E5M2: attend_heads<Product, E5M2, E5M2, false>(a, s, h, e, w); break;
      default: attend_heads<Product, I8, I8, false>(a, s, h, e, w); break;
    }
  }
}

}  // namespace decode
#endif
