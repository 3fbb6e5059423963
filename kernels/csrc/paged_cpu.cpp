// qkv CPU kernels: quantized cache write and fused paged attention over 8-bit blocks.
//
// Semantics are those of kernels/reference.py (the readable specification); the Python
// launcher is kernels/cpu_attention.py. Two properties drive the design:
//
// * The 8-bit blocks are read in place. Attention dequantizes one 16-token block of K and V
//   into an fp32 tile (exact bit tricks for fp8, no table, no per-sequence copy of the
//   context) and reuses it for every query row of the work item (GQA group x query tile).
// * Row invariance. Every output row is computed by the same sequence of floating-point
//   operations whatever else is in the batch: key blocks are visited in order of absolute
//   position, each row only touches the keys it can see, and reductions run in a fixed
//   order inside one thread. So chunked prefill, prefix-cache hits, preemption and batch
//   composition cannot change a single bit of a row's output, and the cache bytes written
//   for a token depend only on that token's K/V.
//
// The cache write is bit-exact with the reference (torch's float8 / int8 / bf16 casts, and its int4
// packing: byte j of a packed half-row plane holds channel j in the low nibble, j + D/2 in the high one).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef uint8_t u8x8 __attribute__((vector_size(8)));
typedef int8_t i8x8 __attribute__((vector_size(8)));

enum DType : int32_t { F32 = 0, BF16 = 1, F16 = 2, E4M3 = 3, E5M2 = 4, I8 = 5, I4 = 6 };
enum ScaleMode : int32_t { SCALE_NONE = 0, SCALE_HEAD = 1, SCALE_CHANNEL = 2, SCALE_DYNAMIC = 3 };

// One layer's paged cache: [num_blocks, 2, block_size, num_kv_heads, head_dim] (strides in elements), or for
// the packed 4-bit dtypes [num_blocks, planes, block_size, num_kv_heads, head_dim / 2] bytes, a side (K or V)
// being one int4 plane or two int8 half-row planes (kernels/paged.py). Side kv's row starts at plane
// side_plane[kv]; its channels [D/2, D) are side_hi[kv] elements further (D/2 for a plain row, 0 for int4
// nibbles, one plane for a split int8 row).
struct CacheDesc {
  void* data;
  int64_t stride_block, stride_kv, stride_slot, stride_head;
  float* scale_cache;  // dynamic modes: [num_blocks, 2, block_size, num_kv_heads] fp32
  int64_t s_stride_block, s_stride_kv, s_stride_slot;
  const float* k_scale;  // static: [Hkv] (SCALE_HEAD) or [Hkv, D] (SCALE_CHANNEL)
  const float* v_scale;
  int32_t dtype, scale_mode, block_size, num_kv_heads, head_dim, rotate;
  float rot_norm, qmax;
  int32_t packed, planes, row_elems;
  int32_t side_dtype[2], side_plane[2];
  int64_t side_hi[2];
  float side_qmax[2], clip[2];
};

struct WriteArgs {
  CacheDesc cache;
  const void* key;
  const void* value;
  const int64_t* slot_mapping;
  int64_t num_tokens, stride_kt, stride_kh, stride_vt, stride_vh;
  int32_t in_dtype, num_threads;
};

struct GatherArgs {
  CacheDesc cache;
  const int32_t* block_table;  // the sequence's
  int64_t start, end;          // positions [start, end)
  void* out;                   // [2, num_kv_heads, end - start, head_dim], contiguous, out_dtype
  int32_t out_dtype, num_threads;
};

struct RotateArgs {
  const void* in;  // [rows, dim], contiguous, in_dtype
  void* out;       // [rows, dim], contiguous, out_dtype
  int64_t rows;
  int32_t dim, in_dtype, out_dtype, num_threads;
  float norm;
};

struct AttnArgs {
  CacheDesc cache;
  const void* query;
  void* out;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  int64_t stride_qt, stride_qh, stride_ot, stride_oh, stride_bt;
  int32_t q_dtype, num_q_heads, num_seqs, window, q_tile, num_threads;
  float sm_scale;
  int32_t decode;  // DecodeProducts: decode rows may take paged_decode.h's (never under --batch-invariant)
};

// Who computes the decode rows of bf16 queries (AttnArgs::decode): the row loop, AMX tiles or VDPBF16PS.
enum DecodeProducts : int32_t { DECODE_ROW_LOOP = 0, DECODE_AMX = 1, DECODE_DP16 = 2 };

// ------------------------------------------------------------------ scalar conversions --
static inline float bits_f32(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
static inline uint32_t f32_bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }

static inline float f16_to_f32(uint16_t h) {
  // fp16 bits shifted into fp32 position, times 2^112: exact for normals and subnormals.
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, rest = h & 0x7fff;
  if (rest >= 0x7c00) return bits_f32(sign | 0x7f800000u | ((rest & 0x3ff) << 13));
  float mag = bits_f32(rest << 13) * 0x1p112f;
  return sign ? -mag : mag;
}

