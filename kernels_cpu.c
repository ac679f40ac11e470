/* kernels_cpu.c — decode attention on the CPU, reading K/V from their blocks in place.
 *
 * The torch fast path (nanopaged.paged_attention) first copies each sequence's blocks
 * into a dense tensor so that SDPA can read them: every K/V byte is read, written and
 * read again. This kernel walks the block table itself, as kernels.cu does on the GPU,
 * and reads every byte once. It serves the decode rows of a step (one query per
 * sequence, where the copy costs most against the work); prefill chunks stay on SDPA,
 * whose many queries per key amortize their gather.
 *
 * Plain C (C11 + OpenMP, and gcc's and clang's vector extensions), no torch headers:
 * build_ext.load_cpu_kernels() compiles it with the system's cc in a few seconds and
 * calls paged_decode() through ctypes.
 *
 * One work item per (decode sequence, kv head), spread over threads by OpenMP: the
 * G = H / KVH query heads of a GQA group read each K/V vector of their kv head while it
 * is in L1. Where that makes fewer than two items a thread (one long chat, a few sequences
 * on many cores), each context is cut into partitions, items of their own, merged after
 * (split-K, as kernels.cu does). Online softmax, one block's run of positions at a time, in base 2 (as
 * kernels.cu): q is scaled by scale * log2(e) once, so each score costs one 2^x, and 2^x
 * is a polynomial the compiler vectorizes (libm's expf would be a call per score).
 *
 * K and V may be stored narrower than q (LLM's kv_cache_dtype): bfloat16 under a float32
 * model, or float8, which is widened to float32 a few rows at a time as they are read.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* storage of q, K/V and out (E4M3, E5M2: torch's float8_e4m3fn and float8_e5m2, for a KV
 * cache only: LLM's kv_cache_dtype); the math is float32 */
enum { F32 = 0, BF16 = 1, F16 = 2, E4M3 = 3, E5M2 = 4 };

struct DecodeArgs {            /* shapes on each field; T tokens, B sequences in the step */
  const void* q;               /* (T, H, D), q_stride elements from one token to the next */
  int64_t q_stride;
  const void* k_cache;         /* (num_blocks, block_size, KVH, D), contiguous */
  const void* v_cache;         /* the same */
  int64_t num_blocks;
  const int32_t* block_tables; /* (B, max_blocks); entries before a window may be -1 */
  int64_t max_blocks;
  const int32_t* seq_lens;     /* (B) context length, this step's token included */
  const int32_t* query_start_loc;  /* (B + 1); decode sequence b's one query: row query_start_loc[b] */
  int64_t num_seqs;            /* B */
  int64_t num_tokens;          /* T */
  const int64_t* seqs;         /* (n) the decode sequences to serve */
  int64_t n;
  void* out;                   /* (T, H, D) contiguous; only the n decode rows written */
  int32_t num_heads, num_kv_heads, head_dim, block_size;
  int32_t window;              /* 0: none; else a query at position p sees p - window + 1 .. p */
  int32_t dtype;               /* q's and out's: F32, BF16 or F16 */
  int32_t kv_dtype;            /* the caches': dtype, BF16, E4M3 or E5M2 */
  int32_t num_threads;
  float scale;
  float softcap;               /* 0: none; else scores become softcap * tanh(s / softcap) */
  int64_t partition_size;      /* positions per work item at most; 0: paged_decode picks (split-K) */
  int64_t bad;                 /* out: the sequence a refused call stumbled on */
  int64_t work_items;          /* out: how many work items the call was cut into */
};

/* What paged_decode returns: 0, or why it refused the call (before reading anything). */
enum { OK = 0, BAD_SEQ = 1, BAD_LEN = 2, BAD_ROW = 3, BAD_BLOCK = 4, NO_F16 = 5, NO_MEMORY = 6, NOT_DECODE = 7,
       BAD_DTYPE = 8 };

int paged_decode_has_float16(void) {
#ifdef __FLT16_MAX__   /* _Float16: gcc 12+ and clang, on x86-64 and arm64 */
  return 1;
#else
  return 0;
#endif
}

