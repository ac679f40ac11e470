"""build_ext.py — turn kernels.cu (and kernels_cpu.c) into ops, or say in one line why not.

    ops = load_kernels()            # the compiled module, or None
    if ops is None: print(unavailable_reason())
    out = ops.paged_attention(q, k_cache, v_cache, block_tables, seq_lens,
                              query_start_loc, scale, max_query_len, max_seq_len,
                              window=0,           # 0: no sliding window
                              partition_size=0)   # 0: the planner picks the split-K cut
    ops.describe_plan(...)          # how a call would be cut into CTAs (tests, bench)
    ops.write_kv(k, v, k_cache, v_cache, slot_mapping)
    ops.copy_blocks(cache, src_dst)

kernels.cu is plain CUDA (raw pointers, no torch headers). The small C++ binding
below checks every tensor — device, dtype, shape, contiguity, alignment — with a
message that names it, then calls the kernels on torch's current CUDA stream.
Values on the GPU it does not read (that would cost a sync per call): seq_lens and
query_start_loc that contradict the tensors are made harmless in the kernel, but block
ids are trusted to lie in [0, num_blocks), as the engine's BlockPool hands them out (but
for the entries wholly before every query's sliding window, which may be -1, dropped:
the kernel never reads those).
torch.utils.cpp_extension.load() compiles both with ninja (kernels.cu with nvcc, the
binding with the host C++ compiler) and caches the result under
~/.cache/nanopaged/kernels (or $NANOPAGED_CACHE/kernels); it rebuilds only when a source
or flag changes.

    python build_ext.py --check   # nvcc-only compile for sm_80 and sm_90, warnings
                                  # as errors, a registers/smem/spills table; the
                                  # binding: under a CUDA build of torch the real
                                  # extension is built, linked and imported once nvcc
                                  # passed, else the binding is syntax-checked beside
                                  # the compiles. No GPU needed (CI runs it under both
                                  # torch builds)
    python build_ext.py --build   # build and load the extension, timed

load_kernels(emulate=True) builds the same kernels.cu and binding for the CPU
emulator (see EMULATOR below): CPU tensors, no GPU, slow but exact — the tests
run the kernels that way on every CI run.

kernels_cpu.c, the CPU's decode kernel, is built apart, with the system's C compiler
(no torch headers: a few seconds), and called through ctypes:

    kernel = load_cpu_kernels()     # CpuKernels, or None: cpu_unavailable_reason()
    kernel.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                            seqs, scale, out, window=None, softcap=None)

--check compiles it too, with warnings as errors.
"""

import concurrent.futures
import contextlib
import ctypes
import hashlib
import importlib
import math
import numbers
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
KERNELS = HERE / "kernels.cu"

# Must match paged_attention_supported() in kernels.cu (the binding re-checks).
SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")   # torch dtype names; KvDtype in kernels.cu
CHECK_ARCHS = ("80", "90")  # Ampere (A100) and Hopper (H100/H200)

