// =============================================================================
// kernels.cu — the CUDA half of nanopaged's paged-attention chapter
// =============================================================================
//
// Plain CUDA, no torch headers: build_ext.py compiles it next to a small C++
// binding that checks the tensors and calls the launch_* functions below.
//
// What paged attention computes
// -----------------------------
// The batch is flat: sequence b owns the query rows
// query_start_loc[b] .. query_start_loc[b+1] of q, and a context of
// seq_lens[b] tokens whose keys and values lie scattered over fixed-size
// blocks of the KV cache:
//
//     k_cache, v_cache : [num_blocks, block_size, num_kv_heads, head_dim]
//     context position t of sequence b  ->  block block_tables[b][t / block_size],
//                                           offset t % block_size
//
// The last q_len context positions are this step's own tokens, so query j of
// sequence b sits at position seq_len - q_len + j and attends causally to
// positions 0 ..= seq_len - q_len + j. Decode is q_len = 1; prefill and chunked
// prefill have q_len > 1 with part of the context (maybe none) already cached.
// With a sliding window W, the query at position p sees only p - W + 1 ..= p.
// With grouped-query attention, query head h reads kv head h / G, G = H / KVH.
//
// The algorithm: online softmax
// -----------------------------
// softmax(s) V seems to need every score s before the first exponent can be
// taken (to subtract the maximum). Online softmax instead keeps, per query row,
// a running maximum m, a running sum l = sum exp(s - m) and a running output
// acc = sum exp(s - m) v. When a new tile of keys raises the maximum to m', the
// old l and acc are rescaled by exp(m - m'). The answer is acc / l at the end.
// Two such states over disjoint sets of keys merge by the same rescaling, which
// lets us cut the keys anywhere: between lanes of a warp, between the warps of a
// thread block, and between thread blocks.
//
// The grid: who does what
// -----------------------
// One thread block (a CTA) owns one (query tile, kv head, key partition):
//  * a query tile is up to 8 "rows", each a (query token, query head) pair whose
//    head belongs to the CTA's kv head. Decode: the G heads of one GQA group for
//    one token; prefill: a few tokens times the group. Each K/V vector the CTA
//    loads serves all its rows, so a kv head is read once per group, not once
//    per query head. That matters: decode attention is bound by memory.
//  * a key partition is a contiguous range of context positions. A decode batch
//    of few long sequences has few (token, kv head) pairs — 1 sequence x 8 kv
//    heads is 8 CTAs for a GPU of 132 SMs — so long contexts are split into
//    partitions that separate CTAs process at once (split-K, "flash decoding").
//    Each CTA then writes its unnormalised state (m, l, acc) and a second small
//    kernel merges the partitions of every row. One partition needs no merge:
//    the CTA writes the final output itself. Partitions are counted from the
//    first key any query of the sequence sees (partition_origin): with a
//    sliding window, from the window's start, so a million-token context with a
//    4k window is cut into partitions of its window, not of its million keys.
// Inside a CTA, 4 warps take turns over tiles of consecutive keys. Inside a
// warp, one key row (head_dim elements, contiguous in memory) is spread over
// head_dim * sizeof(T) / 16 lanes, each loading one 16-byte vector; the other
// lanes of the warp take the next keys. Every lane keeps its own online-softmax
// state for the keys it saw; the states are merged at the end.
//
// Chapters: the interface (what build_ext.py calls) · storage types and
// 16-byte vectors · online softmax · the attention kernel · the partition merge
// · KV write and block copy · planning and launching.

#include <cuda_runtime_api.h>
#include <climits>
#include <cstdint>
#include <type_traits>

// -----------------------------------------------------------------------------
// The interface: the binding in build_ext.py includes this part alone
// (with NANOPAGED_INTERFACE_ONLY defined), so both sides share one declaration.
// -----------------------------------------------------------------------------

enum class KvDtype : int { kFloat32, kFloat16, kBFloat16 };

// Everything one paged-attention call reads and writes. Shapes: T tokens,
// B sequences, H query heads, KVH kv heads, D = head_dim, P partitions.
struct PagedAttentionArgs {
  void* out;                        // [T, H, D]
  const void* q;                    // [T, H, D], rows q_token_stride elements apart
  const void* k_cache;              // [num_blocks, block_size, KVH, D]
  const void* v_cache;              // [num_blocks, block_size, KVH, D]
  const int32_t* block_tables;      // [B, max_blocks_per_seq]; entries wholly before
                                    // every row's window may be -1 (dropped): never read
  const int32_t* seq_lens;          // [B], context length including this step's tokens
  const int32_t* query_start_loc;   // [B + 1]
  float* partial_out;               // [T, H, P, D]  split-K workspace (P > 1 only)
  float* partial_max;               // [T, H, P]
  float* partial_sum;               // [T, H, P]
  int64_t q_token_stride;           // H * D, or more when q is a view into a fused qkv
  int num_tokens, num_seqs, num_heads, num_kv_heads, head_dim;
  int block_size;                   // a power of two
  int max_blocks_per_seq;
  int window;                       // sliding window, in positions (0: none; the
                                    // kernels see INT_MAX, an endless one)
  float scale;                      // softmax scale, usually 1 / sqrt(D)
  KvDtype dtype;
};

