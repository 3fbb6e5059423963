// What the AMX kernels share (included by amx_decode.h and amx_prefill.h): the tile configuration's layout and
// the OS's permission. Built only where -march
// enables AMX-BF16 and AVX512-BF16; elsewhere qkv_amx_available() says 0 and the launcher keeps the row loop.
#pragma once
#include "avx512_common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512BF16__)
#define QKV_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

namespace amx {

struct alignas(64) TileConfig {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

constexpr int MAX_D = 256;  // the largest head_dim of the prefill tiles

// Linux hands AMX's tile state to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM, XTILEDATA).
static bool permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

}  // namespace amx

extern "C" int qkv_amx_available() { return amx::permitted() ? 1 : 0; }
#else
extern "C" int qkv_amx_available() { return 0; }
#endif