static inline float load_f32(const void* p, int64_t i, int32_t dtype) {
  switch (dtype) {
    case F32: return static_cast<const float*>(p)[i];
    case BF16: return bits_f32((uint32_t) static_cast<const uint16_t*>(p)[i] << 16);
    default: return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
}

// n values from element i on, each as load_f32 would: the dtype chosen once, so each loop vectorizes.
static inline void load_row(const void* p, int64_t i, float* v, int n, int32_t dtype) {
  switch (dtype) {
    case F32: std::memcpy(v, static_cast<const float*>(p) + i, sizeof(float) * n); break;
    case BF16: {
      const uint16_t* q = static_cast<const uint16_t*>(p) + i;
      for (int d = 0; d < n; ++d) v[d] = bits_f32((uint32_t)q[d] << 16);
      break;
    }
    default: {
      const uint16_t* q = static_cast<const uint16_t*>(p) + i;
      for (int d = 0; d < n; ++d) v[d] = f16_to_f32(q[d]);
    }
  }
}

static inline uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN -> 0xffff like torch's vectorized cast
  if (std::isnan(f)) return 0xffff;
  uint32_t b = f32_bits(f);
  return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

static inline uint16_t f32_to_f16(float f) {
  _Float16 h = (_Float16)f;  // IEEE round-to-nearest-even
  uint16_t b; std::memcpy(&b, &h, 2); return b;
}

static inline void store_f32(void* p, int64_t i, float v, int32_t dtype) {
  switch (dtype) {
    case F32: static_cast<float*>(p)[i] = v; break;
    case BF16: static_cast<uint16_t*>(p)[i] = f32_to_bf16(v); break;
    default: static_cast<uint16_t*>(p)[i] = f32_to_f16(v); break;
  }
}

// n values stored from element i on, each as store_f32 would: the dtype chosen once, so each loop vectorizes.
static inline void store_row(void* p, int64_t i, const float* v, int n, int32_t dtype) {
  switch (dtype) {
    case F32: std::memcpy(static_cast<float*>(p) + i, v, sizeof(float) * n); break;
    case BF16: {
      uint16_t* q = static_cast<uint16_t*>(p) + i;
      for (int d = 0; d < n; ++d) q[d] = f32_to_bf16(v[d]);
      break;
    }
    default: {
      uint16_t* q = static_cast<uint16_t*>(p) + i;
      for (int d = 0; d < n; ++d) q[d] = f32_to_f16(v[d]);
    }
  }
}

// fp32 -> fp8, round to nearest even, NaN -> 0x7f|sign (e4m3) / 0x7f (e5m2); callers saturate first.
static inline uint8_t f32_to_e4m3(float f) {
  uint32_t b = f32_bits(f), sign = b & 0x80000000u;
  b ^= sign;
  uint8_t r;
  if (b >= (1087u << 20)) {  // 480 and above (only NaN after saturation)
    r = 0x7f;
  } else if (b < (121u << 23)) {  // below 2^-6: subnormal grid, rounded by an fp32 add
    const uint32_t denorm = 141u << 23;
    r = (uint8_t)(f32_bits(bits_f32(b) + bits_f32(denorm)) - denorm);
  } else {
    uint32_t odd = (b >> 20) & 1u;
    b += ((uint32_t)(7 - 127) << 23) + 0x7ffffu + odd;
    r = (uint8_t)(b >> 20);
  }
  return r | (uint8_t)(sign >> 24);
}

static inline uint8_t f32_to_e5m2(float f) {
  uint32_t b = f32_bits(f), sign = b & 0x80000000u;
  b ^= sign;
  uint8_t r;
  if (b >= (143u << 23)) {
    r = b > (255u << 23) ? 0x7f : 0x7c;
  } else if (b < (113u << 23)) {
    const uint32_t denorm = 134u << 23;
    r = (uint8_t)(f32_bits(bits_f32(b) + bits_f32(denorm)) - denorm);
  } else {
    uint32_t odd = (b >> 21) & 1u;
    b += ((uint32_t)(15 - 127) << 23) + 0xfffffu + odd;
    r = (uint8_t)(b >> 21);
  }
  return r | (uint8_t)(sign >> 24);
}

// ------------------------------------------------------------------ vector helpers --
static inline f32x8 splat(float x) { return (f32x8){x, x, x, x, x, x, x, x}; }
static inline f32x8 loadv(const float* p) { f32x8 v; std::memcpy(&v, p, 32); return v; }
static inline void storev(float* p, f32x8 v) { std::memcpy(p, &v, 32); }

static inline float hsum(f32x8 v) {  // fixed tree
  float a0 = v[0] + v[4], a1 = v[1] + v[5], a2 = v[2] + v[6], a3 = v[3] + v[7];
  return (a0 + a2) + (a1 + a3);
}

static inline f32x8 vmax(f32x8 a, f32x8 b) { return a > b ? a : b; }

// exp(x) for x <= 0 arguments of the softmax (Cephes-style range reduction + degree-6 polynomial,
// about 1 ulp); inputs below -87 give a tiny normal number instead of 0.
static inline f32x8 vexp(f32x8 x) {
  x = vmax(x, splat(-87.0f));
  x = x < splat(88.0f) ? x : splat(88.0f);
  f32x8 fx = x * splat(1.44269504088896341f) + splat(0.5f);
  i32x8 t = __builtin_convertvector(fx, i32x8);
  f32x8 tf = __builtin_convertvector(t, f32x8);
  i32x8 gt = tf > fx;  // truncation rounded up a negative value: floor = t - 1
  t = t + gt;
  tf = __builtin_convertvector(t, f32x8);
  x = x - tf * splat(0.693359375f) - tf * splat(-2.12194440e-4f);
  f32x8 z = x * x;
  f32x8 y = splat(1.9875691500e-4f);
  y = y * x + splat(1.3981999507e-3f);
  y = y * x + splat(8.3334519073e-3f);
  y = y * x + splat(4.1665795894e-2f);
  y = y * x + splat(1.6666665459e-1f);
  y = y * x + splat(5.0000001201e-1f);
  y = y * z + x + splat(1.0f);
  i32x8 e = (t + 127) << 23;
  f32x8 pow2;
  std::memcpy(&pow2, &e, 32);
  return y * pow2;
}

// Widen 8 stored integers to 32-bit lanes (one vpmovzx/vpmovsx where the ISA has it).
static inline u32x8 widen_u8(const uint8_t* p) {
#ifdef __AVX2__
  __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return (u32x8)v;
#else
  return (u32x8){p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]};
#endif
}

static inline f32x8 widen_i8(const int8_t* p) {
#ifdef __AVX2__
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  return (f32x8){(float)p[0], (float)p[1], (float)p[2], (float)p[3], (float)p[4], (float)p[5], (float)p[6],
                 (float)p[7]};
#endif
}

static inline u32x8 widen_u16(const uint16_t* p) {
#ifdef __AVX2__
  return (u32x8)_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  return (u32x8){p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]};
