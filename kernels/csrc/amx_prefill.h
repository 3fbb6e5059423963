// Prefill attention on AMX tiles (included by paged_cpu.cpp): dense_prefill.h's driver with S^T = K.Q^T and
// O^T += V^T.P^T as TDPBF16PS products (16 x 16 x 32 each), for CPUs with AMX-BF16. What the driver does, and
// why P is rounded to bf16, is in dense_prefill.h.
#pragma once
#include "amx_common.h"
#include "dense_prefill.h"

#ifdef QKV_AMX
namespace amx {

struct Tiles {
  static bool supports(int D) { return permitted() && D % 64 == 0 && D <= MAX_D; }  // O^T takes 64 channels a go

  static void begin() {
    TileConfig cfg = {};
    cfg.palette_id = 1;
    for (int t = 0; t < 8; ++t) {
      cfg.rows[t] = 16;
      cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
  }

  static void end() { _tile_release(); }  // oneDNN and ATen load their own tile configurations

  // S^T in tmm0/1 (keys 0-15, 16-31 of the step): K's rows are the A operand, Q^T the B one
  static void scores(const uint16_t* qb, const uint16_t* krows, int D, float* sb) {
    _tile_zero(0);
    _tile_zero(1);
    for (int c = 0; c < D / 32; ++c) {
      _tile_loadd(6, qb + c * 32 * 16, 64);
      _tile_loadd(4, krows + c * 32, D * 2);
      _tile_loadd(5, krows + 16 * D + c * 32, D * 2);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 6);
    }
    _tile_stored(0, sb, 64);
    _tile_stored(1, sb + 16 * 16, 64);
  }

  // O^T += V^T.P^T, four 16-channel chunks at a time in tmm0-3
  static void accumulate(const uint16_t* pb, const uint16_t* va_step, float* o, int D) {
    constexpr int PK = dense::PK;
    _tile_loadd(4, pb, 64);
    for (int c = 0; c < D / 16; c += 4) {
      const uint16_t* va = va_step + c * 16 * PK;
      _tile_loadd(0, o + c * 16 * 16, 64);
      _tile_loadd(1, o + (c + 1) * 16 * 16, 64);
      _tile_loadd(2, o + (c + 2) * 16 * 16, 64);
      _tile_loadd(3, o + (c + 3) * 16 * 16, 64);
      _tile_loadd(5, va, 64);
      _tile_loadd(6, va + 16 * PK, 64);
      _tile_loadd(7, va + 32 * PK, 64);
      _tile_dpbf16ps(0, 5, 4);
      _tile_dpbf16ps(1, 6, 4);
      _tile_dpbf16ps(2, 7, 4);
      _tile_loadd(5, va + 48 * PK, 64);
      _tile_dpbf16ps(3, 5, 4);
      _tile_stored(0, o + c * 16 * 16, 64);
      _tile_stored(1, o + (c + 1) * 16 * 16, 64);
      _tile_stored(2, o + (c + 2) * 16 * 16, 64);
      _tile_stored(3, o + (c + 3) * 16 * 16, 64);
    }
  }
};

}  // namespace amx

extern "C" int qkv_dense_attention_amx(const DenseArgs* a) { return dense::attention<amx::Tiles>(a); }
#else
extern "C" int qkv_dense_attention_amx(const DenseArgs*) { return 1; }
#endif