# The half/bfloat16 macros torch's cpp_extension defines for nvcc: kernels.cu must build
# under them. (It also passes --expt-relaxed-constexpr, which --check leaves out: stricter.)
TORCH_NVCC_DEFINES = ["-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                      "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__"]

# ----------------------------------------------------------------------------
# the C++ binding
# ----------------------------------------------------------------------------
BINDING = r"""
#include <torch/extension.h>
#ifndef NANOPAGED_EMULATE
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <cstdint>
#include <mutex>
#include <unordered_map>

// kernels.cu's interface part: the launch functions and their argument structs.
#define NANOPAGED_INTERFACE_ONLY
#include "kernels.cu"

namespace {

KvDtype kv_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return KvDtype::kFloat32;
    case at::kHalf: return KvDtype::kFloat16;
    case at::kBFloat16: return KvDtype::kBFloat16;
    default:
      TORCH_CHECK_TYPE(false, name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

// Every tensor argument: on `device`, of `dtype`, with `dim` dimensions, contiguous.
void check(const at::Tensor& t, const char* name, const at::Device& device,
           at::ScalarType dtype, int64_t dim) {
  TORCH_CHECK_VALUE(t.device() == device, name, " must be on ", device, ", got ", t.device());
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == dim, name, " must have ", dim, " dimensions, got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.is_contiguous(), name, " must be contiguous (call .contiguous()), got shape ",
                    t.sizes(), " with strides ", t.strides());
}

// The kernels move data in 16-byte vectors.
void check_aligned(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0, name,
                    " must start at a 16-byte aligned address (the kernels use 16-byte loads); "
                    "it is a view at an offset: pass a fresh tensor or .clone() it");
}

// q, k, v: [T, heads, D]. Each token's [heads, D] must be contiguous; the tokens
// may be strided, so a view into a fused qkv projection needs no copy.
void check_rows(const at::Tensor& t, const char* name, const at::Device& device, at::ScalarType dtype) {
  TORCH_CHECK_VALUE(t.device() == device, name, " must be on ", device, ", got ", t.device());
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 3, name, " must be [tokens, heads, head_dim], got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.stride(2) == 1 && (t.size(1) == 1 || t.stride(1) == t.size(2)), name,
                    " must have contiguous [heads, head_dim] rows, got shape ", t.sizes(),
                    " with strides ", t.strides(), " (call .contiguous())");
  TORCH_CHECK_VALUE(t.size(0) <= 1 || (t.stride(0) * t.element_size()) % 16 == 0, name,
                    "'s tokens must start a multiple of 16 bytes apart, got strides ", t.strides());
  check_aligned(t, name);
}

// Elements from one token's row to the next.
int64_t token_stride(const at::Tensor& t) { return t.size(0) > 1 ? t.stride(0) : t.size(1) * t.size(2); }

void check_size(const at::Tensor& t, const char* name, int64_t dim, int64_t expected, const char* what) {
  TORCH_CHECK_VALUE(t.size(dim) == expected, name, " has shape ", t.sizes(), " but dimension ", dim,
                    " should be ", expected, " (", what, ")");
}

// Where the kernels run. On a GPU: CUDA tensors, torch's current stream, and the
// planner spreads work over all SMs (asked of the driver once per device). Built
// with NANOPAGED_EMULATE (load_kernels(emulate=True)): the same kernels run on
// CPU fibers over CPU tensors (see EMULATOR), planned as for a 132-SM H100/H200.
#ifndef NANOPAGED_EMULATE
constexpr const char* kKernelDevice = "CUDA";
bool on_kernel_device(const at::Tensor& t) { return t.is_cuda(); }
cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream(); }
int current_device() { return c10::cuda::current_device(); }
using DeviceGuard = c10::cuda::OptionalCUDAGuard;

int sm_count(int device) {
  static std::mutex mutex;
  static std::unordered_map<int, int> counts;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = counts.find(device);
  if (it != counts.end()) return it->second;
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  counts[device] = count;
  return count;
}
#else
constexpr const char* kKernelDevice = "CPU";
bool on_kernel_device(const at::Tensor& t) { return t.is_cpu(); }
cudaStream_t current_stream() { return nullptr; }
int current_device() { return 0; }
struct DeviceGuard { explicit DeviceGuard(const at::Device&) {} };
int sm_count(int) { return 132; }
#endif

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, " failed to launch: ", cudaGetErrorString(err));
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, double scale, int64_t max_query_len,
                           int64_t max_seq_len, int64_t window, int64_t partition_size) {
  TORCH_CHECK_VALUE(on_kernel_device(q), "q must be a ", kKernelDevice, " tensor, got one on ", q.device());
  const auto device = q.device();
  const KvDtype dtype = kv_dtype(q, "q");
  check_rows(q, "q", device, q.scalar_type());
  check(k_cache, "k_cache", device, q.scalar_type(), 4);
  check(v_cache, "v_cache", device, q.scalar_type(), 4);
  check(block_tables, "block_tables", device, at::kInt, 2);
  check(seq_lens, "seq_lens", device, at::kInt, 1);
  check(query_start_loc, "query_start_loc", device, at::kInt, 1);
  check_aligned(k_cache, "k_cache");
  check_aligned(v_cache, "v_cache");

  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t B = block_tables.size(0), max_blocks = block_tables.size(1);
  TORCH_CHECK_VALUE(v_cache.sizes() == k_cache.sizes(), "v_cache has shape ", v_cache.sizes(),
                    " but k_cache has shape ", k_cache.sizes());
  check_size(k_cache, "k_cache", 3, D, "head_dim, from q [T, H, D]");
  TORCH_CHECK_VALUE(paged_attention_supported(dtype, (int)D), "head_dim ", D,
                    " is not compiled into kernels.cu (supported: 64, 128)");
  TORCH_CHECK_VALUE(block_size > 0 && (block_size & (block_size - 1)) == 0,
                    "block_size (k_cache.size(1)) must be a power of two, got ", block_size);
  TORCH_CHECK_VALUE(KVH > 0 && H > 0 && H % KVH == 0, "q has ", H, " heads, not a positive multiple of the ",
                    KVH, " kv heads of k_cache");
  check_size(seq_lens, "seq_lens", 0, B, "one per sequence, from block_tables [B, max_blocks]");
  check_size(query_start_loc, "query_start_loc", 0, B + 1, "B + 1, from block_tables [B, max_blocks]");
  TORCH_CHECK_VALUE(B > 0 || T == 0, "q has ", T, " tokens but block_tables has no sequence to own them");
  TORCH_CHECK_VALUE(max_seq_len <= max_blocks * block_size, "max_seq_len ", max_seq_len,
                    " does not fit in block_tables of ", max_blocks, " blocks of ", block_size);
  // (keys below 2^30: a warp's tile index steps up to kNumWarps * TILE past the last key,
  // and must not wrap past 2^31 on the way)
  TORCH_CHECK_VALUE(T * H < (int64_t(1) << 31) && T + 8 * B < (int64_t(1) << 31) &&
                    max_blocks * block_size < (int64_t(1) << 30),
                    "batch too large for the kernel's 32-bit row, tile and position indices");
  TORCH_CHECK_VALUE(partition_size >= 0 && partition_size < (int64_t(1) << 31), "partition_size must be "
                    "0 (the planner chooses) or a number of keys below 2^31, got ", partition_size);
  TORCH_CHECK_VALUE(window >= 0 && window < (int64_t(1) << 31), "window must be 0 (none) or a number "
                    "of positions below 2^31, got ", window);

  auto out = at::empty({T, H, D}, q.options());
  if (T == 0) return out;
  const DeviceGuard guard(device);

  const AttentionPlan plan = plan_paged_attention((int)T, (int)B, (int)H, (int)KVH,
                                                  (int)max_query_len, (int)max_seq_len, (int)window,
                                                  sm_count(device.index()), (int)partition_size);
  // grid.y walks the kv heads and the chunks of each one's query heads, and stops at 65535.
  TORCH_CHECK_VALUE(KVH * plan.head_chunks <= 65535, "q has ", H, " heads over ", KVH, " kv heads: ",
                    KVH * plan.head_chunks, " CTAs along grid.y, more than CUDA's 65535");
  // Split-K workspace: each partition's unnormalised output, max and sum.
  at::Tensor partial_out, partial_stats;
  if (plan.num_partitions > 1) {
    const auto f32 = q.options().dtype(at::kFloat);
    partial_out = at::empty({T, H, plan.num_partitions, D}, f32);
    partial_stats = at::empty({2, T, H, plan.num_partitions}, f32);
  }

  PagedAttentionArgs args{};
  args.out = out.data_ptr();
  args.q = q.data_ptr();
  args.q_token_stride = token_stride(q);
  args.k_cache = k_cache.data_ptr();
  args.v_cache = v_cache.data_ptr();
  args.block_tables = block_tables.data_ptr<int32_t>();
  args.seq_lens = seq_lens.data_ptr<int32_t>();
  args.query_start_loc = query_start_loc.data_ptr<int32_t>();
  if (plan.num_partitions > 1) {
    args.partial_out = partial_out.data_ptr<float>();
    args.partial_max = partial_stats[0].data_ptr<float>();
    args.partial_sum = partial_stats[1].data_ptr<float>();
  }
  args.num_tokens = (int)T;
  args.num_seqs = (int)B;
  args.num_heads = (int)H;
  args.num_kv_heads = (int)KVH;
  args.head_dim = (int)D;
  args.block_size = (int)block_size;
  args.max_blocks_per_seq = (int)max_blocks;
  args.window = (int)window;
  args.scale = (float)scale;
  args.dtype = dtype;
  check_launch(launch_paged_attention(args, plan, current_stream()), "paged_attention");
  return out;
}

void write_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
              const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK_VALUE(on_kernel_device(k_cache), "k_cache must be a ", kKernelDevice, " tensor, got one on ",
                    k_cache.device());
  const auto device = k_cache.device();
  check(k_cache, "k_cache", device, k_cache.scalar_type(), 4);
  check(v_cache, "v_cache", device, k_cache.scalar_type(), 4);
  check_rows(k, "k", device, k_cache.scalar_type());
  check_rows(v, "v", device, k_cache.scalar_type());
  check(slot_mapping, "slot_mapping", device, at::kLong, 1);
  TORCH_CHECK_VALUE(v_cache.sizes() == k_cache.sizes(), "v_cache has shape ", v_cache.sizes(),
                    " but k_cache has shape ", k_cache.sizes());
  TORCH_CHECK_VALUE(v.sizes() == k.sizes(), "v has shape ", v.sizes(), " but k has shape ", k.sizes());
  check_size(k, "k", 1, k_cache.size(2), "kv heads, from k_cache [num_blocks, block_size, KVH, D]");
  check_size(k, "k", 2, k_cache.size(3), "head_dim, from k_cache [num_blocks, block_size, KVH, D]");
  check_size(slot_mapping, "slot_mapping", 0, k.size(0), "one slot per token of k");
  const int64_t bytes_per_token = k.size(1) * k.size(2) * k.element_size();
  TORCH_CHECK_VALUE(bytes_per_token % 16 == 0, "a token's k row (", bytes_per_token,
                    " bytes) must be a multiple of 16 bytes");
  check_aligned(k_cache, "k_cache");
  check_aligned(v_cache, "v_cache");
  if (k.size(0) == 0) return;
  const DeviceGuard guard(device);
  check_launch(launch_write_kv(k_cache.data_ptr(), v_cache.data_ptr(), k.data_ptr(), v.data_ptr(),
                               slot_mapping.data_ptr<int64_t>(), (int)k.size(0),
                               k_cache.size(0) * k_cache.size(1), bytes_per_token,
                               token_stride(k) * k.element_size(), token_stride(v) * v.element_size(),
                               current_stream()),
               "write_kv");
}

void copy_blocks(const at::Tensor& cache, const at::Tensor& src_dst) {
  TORCH_CHECK_VALUE(on_kernel_device(cache), "cache must be a ", kKernelDevice, " tensor, got one on ", cache.device());
  TORCH_CHECK_VALUE(cache.dim() >= 1 && cache.is_contiguous(), "cache must be a contiguous "
                    "[num_blocks, ...] tensor, got shape ", cache.sizes(), " with strides ", cache.strides());
  check(src_dst, "src_dst", cache.device(), at::kLong, 2);
  check_size(src_dst, "src_dst", 1, 2, "(src, dst) block pairs");
  check_aligned(cache, "cache");
  const int64_t bytes_per_block = cache.numel() / std::max<int64_t>(cache.size(0), 1) * cache.element_size();
  TORCH_CHECK_VALUE(bytes_per_block % 16 == 0, "a cache block (", bytes_per_block,
                    " bytes) must be a multiple of 16 bytes");
  if (src_dst.size(0) == 0) return;
  const DeviceGuard guard(cache.device());
  check_launch(launch_copy_blocks(cache.data_ptr(), src_dst.data_ptr<int64_t>(), (int)src_dst.size(0),
                                  cache.size(0), bytes_per_block, current_stream()),
               "copy_blocks");
}

// The launch shape paged_attention would use on the current device (for benchmarks).
py::dict describe_plan(int64_t num_tokens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                       int64_t max_query_len, int64_t max_seq_len, int64_t window, int64_t partition_size) {
  TORCH_CHECK_VALUE(num_kv_heads > 0 && num_heads > 0 && num_heads % num_kv_heads == 0, "num_heads ",
                    num_heads, " must be a positive multiple of num_kv_heads ", num_kv_heads);
  const AttentionPlan p = plan_paged_attention((int)num_tokens, (int)num_seqs, (int)num_heads,
                                               (int)num_kv_heads, (int)max_query_len, (int)max_seq_len,
                                               (int)window, sm_count(current_device()), (int)partition_size);
  py::dict d;
  d["rows_per_cta"] = p.rows_per_cta;
  d["heads_per_cta"] = p.heads_per_cta;
  d["tokens_per_cta"] = p.tokens_per_cta;
  d["grid"] = py::make_tuple(p.num_tiles, num_kv_heads * p.head_chunks, p.num_partitions);
  d["partition_size"] = p.partition_size;
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention,
        "Paged attention over a flat varlen batch -> out [T, H, D] (kernels.cu)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("seq_lens"), py::arg("query_start_loc"), py::arg("scale"),
        py::arg("max_query_len"), py::arg("max_seq_len"), py::arg("window") = 0,
        py::arg("partition_size") = 0);
  m.def("describe_plan", &describe_plan, "The launch shape of paged_attention on this device",
        py::arg("num_tokens"), py::arg("num_seqs"), py::arg("num_heads"), py::arg("num_kv_heads"),
        py::arg("max_query_len"), py::arg("max_seq_len"), py::arg("window") = 0,
        py::arg("partition_size") = 0);
  m.def("write_kv", &write_kv, "Write k, v [T, KVH, D] into their cache slots (slot < 0: skip)",
        py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"));
  m.def("copy_blocks", &copy_blocks, "Copy cache blocks src_dst[:, 0] onto src_dst[:, 1]",
        py::arg("cache"), py::arg("src_dst"));
}
"""

# ----------------------------------------------------------------------------
# the emulator: kernels.cu on the CPU, for tests on machines without a GPU
# ----------------------------------------------------------------------------
# load_kernels(emulate=True) compiles kernels.cu with the host compiler instead of
# nvcc, after this header, and the binding above for CPU tensors. The kernels
# then run — slowly, microseconds per shuffle — with CUDA's semantics where they
# decide right or wrong: every thread of a CTA runs the kernel with its own
# threadIdx, __syncthreads and warp shuffles are real rendezvous, __shared__
# memory is one per CTA, a misaligned 16-byte load is an error as on the GPU,
# and a thread left waiting at a barrier that another never reaches is reported
# as a deadlock, not a hang. So the tests prove the
# kernels' indexing, masking, online softmax and split-K merge in every CI run.
# What it cannot show: speed, memory coalescing, the GPU's memory model (fibers
# interleave only at barriers; alternate CTAs run their threads in opposite
# orders, which turns most missing __syncthreads into wrong answers, but not
# every race), and nvcc-only bugs; bash gpu_check.sh does, with racecheck.
#
# Each CUDA thread is a fiber (a ucontext with its own stack) on one OS thread.
# A fiber runs until it waits at a barrier, then hands the CPU straight to the
# next runnable fiber; run_grid()'s loop gets control back only when a fiber
# finishes or every remaining one waits (a deadlock). A barrier lets its fibers
# go once every live thread it spans has arrived. CTAs run one after another.
EMULATOR = r"""
// kernels.cu on CPU fibers (build_ext.py's EMULATOR; see the comment above it there).
#include <cuda_runtime_api.h>
#include <vector_functions.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

// Device-code keywords: __global__, __device__ and __forceinline__ already mean
// nothing (or plain inline) to a host compiler; these two need a host meaning.
#undef __launch_bounds__
#undef __shared__
#define __launch_bounds__(...)
#define __shared__ static  // one CTA runs at a time, so a static is its shared memory

using std::max;
using std::min;

inline uint3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

namespace emu {

constexpr int kWarp = 32;
constexpr size_t kStackBytes = 64 << 10;

struct Barrier {      // a CTA's __syncthreads, or one warp's shuffles
  int first, count;   // the threads it spans
  int live, arrived;  // threads not yet exited; threads waiting here
};

struct Fiber {
  ucontext_t context;
  std::vector<char> stack;
  Barrier* waiting_on = nullptr;
  bool done = false;
  unsigned shuffles = 0;  // shuffles done: picks the exchange buffer (see __shfl_xor_sync)
};

struct Grid {
  ucontext_t scheduler;
  std::vector<Fiber> fibers;
  std::vector<Barrier> warps;
  Barrier block;
  std::vector<float> exchange;  // [2][num_warps][32] values in flight in shuffles
  std::function<void()> body;   // the kernel with its arguments
  int current = 0;
  int step = 1;                 // 1: threads run in order 0, 1, ...; n - 1: in reverse
  std::string error;
};
inline Grid grid;

inline void release(Barrier& b) {
  b.arrived = 0;
  for (int t = b.first; t < b.first + b.count; ++t)
    if (grid.fibers[t].waiting_on == &b) grid.fibers[t].waiting_on = nullptr;
}

// Switch from the running fiber (or the scheduler) to fiber t.
inline void resume(ucontext_t* from, int t) {
  grid.current = t;
  threadIdx = make_uint3(t, 0, 0);
  swapcontext(from, &grid.fibers[t].context);
}

// The next fiber after `after` (round robin, in this CTA's direction) that has
// neither finished nor waits at a barrier; -1 if there is none.
inline int next_runnable(int after) {
  const int n = (int)grid.fibers.size();
  for (int i = 1; i <= n; ++i) {
    const int t = (after + i * grid.step) % n;
    if (!grid.fibers[t].done && !grid.fibers[t].waiting_on) return t;
  }
  return -1;
}

// The calling thread waits at b until every live thread of b has arrived. The
// last to arrive releases the others and goes on; the others hand the CPU
// straight to the next runnable fiber (one switch, not two through the
// scheduler), or to the scheduler when none can run: a deadlock.
inline void arrive(Barrier& b) {
  const int me = grid.current;
  Fiber& self = grid.fibers[me];
  self.waiting_on = &b;
  if (++b.arrived == b.live) release(b);
  while (self.waiting_on) {
    const int t = next_runnable(me);
    if (t < 0) swapcontext(&self.context, &grid.scheduler);
    else resume(&self.context, t);
  }
}

// An exited thread no longer counts at its barriers (as on the GPU, where a
// barrier waits only for the threads that have not exited).
inline void leave(Barrier& b) {
  if (--b.live > 0 && b.arrived == b.live) release(b);
}

inline void fiber_main() {
  grid.body();
  grid.fibers[grid.current].done = true;
  Barrier& warp = grid.warps[grid.current / kWarp];
  if (warp.arrived > 0 && grid.error.empty())
    grid.error = "emulator: a thread exited while lanes of its warp wait at a shuffle";
  leave(warp);
  leave(grid.block);
}  // returns to grid.scheduler through uc_link

inline void run_grid(dim3 g, dim3 b, std::function<void()> body) {
  const int threads = (int)(b.x * b.y * b.z), num_warps = (threads + kWarp - 1) / kWarp;
  if (b.y != 1 || b.z != 1) { grid.error = "emulator: only 1-D thread blocks"; return; }
  gridDim = g;
  blockDim = b;
  grid.body = std::move(body);
  grid.fibers.resize(threads);
  grid.warps.resize(num_warps);
  grid.exchange.assign(2 * num_warps * kWarp, 0.f);
  for (Fiber& f : grid.fibers) f.stack.resize(kStackBytes);
  for (unsigned z = 0; z < g.z; ++z)
    for (unsigned y = 0; y < g.y; ++y)
      for (unsigned x = 0; x < g.x; ++x) {
        blockIdx = make_uint3(x, y, z);
        grid.block = Barrier{0, threads, threads, 0};
        for (int w = 0; w < num_warps; ++w) {
          const int n = std::min(kWarp, threads - w * kWarp);
          grid.warps[w] = Barrier{w * kWarp, n, n, 0};
        }
        for (Fiber& f : grid.fibers) {
          f.waiting_on = nullptr;
          f.done = false;
          f.shuffles = 0;
          getcontext(&f.context);
          f.context.uc_stack.ss_sp = f.stack.data();
          f.context.uc_stack.ss_size = f.stack.size();
          f.context.uc_link = &grid.scheduler;
          makecontext(&f.context, fiber_main, 0);
        }
        // Alternate CTAs run their threads in opposite orders, so that a missing
        // __syncthreads (a thread reading what another has not yet written) shows
        // as a wrong answer whichever of the two comes first in the kernel.
        const bool reverse = (x + y + z) % 2;
        grid.step = reverse ? threads - 1 : 1;
        // Fibers come back here when they finish, or when all that remain wait.
        for (int t = reverse ? threads - 1 : 0; t >= 0; t = next_runnable(grid.current))
          resume(&grid.scheduler, t);
        for (const Fiber& f : grid.fibers) {
          if (f.done) continue;
          grid.error = "emulator: deadlock in CTA (" + std::to_string(x) + ", " + std::to_string(y) +
                       ", " + std::to_string(z) + "): a thread waits at __syncthreads or a shuffle "
                       "that another live thread of its CTA or warp never reaches";
          return;
        }
      }
}

// kernel<<<grid, block, smem, stream>>>(args...) is rewritten by build_ext.py as
// emu::launch(kernel, grid, block, smem, stream)(args...).
template <typename Kernel>
auto launch(Kernel kernel, dim3 g, dim3 b, size_t /*dynamic smem*/ = 0, cudaStream_t = nullptr) {
  return [=](auto... args) {
    if (grid.error.empty()) run_grid(g, b, [&] { kernel(args...); });
  };
}

}  // namespace emu

// --- the intrinsics kernels.cu uses ------------------------------------------
inline void __syncthreads() { emu::arrive(emu::grid.block); }

// Each lane posts its value, meets its warp at the barrier, then reads its
// partner's. Consecutive shuffles alternate between two buffers: a lane can run
// at most one shuffle ahead of the slowest (the next barrier stops it), so it
// never overwrites a value that a slower lane has still to read.
inline float __shfl_xor_sync(unsigned mask, float value, int lane_mask) {
  emu::Grid& g = emu::grid;
  const int t = g.current, warp = t / emu::kWarp, lane = t % emu::kWarp;
  emu::Barrier& b = g.warps[warp];
  if ((mask != 0xffffffffu || b.live != emu::kWarp) && g.error.empty())
    g.error = "emulator: a full-warp shuffle needs all 32 lanes live and in the mask";
  float* buffer = &g.exchange[((g.fibers[t].shuffles++ & 1) * g.warps.size() + warp) * emu::kWarp];
  buffer[lane] = value;
  emu::arrive(b);
  return buffer[lane ^ lane_mask];
}

// A GPU faults on a load from an address not aligned to its size (16 bytes for
// the kernels' uint4 loads). Report it instead; and load through memcpy: a plain *p
// of a type declared 16-byte aligned is undefined there (a compiler may emit an aligned
// vector load, which would crash the process before the report is seen).
template <typename T> inline T __ldg(const T* p) {
  if (reinterpret_cast<std::uintptr_t>(p) % alignof(T) != 0 && emu::grid.error.empty())
    emu::grid.error = "emulator: a load from an address not aligned to its " + std::to_string(alignof(T)) +
                      " bytes";
  T value;
  std::memcpy(&value, p, sizeof value);
  return value;
}

inline int __ffs(int x) { return __builtin_ffs(x); }  // 1 + index of the lowest set bit, 0 for 0

inline float __uint_as_float(unsigned x) {
  float f;
  std::memcpy(&f, &x, sizeof f);
  return f;
}

// The runtime calls kernels.cu and the binding make. Like CUDA's, the error of
// a failed launch is reported once, then cleared.
static std::string last_error;

cudaError_t cudaGetLastError(void) {
  if (emu::grid.error.empty()) return cudaSuccess;
  last_error = std::move(emu::grid.error);
  emu::grid.error.clear();
  return cudaErrorLaunchFailure;
}

const char* cudaGetErrorString(cudaError_t error) {
  return error == cudaSuccess ? "no error" : last_error.c_str();
}
"""

# kernel<<<grid, block, smem, stream>>>(args) -> emu::launch(kernel, grid, block, smem, stream)(args)
CUDA_LAUNCH = re.compile(r"(\w+(?:<[^<>;]*>)?)<<<(.+?)>>>\(")


def emulated_source(cuda_source: str, filename: str) -> str:
    """CUDA source as C++ for the host compiler: the emulator, then the source with
    each triple-chevron launch turned into a call (line numbers kept for errors)."""
    source, launches = CUDA_LAUNCH.subn(lambda m: f"emu::launch({m.group(1)}, {m.group(2)})(", cuda_source)
    if launches != cuda_source.count("<<<"):
        raise KernelsUnavailable(f"emulator: a <<<...>>> launch in {filename} is not of the form "
                                 "kernel<<<...>>>( (the kernel and its launch configuration on one line)")
    return f'{EMULATOR}\n#line 1 "{filename}"\n{source}'


# ----------------------------------------------------------------------------
# finding the toolkit, building, loading
# ----------------------------------------------------------------------------


class KernelsUnavailable(RuntimeError):
    """Why the CUDA kernels cannot be used here (one line)."""


def find_cuda_home() -> str | None:
    """A CUDA toolkit directory with bin/nvcc and include/cuda_runtime.h.

    $CUDA_HOME first, then $CUDA_PATH, then /usr/local/cuda, then the directory above
    the nvcc on PATH. The last guess is what torch itself tries, and it fails where that nvcc
    is a wrapper script (e.g. /usr/local/bin/nvcc), which is why we look first.
    """
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    if shutil.which("nvcc"):
        candidates.append(str(Path(shutil.which("nvcc")).resolve().parent.parent))
    for home in candidates:
        if home and (Path(home) / "bin" / "nvcc").exists() and (Path(home) / "include" / "cuda_runtime.h").exists():
            return home
    return None


def cache_root() -> Path | None:
    """Where nanopaged keeps what it makes once (GGUF conversions, compiled kernels):
    $NANOPAGED_CACHE, else ~/.cache/nanopaged; None where there is no home directory (no
    $HOME, and no passwd entry for the user: a container run under an arbitrary uid)."""
    if os.environ.get("NANOPAGED_CACHE"):
        return Path(os.environ["NANOPAGED_CACHE"])
    try:
        return Path.home() / ".cache" / "nanopaged"
    except RuntimeError:   # (pathlib's "Could not determine home directory")
        return None


def current_umask() -> int:
    """The process's umask (os has no getter: it is read by setting it, and set back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


NO_CACHE = "no home directory to keep a cache in (no $HOME, no passwd entry for this user): set NANOPAGED_CACHE"


def build_dir() -> Path:
    if (root := cache_root()) is None:
        raise KernelsUnavailable(NO_CACHE)
    return root / "kernels"


def first_error(log: str) -> str:
    """The line of a compiler log worth showing in a one-line reason."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for pattern in (r"error:", r"\berror\b"):  # a compiler's "file:line: error: ..." first
        for line in lines:
            if re.search(pattern, line, re.IGNORECASE):
                return line[:300]
    return (lines[-1] if lines else "no output")[:300]


def gencode_flags(archs) -> list[str]:
    """nvcc flags that compile machine code for exactly these archs ("80", "90", ...)."""
    return [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]


def write_if_changed(path: Path, text: str) -> None:
    """Rewrite a generated source only when it changed (the build cache goes by it)."""
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


def _build(emulate: bool, archs: tuple[str, ...] | None = None, out: Path | None = None):
    """Compile and import the extension; raise KernelsUnavailable with the reason.

    archs: compile the real extension for these GPU archs instead of the visible GPU's,
    which then need not exist (--check does, under a CUDA build of torch); out: the
    build directory, instead of the cache."""
    try:
        import torch
    except ImportError:
        raise KernelsUnavailable("torch is not installed") from None
    if not emulate and torch.version.cuda is None:
        raise KernelsUnavailable(f"torch {torch.__version__} was built without CUDA")
    if not emulate and archs is None and not torch.cuda.is_available():
        raise KernelsUnavailable("no CUDA GPU is visible to torch")
    home = find_cuda_home()  # (a whole toolkit, though the emulator uses its headers alone: cuda_fp16.h, ...)
    if home is None:
        raise KernelsUnavailable("nvcc not found: set CUDA_HOME to a CUDA toolkit")
    # cpp_extension reads CUDA_HOME once, when first imported: set the variable
    # before that, and the module's copy too in case it was imported already.
    os.environ["CUDA_HOME"] = home
    from torch.utils import cpp_extension
    cpp_extension.CUDA_HOME = home
    if not cpp_extension.is_ninja_available():
        raise KernelsUnavailable("ninja is not installed (pip install ninja): torch needs it to build")

    out = out or (build_dir() / "emulated" if emulate else build_dir())
    out.mkdir(parents=True, exist_ok=True)
    binding = out / "binding.cpp"
    write_if_changed(binding, BINDING)
    if emulate:
        kernels = out / "kernels_emulated.cpp"
        write_if_changed(kernels, emulated_source(KERNELS.read_text(), str(KERNELS)))
        # -Bsymbolic: the emulator's cudaGetLastError answers its own calls, even in a
        # process where the real CUDA runtime is loaded too.
        options = dict(name="nanopaged_kernels_emulated", extra_include_paths=[str(HERE), f"{home}/include"],
                       extra_cflags=["-O2", "-DNANOPAGED_EMULATE"], extra_ldflags=["-Wl,-Bsymbolic"])
    else:
        # Compile for this GPU only. An arch flag of our own makes torch add none of its own,
        # whatever TORCH_CUDA_ARCH_LIST the machine sets (a list of five archs builds five
        # times; one this nvcc dropped fails); but older torch (2.5) adds its own all the same:
        # the machine's list, or, where it sets none, ours (_arch_list_for_old_torch).
        archs = archs or ("".join(map(str, torch.cuda.get_device_capability())),)
        kernels = KERNELS
        options = dict(name="nanopaged_kernels", extra_include_paths=[str(HERE)], extra_cflags=["-O3"],
                       extra_cuda_cflags=["-O3", *gencode_flags(archs)])
    try:
        with _one_build_at_a_time(out), _arch_list_for_old_torch(None if emulate else archs):
            return cpp_extension.load(sources=[str(binding), str(kernels)], build_directory=str(out),
                                      verbose=False, **options)
    except Exception as e:  # a compiler error, a missing header, a link error...
        log = out / "build.log"
        log.write_text(f"{type(e).__name__}: {e}\n")
        raise KernelsUnavailable(f"building kernels.cu failed: {first_error(str(e))} (log: {log})") from None


@contextlib.contextmanager
def _arch_list_for_old_torch(archs):
    """TORCH_CUDA_ARCH_LIST set to archs during the build, where the machine sets none. torch
    2.5 (not 2.11) gives its ninja build arch flags of its own whatever extra_cuda_cflags say:
    this variable's, or else the visible GPU's, and with no GPU visible (build_ext --check) it
    failed with an IndexError. Named here, they are ours again (the same flags twice: one build)."""
    if not archs or "TORCH_CUDA_ARCH_LIST" in os.environ:
        yield
        return
    os.environ["TORCH_CUDA_ARCH_LIST"] = ";".join(f"{a[:-1]}.{a[-1]}" for a in archs)   # ("90" -> "9.0")
    try:
        yield
    finally:
        del os.environ["TORCH_CUDA_ARCH_LIST"]


@contextlib.contextmanager
def _one_build_at_a_time(out: Path):
    """Hold the build directory, with torch's own lock file cleared where a build was killed
    halfway. cpp_extension marks every load (built or not) with a file `lock`, and waits, for
    ever, while another's is there: a Ctrl-C during the first build (a minute, for the CUDA
    kernels) made every later load hang. An flock, which the OS drops with its process, says
    whether anyone is in here: held, a `lock` left behind is stale. (torch 2.14 holds such
    an OS lock on `lock` itself, and a file left there is harmless: cleared all the same.)"""
    import fcntl   # (POSIX: nanopaged's builds run on Linux and macOS)
    with open(out / "nanopaged.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)   # (released as the file closes)
        (out / "lock").unlink(missing_ok=True)
        yield


_loaded: dict = {}  # emulate (True/False) or "cpu" -> (ops or None, reason or None)


def load_kernels(emulate: bool = False):
    """The compiled ops module (built once, then cached), or None; see unavailable_reason().

    emulate=True builds the same kernels for the CPU emulator (EMULATOR): CPU
    tensors in and out, no GPU needed, for tests only."""
    if emulate not in _loaded:
        try:
            _loaded[emulate] = (_build(emulate), None)
        except KernelsUnavailable as e:
            _loaded[emulate] = (None, str(e))
    return _loaded[emulate][0]


def unavailable_reason(emulate: bool = False) -> str | None:
    """One line saying why load_kernels() returns None; None when the kernels work."""
    load_kernels(emulate)
    return _loaded[emulate][1]


# ----------------------------------------------------------------------------
# the CPU decode kernel: kernels_cpu.c, compiled with the system's C compiler
# ----------------------------------------------------------------------------
CPU_KERNELS = HERE / "kernels_cpu.c"
# -march=native: the library is built on the machine that runs it (and cached per CPU);
# -fno-math-errno lets rint-like calls become instructions. Not -ffast-math: gcc links such
# a shared library with code that flushes denormals to zero process-wide, changing torch's
# arithmetic too. -Wno-psabi: without AVX-512, gcc and clang warn that passing a 16-float
# vector by value changes the calling convention, which matters only for calls between
# separately compiled files (the kernel's helpers are all inlined). Warnings are errors in
# --check (CI), not on a user's machine, whose compiler may warn of something new.
CPU_CFLAGS = ["-std=c11", "-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-Wno-psabi", "-fPIC", "-shared"]
CPU_CHECK_FLAGS = ["-Wall", "-Wextra", "-Werror"]
# --check compiles it for this CPU and for the baseline of its instruction set too, as a CPU
# without AVX-512 (or NEON's narrower registers) compiles the same vectors another way
CPU_BASELINE_ARCH = {"x86_64": "x86-64", "AMD64": "x86-64", "aarch64": "armv8-a", "arm64": "armv8-a"}
CPU_DTYPES = {"float32": 0, "bfloat16": 1, "float16": 2}   # F32, BF16, F16 in kernels_cpu.c
# a KV cache's besides (LLM's kv_cache_dtype): E4M3, E5M2; or bfloat16 under another dtype
CPU_KV_DTYPES = {"bfloat16": 1, "float8_e4m3fn": 3, "float8_e5m2": 4}
CPU_STORAGE = CPU_DTYPES | CPU_KV_DTYPES   # every dtype's number, q's or the caches'
CPU_WIDEN_ROWS = 16   # kernels_cpu.c's WIDEN_ROWS
# the per-thread stack the kernel's (group, head_dim) state and a block's scores may take
CPU_STACK_LIMIT = 256 << 10


def openmp_stack_bytes() -> int | None:
    """The stack OpenMP gives its threads where OMP_STACKSIZE (or libgomp's GOMP_STACKSIZE)
    sets it: a number of KiB, or of bytes, KiB, MiB, GiB with a suffix B, K, M, G; None where
    unset or unreadable (the runtime's default: megabytes)."""
    value = os.environ.get("OMP_STACKSIZE") or os.environ.get("GOMP_STACKSIZE") or ""
    m = re.fullmatch(r"\s*(\d+)\s*([bkmg]?)\s*", value, re.I)
    return int(m[1]) << {"b": 0, "": 10, "k": 10, "m": 20, "g": 30}[m[2].lower()] if m else None


def check_softcap(softcap):
    """An attention softcap (Gemma 2's) is None (none) or a finite number > 0: the scores become
    softcap * tanh(s / softcap). The kernels spell None as 0."""
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, numbers.Real)
                                or not 0 < softcap < math.inf):
        raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")