/* ---- loads and stores: a switch on a constant, which inlining folds away ---- */

#define INLINE static inline __attribute__((always_inline))

/* float8 (torch's float8_e4m3fn and float8_e5m2) to float32: a table of each one's 256
 * values, which the compiler works out from these formulas. A byte is a sign s, E exponent
 * bits e and M mantissa bits m (e4m3: 4 and 3; e5m2: 5 and 2), its exponent biased by
 * 2^(E-1) - 1: (2^M + m) x 2^(e - bias - M), or m x 2^(1 - bias - M) where e = 0 (subnormal).
 * e4m3fn has no inf: its all-ones byte (0x7f) is NaN; e5m2's top exponent is float16's, m = 0
 * inf, else NaN. Constant tables: no setup, nothing shared to race on. (Widening by
 * arithmetic needs lane comparisons, which GCC does one lane at a time on x86-64's baseline:
 * 10x slower than the lookup there, measured.) */
#define FP8_BIAS(E) ((1 << ((E) - 1)) - 1)
#define FP8(E, M, s, e, m)                                                                         \
  (((s) ? -1.0f : 1.0f) *                                                                          \
   ((e) == (1 << (E)) - 1 && ((E) == 5 || (m) == (1 << (M)) - 1) ? ((m) ? NAN : INFINITY)          \
    : (e) ? (float)((1 << (M)) + (m)) * (float)(1ull << (e)) / (float)(1ull << (FP8_BIAS(E) + (M))) \
          : (float)(m) / (float)(1ull << (FP8_BIAS(E) + (M) - 1))))
#define E4M3_AT(b) FP8(4, 3, (b) & 0x80, ((b) >> 3) & 15, (b) & 7)
#define E5M2_AT(b) FP8(5, 2, (b) & 0x80, ((b) >> 2) & 31, (b) & 3)
#define TABLE4(f, b) f(b), f(b + 1), f(b + 2), f(b + 3)
#define TABLE16(f, b) TABLE4(f, b), TABLE4(f, b + 4), TABLE4(f, b + 8), TABLE4(f, b + 12)
#define TABLE64(f, b) TABLE16(f, b), TABLE16(f, b + 16), TABLE16(f, b + 32), TABLE16(f, b + 48)
#define TABLE256(f) TABLE64(f, 0), TABLE64(f, 64), TABLE64(f, 128), TABLE64(f, 192)
static const float e4m3_values[256] = {TABLE256(E4M3_AT)};
static const float e5m2_values[256] = {TABLE256(E5M2_AT)};

/* cnt rows of D float8 values, the first at element `base` of cache, `stride` elements
 * apart, widened into out (cnt, D). (Not inlined: one copy serves every attend.) */
static void widen_rows(const uint8_t* cache, int64_t base, int64_t stride, int cnt, int D, int dtype, float* out) {
  const float* values = dtype == E4M3 ? e4m3_values : e5m2_values;
  for (int j = 0; j < cnt; j++)
    for (int d = 0; d < D; d++) out[j * D + d] = values[cache[base + j * stride + d]];
}

/* bfloat16 is the top half of a float32: widening is a shift; narrowing rounds to nearest
 * even, as torch does, and keeps a NaN a NaN. */