#endif
}

static inline f32x8 as_f32(u32x8 b) { f32x8 f; std::memcpy(&f, &b, 32); return f; }

// decode8 leaves a factor of 2^8 out of e4m3 values: the caller folds it into its scale.
static inline float prescale(int32_t dtype) { return dtype == E4M3 ? 0x1p8f : 1.0f; }

// Decode 8 stored elements to fp32, exact for every format; e4m3 values come out divided by prescale().
// A template, so that the loops over a block's rows hold no per-element switch on the dtype.
template <int32_t DT>
static inline f32x8 decode8(const void* base, int64_t i) {
  switch (DT) {
    case F32: return loadv(static_cast<const float*>(base) + i);
    case BF16: return as_f32(widen_u16(static_cast<const uint16_t*>(base) + i) << 16);
    case F16: {  // fp16 bits into fp32 position times 2^112, exponent 31 is inf/NaN (as for e5m2 below)
      u32x8 b = widen_u16(static_cast<const uint16_t*>(base) + i);
      u32x8 rest = b & 0x7fffu, sign = (b & 0x8000u) << 16;
      u32x8 special = (u32x8)(rest >= 0x7c00u);
      u32x8 bits = ((rest << 13) & ~special) | (special & (0x7f800000u | ((rest & 0x3ffu) << 13))) | sign;
      return as_f32(bits) * splat(0x1p112f);
    }
    case I8: return widen_i8(static_cast<const int8_t*>(base) + i);
    case E4M3: {
#if defined(__AVX2__) && defined(__F16C__)
      // The byte sign-extended to 16 bits and shifted left by 7 holds the sign in bit 15, a copy of it in
      // bit 14 (cleared) and the 7 magnitude bits in 13..7: an fp16 of value * 2^-8, subnormals included,
      // which F16C widens exactly (no fp32 subnormal is ever made: an fp32 multiply of one can take a
      // microcode assist). The 2^8 is left to the caller (E4M3_PRESCALE). 0x7f/0xff must decode to NaN:
      // their fp16 exponent is made all ones, only when 8 bytes hold one (a scalar test).
      uint64_t raw;
      std::memcpy(&raw, static_cast<const uint8_t*>(base) + i, 8);
      __m128i h = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(_mm_cvtsi64_si128((long long)raw)), 7),
                                _mm_set1_epi16((short)0xbfff));
      const uint64_t mag = raw & 0x7f7f7f7f7f7f7f7full;
      if ((mag + 0x0101010101010101ull) & 0x8080808080808080ull) {  // some byte is 0x7f or 0xff
        const __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x3f80)), _mm_set1_epi16(0x3f80));
        h = _mm_or_si128(h, _mm_and_si128(nan, _mm_set1_epi16(0x7c00)));
      }
      return (f32x8)_mm256_cvtph_ps(h);
#else
      // low 7 bits into fp32 exponent/mantissa, times 2^120; 0x7f/0xff is NaN
      u32x8 b = widen_u8(static_cast<const uint8_t*>(base) + i);
      u32x8 rest = b & 0x7fu, sign = (b & 0x80u) << 24;
      u32x8 nan = (u32x8)(rest == 0x7fu);
      u32x8 bits = ((rest << 20) & ~nan) | (nan & 0x7fc00000u) | sign;
      return as_f32(bits) * splat(0x1p112f);  // 2^120 with E4M3_PRESCALE
#endif
    }
    default: {  // E5M2: low 7 bits into fp32, times 2^112; exponent 31 is inf/NaN
      u32x8 b = widen_u8(static_cast<const uint8_t*>(base) + i);
      u32x8 rest = b & 0x7fu, sign = (b & 0x80u) << 24;
      u32x8 special = (u32x8)(rest >= 0x7cu);
      u32x8 bits = ((rest << 21) & ~special) | (special & (0x7f800000u | ((rest & 3u) << 21))) | sign;
      return as_f32(bits) * splat(0x1p112f);
    }
  }
}

// 8 int4 codes of a packed plane: the low (channels j) or high (j + D/2) nibbles of 8 bytes, sign-extended.
static inline f32x8 decode8_i4(const uint8_t* p, bool high) {
  const i32x8 b = (i32x8)widen_u8(p);
  const i32x8 v = high ? (b << 24) >> 28 : (b << 28) >> 28;
  return __builtin_convertvector(v, f32x8);
}

// Run CALL, which names the template argument DT, with DT the runtime dtype code.
#define QKV_DISPATCH_DTYPE(dtype, ...)  \
  switch (dtype) {                       \
    case F32: { constexpr int32_t DT = F32; __VA_ARGS__; } break;   \
    case BF16: { constexpr int32_t DT = BF16; __VA_ARGS__; } break; \
    case F16: { constexpr int32_t DT = F16; __VA_ARGS__; } break;   \
    case E4M3: { constexpr int32_t DT = E4M3; __VA_ARGS__; } break; \
    case E5M2: { constexpr int32_t DT = E5M2; __VA_ARGS__; } break; \
    default: { constexpr int32_t DT = I8; __VA_ARGS__; } break;     \
  }

// Run CALL, which names DK and DV (the K and V side dtypes) and PK (packed), with the layer's values.
#define QKV_DISPATCH_CACHE(c, ...)                                                            \
  if (c.packed) {                                                                             \
    constexpr bool PK = true;                                                                 \
    constexpr int32_t DV = I4;                                                                \
    if (c.side_dtype[0] == I4) { constexpr int32_t DK = I4; __VA_ARGS__; }                    \
    else { constexpr int32_t DK = I8; __VA_ARGS__; }                                          \
  } else {                                                                                    \
    constexpr bool PK = false;                                                                \
    QKV_DISPATCH_DTYPE(c.dtype, constexpr int32_t DK = DT; constexpr int32_t DV = DT; __VA_ARGS__) \
  }