def check_window(window):
    """A sliding window is None (full attention) or a number of positions, at least 1 (each
    query sees itself): for every attention path (nanopaged's torch paths use it too). The
    kernels spell None as 0."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be None or an int >= 1, got {window!r}")


class DecodeArgs(ctypes.Structure):
    """struct DecodeArgs of kernels_cpu.c, field for field (shapes there)."""
    _fields_ = [("q", ctypes.c_void_p), ("q_stride", ctypes.c_int64),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p), ("num_blocks", ctypes.c_int64),
                ("block_tables", ctypes.c_void_p), ("max_blocks", ctypes.c_int64),
                ("seq_lens", ctypes.c_void_p), ("query_start_loc", ctypes.c_void_p),
                ("num_seqs", ctypes.c_int64), ("num_tokens", ctypes.c_int64),
                ("seqs", ctypes.c_void_p), ("n", ctypes.c_int64), ("out", ctypes.c_void_p),
                ("num_heads", ctypes.c_int32), ("num_kv_heads", ctypes.c_int32), ("head_dim", ctypes.c_int32),
                ("block_size", ctypes.c_int32), ("window", ctypes.c_int32), ("dtype", ctypes.c_int32),
                ("kv_dtype", ctypes.c_int32), ("num_threads", ctypes.c_int32), ("scale", ctypes.c_float),
                ("softcap", ctypes.c_float),
                ("partition_size", ctypes.c_int64), ("bad", ctypes.c_int64), ("work_items", ctypes.c_int64)]


# paged_decode's refusals (enum in kernels_cpu.c), as the message says them
CPU_REFUSALS = {1: "sequence {bad} of seqs is not in the batch",
                2: "seq_lens[{bad}] is outside 1 .. block_tables' columns x block_size",
                3: "query_start_loc[{bad}] is not a row of q",
                4: "block_tables[{bad}] holds a block id outside the cache, in the positions it reads",
                5: "this compiler has no _Float16: float16 is not supported",
                6: "no memory for the list of work items, or for the partitions' partial results",
                7: "sequence {bad} of seqs does not have exactly one query row (query_start_loc): the kernel "
                   "decodes one each",
                8: "q's or the caches' dtype is not one the kernel knows"}


class CpuKernels:
    """kernels_cpu.c through ctypes: decode_attention() checks the tensors (a message naming
    the one at fault) and calls paged_decode(), which checks the values it will use to
    index (seq_lens, query_start_loc, block ids). ctypes releases the GIL for the call."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        lib.paged_decode.argtypes = [ctypes.POINTER(DecodeArgs)]
        lib.paged_decode.restype = ctypes.c_int
        self.dtypes = [d for d in CPU_DTYPES if d != "float16" or lib.paged_decode_has_float16()]
        self.work_items = 0   # the last call's (split-K makes more than its sequences x kv heads)

    def unsupported(self, dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                    kv_dtype=None) -> str | None:
        """Why a model of these shapes cannot use the kernel, or None (kv_dtype: its KV
        cache's, where it is another than dtype)."""
        name = str(dtype).removeprefix("torch.")
        if name not in self.dtypes:
            return f"the CPU kernel is built for {', '.join(self.dtypes)}, not {name}"
        group = num_heads // num_kv_heads
        # (half of a stack OMP_STACKSIZE makes small: the rest of the frames need room too;
        # past it the kernel's threads overflowed theirs, a segfault)
        stack = openmp_stack_bytes()
        limit = CPU_STACK_LIMIT if stack is None else min(CPU_STACK_LIMIT, stack // 2)
        # (and a float8 cache's rows, widened to float32 WIDEN_ROWS at a time, K's and V's)
        widened = 2 * CPU_WIDEN_ROWS * head_dim if str(kv_dtype).startswith("torch.float8") else 0
        if 4 * (2 * group * head_dim + 2 * group + block_size + widened) > limit:
            return (f"the CPU kernel keeps a GQA group's state on the stack: {group} heads x head_dim {head_dim} "
                    f"with block_size {block_size}{' and a float8 cache' if widened else ''} is too large" +
                    (f" for OpenMP's threads' stacks of {stack >> 10} KiB (OMP_STACKSIZE)" if limit < CPU_STACK_LIMIT else ""))
        return None

    def decode_attention(self, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, seqs, scale: float,
                         out, window: int | None = None, softcap: float | None = None, partition_size: int = 0):
        """out[query_start_loc[b]] = attention of that query over sequence b's context, for
        each b in seqs (int64, decode sequences: one query each). Other rows of out untouched.
        partition_size: positions per work item at most (0: the kernel's choice: split-K where
        the (sequence, kv head) items are too few for the threads); self.work_items then says
        how many items the call made."""
        import torch
        T, H, D = q.shape
        # the caches: q's dtype, or a narrower one (kv_cache_dtype), widened as they are read
        kv_dtype = k_cache.dtype if str(k_cache.dtype).removeprefix("torch.") in CPU_KV_DTYPES else q.dtype
        checks = [("q", q, q.dtype, 3), ("k_cache", k_cache, kv_dtype, 4), ("v_cache", v_cache, kv_dtype, 4),
                  ("block_tables", block_tables, torch.int32, 2), ("seq_lens", seq_lens, torch.int32, 1),
                  ("query_start_loc", query_start_loc, torch.int32, 1), ("seqs", seqs, torch.int64, 1),
                  ("out", out, q.dtype, 3)]
        for name, t, dtype, dims in checks:
            if t.device.type != "cpu" or t.dtype != dtype or t.dim() != dims:
                raise ValueError(f"{name} must be a {dims}-d {dtype} CPU tensor, got {t.dim()}-d {t.dtype} on {t.device}")
            if name != "q" and not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        num_blocks, block_size, kvh, _ = k_cache.shape
        if q.stride(2) != 1 or q.stride(1) != D:
            raise ValueError("q's heads must be contiguous (a token's row may be a view into a wider tensor)")
        if not kvh or not D or k_cache.shape[3] != D or v_cache.shape != k_cache.shape or H % kvh:
            raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} do not fit "
                             f"q {tuple(q.shape)}: (num_blocks, block_size, kv heads dividing {H}, {D}) each")
        if out.shape != q.shape:
            raise ValueError(f"out {tuple(out.shape)} must have q's shape {tuple(q.shape)}")
        if query_start_loc.shape[0] != seq_lens.shape[0] + 1 or block_tables.shape[0] != seq_lens.shape[0]:
            raise ValueError(f"seq_lens ({seq_lens.shape[0]}), query_start_loc ({query_start_loc.shape[0]}) and "
                             f"block_tables ({block_tables.shape[0]} rows) disagree on the number of sequences")
        reason = self.unsupported(q.dtype, H, kvh, D, block_size, kv_dtype)
        if reason:
            raise ValueError(reason)
        check_window(window)
        check_softcap(softcap)
        window = min(window or 0, 2**31 - 1)   # (a window past any context is none: int32 must not wrap)
        if isinstance(partition_size, bool) or not isinstance(partition_size, int) or not 0 <= partition_size < 2**62:
            raise ValueError(f"partition_size must be an int >= 0 (0: the kernel picks), got {partition_size!r}")
        args = DecodeArgs(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), num_blocks,
                          block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(),
                          query_start_loc.data_ptr(), seq_lens.shape[0], T, seqs.data_ptr(), seqs.shape[0],
                          out.data_ptr(), H, kvh, D, block_size, window,
                          CPU_DTYPES[str(q.dtype).removeprefix("torch.")],
                          CPU_STORAGE[str(kv_dtype).removeprefix("torch.")], torch.get_num_threads(),
                          scale, softcap or 0.0, partition_size)
        rc = self.lib.paged_decode(ctypes.byref(args))
        if rc:
            raise ValueError("paged_decode refused the call: " + CPU_REFUSALS[rc].format(bad=args.bad))
        self.work_items = args.work_items
        return out