// How a call is cut into CTAs; chosen on the host by plan_paged_attention.
struct AttentionPlan {
  int rows_per_cta;     // query rows per CTA: 1, 2, 4 or 8 (a template parameter)
  int heads_per_cta;    // query heads of one GQA group handled by one CTA
  int tokens_per_cta;   // query tokens handled by one CTA
  int head_chunks;      // CTAs that share one GQA group (group larger than 8)
  int num_tiles;        // grid.x: query tiles (see first_tile)
  int num_partitions;   // grid.z: key partitions
  int partition_size;   // keys per partition (the last one takes the rest)
};

bool paged_attention_supported(KvDtype dtype, int head_dim);

// partition_size = 0 picks one from the batch shape and num_sms; tests force
// small partitions to exercise the merge.
AttentionPlan plan_paged_attention(int num_tokens, int num_seqs, int num_heads,
                                   int num_kv_heads, int max_query_len,
                                   int max_seq_len, int window, int num_sms,
                                   int partition_size);

// Workspace (partial_*) must hold T * H * P * (D + 2) floats when P > 1.
cudaError_t launch_paged_attention(const PagedAttentionArgs& args,
                                   const AttentionPlan& plan,
                                   cudaStream_t stream);

// Copies token i's k and v rows (bytes_per_token each, starting every
// k_stride / v_stride bytes) into slot slot_mapping[i] of the caches; slots < 0
// (padding) are skipped. All sizes are multiples of 16 bytes.
cudaError_t launch_write_kv(void* k_cache, void* v_cache, const void* k,
                            const void* v, const int64_t* slot_mapping,
                            int num_tokens, int64_t num_slots, int64_t bytes_per_token,
                            int64_t k_stride, int64_t v_stride, cudaStream_t stream);

// Copies block src_dst[i][0] onto block src_dst[i][1] (copy-on-write).
cudaError_t launch_copy_blocks(void* cache, const int64_t* src_dst,
                               int num_pairs, int64_t num_blocks,
                               int64_t bytes_per_block, cudaStream_t stream);

#ifndef NANOPAGED_INTERFACE_ONLY

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace {

constexpr int kWarp = 32;
constexpr int kNumWarps = 4;                      // warps per attention CTA
constexpr int kNumThreads = kNumWarps * kWarp;
constexpr int kMaxRows = 8;                       // query rows per CTA, at most
constexpr int kNoRow = -1;                        // the causal limit of a row slot with no row
constexpr unsigned kFullMask = 0xffffffffu;       // every lane joins a shuffle
constexpr float kLog2e = 1.4426950408889634f;

// -----------------------------------------------------------------------------
// Storage types and 16-byte vectors
// -----------------------------------------------------------------------------
// All global loads of q, K and V are 16 bytes per lane (one LDG.128): 4 floats
// or 8 halves. The binding checks that every tensor is 16-byte aligned, and a
// row of D elements is a multiple of 16 bytes for every supported head_dim.
// Values are widened to float32 right after the load; all arithmetic is float32.

template <typename T> struct Storage;

template <> struct Storage<float> {
  static constexpr int kVec = 4;
  __device__ static void unpack(const uint4& raw, float (&x)[kVec]) {
    x[0] = __uint_as_float(raw.x); x[1] = __uint_as_float(raw.y);
    x[2] = __uint_as_float(raw.z); x[3] = __uint_as_float(raw.w);
  }
  __device__ static float round(float x) { return x; }
};

template <> struct Storage<__half> {
  static constexpr int kVec = 8;
  __device__ static void unpack(const uint4& raw, float (&x)[kVec]) {
    const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // element 2i is the low half (little endian)
      x[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(words[i] & 0xffffu)));
      x[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(words[i] >> 16)));
    }
  }
  __device__ static __half round(float x) { return __float2half_rn(x); }
};