// x @ H along n (a power of two): butterflies of stride 1, 2, 4, ... then one multiply,
// the reference's exact operation order.
static void fwht(float* x, int n, float norm) {
  for (int h = 1; h < n; h *= 2)
    for (int g = 0; g < n; g += 2 * h)
      for (int i = g; i < g + h; ++i) {
        float a = x[i], b = x[i + h];
        x[i] = a + b;
        x[i + h] = a - b;
      }
  for (int i = 0; i < n; ++i) x[i] *= norm;
}

// ------------------------------------------------------------------ cache write --
// Eight lanes at a time, each lane exactly the scalar f32_to_e4m3 / f32_to_e5m2 / int8 rule above (selects,
// no branches, so the loop vectorizes): NaN stays NaN (0x7f|sign, 0x7f), ties round to even, subnormals by
// an fp32 add.
static inline u32x8 as_u32(f32x8 f) { u32x8 b; std::memcpy(&b, &f, 32); return b; }

static inline void store_bytes(uint8_t* dst, u32x8 r) {
  for (int k = 0; k < 8; ++k) dst[k] = (uint8_t)r[k];
}

static inline u32x8 encode8_fp8(f32x8 y, int32_t dtype) {
  const bool e4 = dtype == E4M3;
  u32x8 b = as_u32(y);
  const u32x8 sign = b & 0x80000000u;
  b ^= sign;
  const uint32_t m_shift = e4 ? 20 : 21, bias = e4 ? 7 : 15, round = e4 ? 0x7ffffu : 0xfffffu;
  const uint32_t denorm = e4 ? (141u << 23) : (134u << 23), sub_below = e4 ? (121u << 23) : (113u << 23);
  const u32x8 odd = (b >> m_shift) & 1u;
  const u32x8 normal = (b + (((bias - 127u) << 23) + round) + odd) >> m_shift;
  const u32x8 sub = as_u32(as_f32(b) + splat(bits_f32(denorm))) - denorm;
  u32x8 r = (u32x8)(b < sub_below) ? sub : normal;
  if (e4) {
    r = (u32x8)(b >= (1087u << 20)) ? (u32x8){} + 0x7fu : r;  // 480 and above: only NaN after saturation
  } else {
    r = (u32x8)(b >= (143u << 23)) ? ((u32x8)(b > (255u << 23)) ? (u32x8){} + 0x7fu : (u32x8){} + 0x7cu) : r;
  }
  return (r & 0xffu) | (sign >> 24);
}

// Round |y| <= 127 to the nearest integer, half to even (adding 1.5 * 2^23 does it); NaN -> 0, as torch on CPU.
static inline i32x8 round_int(f32x8 y) {
  const f32x8 magic = splat(0x1.8p23f);
  const i32x8 q = __builtin_convertvector((y + magic) - magic, i32x8);
  return (i32x8)(y == y) ? q : (i32x8){};
}

// Element offset of side kv's row at (block, slot offset, kv head).
static inline int64_t row_base(const CacheDesc& c, int64_t block, int kv, int64_t off, int h) {
  return block * c.stride_block + (int64_t)c.side_plane[kv] * c.stride_kv + off * c.stride_slot + h * c.stride_head;
}

// One side's row of a packed cache, with its dynamic scale: int codes clamped to +-qmax, then as one int4 plane
// (channel j | channel j + D/2 << 4) or as an int8 row's two half-row planes.
static void quantize_row_packed(const float* x, float scale, int D, float qmax, int32_t side_dtype, uint8_t* data,
                                int64_t base, int64_t hi_off) {
  int8_t q[512];  // D <= 512 (checked by the launcher)
  // an int4 side's signed grid is [-8, 7] (qmax 8); an int8 side's is symmetric
  const f32x8 hi = splat(side_dtype == I4 ? qmax - 1.0f : qmax), lo = splat(-qmax), s = splat(scale);
  for (int d = 0; d < D; d += 8) {
    f32x8 y = loadv(x + d) / s;
    y = y > hi ? hi : y;
    y = y < lo ? lo : y;
    const i32x8 r = round_int(y);
    for (int k = 0; k < 8; ++k) q[d + k] = (int8_t)r[k];
  }
  const int half = D / 2;
  if (side_dtype == I4) {
    for (int j = 0; j < half; ++j) data[base + j] = (uint8_t)((q[j] & 0xf) | ((q[j + half] & 0xf) << 4));
  } else {
    std::memcpy(data + base, q, half);
    std::memcpy(data + base + hi_off, q + half, half);
  }
}

static void quantize_row(const float* x, const float* scale, int D, bool per_channel, float qmax,
                         int32_t dtype, void* dst, int64_t off) {
  if (dtype == F32 || dtype == BF16 || dtype == F16) {
    store_row(dst, off, x, D, dtype);
    return;
  }
  const f32x8 hi = splat(qmax), lo = splat(-qmax);
  for (int d = 0; d < D; d += 8) {  // D % 8 == 0 (checked by the launcher)
    const f32x8 s = per_channel ? loadv(scale + d) : splat(scale[0]);
    f32x8 y = loadv(x + d) / s;  // IEEE division in every lane, as torch's x / scale
    y = y > hi ? hi : y;         // saturate (__NV_SATFINITE); a NaN lane compares false and stays NaN
    y = y < lo ? lo : y;
    uint8_t* out = static_cast<uint8_t*>(dst) + off + d;
    if (dtype == I8) {
      store_bytes(out, (u32x8)round_int(y));
    } else {
      store_bytes(out, encode8_fp8(y, dtype));
    }
  }
}