def cpu_cache_key(cc: str) -> str:
    """What the compiled library depends on: the source, the flags, the compiler's command
    ($CC, or cc or gcc: its name, not its version: a compiler upgraded in place is not seen), and the CPU
    it was built for (-march=native; a home directory may be shared between machines)."""
    try:
        cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        cpu = ""
    text = "\n".join([CPU_KERNELS.read_text(), " ".join(CPU_CFLAGS), cc, platform.machine(), platform.processor(), cpu])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def find_cc() -> str:
    """The C compiler: $CC (a command line, as make reads it: "ccache gcc" too), else cc, else gcc."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    try:
        program = shlex.split(cc)[0] if cc else None
    except (ValueError, IndexError):   # an unclosed quote; only spaces
        program = None
    if not program or not shutil.which(program):
        raise KernelsUnavailable(f"no C compiler found ({'$CC = ' + repr(cc) if cc else 'cc, gcc'}): "
                                 "the CPU kernel is compiled on first use")
    return cc


def compile_cpu_kernels(cc: str, lib: str, extra=()) -> str:
    """cc kernels_cpu.c into the shared library lib; the compiler's output (raises on failure)."""
    run = subprocess.run([*shlex.split(cc), *CPU_CFLAGS, *extra, str(CPU_KERNELS), "-o", lib, "-lm"],
                         capture_output=True, text=True)
    output = run.stdout + run.stderr
    if run.returncode != 0:
        try:   # the whole log kept where it can be (a cache it cannot write: the reason without it)
            log = build_dir() / "cpu" / "build.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text(output)
            kept = f" (log: {log})"
        except (OSError, KernelsUnavailable):
            kept = ""
        raise KernelsUnavailable(f"compiling kernels_cpu.c failed: {first_error(output)}{kept}")
    if not library_is_whole(Path(lib)):
        raise KernelsUnavailable(f"{cc} exited 0 but wrote no whole library into {lib}")
    return output