template <> struct Storage<__nv_bfloat16> {
  static constexpr int kVec = 8;
  __device__ static void unpack(const uint4& raw, float (&x)[kVec]) {
    const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // a bfloat16 is the top half of a float32
      x[2 * i] = __uint_as_float(words[i] << 16);
      x[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
  }
  __device__ static __nv_bfloat16 round(float x) { return __float2bfloat16_rn(x); }
};

// A read-only 16-byte load through the non-coherent (texture) path
// (ld.global.nc.v4): this kernel never writes q or the caches.
__device__ __forceinline__ uint4 load16(const void* p) {
  return __ldg(static_cast<const uint4*>(p));
}

// -----------------------------------------------------------------------------
// Online softmax
// -----------------------------------------------------------------------------
// Scores are kept in base 2: q is multiplied once by scale * log2(e), so
// exp(s - m) becomes 2^(s' - m'): one instruction of the hardware (fast_exp2).
//
// A row that has seen no key yet has m = -inf. Subtracting -inf from -inf is
// NaN, so every rescale subtracts `safe_max(m)`, which is 0 for -inf: then
// exp2(-inf - 0) = 0 wipes the empty state (l = 0, acc = 0 stay 0) and a masked
// score s = -inf contributes exp2(-inf) = 0. No NaN can appear.
__device__ __forceinline__ float safe_max(float m) { return m == -INFINITY ? 0.f : m; }

// 2^x with the hardware's approximate ex2 alone. exp2f adds a few instructions to
// keep results below 2^-126 exact; probabilities that small vanish next to the
// row's largest, which is 1. (The emulator has no PTX: it calls exp2f.)
__device__ __forceinline__ float fast_exp2(float x) {
#ifdef __CUDA_ARCH__
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}

// Query tiles of tokens_per_cta tokens must not straddle two sequences, so
// sequence b's tiles start at tile (query_start_loc[b] + b * (QT - 1)) / QT:
// numbered as if every sequence before b had QT - 1 extra tokens, room for its
// last, partial tile. A few tiles fall between sequences and exit at once; the
// grid needs (T + B * (QT - 1)) / QT tiles, exactly T for decode (QT = 1).
__host__ __device__ inline int first_tile(int query_start, int seq, int tokens_per_cta) {
  return (query_start + seq * (tokens_per_cta - 1)) / tokens_per_cta;
}

// Where a sequence's partitions begin: the first key its first query sees,
// key 0 without a window (INT_MAX), its window's start with one. Every later
// query sees from there on or later, so partition p of the sequence covers keys
// origin + p * partition_size onwards. The attention kernel and the merge both
// call this, and cap a row's keys at the block table as each other does.
__device__ __forceinline__ int partition_origin(int cached, int table_keys, int window) {
  const int first_limit = max(min(cached + 1, table_keys), 0);  // keys query 0 sees end here
  return first_limit > window ? first_limit - window : 0;
}

// Largest b in [0, num_seqs) with first_of(b) <= x, for a non-decreasing
// first_of: which sequence a query token (or query tile) belongs to.
template <typename FirstOf>
__device__ int find_sequence(int num_seqs, int x, FirstOf first_of) {
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (first_of(mid) <= x) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// -----------------------------------------------------------------------------
// The attention kernel: one CTA per (query tile, kv head, key partition)
// -----------------------------------------------------------------------------
// Decode-sized CTAs (up to 4 rows) are bound by memory bandwidth: ask the
// compiler to fit 4 of them (16 warps, <= 128 registers a thread) on an SM so
// that more loads are in flight. 8-row prefill CTAs need the registers more.
constexpr int min_ctas_per_sm(int rows) { return rows <= 4 ? 4 : 1; }

template <typename T, int D, int ROWS>
__global__ void __launch_bounds__(kNumThreads, min_ctas_per_sm(ROWS))
paged_attention_kernel(const PagedAttentionArgs a, const AttentionPlan plan) {
  using S = Storage<T>;
  constexpr int VEC = S::kVec;                         // elements per 16-byte vector
  constexpr int LANES_PER_KEY = D / VEC;               // lanes sharing one key row
  constexpr int KEYS_PER_STEP = kWarp / LANES_PER_KEY; // keys a warp reads at once
  // Keys per lane per tile: all of a tile's loads are issued before any is
  // used, so more of them are in flight. Fewer rows leave registers for more.
  constexpr int UNROLL = ROWS == 1 ? 8 : ROWS <= 4 ? 4 : 2;
  constexpr int TILE = KEYS_PER_STEP * UNROLL;         // keys per warp per tile
  static_assert(D % VEC == 0 && kWarp % LANES_PER_KEY == 0, "head_dim must fit a warp");
  static_assert(D <= kNumThreads, "the epilogue gives each thread one element");

  const int warp = threadIdx.x / kWarp;
  const int lane = threadIdx.x % kWarp;
  const int key_in_step = lane / LANES_PER_KEY;  // which key of a step this lane reads
  const int chunk = lane % LANES_PER_KEY;        // which 16 bytes of the key row

  // --- 1. which sequence, query rows and keys this CTA owns -----------------
  const int QT = plan.tokens_per_cta, GH = plan.heads_per_cta;
  const int seq = find_sequence(a.num_seqs, blockIdx.x, [&](int b) {
    return first_tile(__ldg(a.query_start_loc + b), b, QT);
  });
  const int q_start = __ldg(a.query_start_loc + seq);
  const int q_len = __ldg(a.query_start_loc + seq + 1) - q_start;
  const int tok0 = (blockIdx.x - first_tile(q_start, seq, QT)) * QT;  // first query of the tile
  if (tok0 >= q_len) return;  // a spare tile between two sequences

  const int group = a.num_heads / a.num_kv_heads;             // G
  const int kv_head = blockIdx.y / plan.head_chunks;
  const int head0 = kv_head * group + (blockIdx.y % plan.head_chunks) * GH;
  const int head_end = (kv_head + 1) * group;                 // this group's heads
  const int cached = __ldg(a.seq_lens + seq) - q_len;         // context before this step
  // The binding cannot read seq_lens and query_start_loc (they live on the GPU), so
  // metadata that contradicts the tensors is made harmless here, for free: a row
  // outside q is no row, and no key lies past the end of the block table.
  const int table_keys = a.max_blocks_per_seq * a.block_size;

  // Row r is query token tok0 + r / GH, query head head0 + r % GH. Each row has
  // its own causal limit: keys t < limit[r] are visible to it (kNoRow: no row),
  // and of those only t >= limit[r] - window. (No window is an endless one,
  // INT_MAX: limit - INT_MAX does not overflow, as limit >= -1.) A row with
  // limit 0 sees no key — only metadata where seq_len < q_len gives one — and
  // its output is 0 / 0 = NaN, as the torch reference's.
  // q is loaded once, pre-multiplied by scale * log2(e) (see online softmax).
  const float q_scale = a.scale * kLog2e;
  float q[ROWS][VEC];
  int limit[ROWS];
  int cta_limit = 0;           // keys any row of the CTA may see end here,
  int cta_first = table_keys;  // and begin here;
  int window_end = 0;          // below this, some row's window may hide a key
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const int j = tok0 + r / GH, head = head0 + r % GH;
    const bool valid = r < QT * GH && j < q_len && head < head_end &&
                       q_start + j >= 0 && q_start + j < a.num_tokens;
    limit[r] = valid ? max(min(cached + j + 1, table_keys), 0) : kNoRow;
    cta_limit = max(cta_limit, limit[r]);
    if (valid) {
      cta_first = min(cta_first, max(limit[r] - a.window, 0));
      window_end = max(window_end, limit[r] - a.window);
    }
    uint4 raw = make_uint4(0, 0, 0, 0);
    if (valid)
      raw = load16(static_cast<const T*>(a.q) + (q_start + j) * a.q_token_stride +
                   head * D + chunk * VEC);
    S::unpack(raw, q[r]);
#pragma unroll
    for (int i = 0; i < VEC; ++i) q[r][i] *= q_scale;
  }

  cta_first = min(cta_first, cta_limit);  // (a CTA with no row: an empty range)

  // This partition's keys, counted from the sequence's origin (every row's
  // window begins there or later). In int64 until capped: origin + a whole
  // context of partitions may pass INT_MAX.
  const int partition = blockIdx.z;
  const int64_t begin = partition_origin(cached, table_keys, a.window) +
                        (int64_t)partition * plan.partition_size;
  const int key_begin = (int)min(begin, (int64_t)cta_limit);
  const int key_end = partition == plan.num_partitions - 1
                          ? cta_limit  // the last partition takes all the rest
                          : (int)min(begin + plan.partition_size, (int64_t)cta_limit);
  // Every row ends before this partition, or every row's window begins after
  // it: nothing to do, nothing the merge will read. (Partition 0 goes on to
  // write its rows even when they see no key at all: NaN, see above.)
  if ((key_begin >= cta_limit || key_end <= cta_first) && partition > 0) return;

  // --- 2. stream the partition's keys through online softmax ---------------
  // Paging: position t lives in block table[t >> block_shift] at offset
  // t & (block_size - 1). Offsets are int64: a pool of more than 2^31
  // elements (e.g. 70k blocks x 32 x 8 kv heads x 128) is a few GB of memory.
  const int block_shift = __ffs(a.block_size) - 1;
  const int64_t token_stride = (int64_t)a.num_kv_heads * D;  // one position, all kv heads
  const int64_t block_stride = token_stride * a.block_size;
  const int32_t* table = a.block_tables + (int64_t)seq * a.max_blocks_per_seq;
  const T* k_base = static_cast<const T*>(a.k_cache) + kv_head * D + chunk * VEC;
  const T* v_base = static_cast<const T*>(a.v_cache) + kv_head * D + chunk * VEC;

  float m[ROWS], l[ROWS], acc[ROWS][VEC];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[r][i] = 0.f;
  }

  // One tile of keys through online softmax. `masked` is a compile-time bool
  // (std::true_type or std::false_type): most tiles lie wholly inside the
  // partition, below every row's causal limit and inside every row's window,
  // and for those the bounds
  // checks and the mask are compiled out — a sixth of the loop's instructions,
  // in a loop that must keep pace with the memory system.
  auto tile_step = [&](int tile0, auto masked) {
    constexpr bool MASKED = decltype(masked)::value;
    // 2a. Issue every load of the tile first. Keys at or beyond key_end are
    // never loaded — not even their block-table entry, which may be padding —
    // and stand in as zeros: the cache slots past a sequence's end may hold
    // anything, NaN included, and 0 * NaN would poison the accumulator.
    uint4 k_raw[UNROLL], v_raw[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int t = tile0 + u * KEYS_PER_STEP + key_in_step;
      k_raw[u] = v_raw[u] = make_uint4(0, 0, 0, 0);
      if (!MASKED || t < key_end) {
        const int64_t offset = (int64_t)__ldg(table + (t >> block_shift)) * block_stride +
                               (t & (a.block_size - 1)) * token_stride;
        k_raw[u] = load16(k_base + offset);
        v_raw[u] = load16(v_base + offset);
      }
    }

    // 2b. Scores. Each lane dots its 16 bytes of the key with the same 16
    // bytes of every query row, then the LANES_PER_KEY lanes of the key add up
    // their partial sums with a butterfly of xor-shuffles (log2 steps; the xor
    // partner never leaves the aligned group, and every lane gets the total).
    float s[UNROLL][ROWS];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float k[VEC];
      S::unpack(k_raw[u], k);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < VEC; ++i) dot = fmaf(q[r][i], k[i], dot);
#pragma unroll
        for (int offset = LANES_PER_KEY / 2; offset > 0; offset /= 2)
          dot += __shfl_xor_sync(kFullMask, dot, offset);
        const int t = tile0 + u * KEYS_PER_STEP + key_in_step;
        // limit - window <= t < limit (causal, inside the window), in one unsigned
        // comparison: t >= limit wraps around to a huge number.
        const bool visible = t < key_end && (unsigned)(limit[r] - 1 - t) < (unsigned)a.window;
        s[u][r] = (!MASKED || visible) ? dot : -INFINITY;
      }
    }

    // 2c. Online softmax: one rescale per tile, not per key.
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      float tile_max = s[0][r];
#pragma unroll
      for (int u = 1; u < UNROLL; ++u) tile_max = fmaxf(tile_max, s[u][r]);
      const float m_new = fmaxf(m[r], tile_max);
      const float base = safe_max(m_new);
      const float rescale = fast_exp2(m[r] - base);
      l[r] *= rescale;
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[r][i] *= rescale;
      m[r] = m_new;
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) s[u][r] = fast_exp2(s[u][r] - base);  // now p
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      float v[VEC];
      S::unpack(v_raw[u], v);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        l[r] += s[u][r];
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[r][i] = fmaf(s[u][r], v[i], acc[r][i]);
      }
    }
  };

  // The keys begin at the partition's start or the first any row's window
  // shows, whichever is later. Tiles from `window_end` up to `unmasked_end` hold
  // no key any row must not see. (A row that is no row may see them all: it is
  // never written.) The loop conditions depend on the warp only, so all 32
  // lanes run the same iterations: the shuffles need every lane of the warp.
  int unmasked_end = key_end;
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
    if (limit[r] != kNoRow) unmasked_end = min(unmasked_end, limit[r]);
  int tile0 = max(key_begin, cta_first) + warp * TILE;
  for (; tile0 < window_end && tile0 < key_end; tile0 += kNumWarps * TILE)
    tile_step(tile0, std::true_type{});
  for (; tile0 + TILE <= unmasked_end; tile0 += kNumWarps * TILE) tile_step(tile0, std::false_type{});
  for (; tile0 < key_end; tile0 += kNumWarps * TILE) tile_step(tile0, std::true_type{});

  // --- 3. merge the lanes' states, then the warps' states ------------------
  // Lanes that read the same 16-byte chunk of different keys hold states over
  // disjoint keys: merge them with xor-shuffles across the key groups.