INLINE float from_bf16(uint16_t x) {
  const uint32_t u = (uint32_t)x << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
INLINE uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

INLINE float load(const void* p, int64_t i, int dtype) {
  switch (dtype) {
    case BF16: return from_bf16(((const uint16_t*)p)[i]);
#ifdef __FLT16_MAX__
    case F16: return (float)((const _Float16*)p)[i];
#endif
    default: return ((const float*)p)[i];
  }
}

INLINE void store(void* p, int64_t i, float x, int dtype) {
  switch (dtype) {
    case BF16: ((uint16_t*)p)[i] = to_bf16(x); break;
#ifdef __FLT16_MAX__
    case F16: ((_Float16*)p)[i] = (_Float16)x; break;
#endif
    default: ((float*)p)[i] = x;
  }
}

/* the bytes of one element of this dtype */
INLINE int64_t bytes_of(int dtype) { return dtype == F32 ? 4 : dtype == E4M3 || dtype == E5M2 ? 1 : 2; }

/* element i of a tensor of this dtype, as a pointer (to hand a row to the loops below) */
INLINE const void* at(const void* p, int64_t i, int dtype) {
  return (const char*)p + i * bytes_of(dtype);
}

/* ---- 16 floats at a time ----
 * GCC/clang vector extensions: a 16-float value is one AVX-512 register, two AVX2 or four
 * SSE/NEON ones (the compiler splits it), so no intrinsics tie the file to one ISA. The
 * loops below are written with them rather than left to the auto-vectorizer, which kept
 * the output row in memory (this, with the prefetch in attend: 1.33x faster, measured). */
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
#ifdef __FLT16_MAX__
typedef _Float16 f16x16 __attribute__((vector_size(32)));
#endif

/* elements i .. i + 15 of a tensor as float32 (memcpy: an unaligned load) */
INLINE f32x16 load16(const void* p, int64_t i, int dtype) {
  f32x16 x;
  switch (dtype) {
    case BF16: {   /* widened by a shift, as load() */
      u16x16 h;
      memcpy(&h, (const uint16_t*)p + i, sizeof h);
      const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
      memcpy(&x, &w, sizeof x);
      return x;
    }
#ifdef __FLT16_MAX__
    case F16: {
      f16x16 h;
      memcpy(&h, (const _Float16*)p + i, sizeof h);
      return __builtin_convertvector(h, f32x16);
    }
#endif
    default: memcpy(&x, (const float*)p + i, sizeof x); return x;
  }
}

/* the sum of x's 16 lanes: halves added, 16 -> 8 -> 4, then those 4 */
INLINE float sum16(f32x16 x) {
  f32x8 lo, hi;
  memcpy(&lo, &x, sizeof lo);
  memcpy(&hi, (const char*)&x + sizeof lo, sizeof hi);
  lo += hi;
  f32x4 a, b;
  memcpy(&a, &lo, sizeof a);
  memcpy(&b, (const char*)&lo + sizeof a, sizeof b);
  a += b;
  return (a[0] + a[2]) + (a[1] + a[3]);
}

/* q . k over one head (q already float32): two running sums, 16 lanes each, then one sum */
INLINE float dot(const float* q, const void* k, int D, int dtype) {
  f32x16 s0 = {0}, s1 = {0}, qd;
  int d = 0;
  for (; d + 32 <= D; d += 32) {
    memcpy(&qd, q + d, sizeof qd);
    s0 += qd * load16(k, d, dtype);
    memcpy(&qd, q + d + 16, sizeof qd);
    s1 += qd * load16(k, d + 16, dtype);
  }
  if (d + 16 <= D) {
    memcpy(&qd, q + d, sizeof qd);
    s0 += qd * load16(k, d, dtype);
    d += 16;
  }
  float s = sum16(s0 + s1);
  for (; d < D; d++) s += q[d] * load(k, d, dtype);   /* a head_dim not a multiple of 16 */
  return s;
}

/* acc = acc * corr + sum_j p[j] v_j over one head, v_j the cnt rows from element `base` of
 * v, slot_stride apart. 64 floats of acc stay in registers (four 16-float vectors: four
 * AVX-512 registers, eight AVX2) across all the rows: a loop
 * over the rows that updated all of acc per row would load and store it again for each
 * row, and each row's adds would wait for the previous row's stores. */
INLINE void accumulate(float* acc, float corr, const float* p, const void* v, int64_t base, int64_t slot_stride,
                       int cnt, int D, int dtype) {
  int d = 0;
  for (; d + 64 <= D; d += 64) {
    f32x16 a0, a1, a2, a3;
    memcpy(&a0, acc + d, sizeof a0);
    memcpy(&a1, acc + d + 16, sizeof a1);
    memcpy(&a2, acc + d + 32, sizeof a2);
    memcpy(&a3, acc + d + 48, sizeof a3);
    a0 *= corr, a1 *= corr, a2 *= corr, a3 *= corr;
    for (int j = 0; j < cnt; j++) {
      const int64_t r = base + j * slot_stride + d;
      a0 += p[j] * load16(v, r, dtype);
      a1 += p[j] * load16(v, r + 16, dtype);
      a2 += p[j] * load16(v, r + 32, dtype);
      a3 += p[j] * load16(v, r + 48, dtype);
    }
    memcpy(acc + d, &a0, sizeof a0);
    memcpy(acc + d + 16, &a1, sizeof a1);
    memcpy(acc + d + 32, &a2, sizeof a2);
    memcpy(acc + d + 48, &a3, sizeof a3);
  }
  for (; d + 16 <= D; d += 16) {   /* the rest of a head_dim such as 80 or 96 */
    f32x16 a;
    memcpy(&a, acc + d, sizeof a);
    a *= corr;
    for (int j = 0; j < cnt; j++) a += p[j] * load16(v, base + j * slot_stride + d, dtype);
    memcpy(acc + d, &a, sizeof a);
  }
  for (; d < D; d++) {   /* and of one not a multiple of 16 */
    float a = acc[d] * corr;
    for (int j = 0; j < cnt; j++) a += p[j] * load(v, base + j * slot_stride + d, dtype);
    acc[d] = a;
  }
}

/* 2^x for x <= 0 (a score minus the running max), within ~2e-7 relative: x = n + f, n an
 * integer, f in [-0.5, 0.5]; 2^f = e^(f ln 2) by its Taylor series to the 6th power (the
 * next term is under 2e-7), 2^n written straight into the exponent bits. Below -126 it
 * gives 0 (2^-127 would be a denormal): such a key weighs under 2^-126 of the row's
 * largest. No branch and no call, so a loop over it vectorizes. */
INLINE float exp2_neg(float x) {
  x = x < -126.0f ? -127.0f : x;
  const float n = nearbyintf(x);
  const float f = (x - n) * 0.69314718f;
  float p = 1.0f / 720;
  p = p * f + 1.0f / 120;
  p = p * f + 1.0f / 24;
  p = p * f + 1.0f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  const int32_t bits = ((int32_t)n + 127) << 23;   /* n = -127: all zero bits, 0.0f */
  float two_n;
  memcpy(&two_n, &bits, 4);
  return p * two_n;
}

/* ---- one work item: a kv head's group of G query heads over a run of one context ---- */

enum { WIDEN_ROWS = 16 };   /* a float8 cache's rows widened at a time (see attend) */

/* Positions t0 .. t1 - 1 of decode sequence b, kv head h (D: the head_dim, a constant in
 * the copies paged_decode makes for common ones). partial NULL: the run is every position
 * the query sees, and the output is written to out. Else, per query head g, (2 + D) floats at
 * partial + g * (2 + D): the running max m (base 2), l = sum of 2^(score - m), and acc =
 * sum of those weights times V, for merge() to combine with the other partitions. */
INLINE void attend(const struct DecodeArgs* a, int64_t b, int h, int64_t t0, int64_t t1, float* partial, int D,
                   int dtype, int kv_dtype) {
  const int H = a->num_heads, KVH = a->num_kv_heads, bs = a->block_size;
  const int G = H / KVH;
  const int64_t row = a->query_start_loc[b];
  const int64_t slot_stride = (int64_t)KVH * D;        /* from one position to the next */
  const float log2e = 1.44269504f, qscale = a->scale * log2e;

  float qs[G][D], acc[G][D], m[G], l[G], p[bs];          /* the group's running state */
  /* A float8 cache (served by the F32 copy of this function: its loops read float32) has
   * its rows widened once, WIDEN_ROWS at a time, for all G heads to read: widening costs
   * more than the math it feeds, and each head widening its own would do it G times. */
  const int narrow = a->kv_dtype == E4M3 || a->kv_dtype == E5M2;
  float kw[narrow ? WIDEN_ROWS : 1][D], vw[narrow ? WIDEN_ROWS : 1][D];
  for (int g = 0; g < G; g++) {
    const int64_t q0 = row * a->q_stride + (int64_t)(h * G + g) * D;
    for (int d = 0; d < D; d++) {
      qs[g][d] = load(a->q, q0 + d, dtype) * qscale;
      acc[g][d] = 0.0f;
    }
    m[g] = -INFINITY;
    l[g] = 0.0f;
  }
  for (int64_t t = t0; t < t1;) {
    /* positions t .. t + cnt - 1 lie in one block, consecutive in its slots */
    const int64_t blk = t / bs, off = t % bs;
    int cnt = (int)(t1 - t < bs - off ? t1 - t : bs - off);
    cnt = narrow && cnt > WIDEN_ROWS ? WIDEN_ROWS : cnt;
    const int64_t base = ((int64_t)a->block_tables[b * a->max_blocks + blk] * bs + off) * slot_stride + (int64_t)h * D;
    if (off + cnt == bs && t + cnt < t1) {
      /* Ask for the next block's rows now: blocks lie anywhere in the cache, so no hardware
       * prefetcher guesses where the next one is, and its loads would wait on memory. */
      const int64_t next = (int64_t)a->block_tables[b * a->max_blocks + blk + 1] * bs * slot_stride + (int64_t)h * D;
      const int64_t bytes = bytes_of(a->kv_dtype);
      for (int j = 0; j < bs; j++)
        for (int64_t c = 0; c < D * bytes; c += 64) {   /* a cache line at a time */
          __builtin_prefetch((const char*)a->k_cache + (next + j * slot_stride) * bytes + c);
          __builtin_prefetch((const char*)a->v_cache + (next + j * slot_stride) * bytes + c);
        }
    }
    /* the rows the heads read: the cache's, or their widened copies (float32, D apart) */
    const void *k = a->k_cache, *v = a->v_cache;
    int64_t at0 = base, stride = slot_stride;
    if (narrow) {
      widen_rows(a->k_cache, base, slot_stride, cnt, D, a->kv_dtype, &kw[0][0]);
      widen_rows(a->v_cache, base, slot_stride, cnt, D, a->kv_dtype, &vw[0][0]);
      k = kw, v = vw, at0 = 0, stride = D;
    }
    for (int g = 0; g < G; g++) {
      float mx = m[g];
      for (int j = 0; j < cnt; j++) {
        float s = dot(qs[g], at(k, at0 + j * stride, kv_dtype), D, kv_dtype);
        if (a->softcap > 0)   /* in natural-log units, then back to base 2 */
          s = a->softcap * tanhf(s / log2e / a->softcap) * log2e;
        p[j] = s;
        mx = s > mx ? s : mx;
      }
      /* what was summed under the old max shrinks by 2^(old - new); nothing on the first run */
      const float corr = m[g] == -INFINITY ? 0.0f : exp2_neg(m[g] - mx);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int j = 0; j < cnt; j++) {
        p[j] = exp2_neg(p[j] - mx);
        sum += p[j];
      }
      l[g] = l[g] * corr + sum;
      m[g] = mx;
      accumulate(acc[g], corr, p, v, at0, stride, cnt, D, kv_dtype);
    }
    t += cnt;
  }
  for (int g = 0; g < G; g++) {
    if (partial) {
      float* out = partial + (int64_t)g * (2 + D);
      out[0] = m[g];
      out[1] = l[g];
      memcpy(out + 2, acc[g], sizeof acc[g]);
    } else {
      const int64_t o0 = (row * H + h * G + g) * (int64_t)D;
      for (int d = 0; d < D; d++) store(a->out, o0 + d, acc[g][d] / l[g], dtype);
    }
  }
}

