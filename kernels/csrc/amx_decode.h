// Decode attention on AMX tiles (included by paged_cpu.cpp after paged_decode.h, whose driver this product plugs
// into; what the driver does and why P is rounded to bf16 is there). Per 16-token block and kv head, one AMX
// instruction each:
//
//   S^T [16 keys x G] = K [16 x D] . Q^T      (K's rows are the A operand, loaded from the cache rows in place)
//   O   [G x D]      += P [G x 16] . V [16 x D] (V pairs interleaved into the B operand's layout)
//
// Machines without AMX build none of this (amx_common.h).
#pragma once
#include "amx_common.h"
#include "paged_decode.h"

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

struct DecodeTiles {
  static void begin(int G) {
    TileConfig cfg = {};
    cfg.palette_id = 1;
    auto set = [&](int t, int rows, int colsb) {
      cfg.rows[t] = (uint8_t)rows;
      cfg.colsb[t] = (uint16_t)colsb;
    };
    set(T_S, decode::BS, 4 * G);
    set(T_K, decode::BS, 64);
    set(T_Q, 16, 4 * G);
    set(T_P, G, 64);
    set(T_V, 16, 64);
    set(T_O, G, 64);
    _tile_loadconfig(&cfg);
  }

  static void end() { _tile_release(); }  // oneDNN and ATen load their own tile configurations

  static int qb_index(int d, int g, int G, int) { return ((d / 2) * G + g) * 2 + d % 2; }  // Q^T in channel pairs

  // The round's work for kv head h: S^T = K.Q^T block by block, the online softmax, then O += P.V.
  template <int32_t DK, int32_t DV, bool PK>
  static void round(const AttnArgs& a, const decode::Round& rd, int h, decode::HeadState& hs, decode::Work& w) {
    using decode::BS;
    using decode::NB;
    using decode::RK;
    const CacheDesc& c = a.cache;
    const int D = c.head_dim, G = a.num_q_heads / c.num_kv_heads;
    const int nb = rd.nb;
    const uint16_t* vrow[RK];
    for (int i = 0; i < NB; ++i) {
      if (i >= nb) {  // a short round: its missing keys have zero P and zero V
        for (int j = 0; j < BS; ++j) vrow[i * BS + j] = w.zero;
        continue;
      }
      int64_t kstride;
      const uint16_t* krows = decode::block_rows<DK, DV, PK>(c, rd, i, h, w, kstride, vrow + i * BS);
      _tile_zero(T_S);
      for (int d = 0; d < D; d += 32) {
        _tile_loadd(T_K, krows + d, kstride * 2);
        _tile_loadd(T_Q, hs.qb + (size_t)d * G, 4 * G);
        _tile_dpbf16ps(T_S, T_K, T_Q);
      }
      _tile_stored(T_S, w.sb + i * BS * 16, 64);
    }
    // S^T's column g for block i: a gather of 16 keys
    const __m512i rows16 = _mm512_slli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 4);
    float alpha[decode::MAX_G];
    decode::softmax(a, rd, h, hs, w, alpha, [&](int i, int g) {
      return _mm512_i32gather_ps(_mm512_add_epi32(rows16, _mm512_set1_epi32(g)), w.sb + i * BS * 16, 4);
    });
    // V in pairs of keys, the B operand's layout: vb[D/16][RK/2][32]
    const __m512i pair_lo = decode::pairs_lo(), pair_hi = _mm512_add_epi16(pair_lo, _mm512_set1_epi16(16));
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
};

}  // namespace amx
#undef T_S
#undef T_K
#undef T_Q
#undef T_P
#undef T_V
#undef T_O
#endif