#pragma unroll
  for (int offset = LANES_PER_KEY; offset < kWarp; offset *= 2) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const float m_other = __shfl_xor_sync(kFullMask, m[r], offset);
      const float l_other = __shfl_xor_sync(kFullMask, l[r], offset);
      const float m_new = fmaxf(m[r], m_other);
      const float mine = exp2f(m[r] - safe_max(m_new));
      const float theirs = exp2f(m_other - safe_max(m_new));
      l[r] = l[r] * mine + l_other * theirs;
#pragma unroll
      for (int i = 0; i < VEC; ++i)
        acc[r][i] = acc[r][i] * mine + __shfl_xor_sync(kFullMask, acc[r][i], offset) * theirs;
      m[r] = m_new;
    }
  }

  __shared__ float s_max[kNumWarps][ROWS];
  __shared__ float s_sum[kNumWarps][ROWS];
  __shared__ float s_acc[kNumWarps][ROWS][D];
  if (key_in_step == 0) {  // lanes 0 .. LANES_PER_KEY-1 now hold the warp's state
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
      for (int i = 0; i < VEC; ++i) s_acc[warp][r][chunk * VEC + i] = acc[r][i];
      if (chunk == 0) {
        s_max[warp][r] = m[r];
        s_sum[warp][r] = l[r];
      }
    }
  }
  __syncthreads();

  // --- 4. epilogue: thread d merges the warps for element d of every row ----
  const int d = threadIdx.x;
  if (d >= D) return;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    if (limit[r] == kNoRow) continue;  // past the tile or the group
    float row_max = -INFINITY;