def library_is_whole(path: Path) -> bool:
    """Whether a shared library's file is all there. A file cut short (a crash before it
    reached the disk) would kill the process with a bus error when the loader maps past its
    end. An ELF file (Linux) ends with its section header table, so one cut short lacks it:
    e_shoff + e_shnum * e_shentsize bytes (header fields at 0x28/0x3c/0x3a in 64-bit files,
    0x20/0x30/0x2e in 32-bit ones). Another format (macOS's Mach-O) is trusted if not empty."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError:
        return False
    if head[:4] != b"\x7fELF":
        return size > 0   # (another format: trusted unless empty)
    if len(head) < 64:   # (not even the ELF header)
        return False
    order = "little" if head[5] == 1 else "big"
    field = lambda at, n: int.from_bytes(head[at:at + n], order)
    shoff, shentsize, shnum = (field(0x28, 8), field(0x3A, 2), field(0x3C, 2)) if head[4] == 2 else \
                              (field(0x20, 4), field(0x2E, 2), field(0x30, 2))
    return size >= shoff + shnum * shentsize


# OpenMP runtimes by file name: GCC's libgomp, LLVM's libomp, Intel's libiomp5
OPENMP_RUNTIME = re.compile(r"lib(gomp|omp|iomp5)[-.]")
_torch_openmp: set | None = None   # the runtimes mapped before the first kernel loaded


def openmp_runtimes() -> set[str]:
    """The OpenMP runtimes mapped into this process, as file paths (from /proc/self/maps;
    none known where there is no /proc)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return set()
    paths = {fields[5] for line in maps if len(fields := line.split(maxsplit=5)) == 6}
    return {p for p in paths if OPENMP_RUNTIME.match(os.path.basename(p))}