extern "C" int qkv_write_kv_cache(const WriteArgs* a) {
  const CacheDesc& c = a->cache;
  const int D = c.head_dim, H = c.num_kv_heads;
  if (D > 512) return 1;
  // A decode step writes a few tokens: waking a thread team would cost more than the work.
#pragma omp parallel for schedule(static) num_threads(a->num_threads) if (a->num_tokens >= 64)
  for (int64_t t = 0; t < a->num_tokens; ++t) {
    const int64_t slot = a->slot_mapping[t];
    if (slot < 0) continue;
    const int64_t block = slot / c.block_size, off = slot % c.block_size;
    alignas(64) float x[512];
    for (int kv = 0; kv < 2; ++kv) {
      const void* src = kv == 0 ? a->key : a->value;
      const int64_t st = kv == 0 ? a->stride_kt : a->stride_vt, sh = kv == 0 ? a->stride_kh : a->stride_vh;
      const float* static_scale = kv == 0 ? c.k_scale : c.v_scale;
      if (!c.rotate && a->in_dtype == c.dtype) {  // same dtype, unquantized: the bytes as they are
        const int64_t size = c.dtype == F32 ? 4 : 2;
        char* out = static_cast<char*>(c.data) + row_base(c, block, kv, off, 0) * size;
        const char* in = static_cast<const char*>(src) + t * st * size;
        if (sh == D && c.stride_head == D) {  // the token's heads are one run on both sides: one copy
          std::memcpy(out, in, (size_t)H * D * size);
        } else {
          for (int h = 0; h < H; ++h) std::memcpy(out + h * c.stride_head * size, in + h * sh * size, D * size);
        }
        continue;
      }
      for (int h = 0; h < H; ++h) {
        const int64_t dst = row_base(c, block, kv, off, h);
        load_row(src, t * st + h * sh, x, D, a->in_dtype);
        if (c.rotate) fwht(x, D, c.rot_norm);
        float dyn = 1.0f;
        const float* scale = &dyn;
        bool per_channel = false;
        if (c.scale_mode == SCALE_DYNAMIC) {
          float amax = 0.0f, xmax = -INFINITY;
          for (int d = 0; d < D; ++d) {  // NaN propagates, like torch's amax
            const float v = std::fabs(x[d]);
            if (std::isnan(v)) { amax = v; break; }
            amax = std::max(amax, v);
            xmax = std::max(xmax, x[d]);
          }
          float sc = amax / c.side_qmax[kv];  // the reference's order: amax / qmax, times a calibrated clip
          if (c.clip[kv] != 1.0f) sc *= c.clip[kv];
          dyn = std::max(sc, 1e-8f);
          // an int4 side's signed grid: a positive extreme (or a zero row) takes code -8, so the scale flips
          if (c.packed && c.side_dtype[kv] == I4 && xmax == amax) dyn = -dyn;
          c.scale_cache[block * c.s_stride_block + kv * c.s_stride_kv + off * c.s_stride_slot + h] = dyn;
        } else if (c.scale_mode == SCALE_HEAD) {
          scale = static_scale + h;
        } else if (c.scale_mode == SCALE_CHANNEL) {
          scale = static_scale + (int64_t)h * D;
          per_channel = true;
        }
        if (c.packed)
          quantize_row_packed(x, dyn, D, c.side_qmax[kv], c.side_dtype[kv], static_cast<uint8_t*>(c.data),
                              dst, c.side_hi[kv]);
        else
          quantize_row(x, scale, D, per_channel, c.qmax, c.dtype, c.data, dst);
      }
    }
  }
  return 0;
}

// ------------------------------------------------------------------ attention --
// Dequantize one cached row (D values of kv head h at a slot) into fp32.
// PK: a packed cache, whose side dtype DT is I4 (nibbles of one plane) or I8 (two half-row planes).
template <int32_t DT, bool PK>
static inline void load_cached_row(const CacheDesc& c, int64_t block, int kv, int64_t off, int h, float* dst) {
  const int64_t base = row_base(c, block, kv, off, h);
  float s = prescale(DT);  // power of two: s * scale is exact, so folding it in changes no bit
  if (c.scale_mode == SCALE_DYNAMIC)
    s *= c.scale_cache[block * c.s_stride_block + kv * c.s_stride_kv + off * c.s_stride_slot + h];
  else if (c.scale_mode == SCALE_HEAD)
    s *= (kv == 0 ? c.k_scale : c.v_scale)[h];
  const f32x8 sv = splat(s);  // s == 1 multiplies exactly
  if constexpr (PK) {
    const int half = c.head_dim / 2;
    const uint8_t* lo = static_cast<const uint8_t*>(c.data) + base;
    const uint8_t* hi = lo + c.side_hi[kv];
    for (int d = 0; d < half; d += 8) {
      if constexpr (DT == I4) {
        storev(dst + d, decode8_i4(lo + d, false) * sv);
        storev(dst + half + d, decode8_i4(hi + d, true) * sv);
      } else {
        storev(dst + d, widen_i8(reinterpret_cast<const int8_t*>(lo) + d) * sv);
        storev(dst + half + d, widen_i8(reinterpret_cast<const int8_t*>(hi) + d) * sv);
      }
    }
  } else {
    for (int d = 0; d < c.head_dim; d += 8) storev(dst + d, decode8<DT>(c.data, base + d) * sv);
  }
}

// The K and V rows of slots [j0, j1) (block-relative) and heads [h0, h1) into the item's tiles, laid out
// [head - h0][slot][D] with TK slots per head.
template <int32_t DK, int32_t DV, bool PK>
static void load_block(const CacheDesc& c, int64_t block, int64_t j0, int64_t j1, int h0, int h1, int TK,
                       float* kbuf, float* vbuf) {
  const int D = c.head_dim;
  for (int64_t j = j0; j < j1; ++j)
    for (int h = h0; h < h1; ++h) {
      load_cached_row<DK, PK>(c, block, 0, j, h, kbuf + ((size_t)(h - h0) * TK + j) * D);
      load_cached_row<DV, PK>(c, block, 1, j, h, vbuf + ((size_t)(h - h0) * TK + j) * D);
    }
}

// Lane k of the result is the sum of the 8 lanes of v[k], always added in the same tree:
// ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)).
static inline f32x8 reduce8(const f32x8* v) {
#ifdef __AVX2__
  __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
#else
  f32x8 r;
  for (int k = 0; k < 8; ++k)
    r[k] = ((v[k][0] + v[k][1]) + (v[k][2] + v[k][3])) + ((v[k][4] + v[k][5]) + (v[k][6] + v[k][7]));
  return r;
#endif
}