#pragma unroll
    for (int w = 0; w < kNumWarps; ++w) row_max = fmaxf(row_max, s_max[w][r]);
    float row_sum = 0.f, row_acc = 0.f;
#pragma unroll
    for (int w = 0; w < kNumWarps; ++w) {
      const float weight = exp2f(s_max[w][r] - safe_max(row_max));
      row_sum += s_sum[w][r] * weight;
      row_acc += s_acc[w][r][d] * weight;
    }
    const int64_t row = (int64_t)(q_start + tok0 + r / GH) * a.num_heads + head0 + r % GH;
    if (plan.num_partitions == 1) {
      // The whole context was ours: normalise and store the answer.
      static_cast<T*>(a.out)[row * D + d] = S::round(row_acc / row_sum);
    } else {
      // Leave the unnormalised state for the merge kernel. (A row whose keys
      // all lie before this partition, or whose window begins after it, stores
      // m = -inf, l = 0; the merge never reads it.)
      const int64_t slot = row * plan.num_partitions + partition;
      a.partial_out[slot * D + d] = row_acc;
      if (d == 0) {
        a.partial_max[slot] = row_max;
        a.partial_sum[slot] = row_sum;
      }
    }
  }
}

// -----------------------------------------------------------------------------
// The partition merge: one CTA per (token, query head) row, one thread per
// element of head_dim. Every thread recomputes the partition weights — a few
// dozen MUFU ops — which is cheaper than sharing them through shared memory.
// -----------------------------------------------------------------------------
template <typename T>
__global__ void merge_partitions_kernel(const PagedAttentionArgs a, const AttentionPlan plan) {
  const int64_t row = blockIdx.x;                 // token * H + head
  const int token = (int)(row / a.num_heads);
  const int d = threadIdx.x;
  const int seq = find_sequence(a.num_seqs, token, [&](int b) {
    return __ldg(a.query_start_loc + b);
  });
  const int q_start = __ldg(a.query_start_loc + seq);
  const int q_len = __ldg(a.query_start_loc + seq + 1) - q_start;
  const int cached = __ldg(a.seq_lens + seq) - q_len;
  const int table_keys = a.max_blocks_per_seq * a.block_size;
  const int keys = min(cached + (token - q_start) + 1, table_keys);  // causal, capped as there
  // Read only the partitions that hold some of this row's keys (the others may
  // not have been written): from the one where its window begins to the one
  // where its keys end, counted from the sequence's origin. (The last partition
  // takes every key past the others: with a max_seq_len or max_query_len
  // shorter than the batch's, `first` may lie beyond it.)
  const int P = plan.num_partitions;
  const int ahead = keys - partition_origin(cached, table_keys, a.window);  // keys from the origin
  const int64_t touched = ((int64_t)ahead + plan.partition_size - 1) / plan.partition_size;
  const int used = touched < P ? (int)touched : P;
  const int first = ahead > a.window ? min((ahead - a.window) / plan.partition_size, max(used - 1, 0)) : 0;

  const float* part_max = a.partial_max + row * P;
  const float* part_sum = a.partial_sum + row * P;
  const float* part_out = a.partial_out + row * P * a.head_dim + d;
  // The loops are unrolled so that the loads of 8 partitions are in flight at
  // once: a decode of one long sequence has a hundred partitions or more.
  float row_max = -INFINITY;
#pragma unroll 8
  for (int p = first; p < used; ++p) row_max = fmaxf(row_max, part_max[p]);
  float row_sum = 0.f, row_acc = 0.f;
#pragma unroll 8
  for (int p = first; p < used; ++p) {
    const float weight = exp2f(part_max[p] - row_max);
    row_sum += part_sum[p] * weight;
    row_acc += part_out[(int64_t)p * a.head_dim] * weight;
  }
  static_cast<T*>(a.out)[row * a.head_dim + d] = Storage<T>::round(row_acc / row_sum);
}