/* ---- split-K: partitions, and their merge ---- */

/* Below this many positions a partition's own costs (its q, its state, its merge) weigh on
 * its share of the reading. */
enum { MIN_PARTITION = 256 };

/* Positions per work item: the caller's partition_size, else none (the whole context) where
 * there are work items enough for the threads, else as many as make about 4 items per
 * thread (dynamic scheduling evens out the rest), in whole blocks. total: the positions the
 * call reads, all sequences. */
static int64_t partition(const struct DecodeArgs* a, int64_t total) {
  if (a->partition_size > 0) return a->partition_size;
  const int64_t threads = a->num_threads;
  if (a->n * a->num_kv_heads >= 2 * threads) return INT64_MAX;
  const int64_t want = 4 * threads;
  int64_t len = (total * a->num_kv_heads + want - 1) / want;
  len = len < MIN_PARTITION ? MIN_PARTITION : len;
  return (len + a->block_size - 1) / a->block_size * a->block_size;
}

/* Sequence b's output for kv head h from its `parts` partitions (partials: where sequence
 * b's begin; kv head h of partition p at + (p * KVH + h) * G * (2 + D) floats, a query head
 * g's (2 + D) of them g * (2 + D) further): each partition's sums rescaled
 * to the largest of their maxima M, out = sum_p 2^(m_p - M) acc_p / sum_p 2^(m_p - M) l_p. */