static inline float hmax(f32x8 v) {
  float a0 = std::max(v[0], v[4]), a1 = std::max(v[1], v[5]), a2 = std::max(v[2], v[6]), a3 = std::max(v[3], v[7]);
  return std::max(std::max(a0, a2), std::max(a1, a3));
}

// Scores of keys g .. g+7 of the tile for one query row: 8 independent dot products over D, then one
// batched horizontal reduction. The order of every addition is fixed. NC = D / 8 when known at compile time
// (the query row then stays in registers across the keys), 0 otherwise.
template <int NC>
static inline f32x8 scores8(const f32x8* qv, const float* q, const float* kbuf, int D) {
  f32x8 acc[8];
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) {
    if constexpr (NC > 0) {
      const float* kr = kbuf + (size_t)k * 8 * NC;
      f32x8 a = qv[0] * loadv(kr);
#pragma GCC unroll 32
      for (int c = 1; c < NC; ++c) a += qv[c] * loadv(kr + 8 * c);
      acc[k] = a;
    } else {
      const float* kr = kbuf + (size_t)k * D;
      f32x8 a = loadv(q) * loadv(kr);
      for (int d = 8; d < D; d += 8) a += loadv(q + d) * loadv(kr + d);
      acc[k] = a;
    }
  }
  return reduce8(acc);
}

// Lanes of keys g .. g+7 outside [a0, a1) set to `fill`.
static inline f32x8 mask_keys(f32x8 v, int g, int a0, int a1, float fill) {
  const i32x8 j = (i32x8){0, 1, 2, 3, 4, 5, 6, 7} + g;
  return (j >= a0 && j < a1) ? v : splat(fill);
}

// o[0:8*NC] = o * alpha + sum_j p[j] * v[j] for j in [a0, a1), accumulators kept in registers.
template <int NC>
static inline void pv_chunk(float* o, const float* vbuf, const float* p, int a0, int a1, int D, float alpha) {
  f32x8 acc[NC];
  const f32x8 al = splat(alpha);
#pragma GCC unroll 8
  for (int c = 0; c < NC; ++c) acc[c] = loadv(o + 8 * c) * al;
  for (int j = a0; j < a1; ++j) {
    const f32x8 pj = splat(p[j]);
    const float* v = vbuf + (size_t)j * D;
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) acc[c] += pj * loadv(v + 8 * c);
  }
#pragma GCC unroll 8
  for (int c = 0; c < NC; ++c) storev(o + 8 * c, acc[c]);
}

static void pv(float* o, const float* vbuf, const float* p, int a0, int a1, int D, float alpha) {
  int d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) pv_chunk<8>(o + d0, vbuf + d0, p, a0, a1, D, alpha);
  switch ((D - d0) / 8) {
    case 1: pv_chunk<1>(o + d0, vbuf + d0, p, a0, a1, D, alpha); break;
    case 2: pv_chunk<2>(o + d0, vbuf + d0, p, a0, a1, D, alpha); break;
    case 3: pv_chunk<3>(o + d0, vbuf + d0, p, a0, a1, D, alpha); break;
    case 4: pv_chunk<4>(o + d0, vbuf + d0, p, a0, a1, D, alpha); break;
    case 5: pv_chunk<5>(o + d0, vbuf + d0, p, a0, a1, D, alpha); break;
    case 6: pv_chunk<6>(o + d0, vbuf + d0, p, a0, a1, D, alpha); break;
    case 7: pv_chunk<7>(o + d0, vbuf + d0, p, a0, a1, D, alpha); break;
    default: break;
  }
}

namespace {
struct RowState {
  float m, l;
  int64_t lo, hi;  // visible key positions [lo, hi)
};
static_assert(sizeof(RowState) == 24, "RowState is stored in the float work buffer");
}  // namespace

// Online-softmax update of one query row with the keys [a0, a1) of the current tile (tile-relative).
template <int NC>
static void attend_row(const float* q, float* o, RowState& rs, const float* kbuf, const float* vbuf, int a0, int a1,
                       int D) {
  const float ninf = -std::numeric_limits<float>::infinity();
  float s[64], p[64];
  f32x8 qv[NC > 0 ? NC : 1];
  if constexpr (NC > 0)
    for (int c = 0; c < NC; ++c) qv[c] = loadv(q + 8 * c);
  f32x8 mv = splat(ninf);
  for (int g = (a0 / 8) * 8; g < a1; g += 8) {
    const f32x8 sv = mask_keys(scores8<NC>(qv, q, kbuf + (size_t)g * D, D), g, a0, a1, ninf);
    storev(s + g, sv);
    mv = vmax(mv, sv);
  }
  const float m_new = std::max(rs.m, hmax(mv));
  const float alpha = rs.m == ninf ? 0.0f : vexp(splat(rs.m - m_new))[0];
  f32x8 lsum = splat(0.0f);
  for (int g = (a0 / 8) * 8; g < a1; g += 8) {
    const f32x8 e = mask_keys(vexp(loadv(s + g) - splat(m_new)), g, a0, a1, 0.0f);
    storev(p + g, e);
    lsum += e;
  }
  rs.l = rs.l * alpha + hsum(lsum);
  rs.m = m_new;
  pv(o, vbuf, p, a0, a1, D, alpha);
}

// Bring the next block's K and V rows of heads [h0, h1) towards L1 while the current one is computed:
// block ids are scattered, so the hardware prefetcher cannot guess them.
static inline void prefetch_block(const CacheDesc& c, int64_t block, int h0, int h1) {
  const int64_t esize = c.dtype == F32 ? 4 : (c.dtype == BF16 || c.dtype == F16) ? 2 : 1;
  const char* base = static_cast<const char*>(c.data);
  const int64_t row_bytes = (int64_t)(h1 - h0) * c.row_elems * esize;
  for (int p = 0; p < c.planes; ++p)
    for (int j = 0; j < c.block_size; ++j) {
      const char* row = base + (block * c.stride_block + p * c.stride_kv + j * c.stride_slot + h0 * c.stride_head) * esize;
      for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(row + off);
    }
}