// -----------------------------------------------------------------------------
// KV write and block copy: byte copies in 16-byte vectors
// -----------------------------------------------------------------------------
// One CTA per token; sizes and strides in 16-byte vectors.
__global__ void write_kv_kernel(uint4* k_cache, uint4* v_cache, const uint4* k, const uint4* v,
                                const int64_t* slot_mapping, int64_t num_slots,
                                int vecs_per_token, int64_t k_stride, int64_t v_stride) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  // slot < 0 marks padding; a slot past the pool would write out of bounds.
  if (slot < 0 || slot >= num_slots) return;
  const int64_t dst = slot * vecs_per_token;
  for (int i = threadIdx.x; i < vecs_per_token; i += blockDim.x) {
    k_cache[dst + i] = k[token * k_stride + i];
    v_cache[dst + i] = v[token * v_stride + i];
  }
}

// One CTA per (src, dst) pair, in no set order: no block may be both a source and
// a destination of one call (PagedAttention.copy_blocks launches such pairs apart).
__global__ void copy_blocks_kernel(uint4* cache, const int64_t* src_dst, int64_t num_blocks,
                                   int vecs_per_block) {
  const int64_t src = src_dst[2 * blockIdx.x], dst = src_dst[2 * blockIdx.x + 1];
  if (src < 0 || src >= num_blocks || dst < 0 || dst >= num_blocks) return;
  for (int i = threadIdx.x; i < vecs_per_block; i += blockDim.x)
    cache[dst * vecs_per_block + i] = cache[src * vecs_per_block + i];
}