INLINE void merge(const struct DecodeArgs* a, const float* partials, int64_t parts, int64_t b, int h, int dtype) {
  const int KVH = a->num_kv_heads, D = a->head_dim, G = a->num_heads / KVH;
  const int64_t partial_floats = (int64_t)G * (2 + D), row = a->query_start_loc[b];
  for (int g = 0; g < G; g++) {
    const float* head = partials + h * partial_floats + (int64_t)g * (2 + D);   /* partition 0's */
    float M = -INFINITY, l = 0.0f, acc[D];
    for (int64_t p = 0; p < parts; p++) M = fmaxf(M, head[p * KVH * partial_floats]);
    memset(acc, 0, sizeof acc);
    for (int64_t p = 0; p < parts; p++) {
      const float* partial = head + p * KVH * partial_floats;   /* partition p's */
      const float w = exp2_neg(partial[0] - M);
      l += w * partial[1];
      for (int d = 0; d < D; d++) acc[d] += w * partial[2 + d];
    }
    const int64_t o0 = (row * a->num_heads + h * G + g) * (int64_t)D;
    for (int d = 0; d < D; d++) store(a->out, o0 + d, acc[d] / l, dtype);
  }
}

/* ---- the entry point ---- */

/* the first position the query at position len - 1 sees (scheduler.first_visible's) */
INLINE int64_t first_visible(const struct DecodeArgs* a, int64_t len) {
  return a->window > 0 && len > a->window ? len - a->window : 0;
}