// attend_row for the head sizes models use (query row in registers), and for any other multiple of 8.
static inline void attend_row_d(const float* q, float* o, RowState& rs, const float* kbuf, const float* vbuf,
                                int a0, int a1, int D) {
  switch (D) {
    case 64: attend_row<8>(q, o, rs, kbuf, vbuf, a0, a1, D); break;
    case 128: attend_row<16>(q, o, rs, kbuf, vbuf, a0, a1, D); break;
    default: attend_row<0>(q, o, rs, kbuf, vbuf, a0, a1, D); break;
  }
}

// One work item: query tokens [tok0, tok0 + ntok) of sequence s, kv heads [h0, h1) and their query heads.
static void attend_item(const AttnArgs& a, int s, int64_t tok0, int64_t ntok, int h0, int h1,
                        std::vector<float>& work) {
  const CacheDesc& c = a.cache;
  const int D = c.head_dim, G = a.num_q_heads / c.num_kv_heads, BS = c.block_size, NH = h1 - h0;
  const int TK = BS < 8 ? 8 : BS;  // tile rows per head: keys of one block, padded to a group of 8
  const int64_t q0 = a.query_start_loc[s], q_len = a.query_start_loc[s + 1] - q0;
  const int64_t first_pos = a.seq_lens[s] - q_len;
  const int rows = (int)ntok * NH * G;  // row r: token r / (NH * G), query head h0 * G + r % (NH * G)
  work.resize((size_t)rows * D * 2 + (size_t)NH * TK * D * 2 + (size_t)rows * sizeof(RowState) / sizeof(float));
  float* qbuf = work.data();
  float* acc = qbuf + (size_t)rows * D;
  float* kbuf = acc + (size_t)rows * D;
  float* vbuf = kbuf + (size_t)NH * TK * D;
  RowState* st = reinterpret_cast<RowState*>(vbuf + (size_t)NH * TK * D);
  const int32_t* table = a.block_tables + (int64_t)s * a.stride_bt;

  for (int r = 0; r < rows; ++r) {
    const int64_t tok = tok0 + r / (NH * G), head = (int64_t)h0 * G + r % (NH * G);
    const int kvh = (int)(head / G);
    float* q = qbuf + (size_t)r * D;
    load_row(a.query, (q0 + tok) * a.stride_qt + head * a.stride_qh, q, D, a.q_dtype);
    if (c.rotate) {  // (qH).(kH) = q.k; rounded back to the query dtype like the reference
      fwht(q, D, c.rot_norm);
      if (a.q_dtype == BF16)
        for (int d = 0; d < D; ++d) q[d] = bits_f32((uint32_t)f32_to_bf16(q[d]) << 16);
      else if (a.q_dtype == F16)
        for (int d = 0; d < D; ++d) q[d] = f16_to_f32(f32_to_f16(q[d]));
    }
    if (c.scale_mode == SCALE_CHANNEL)  // q . (k_q * s_k) = (q * s_k) . k_q
      for (int d = 0; d < D; ++d) q[d] *= c.k_scale[(int64_t)kvh * D + d];
    for (int d = 0; d < D; ++d) q[d] *= a.sm_scale;
    std::fill(acc + (size_t)r * D, acc + (size_t)(r + 1) * D, 0.0f);
    const int64_t pos = first_pos + tok;
    st[r] = {-std::numeric_limits<float>::infinity(), 0.0f,
             a.window > 0 ? std::max<int64_t>(0, pos - a.window + 1) : 0, pos + 1};
  }
  const int64_t lo = st[0].lo, hi = st[rows - 1].hi;
  for (int64_t b = lo / BS; b * BS < hi; ++b) {
    const int64_t block = table[b], start = b * BS;
    if ((b + 1) * BS < hi) prefetch_block(c, table[b + 1], h0, h1);
    const int64_t j0 = std::max(start, lo), j1 = std::min(start + BS, hi);
    // only slots some row of the item can see are read
    QKV_DISPATCH_CACHE(c, load_block<DK, DV, PK>(c, block, j0 - start, j1 - start, h0, h1, TK, kbuf, vbuf))
    for (int r = 0; r < rows; ++r) {
      const int64_t a0 = std::max(start, st[r].lo), a1 = std::min(start + BS, st[r].hi);
      const size_t tile = (size_t)((r % (NH * G)) / G) * TK * D;
      if (a0 < a1)
        attend_row_d(qbuf + (size_t)r * D, acc + (size_t)r * D, st[r], kbuf + tile, vbuf + tile, (int)(a0 - start),
                     (int)(a1 - start), D);
    }
  }
  for (int r = 0; r < rows; ++r) {
    const int64_t tok = tok0 + r / (NH * G), head = (int64_t)h0 * G + r % (NH * G);
    const int kvh = (int)(head / G);
    float* o = acc + (size_t)r * D;
    const float l = st[r].l;
    for (int d = 0; d < D; ++d) o[d] = l == 0.0f ? 0.0f : o[d] / l;
    if (c.scale_mode == SCALE_CHANNEL)  // sum p (v_q * s_v) = s_v * sum p v_q
      for (int d = 0; d < D; ++d) o[d] *= c.v_scale[(int64_t)kvh * D + d];
    if (c.rotate) fwht(o, D, c.rot_norm);
    for (int d = 0; d < D; ++d)
      store_f32(a.out, (q0 + tok) * a.stride_ot + head * a.stride_oh + d, o[d], a.q_dtype);
  }
}

#include "paged_decode.h"
#include "amx_decode.h"
#include "dense_prefill.h"
#include "amx_prefill.h"
#include "small_gemm.h"
#include "argmax_rows.h"