// -----------------------------------------------------------------------------
// Planning and launching (host code)
// -----------------------------------------------------------------------------
constexpr int kMinPartitionKeys = 256;  // below this a partition's overhead shows
constexpr int kTargetCtasPerSm = 16;    // split until the grid is a few waves deep
constexpr int kPartitionAlign = 128;   // keys a CTA covers per round of tiles: at most 4 warps x 32

int ceil_div(int64_t x, int64_t y) { return (int)((x + y - 1) / y); }

template <typename T, int D, int ROWS>
void launch_attention(const PagedAttentionArgs& a, const AttentionPlan& plan, cudaStream_t stream) {
  const dim3 grid(plan.num_tiles, a.num_kv_heads * plan.head_chunks, plan.num_partitions);
  paged_attention_kernel<T, D, ROWS><<<grid, kNumThreads, 0, stream>>>(a, plan);
  if (plan.num_partitions > 1)
    merge_partitions_kernel<T><<<a.num_tokens * a.num_heads, D, 0, stream>>>(a, plan);
}

template <typename T, int D>
void launch_for_rows(const PagedAttentionArgs& a, const AttentionPlan& plan, cudaStream_t stream) {
  switch (plan.rows_per_cta) {
    case 1: launch_attention<T, D, 1>(a, plan, stream); break;
    case 2: launch_attention<T, D, 2>(a, plan, stream); break;
    case 4: launch_attention<T, D, 4>(a, plan, stream); break;
    default: launch_attention<T, D, kMaxRows>(a, plan, stream); break;
  }
}

template <typename T>
void launch_for_head_dim(const PagedAttentionArgs& a, const AttentionPlan& plan, cudaStream_t stream) {
  if (a.head_dim == 64) launch_for_rows<T, 64>(a, plan, stream);
  else launch_for_rows<T, 128>(a, plan, stream);
}

}  // namespace

bool paged_attention_supported(KvDtype dtype, int head_dim) {
  return (head_dim == 64 || head_dim == 128) &&
         (dtype == KvDtype::kFloat32 || dtype == KvDtype::kFloat16 ||
          dtype == KvDtype::kBFloat16);
}