def _build_cpu() -> CpuKernels:
    """Compile kernels_cpu.c (once per source, flags and CPU: cached) and load it."""
    cc = find_cc()
    out = build_dir() / "cpu"
    lib = out / f"kernels_cpu-{cpu_cache_key(cc)}.so"
    if not library_is_whole(lib):   # not built yet, or damaged since: built (again)
        try:
            out.mkdir(parents=True, exist_ok=True)
            # into a temporary name, then renamed: a process that finds the library finds it whole
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=out)
            os.close(fd)
            try:
                compile_cpu_kernels(cc, tmp)
                # mkstemp's 0600, which the linker keeps (adding x): given the modes of what
                # the user creates (the umask's), a cache shared by users serves them all
                os.chmod(tmp, 0o755 & ~current_umask())
                os.replace(tmp, lib)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except OSError as e:   # a cache directory it cannot write, a compiler it cannot run
            raise KernelsUnavailable(f"building kernels_cpu.c into {out} failed: {e}") from None
    global _torch_openmp
    importlib.import_module("torch")   # (mapping its runtime first: whatever the kernel adds is the kernel's)
    before = openmp_runtimes()
    if _torch_openmp is None:   # once, before any kernel of this process loads its own
        _torch_openmp = before
    try:
        kernels = CpuKernels(ctypes.CDLL(str(lib)))
    except (OSError, AttributeError) as e:   # (AttributeError: a library without paged_decode)
        raise KernelsUnavailable(f"loading {lib} failed: {e}") from None
    # A compiler brings its own OpenMP runtime: gcc's libgomp is the one torch's Linux wheels
    # bundle (same soname: the loader hands the kernel torch's copy, one thread pool), but
    # clang's is libomp. Two runtimes keep two thread pools, each spinning on the cores
    # after its work (libomp for 200 ms) while the other waits for them: with clang the
    # engine ran 1.5x slower than with gcc, and slower than the torch path (measured).
    # What this load mapped, not all that came since torch: a library imported in between
    # may bring a runtime of its own (sentencepiece's wheel bundles a libgomp), which is not
    # the kernel's: blamed on it, it would refuse a kernel that shares torch's runtime.
    second = sorted(openmp_runtimes() - before)
    if _torch_openmp and second:
        raise KernelsUnavailable(f"{Path(cc).name} built kernels_cpu.c on {', '.join(second)}, an OpenMP runtime "
                                 f"beside torch's ({', '.join(sorted(_torch_openmp))}): two thread pools would "
                                 "contend for the cores; set CC to gcc (or the compiler of torch's runtime)")
    return kernels