extern "C" int qkv_paged_attention(const AttnArgs* a) {
  const int G = a->num_q_heads / a->cache.num_kv_heads, H = a->cache.num_kv_heads;
  if (a->cache.block_size > 64 || a->cache.head_dim % 8) return 1;
  // Work items: (sequence, query tile, kv-head range). An item reads its heads' rows of a block as one
  // contiguous run; heads are split only when there would be too few items to keep the threads busy.
  const int64_t tile = std::max<int64_t>(1, std::min<int64_t>(a->q_tile, 1024 / (G * H)));
  int64_t tiles = 0;
  for (int s = 0; s < a->num_seqs; ++s)
    tiles += (a->query_start_loc[s + 1] - a->query_start_loc[s] + tile - 1) / tile;
  const int split = (int)std::min<int64_t>(H, std::max<int64_t>(1, (2 * a->num_threads + tiles - 1) / std::max<int64_t>(tiles, 1)));
  const int per = (H + split - 1) / split;
  std::vector<int64_t> items;
  for (int s = 0; s < a->num_seqs; ++s) {
    const int64_t q_len = a->query_start_loc[s + 1] - a->query_start_loc[s];
    for (int64_t t0 = 0; t0 < q_len; t0 += tile)
      for (int h = 0; h < H; h += per) items.insert(items.end(), {s, t0, std::min(tile, q_len - t0), h, std::min(H, h + per)});
  }
  const int64_t n = (int64_t)items.size() / 5;
#pragma omp parallel num_threads(a->num_threads) if (n > 1)
  {
    std::vector<float> work;
#ifdef QKV_BF16DP
    // decode rows in bf16 products (paged_decode.h): AMX tiles or VDPBF16PS, as the launcher chose
    const int products = decode::supports(a->cache, G, a->q_dtype) ? a->decode : DECODE_ROW_LOOP;
    static thread_local std::unique_ptr<decode::Work> decode_work;
    [[maybe_unused]] bool begun = false;
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t* it = &items[5 * i];
#ifdef QKV_BF16DP
      const int s = (int)it[0];
      if (products != DECODE_ROW_LOOP && a->query_start_loc[s + 1] - a->query_start_loc[s] == 1) {
        if (!decode_work) decode_work = std::make_unique<decode::Work>();  // value-initialized: its zero row
#ifdef QKV_AMX
        if (products == DECODE_AMX && amx::permitted()) {
          if (!begun) amx::DecodeTiles::begin(G);
          begun = true;
          decode::attend_item<amx::DecodeTiles>(*a, s, (int)it[3], (int)it[4], *decode_work);
          continue;
        }
#endif
        if (products == DECODE_DP16) {
          decode::attend_item<decode::Dp16>(*a, s, (int)it[3], (int)it[4], *decode_work);
          continue;
        }
      }
#endif
      attend_item(*a, (int)it[0], it[1], it[2], (int)it[3], (int)it[4], work);
    }
#ifdef QKV_AMX
    if (begun) amx::DecodeTiles::end();
#endif
  }
  return 0;
}

// ------------------------------------------------------------------ gather --
// Positions [start, end) of one sequence, dequantized into contiguous K and V ([2, Hkv, L, D]): the input
// of a dense attention (torch's SDPA, for long prefill chunks, where a tiled GEMM beats this file's
// row-by-row loop). Each value is what attention reads from the cache (its scale applied, per channel too),
// rounded once to the output dtype; only slots in [start, end) are read, so stale bytes never are.
extern "C" int qkv_gather_kv(const GatherArgs* a) {
  const CacheDesc& c = a->cache;
  const int D = c.head_dim, H = c.num_kv_heads, BS = c.block_size;
  if (D % 8 || D > 512 || a->end < a->start) return 1;
  const int64_t L = a->end - a->start, b0 = a->start / BS, b1 = (a->end + BS - 1) / BS;
  const int64_t units = 2 * (b1 - b0);
#pragma omp parallel for schedule(static) num_threads(a->num_threads) if (L * H * D > (1 << 16))
  for (int64_t u = 0; u < units; ++u) {
    const int kv = (int)(u % 2);
    const int64_t b = b0 + u / 2, block = a->block_table[b];
    const int64_t j0 = std::max(a->start, b * BS), j1 = std::min(a->end, (b + 1) * BS);
    const float* chan = c.scale_mode == SCALE_CHANNEL ? (kv == 0 ? c.k_scale : c.v_scale) : nullptr;
    float row[512];
    for (int64_t j = j0; j < j1; ++j)
      for (int h = 0; h < H; ++h) {
        if (kv == 0) {
          QKV_DISPATCH_CACHE(c, load_cached_row<DK, PK>(c, block, 0, j - b * BS, h, row))
        } else {
          QKV_DISPATCH_CACHE(c, load_cached_row<DV, PK>(c, block, 1, j - b * BS, h, row))
        }
        if (chan)
          for (int d = 0; d < D; ++d) row[d] *= chan[(int64_t)h * D + d];
        const int64_t o = (((int64_t)kv * H + h) * L + (j - a->start)) * D;
        store_row(a->out, o, row, D, a->out_dtype);
      }
  }
  return 0;
}

// ------------------------------------------------------------------ rotate --
// Rows of `dim` values times the normalized Hadamard matrix, in fp32, rounded once to out_dtype: the dense
// prefill's query and output of a rotated cache. The same butterflies in the same order as the reference's
// hadamard_rotate (then one multiply by the norm), so the result is bit for bit its `.to(dtype)`.
extern "C" int qkv_hadamard_rows(const RotateArgs* a) {
  const int D = a->dim;
  if (D <= 0 || (D & (D - 1)) || D > 4096) return 1;
#pragma omp parallel num_threads(a->num_threads) if (a->rows * D > (1 << 14))
  {
    std::vector<float> x(D);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < a->rows; ++r) {
      load_row(a->in, r * D, x.data(), D, a->in_dtype);
      fwht(x.data(), D, a->norm);
      store_row(a->out, r * D, x.data(), D, a->out_dtype);
    }
  }
  return 0;
}
