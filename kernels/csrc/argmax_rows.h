// Greedy sampling's pick: the argmax of some rows of a step's logits, with torch's semantics for fp32 (the
// first index of the maximum; the first NaN where a row holds one). Included by paged_cpu.cpp, after decode8.
//
// Why a kernel: torch's CPU argmax reduces a bf16 row of a 49k vocabulary element by element, and widening the
// rows to fp32 first costs a copy of them all; this is one vectorized pass over each row (a maximum and a NaN
// test) plus a second pass that stops at the first lane equal to the maximum. Decode steps at a fixed KV budget
// run dozens of rows, so the difference is a few percent of a step.
#pragma once

struct ArgmaxArgs {
  const void* logits;  // [*, vocab], rows row_stride elements apart
  const int64_t* rows;  // which rows
  int64_t* out;  // one index per row of `rows`
  int64_t num_rows, vocab, row_stride;
  int32_t in_dtype, num_threads;
};

// Index of the first lane of v that is NaN (nan) or equal to m, or -1.
static inline int first_lane(f32x8 v, float m, bool nan) {
  i32x8 hit = nan ? (i32x8)(v != v) : (i32x8)(v == splat(m));
  for (int l = 0; l < 8; ++l)
    if (hit[l]) return l;
  return -1;
}

template <int32_t DT>
static int64_t argmax_row(const void* base, int64_t n) {
  // pass 1: the maximum and whether any element is NaN (four accumulators: max has a latency of several cycles)
  f32x8 mx[4] = {splat(-INFINITY), splat(-INFINITY), splat(-INFINITY), splat(-INFINITY)};
  i32x8 nan = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int u = 0; u < 4; ++u) {
      f32x8 v = decode8<DT>(base, i + 8 * u);
      nan |= (i32x8)(v != v);
      mx[u] = vmax(v, mx[u]);
    }
  for (; i + 8 <= n; i += 8) {
    f32x8 v = decode8<DT>(base, i);
    nan |= (i32x8)(v != v);
    mx[0] = vmax(v, mx[0]);
  }
  float m = hmax(vmax(vmax(mx[0], mx[1]), vmax(mx[2], mx[3])));
  bool any_nan = false;
  for (int l = 0; l < 8; ++l) any_nan |= nan[l] != 0;
  for (int64_t j = i; j < n; ++j) {
    float v = load_f32(base, j, DT);
    any_nan |= v != v;
    m = std::max(m, v);
  }
  // pass 2: the first element that is NaN, or else equal to the maximum
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    int l = first_lane(decode8<DT>(base, j), m, any_nan);
    if (l >= 0) return j + l;
  }
  for (; j < n; ++j) {
    float v = load_f32(base, j, DT);
    if (any_nan ? v != v : v == m) return j;
  }
  return 0;  // unreachable for n > 0
}

extern "C" int qkv_argmax_rows(const ArgmaxArgs* a) {
  if (a->vocab <= 0 || a->in_dtype < F32 || a->in_dtype > F16) return 1;
  const size_t esize = a->in_dtype == F32 ? 4 : 2;
#pragma omp parallel for schedule(static) num_threads(a->num_threads) if (a->num_rows * a->vocab >= (1 << 17))
  for (int64_t r = 0; r < a->num_rows; ++r) {
    const void* row = static_cast<const char*>(a->logits) + (size_t)(a->rows[r] * a->row_stride) * esize;
    switch (a->in_dtype) {
      case F32: a->out[r] = argmax_row<F32>(row, a->vocab); break;
      case BF16: a->out[r] = argmax_row<BF16>(row, a->vocab); break;
      default: a->out[r] = argmax_row<F16>(row, a->vocab); break;
    }
  }
  return 0;
}