def load_cpu_kernels() -> CpuKernels | None:
    """The CPU decode kernel (compiled once, then cached), or None; see cpu_unavailable_reason()."""
    if "cpu" not in _loaded:
        try:
            _loaded["cpu"] = (_build_cpu(), None)
        except KernelsUnavailable as e:
            _loaded["cpu"] = (None, str(e))
    return _loaded["cpu"][0]


def cpu_unavailable_reason() -> str | None:
    """One line saying why load_cpu_kernels() returns None; None when it works."""
    load_cpu_kernels()
    return _loaded["cpu"][1]


# ----------------------------------------------------------------------------
# --check: compile with plain nvcc, report resources (no GPU, no CUDA torch)
# ----------------------------------------------------------------------------

PTXAS_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(sm_\d+)'")
PTXAS_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
PTXAS_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def demangle(names: list[str]) -> list[str]:
    """Readable kernel names: c++filt, then without the namespace and arguments."""
    if shutil.which("c++filt"):
        run = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
        if run.returncode == 0 and len(run.stdout.splitlines()) == len(names):
            names = run.stdout.splitlines()
    short = []
    for name in names:
        name = name.replace("(anonymous namespace)::", "")
        name = re.sub(r"^void ", "", name)
        name = re.sub(r"\((?:[^()]|\([^()]*\))*\)$", "", name)  # drop the argument list
        short.append(name.replace("__nv_bfloat16", "bf16").replace("__half", "fp16"))
    return short


def parse_ptxas(log: str) -> list[dict]:
    """One row per (kernel, arch) from nvcc -Xptxas -v output."""
    rows = []
    for line in log.splitlines():
        if m := PTXAS_ENTRY.search(line):
            rows.append(dict(kernel=m.group(1), arch=m.group(2), regs=0, smem=0, stack=0, spill_st=0, spill_ld=0))
        elif rows and (m := PTXAS_SPILLS.search(line)):
            rows[-1].update(stack=int(m.group(1)), spill_st=int(m.group(2)), spill_ld=int(m.group(3)))
        elif rows and (m := PTXAS_USED.search(line)):
            rows[-1].update(regs=int(m.group(1)), smem=int(m.group(2) or 0))
    for row, name in zip(rows, demangle([r["kernel"] for r in rows])):
        row["kernel"] = name
    return rows