AttentionPlan plan_paged_attention(int num_tokens, int num_seqs, int num_heads,
                                   int num_kv_heads, int max_query_len,
                                   int max_seq_len, int window, int num_sms,
                                   int partition_size) {
  AttentionPlan plan;
  const int group = num_heads / num_kv_heads;
  // Decode reads K/V once for the whole group: as many rows as the group has
  // (rounded up to a power of two). Prefill fills all 8 rows with more tokens.
  int rows = kMaxRows;
  if (max_query_len <= 1) {
    rows = 1;
    while (rows < group && rows < kMaxRows) rows *= 2;
  }
  plan.rows_per_cta = rows;
  plan.heads_per_cta = group < rows ? group : rows;
  plan.tokens_per_cta = rows / plan.heads_per_cta;
  plan.head_chunks = ceil_div(group, plan.heads_per_cta);
  plan.num_tiles = first_tile(num_tokens, num_seqs, plan.tokens_per_cta);
  const int busy_tiles = ceil_div(num_tokens, plan.tokens_per_cta);

  // The keys a sequence's partitions cover, from its origin (partition_origin):
  // the whole context, or with a sliding window at most window + max_query_len
  // - 1 (the first query's window to the last query). Metadata that says less
  // than the batch holds costs time, not answers: the last partition takes
  // every key past the others.
  const int seq_len = max_seq_len > 1 ? max_seq_len : 1;
  const int queries = max_query_len > 1 ? max_query_len : 1;
  int span = seq_len;
  if (window > 0 && (int64_t)window + queries - 1 < span) span = window + queries - 1;
  if (partition_size <= 0) {
    // Split only as far as needed to give every SM several CTAs, and never
    // into partitions shorter than kMinPartitionKeys.
    const int64_t busy_ctas = (int64_t)busy_tiles * num_kv_heads * plan.head_chunks;
    int parts = ceil_div((int64_t)kTargetCtasPerSm * num_sms, busy_ctas > 0 ? busy_ctas : 1);
    const int by_length = ceil_div(span, kMinPartitionKeys);
    if (parts > by_length) parts = by_length;
    if (parts < 1) parts = 1;
    partition_size = parts == 1 ? span : ceil_div(ceil_div(span, parts), kPartitionAlign) * kPartitionAlign;
  }
  // More keys than the span is one partition.
  if (partition_size > span) partition_size = span;
  // grid.z is at most 65535.
  if (ceil_div(span, partition_size) > 65535) partition_size = ceil_div(span, 65535);
  plan.partition_size = partition_size;
  plan.num_partitions = ceil_div(span, partition_size);
  return plan;
}

cudaError_t launch_paged_attention(const PagedAttentionArgs& args, const AttentionPlan& plan,
                                   cudaStream_t stream) {
  PagedAttentionArgs a = args;
  if (a.window <= 0) a.window = INT_MAX;  // no window: one longer than any context
  if (!paged_attention_supported(a.dtype, a.head_dim) || a.block_size <= 0 ||
      (a.block_size & (a.block_size - 1)) != 0)
    return cudaErrorInvalidValue;
  if (a.num_tokens == 0) return cudaSuccess;
  switch (a.dtype) {
    case KvDtype::kFloat32: launch_for_head_dim<float>(a, plan, stream); break;
    case KvDtype::kFloat16: launch_for_head_dim<__half>(a, plan, stream); break;
    case KvDtype::kBFloat16: launch_for_head_dim<__nv_bfloat16>(a, plan, stream); break;
  }
  return cudaGetLastError();
}

cudaError_t launch_write_kv(void* k_cache, void* v_cache, const void* k, const void* v,
                            const int64_t* slot_mapping, int num_tokens, int64_t num_slots,
                            int64_t bytes_per_token, int64_t k_stride, int64_t v_stride,
                            cudaStream_t stream) {
  if (bytes_per_token % 16 != 0 || k_stride % 16 != 0 || v_stride % 16 != 0)
    return cudaErrorInvalidValue;
  if (num_tokens == 0) return cudaSuccess;
  write_kv_kernel<<<num_tokens, 128, 0, stream>>>(
      static_cast<uint4*>(k_cache), static_cast<uint4*>(v_cache), static_cast<const uint4*>(k),
      static_cast<const uint4*>(v), slot_mapping, num_slots, (int)(bytes_per_token / 16),
      k_stride / 16, v_stride / 16);
  return cudaGetLastError();
}

cudaError_t launch_copy_blocks(void* cache, const int64_t* src_dst, int num_pairs,
                               int64_t num_blocks, int64_t bytes_per_block, cudaStream_t stream) {
  if (bytes_per_block % 16 != 0) return cudaErrorInvalidValue;
  if (num_pairs == 0) return cudaSuccess;
  copy_blocks_kernel<<<num_pairs, 256, 0, stream>>>(static_cast<uint4*>(cache), src_dst,
                                                    num_blocks, (int)(bytes_per_block / 16));
  return cudaGetLastError();
}

#endif  // NANOPAGED_INTERFACE_ONLY