/* Each case its own copy of the function, dtype a constant in it (per call or work item,
 * not per element). attend's copies are made per K/V dtype, which its loops read (q is
 * read once, out written once: their dtype's switch is left in); a float8 cache's is the
 * F32 one (it widens the rows to float32 before its loops read them). */
#define BY_DTYPE(dtype, call)     \
  switch (dtype) {                \
    case BF16: call(BF16); break; \
    case F16: call(F16); break;   \
    default: call(F32);           \
  }

int paged_decode(struct DecodeArgs* a) {
  if ((a->dtype == F16 || a->kv_dtype == F16) && !paged_decode_has_float16()) return NO_F16;
  if (a->dtype > F16 || a->kv_dtype > E5M2 || a->dtype < 0 || a->kv_dtype < 0) return BAD_DTYPE;
  /* First, serially, what the engine promises: every read below stays inside the tensors,
   * whatever seqs, seq_lens, query_start_loc and block_tables hold (the sizes in DecodeArgs
   * are trusted: CpuKernels.decode_attention takes them from the tensors and checks them).
   * An int per block read: cheap next to the attention. */
  int64_t total = 0;
  for (int64_t i = 0; i < a->n; i++) {
    const int64_t b = a->seqs[i];
    a->bad = b;
    if (b < 0 || b >= a->num_seqs) return BAD_SEQ;
    const int64_t len = a->seq_lens[b], row = a->query_start_loc[b];
    if (len < 1 || len > a->max_blocks * a->block_size) return BAD_LEN;
    if (row < 0 || row >= a->num_tokens) return BAD_ROW;
    if (a->query_start_loc[b + 1] != row + 1) return NOT_DECODE;   /* (its rows but the first: unserved) */
    const int64_t first = first_visible(a, len);
    for (int64_t blk = first / a->block_size; blk <= (len - 1) / a->block_size; blk++) {
      const int32_t id = a->block_tables[b * a->max_blocks + blk];
      if (id < 0 || id >= a->num_blocks) return BAD_BLOCK;
    }
    total += len - first;
  }
  /* The work items: sequence i's are start[i] .. start[i + 1] - 1, partition-major (the
   * kv heads of one partition side by side: they read the same blocks). */
  const int64_t KVH = a->num_kv_heads, partition_len = partition(a, total);
  const int64_t partial_floats = (int64_t)(a->num_heads / KVH) * (2 + a->head_dim);   /* G x (2 + D) */
  int64_t* start = malloc((a->n + 1) * sizeof *start);
  if (!start) return NO_MEMORY;
  start[0] = 0;
  for (int64_t i = 0; i < a->n; i++) {
    const int64_t len = a->seq_lens[a->seqs[i]];
    start[i + 1] = start[i] + ((len - first_visible(a, len) - 1) / partition_len + 1) * KVH;
  }
  const int64_t items = a->work_items = start[a->n];
  float* partials = NULL;   /* work item w's at partials + w * partial_floats: unused by unsplit sequences */
  if (items > a->n * KVH && !(partials = malloc(items * partial_floats * sizeof *partials))) {
    free(start);
    return NO_MEMORY;
  }
  /* dynamic: contexts differ in length, so equal shares of work items are not equal work */
#pragma omp parallel for schedule(dynamic, 1) num_threads(a->num_threads)
  for (int64_t w = 0; w < items; w++) {
    int64_t lo = 0, hi = a->n - 1;   /* the sequence i with start[i] <= w < start[i + 1] */
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (start[mid] <= w) lo = mid; else hi = mid - 1;
    }
    const int64_t b = a->seqs[lo], len = a->seq_lens[b], parts = (start[lo + 1] - start[lo]) / KVH;
    const int64_t p = (w - start[lo]) / KVH, t0 = first_visible(a, len) + p * partition_len;
    const int h = (int)((w - start[lo]) % KVH);
    const int64_t t1 = len - t0 <= partition_len ? len : t0 + partition_len;
    float* partial = parts > 1 ? partials + w * partial_floats : NULL;
    /* and per common head_dim: a constant D lets the compiler unroll the vector loops of
     * dot and accumulate completely (1.17-1.20x, measured); any other is run as given */
#define ATTEND(kv)                                                        \
  switch (a->head_dim) {                                                  \
    case 64: attend(a, b, h, t0, t1, partial, 64, a->dtype, kv); break;   \
    case 128: attend(a, b, h, t0, t1, partial, 128, a->dtype, kv); break; \
    default: attend(a, b, h, t0, t1, partial, a->head_dim, a->dtype, kv); \
  }
    BY_DTYPE(a->kv_dtype == E4M3 || a->kv_dtype == E5M2 ? F32 : a->kv_dtype, ATTEND)
  }
  if (partials) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(a->num_threads)
    for (int64_t w = 0; w < a->n * KVH; w++) {   /* (sequence, kv head) */
      const int64_t i = w / KVH, parts = (start[i + 1] - start[i]) / KVH;
      if (parts > 1) {
#define MERGE(dt) merge(a, partials + start[i] * partial_floats, parts, a->seqs[i], (int)(w % KVH), dt)
        BY_DTYPE(a->dtype, MERGE)
      }
    }
  }
  free(partials);
  free(start);
  return OK;
}