def check_binding_syntax(nvcc_home: str) -> str:
    """g++ -fsyntax-only on the binding against torch's headers (torch importable, without CUDA)."""
    from torch.utils import cpp_extension
    gxx = shutil.which("g++") or shutil.which("c++")
    if gxx is None:
        return "skipped (no g++)"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "binding.cpp"
        src.write_text(BINDING)
        # A CPU wheel ships c10/cuda's headers but not the one its CMake build
        # generates; stand in for it (it only marks c10_cuda as a shared library).
        stub = Path(tmp) / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
        stub.parent.mkdir(parents=True)
        stub.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        cmd = [gxx, "-fsyntax-only", "-std=c++17", "-DTORCH_EXTENSION_NAME=nanopaged_kernels",
               f"-I{HERE}", f"-I{nvcc_home}/include", *[f"-isystem{p}" for p in cpp_extension.include_paths()],
               f"-idirafter{tmp}",
               f"-isystem{__import__('sysconfig').get_paths()['include']}", str(src)]
        run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        raise KernelsUnavailable(f"the C++ binding does not compile:\n{run.stdout}{run.stderr}")
    return "ok (g++ -fsyntax-only against torch's headers)"


def check_binding(nvcc_home: str, archs=CHECK_ARCHS) -> str:
    """Under a CUDA build of torch, build and link the real extension (no GPU needed) and
    import it (under another torch, check() runs check_binding_syntax instead)."""
    import torch
    start = time.perf_counter()
    ops = _build(False, archs=archs, out=build_dir() / "check")
    # Its ops are registered and the binding's checks run: a CPU tensor is refused by name.
    try:
        ops.copy_blocks(torch.zeros(2, 4), torch.zeros(1, 2, dtype=torch.int64))
    except ValueError as e:
        if "must be a CUDA tensor" not in str(e):
            raise KernelsUnavailable(f"the built extension refused a CPU tensor with: {e}") from None
    else:
        raise KernelsUnavailable("the built extension accepted a CPU tensor")
    return (f"built and linked against torch {torch.__version__} for {'/'.join(f'sm_{a}' for a in archs)} "
            f"in {time.perf_counter() - start:.0f} s, imported, refuses a CPU tensor")


def check_cpu(pool: concurrent.futures.Executor) -> int:
    """kernels_cpu.c through the C compiler with warnings as errors, for each -march side by side."""
    try:
        cc = find_cc()
    except KernelsUnavailable as e:
        print(f"cc: kernels_cpu.c not compiled: {e}")
        return 0   # a machine without a C compiler runs the torch path; nothing to check
    archs = ["native"] + [arch for arch in [CPU_BASELINE_ARCH.get(platform.machine())] if arch]
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        compiles = [pool.submit(compile_cpu_kernels, cc, str(Path(tmp) / f"kernels_cpu_{arch}.so"),
                                [*CPU_CHECK_FLAGS, f"-march={arch}"])   # (a later -march overrides CPU_CFLAGS' own)
                    for arch in archs]
        concurrent.futures.wait(compiles)   # (all of them done before their directory is removed)
        for arch, compiled in zip(archs, compiles):
            try:
                compiled.result()
            except KernelsUnavailable as e:
                print(f"build_ext --check: -march={arch}: {e}", file=sys.stderr)
                return 1
    print(f"{cc}: kernels_cpu.c compiled for {' and '.join(f'-march={a}' for a in archs)} in {time.perf_counter() - start:.1f} s, "
          f"no warnings ({' '.join(CPU_CHECK_FLAGS)})")
    return 0


def check(archs=CHECK_ARCHS) -> int:
    # The compiles are independent: each runs in its own process, side by side (one nvcc an
    # arch; on CI's 2 cores the whole check takes ~30 s rather than ~50 one after another).
    # (The pool is left, waiting for every compile, before the directory they write into is.)
    with tempfile.TemporaryDirectory() as tmp, concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
        home = find_cuda_home()
        if home is not None:
            start = time.perf_counter()
            nvcc = [[str(Path(home) / "bin" / "nvcc"), "-c", str(KERNELS), "-o", str(Path(tmp) / f"kernels_{arch}.o"),
                     "-std=c++17", "-O3", *gencode_flags((arch,)), *TORCH_NVCC_DEFINES, "-Werror", "all-warnings",
                     "-Xcompiler", "-Wall,-Wextra", "-Xptxas", "-v"] for arch in archs]
            runs = [pool.submit(subprocess.run, cmd, capture_output=True, text=True) for cmd in nvcc]
            try:
                import torch
            except ImportError:
                torch = None
            # the binding: syntax-checked alongside under a torch without CUDA; under a CUDA build,
            # built for real once nvcc has passed (check_binding)
            cpu_torch = torch is not None and torch.version.cuda is None
            syntax = pool.submit(check_binding_syntax, home) if cpu_torch else None
        if check_cpu(pool):
            return 1
        if home is None:
            print("build_ext --check: nvcc not found (set CUDA_HOME)", file=sys.stderr)
            return 1
        runs = [run.result() for run in runs]
        seconds = time.perf_counter() - start
    log = "".join(run.stdout + run.stderr for run in runs)
    for cmd, run in zip(nvcc, runs):
        if run.returncode != 0:
            print(" ".join(cmd), file=sys.stderr)
            print(run.stdout + run.stderr, file=sys.stderr)
            print(f"build_ext --check: nvcc failed (exit {run.returncode})", file=sys.stderr)
            return 1
    rows = parse_ptxas(log)
    if not rows:
        print(log, file=sys.stderr)
        print("build_ext --check: found no kernel in ptxas's report (did its format change?)", file=sys.stderr)
        return 1
    kernels = sorted({r["kernel"] for r in rows})
    by_key = {(r["kernel"], r["arch"]): r for r in rows}
    width = max(len(k) for k in kernels)
    arch_names = "/".join(f"sm_{a}" for a in archs)
    print(f"nvcc {arch_names}: kernels.cu compiled in {seconds:.1f} s (side by side), no warnings")
    # (registers per arch; shared memory, stack and spills the most of any arch)
    print(f"{'kernel':<{width}}  {'registers':>12}  {'smem (B)':>9}  {'stack (B)':>10}  {'spills (B)':>10}")
    print(f"{'':<{width}}  {arch_names:>12}")
    for kernel in kernels:
        per_arch = [by_key.get((kernel, f"sm_{a}"), {}) for a in archs]
        regs = "/".join(str(r.get("regs", "?")) for r in per_arch)
        stack = max(r.get("stack", 0) for r in per_arch)
        spills = max(r.get("spill_st", 0) + r.get("spill_ld", 0) for r in per_arch)
        smem = max(r.get("smem", 0) for r in per_arch)
        print(f"{kernel:<{width}}  {regs:>12}  {smem:>9}  {stack:>10}  {spills:>10}")
    sys.stdout.flush()
    spilled = [f"{r['kernel']} ({r['arch']})" for r in rows if r["spill_st"] or r["spill_ld"]]
    if spilled:  # a spill is no error, but it quietly slows the kernel down
        print(f"build_ext --check: register spills in {', '.join(spilled)}", file=sys.stderr)
        return 1
    try:
        binding = ("skipped (torch not importable)" if torch is None else
                   syntax.result() if cpu_torch else check_binding(home, archs))
        print(f"C++ binding: {binding}")
    except KernelsUnavailable as e:
        print(f"build_ext --check: {e}", file=sys.stderr)
        return 1
    return 0


def build() -> int:
    start = time.perf_counter()
    ops = load_kernels()
    if ops is None:
        print(f"build_ext --build: kernels unavailable: {unavailable_reason()}", file=sys.stderr)
        return 1
    print(f"build_ext --build: built and loaded {ops.__name__} in {time.perf_counter() - start:.1f} s "
          f"(cache: {build_dir()})")
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        sys.exit(check())
    if sys.argv[1:] == ["--build"]:
        sys.exit(build())
    print(__doc__.strip())
    print("\nusage: python build_ext.py --check | --build", file=sys.stderr)
    sys.exit(2)
