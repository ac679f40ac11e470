"""
nanopaged: a minimal, readable PagedAttention inference engine.

This file is the chapter on KV-cache management, top to bottom:
  1. the paged KV cache: BlockPool (physical blocks, ref_count, free list, prefix-cache
     index) and BlockTable (one per sequence: logical block -> physical block, copy-on-write)
  2. paged attention: the KV write, the block copy, the readable online-softmax reference
     and the fast torch path, and PagedAttention, the object the model calls
  3. the engine: LLM._step (schedule -> batch -> swaps and copies -> forward -> sample ->
     commit), driven by generate, stream or step(), and beam search (LLM._beam_step); then
     beam search's history and rank (3b), sampling (3c) and small helpers (3d)
  4. the command line

The scheduler (who runs next) lives in scheduler.py, the model in model.py, the kernels in
kernels.cu (CUDA) and kernels_cpu.c (the CPU's decode rows), both built by build_ext.py.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import copy
import json
import math
import numbers
import os
import re
import reprlib
import signal
import sys
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import NamedTuple, TypedDict

try:   # (torch takes a second to import: a Ctrl-C then ends the command line as quietly as later)
    import numpy as np
    import torch
    import torch.nn.functional as F

    import build_ext
    from build_ext import check_softcap, check_window   # (every attention path's: the kernels' module has them)
    from model import (NO_FLOAT16, ModelConfig, ModelError, device_memory, load_model, load_tokenizer,
                       override_sampling_defaults, read_generation_config, resolve_model_dir, tanh_softcap, truncated)
    from scheduler import (BeamSearchParams, RequestOutputKind, SamplingParams, Scheduler, Status, cdiv,
                           check_priority, first_visible, hash_block, is_integer, is_one_of, stop_token_set,
                           truncate_prompt_tokens_check)
except KeyboardInterrupt:
    if __name__ != "__main__":   # (imported: the importer's Ctrl-C)
        raise
    print("nanopaged: interrupted", file=sys.stderr)
    sys.exit(130)

# -----------------------------------------------------------------------------
# 1. The paged KV cache
#
# The KV cache is cut into fixed-size blocks of `block_size` token slots, like pages of
# virtual memory. A sequence owns a list of blocks (its BlockTable) that need not be
# contiguous, so memory is allocated a block at a time as the sequence grows and at most
# one partially filled block per sequence is wasted. Blocks carry a reference count, so
# several sequences can share one (parallel sampling, a common prompt prefix); a shared
# block that someone wants to write is copied first (copy-on-write).


class OutOfBlocks(RuntimeError):
    """The pool cannot hand out the blocks asked for. Nothing was changed."""


class BlockPool:
    """All physical KV blocks of all layers, and the bookkeeping that hands them out.

    A block is in exactly one of three states:
      used       ref_count > 0: held by one or more BlockTables (a full one may be in the
                 prefix cache too, shared by the tables that found it there)
      evictable  ref_count == 0 but in the prefix cache: its KV data is still valid and a
                 later request with the same prefix can revive it; evicted in
                 least-recently-used order, and only when no plain free block is left
      free       ref_count == 0, on the free list
    (num_used is counted as num_blocks - free - evictable; the tests check that it equals
    the number of blocks with ref_count > 0.)
    """

    def __init__(self, num_blocks: int, block_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device="cpu"):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a BlockPool needs num_blocks >= 1 and block_size >= 1, "
                             f"got {num_blocks} and {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        # The KV data, preallocated once: one K and one V tensor per layer. Left uninitialized:
        # no slot is ever read before it is written (the tests fill unused slots with NaN).
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        try:
            self.k_cache = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
            self.v_cache = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        except (RuntimeError, TypeError) as e:   # out of memory (torch.OutOfMemoryError is a
            # RuntimeError), or a size past int64 (torch says TypeError: "Overflow when unpacking")
            size = num_blocks * self.bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
            raise ValueError(f"cannot allocate a KV cache of {num_blocks} blocks ({size / 2**30:.1f} GiB) "
                             f"on {device}: {str(e).splitlines()[0]}") from None
        self.clear()
        self.trace = None  # a callable(str) to narrate every event (the --trace option)

    def clear(self):
        """Every block free, the prefix cache empty: the pool as it was made, its KV data aside
        (also the engine's last resort, LLM._bookkeeping, once nothing holds a block)."""
        self.ref_count = [0] * self.num_blocks
        self.free_list = deque(range(self.num_blocks))  # O(1) popleft / append
        # The prefix cache: full blocks indexed by the hash of their whole prefix.
        self.cached_blocks: dict[int, int] = {}      # prefix hash -> block id
        self.block_hash: dict[int, int] = {}         # block id -> prefix hash
        self.block_tokens: dict[int, tuple] = {}     # block id -> its token ids (to confirm a hit)
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks with ref_count 0, LRU first
        # (src, dst) block copies that copy-on-write recorded; the engine runs them
        # before the next forward pass, so the data moves before anyone reads it.
        self.pending_copies: list[tuple[int, int]] = []

    @staticmethod
    def bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype) -> int:
        """The chapter's formula: layers x (K and V) x block_size x kv_heads x head_dim x bytes."""
        return num_layers * 2 * block_size * num_kv_heads * head_dim * dtype.itemsize

    # --- counters ---
    @property
    def num_free(self) -> int:
        return len(self.free_list)

    @property
    def num_evictable(self) -> int:
        """Blocks in the prefix cache that no table holds (ref_count 0): kept for a prefix hit
        until allocate() needs them. (cached_blocks lists every cached block, held or not.)"""
        return len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free - self.num_evictable

    @property
    def num_available(self) -> int:
        """Blocks that allocate() can hand out: plain free ones, then evicted cached ones."""
        return len(self.free_list) + len(self.evictable)

    def say(self, msg: str):
        """Narrate an event to the block trace, if one is listening."""
        if self.trace:
            self.trace(msg)

    # --- allocate / free ---
    def allocate(self, n: int) -> list[int]:
        """n fresh blocks with ref_count 1, all or nothing."""
        if n > self.num_available:
            raise OutOfBlocks(f"asked for {n} blocks, only {self.num_available} available")
        blocks = []
        for _ in range(n):
            if self.free_list:
                block = self.free_list.popleft()
            else:  # no plain free block left: evict the least recently used cached one
                block, _ = self.evictable.popitem(last=False)
                self._uncache(block)
                self.say(f"evict block {block} from the prefix cache")
            self.ref_count[block] = 1
            blocks.append(block)
        if blocks:
            self.say(f"allocate blocks {blocks} ({self.num_free} free)")
        return blocks

    def incref(self, block: int):
        """One more holder: a fork, or a prefix-cache hit that revives a cached block."""
        if self.ref_count[block] == 0:
            if block not in self.evictable:
                raise ValueError(f"incref of block {block}, which is free")
            del self.evictable[block]
        self.ref_count[block] += 1

    def free(self, block: int):
        """One holder fewer; at zero the block is cached (if it is in the prefix cache) or free."""
        if self.ref_count[block] <= 0:
            raise ValueError(f"free of block {block}, which is already free (no holder)")
        self.ref_count[block] -= 1
        if self.ref_count[block] == 0:
            if block in self.block_hash:
                self.evictable[block] = None  # most recently used end of the LRU queue
            else:
                self.free_list.append(block)

    # --- the prefix cache index ---
    def lookup(self, prefix_hash: int, tokens: tuple) -> int | None:
        """The cached block for this prefix hash, if its token ids really match."""
        block = self.cached_blocks.get(prefix_hash)
        if block is None:
            return None
        if self.block_tokens[block] != tokens:  # a hash collision: never trust a hash alone
            self.say(f"hash collision on block {block}: tokens differ, not a hit")
            return None
        return block

    def register(self, block: int, prefix_hash: int, tokens: tuple):
        """Enter a full block into the prefix cache. If another block already holds the same
        prefix (two requests computed it at once), the first one stays the cached copy."""
        if prefix_hash not in self.cached_blocks and block not in self.block_hash:
            self.cached_blocks[prefix_hash] = block
            self.block_hash[block] = prefix_hash
            self.block_tokens[block] = tokens

    def reset_prefix_cache(self):
        """Every cached block becomes a plain free one (LLM.reset_prefix_cache: none is held)."""
        self.free_list.extend(self.evictable)
        self.evictable.clear()
        self.cached_blocks.clear()
        self.block_hash.clear()
        self.block_tokens.clear()
        self.say("prefix cache reset: every cached block is free")

    def _uncache(self, block: int):
        del self.cached_blocks[self.block_hash.pop(block)]
        del self.block_tokens[block]

    def new_table(self) -> "BlockTable":
        """A fresh, empty BlockTable on this pool (the scheduler calls this; it never
        imports this file)."""
        return BlockTable(self)


class BlockTable:
    """One sequence's view of the cache: logical block i lives in physical block block_ids[i].

    num_tokens counts the slots handed out so far: behind Sequence.num_tokens, the sequence's
    length, by the tokens not computed yet (between two decode steps the token just sampled,
    during a chunked prefill the rest of the prompt); token t of the sequence lives in slot
    block_ids[t // block_size] * block_size + t % block_size.

    Under a sliding window in every layer, the first num_dropped blocks have slid out of the
    window: freed, their entries DROPPED (so that logical block i stays entry i), never
    read again by any attention path. (-1 is a valid Python index: code that reads the
    table must start at num_dropped, or past the window.)
    """

    DROPPED = -1

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.block_ids: list[int] = []
        self.num_tokens = 0
        self.num_dropped = 0

    @property
    def num_held(self) -> int:
        """Blocks this table holds (a reference on each)."""
        return len(self.block_ids) - self.num_dropped

    def _last_block_is_shared_and_partial(self) -> bool:
        return (self.num_tokens % self.pool.block_size != 0
                and self.pool.ref_count[self.block_ids[-1]] > 1)

    def blocks_needed(self, n: int) -> int:
        """How many new blocks slots_for(n) will allocate (copy-on-write included)."""
        if n <= 0:
            return 0
        total = cdiv(self.num_tokens + n, self.pool.block_size)
        cow = 1 if self._last_block_is_shared_and_partial() else 0   # copy-on-write takes a fresh block
        return total - len(self.block_ids) + cow

    def slots_for(self, n: int) -> list[int]:
        """Reserve slots for n new tokens and return their physical slot ids. Allocates blocks
        as needed, all or nothing (OutOfBlocks leaves the table and the pool unchanged)."""
        bs = self.pool.block_size
        new_blocks = self.pool.allocate(self.blocks_needed(n))
        if n > 0 and self._last_block_is_shared_and_partial():
            # Copy-on-write: the block we are about to append into is also someone else's.
            # Copy the block into a fresh one (only its filled slots matter), point *our* table at the copy, and
            # leave the original to its other holders. Full shared blocks are never copied:
            # nobody writes into a full block.
            src, dst = self.block_ids[-1], new_blocks.pop(0)
            self.pool.pending_copies.append((src, dst))
            self.block_ids[-1] = dst
            self.pool.free(src)
            self.pool.say(f"copy-on-write: block {src} -> {dst} "
                           f"(ref_count of {src} now {self.pool.ref_count[src]})")
        self.block_ids.extend(new_blocks)
        start = self.num_tokens
        self.num_tokens += n
        return [self.block_ids[t // bs] * bs + t % bs for t in range(start, start + n)]

    def append_cached(self, block: int):
        """Adopt a full block found in the prefix cache, in place of computing it."""
        assert self.num_tokens % self.pool.block_size == 0, "cached blocks only extend full blocks"
        self.pool.incref(block)
        self.block_ids.append(block)
        self.num_tokens += self.pool.block_size

    def append_moved(self, blocks: list[int], num_tokens: int):
        """Take fresh blocks (allocated for this table) for a sequence moved here from another
        pool, num_tokens in all now: the engine copies their data over (Scheduler._move_table)."""
        self.block_ids += blocks
        self.num_tokens = num_tokens

    def fork(self) -> "BlockTable":
        """A second table sharing every block (ref_count + 1 each, nothing allocated)."""
        child = BlockTable(self.pool)
        for block in self.block_ids[self.num_dropped:]:
            self.pool.incref(block)
        child.block_ids, child.num_tokens = list(self.block_ids), self.num_tokens
        child.num_dropped = self.num_dropped
        return child

    def release(self):
        """Give back every block. Freed last-block-first, so that when cached blocks are later
        evicted (least recently used first), a prefix's tail goes before its head: the head is
        what other requests are most likely to share."""
        for block in reversed(self.block_ids[self.num_dropped:]):
            self.pool.free(block)
        self.block_ids, self.num_tokens, self.num_dropped = [], 0, 0

    def drop_before(self, position: int) -> list[int]:
        """Sliding window: free the blocks that hold only positions before `position`, which
        no query sees any more (every layer's window begins at or after it), and return them.
        Blocks still in the prefix cache stay there, evictable."""
        end = min(max(position, 0) // self.pool.block_size, len(self.block_ids))
        dropped = self.block_ids[self.num_dropped:end]
        for i in range(self.num_dropped, end):
            self.pool.free(self.block_ids[i])
            self.block_ids[i] = self.DROPPED
        self.num_dropped = max(self.num_dropped, end)
        return dropped

    def skip_dropped(self, n: int):
        """Begin an empty table with n blocks dropped: a sequence's, moved between pools, or
        one that takes only the prefix-cache hits its window reads (Scheduler._adopt_cached_prefix)."""
        assert not self.block_ids, "only an empty table skips blocks"
        self.block_ids, self.num_dropped = [self.DROPPED] * n, n
        self.num_tokens = n * self.pool.block_size


# -----------------------------------------------------------------------------
# 2. Paged attention
#
# Inputs of one step, over a flat batch of T query tokens from B sequences (no padding):
#   q               (T, H, D)    queries, RoPE applied
#   k_cache/v_cache (num_blocks, block_size, KVH, D)   one layer's cache
#   slot_mapping    (T,) int64   the cache slot of each query token's k, v (write_kv):
#                                block * block_size + offset, never < 0 here (no padding;
#                                the CUDA kernel would skip a -1, vLLM's mark for it)
#   block_tables    (B, max_blocks) int32   padded and DROPPED entries are never read
#   seq_lens        (B,) int32   context length of each sequence, this step's tokens included
#   query_start_loc (B+1,) int32 sequence b owns rows query_start_loc[b]:query_start_loc[b+1]
# Query j of a sequence with q_len queries sits at position seq_len - q_len + j and sees
# context positions 0..that position (causal); with a sliding window W, only that position
# - W + 1..that position. With grouped-query attention, query head h reads kv head
# h // (H // KVH).


def write_kv(k_cache, v_cache, k, v, slot_mapping):
    """Store this step's k, v (T, KVH, D) into their slots: slot = block * block_size + offset.
    A cache of another dtype than the model's (LLM's kv_cache_dtype) stores them rounded to
    it (to_cache_dtype)."""
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    for cache, x in ((k_cache, k), (v_cache, v)):
        x = to_cache_dtype(x, cache.dtype)
        if cache.dtype.itemsize == 1:   # (torch's CPU index_copy_ has no float8: their bytes are copied)
            cache, x = cache.view(torch.uint8), x.view(torch.uint8)
        cache.view(-1, kvh, d).index_copy_(0, slot_mapping, x)  # cache seen as (slots, KVH, D)


def to_cache_dtype(x, dtype):
    """x rounded to the KV cache's dtype. A float8 cache saturates: a value past the format's
    largest (448 for e4m3, 57,344 for e5m2) is stored as that largest, as vLLM's kernels store
    it, where torch's own cast makes e5m2's inf. No scale divides it first: vLLM's default
    scale of 1.0, which K and V, a few units in size, fit (what float8 costs is precision: 3
    mantissa bits in e4m3, 2 in e5m2, against bfloat16's 7)."""
    if x.dtype == dtype:
        return x
    if dtype.itemsize == 1:
        big = torch.finfo(dtype).max
        x = x.clamp(-big, big)
    return x.to(dtype)


def copy_blocks(src_caches, dst_caches, pairs):
    """Copy whole blocks: block s of each source cache onto block d of its twin in dst_caches,
    for each (s, d) in pairs (block ids); each cache (num_blocks, block_size, KVH, D), one
    layer's k or v. Copy-on-write's copies stay in one pool (src_caches is dst_caches: every
    layer's k and v caches); swapping's go between two (swap_blocks). Each cache's blocks are
    gathered on the source's device and moved in one copy."""
    if not pairs:
        return
    src = torch.tensor([s for s, _ in pairs], device=src_caches[0].device)
    dst = torch.tensor([d for _, d in pairs], device=dst_caches[0].device)
    for src_cache, dst_cache in zip(src_caches, dst_caches):
        dst_cache[dst] = src_cache[src].to(dst_cache.device)


def copy_waves(pairs: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """pairs (src, dst), in order, cut into runs in which no block is both read and written,
    nor written twice, so that a run's copies may run at once, in any order, and give what
    copying the pairs one after another gives."""
    waves, read, written = [[]], set(), set()
    for src, dst in pairs:
        if dst in read or src in written or dst in written:
            waves.append([])
            read, written = set(), set()
        waves[-1].append((src, dst))
        read.add(src)
        written.add(dst)
    return waves


def swap_blocks(src_pool, dst_pool, pairs):
    """Swapping: copy whole blocks (src, dst) from one pool to another, in every layer:
    from the GPU's pool to the swap space in CPU memory, or back. (Through pageable memory: a
    production engine pins the swap space and copies blocks into it directly, without
    waiting for them.) Without a swap space (the pools may be None), pairs is empty."""
    if pairs:
        copy_blocks((*src_pool.k_cache, *src_pool.v_cache), (*dst_pool.k_cache, *dst_pool.v_cache), pairs)


def paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, window=None,
                        softcap=None):
    """The chapter's algorithm, written to be read: walk each sequence's blocks through its
    block table, and fold them into the output one block at a time with online softmax.

    For each query we keep a running max m, a running sum of exponentials l and an
    unnormalized output acc. When a block with scores s arrives:
        m_new = max(m, max(s));  alpha = exp(m - m_new)        (rescales what we had)
        p = exp(s - m_new);      l = l * alpha + sum(p);   acc = acc * alpha + p @ V_block
    and at the end out = acc / l: the softmax over every position the query sees, without
    ever holding more than one block of scores.

    With a sliding window W, the query at position p sees only positions p - W + 1 ..= p:
    blocks wholly before the first query's window are never read. softcap (Gemma 2's): the
    scores squashed into (-softcap, softcap), softcap * tanh(s / softcap), before the softmax.
    """
    check_window(window)
    check_softcap(softcap)
    _, H, D = q.shape   # (T, H, D)
    block_size, kvh = k_cache.shape[1], k_cache.shape[2]
    group = H // kvh
    out = torch.empty_like(q)
    for b in range(len(seq_lens)):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        seq_len, q_len = int(seq_lens[b]), end - start
        if q_len == 0:
            continue
        qb = q[start:end].float()                                     # (q_len, H, D)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)  # each query's position
        m = torch.full((q_len, H), float("-inf"), device=q.device)
        l = torch.zeros(q_len, H, device=q.device)
        acc = torch.zeros(q_len, H, D, device=q.device)
        first = first_visible(seq_len - q_len, window)                # what the first query sees
        for i in range(first // block_size, cdiv(seq_len, block_size)):  # logical blocks in order
            block = int(block_tables[b, i])                           # -> physical block
            lo = max(first - i * block_size, 0)                       # (a window may start mid-block)
            n = min(block_size, seq_len - i * block_size)             # filled slots of this block
            kb = k_cache[block, lo:n].float().repeat_interleave(group, dim=1)  # (n - lo, H, D)
            vb = v_cache[block, lo:n].float().repeat_interleave(group, dim=1)  # (n - lo, H, D)
            s = torch.einsum("qhd,khd->qhk", qb, kb) * scale          # (q_len, H, n - lo)
            if softcap is not None:
                s = tanh_softcap(s, softcap)
            k_pos = torch.arange(i * block_size + lo, i * block_size + n, device=q.device)
            visible = k_pos[None, :] <= q_pos[:, None]                # (q_len, n - lo) causal
            if window is not None:
                visible &= k_pos[None, :] > q_pos[:, None] - window
            s = s.masked_fill(~visible[:, None, :], float("-inf"))   # (q_len, H, n - lo): one mask, every head
            m_new = torch.maximum(m, s.amax(dim=-1))                  # (q_len, H)
            # A query may see nothing yet (its window starts in a later block): m_new is -inf,
            # and -inf - -inf would be NaN. Subtracting 0 instead keeps its l and acc at 0.
            base = m_new.masked_fill(m_new == float("-inf"), 0)
            alpha = torch.exp(m - base)
            p = torch.exp(s - base[..., None])                        # (q_len, H, n - lo)
            l = l * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + torch.einsum("qhk,khd->qhd", p, vb)   # (q_len, H, D)
            m = m_new
        out[start:end] = (acc / l[..., None]).to(q.dtype)
    return out


class GatherPlan:
    """What the fast torch path derives from a step's metadata, once per step rather than
    once per layer (every layer of the step shares it): what to gather, and how to batch it.

    The fast path gathers each sequence's context from its blocks into a dense tensor and
    runs scaled_dot_product_attention on it. Decode sequences (one query each) are sorted
    by the length they gather (the context, or its window) and stacked, DECODE_BUCKET at a
    time, into padded batches: sorting first keeps the padding small, since neighbours have
    similar lengths. Sequences with several queries (prefill chunks) get one call each. The
    gather indices point only at slots inside a context: positions past a sequence's end
    are clamped to its first gathered position and masked out, so padding never reads a
    slot the sequence does not own (a NaN there would leak in through 0 * NaN).

    With a sliding window (a plan per window: the layers of a step share it too), only the
    positions some query can see are gathered, from the first query's window start on:
    a decode step of a windowed layer reads at most `window` positions, however long the
    context.

    With the CPU kernel (kernels_cpu.c) the decode sequences are not gathered at all
    (gather_decodes=False): the kernel reads their blocks in place; decode_seqs lists them.
    """

    DECODE_BUCKET = 8  # decode sequences per padded batch (8 measured best on a 2-core CPU)

    def __init__(self, block_tables, seq_lens, query_start_loc, block_size, window=None, gather_decodes=True):
        check_window(window)
        self.window = window
        device = block_tables.device
        lens = seq_lens.tolist()
        qsl = query_start_loc.tolist()
        q_lens = [qsl[b + 1] - qsl[b] for b in range(len(lens))]
        # the first position any query of sequence b can see
        firsts = [first_visible(lens[b] - q_lens[b], window) for b in range(len(lens))]
        # Decode buckets: (q rows, slots (n * Lmax,) to gather, (n, 1, 1, Lmax) length mask,
        # n, Lmax) each; Lmax is the bucket's longest gather.
        decode = sorted((b for b, n in enumerate(q_lens) if n == 1), key=lambda b: lens[b] - firsts[b])
        self.decode_seqs = torch.tensor(decode, dtype=torch.int64, device=device)   # (decodes,)
        self.gather_decodes = gather_decodes
        self.decode_buckets = []
        for i in range(0, len(decode) if gather_decodes else 0, self.DECODE_BUCKET):
            seqs = decode[i:i + self.DECODE_BUCKET]
            idx = torch.tensor(seqs, device=device)
            Lmax = max(lens[b] - firsts[b] for b in seqs)
            starts = torch.tensor([firsts[b] for b in seqs], device=device)
            slots, valid = self._slots(block_tables[idx], starts, seq_lens[idx].long(), Lmax, block_size)
            rows = query_start_loc[idx].long()   # (n,) each decode's one query row in the flat batch
            self.decode_buckets.append((rows, slots.reshape(-1), valid[:, None, None, :], len(seqs), Lmax))
        # The gathered K and V, (2, n * Lmax, KVH, D) for the largest bucket, allocated by the
        # first layer and rewritten by every other bucket and layer: a fresh tensor per
        # gather would cost more in page faults than the gather itself.
        self.workspace = None
        self.workspace_rows = max((n * Lmax for *_, n, Lmax in self.decode_buckets), default=0)
        # Prefill sequences: (row range, slots, mask or None) each. The mask is aligned
        # bottom-right: the queries are the *last* q_len positions of the context. With
        # nothing cached before them (q_len == context) and no window cutting in, it is plain
        # causal attention, which SDPA does without a mask tensor.
        self.prefills = []
        for b, n in enumerate(q_lens):
            if n <= 1:
                continue
            L, first = lens[b], firsts[b]
            starts = torch.tensor([first], device=device)
            slots, _ = self._slots(block_tables[b:b + 1], starts, seq_lens[b:b + 1].long(), L - first, block_size)
            mask = None
            if n < L or (window is not None and window < L):
                q_pos = torch.arange(L - n, L, device=device)[:, None]       # (q_len, 1)
                k_pos = torch.arange(first, L, device=device)[None, :]       # (1, L - first)
                mask = k_pos <= q_pos                                        # (q_len, L - first)
                if window is not None:
                    mask &= k_pos > q_pos - window
            self.prefills.append((qsl[b], qsl[b + 1], slots[0], mask))

    @staticmethod
    def _slots(tables, starts, lens, max_len, block_size):
        """Slots of the positions starts[b] .. starts[b] + max_len - 1 of each sequence
        (B, max_len), and which of them lie before its end; those past it are clamped to
        starts[b]."""
        pos = starts[:, None] + torch.arange(max_len, device=tables.device)[None, :]  # (B, L)
        valid = pos < lens[:, None]                                    # (B, L)
        pos = torch.where(valid, pos, starts[:, None])                 # (B, L)
        blocks = tables.long().gather(1, pos // block_size)           # (B, L) physical block ids
        return blocks * block_size + pos % block_size, valid


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, window=None, plan=None,
                    softcap=None, decode_kernel=None):
    """The fast torch path: same inputs and result as paged_attention_ref (a plan, if given,
    made for the same step and window). decode_kernel: the CPU kernel
    (build_ext.load_cpu_kernels()) for the decode rows, in place of their gather and SDPA."""
    if plan is None:
        plan = GatherPlan(block_tables, seq_lens, query_start_loc, k_cache.shape[1], window,
                          gather_decodes=decode_kernel is None)
    if plan.window != window:
        raise ValueError(f"the plan was made for window {plan.window}, not {window}")
    check_softcap(softcap)
    if decode_kernel is None and not plan.gather_decodes and len(plan.decode_seqs):
        raise ValueError("the plan was made for the CPU kernel (gather_decodes=False): pass decode_kernel")
    T, H, D = q.shape
    kvh = k_cache.shape[2]
    group = H // kvh
    k_flat = k_cache.view(-1, kvh, D)                                  # (slots, KVH, D)
    v_flat = v_cache.view(-1, kvh, D)
    out = q.new_empty(T, H, D)
    if decode_kernel is not None and len(plan.decode_seqs):
        decode_kernel.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                       plan.decode_seqs, scale, out, window, softcap)
    if plan.decode_buckets and plan.workspace is None:
        plan.workspace = q.new_empty(2, plan.workspace_rows, kvh, D)
    for rows, slots, mask, n, L in plan.decode_buckets:
        kd, vd = plan.workspace[0, :n * L], plan.workspace[1, :n * L]
        gather_slots(k_flat, slots, kd)                                # (n * L, KVH, D)
        gather_slots(v_flat, slots, vd)
        # GQA without copying K/V: the `group` query heads that share a kv head become
        # `group` query rows of that kv head: (n, KVH, group, D) against (n, KVH, L, D).
        od = attend(q[rows].view(n, kvh, group, D), kd.view(n, L, kvh, D).transpose(1, 2),
                    vd.view(n, L, kvh, D).transpose(1, 2), mask, scale, softcap)
        out.index_copy_(0, rows, od.reshape(n, H, D))                  # (n, KVH, group, D) -> (n, H, D)
    for start, end, slots, mask in plan.prefills:
        qp = q[start:end].transpose(0, 1)[None]                        # (1, H, q_len, D)
        kp = k_flat[slots].to(q.dtype).transpose(0, 1)[None]           # (1, KVH, len(slots), D)
        vp = v_flat[slots].to(q.dtype).transpose(0, 1)[None]
        op = attend(qp, kp, vp, mask, scale, softcap)                  # (1, H, q_len, D)
        out[start:end] = op[0].transpose(0, 1)                         # (q_len, H, D)
    return out


def gather_slots(cache_flat, slots, out):
    """out = cache_flat[slots], (slots, KVH, D), in out's dtype: a cache of another dtype than
    the model's (kv_cache_dtype) is widened as it is gathered. (Every float8 value is exact in
    float16, bfloat16 and float32 alike, a bfloat16 one in float32: only the store rounds.)"""
    if cache_flat.dtype == out.dtype:
        torch.index_select(cache_flat, 0, slots, out=out)   # (into the workspace: no temporary)
    else:
        out.copy_(cache_flat[slots])


SOFTCAP_ROWS = 256   # query rows per block of scores where attention is written out (softcap)


def attend(q, k, v, mask, scale, softcap=None):
    """Attention over dense tensors: q (B, H, Lq, D), k and v (B, KVH, L, D), mask broadcast
    to (B, H, Lq, L), True where a query sees a key, or None: causal (Lq == L). SDPA does it;
    4-D inputs and enable_gqa let it pick its fused (flash) CPU kernel, which also reads each
    kv head once for its whole group of query heads. SDPA has no softcap: with Gemma 2's, the
    same is written out, in float32, SOFTCAP_ROWS query rows at a time (a 2k-token chunk over
    an 8k context would otherwise hold a (16 heads, 2k, 8k) score matrix: 1 GiB)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=q.shape[1] != k.shape[1])
    B, H, Lq, D = q.shape
    KVH, L = k.shape[1], k.shape[2]
    k, v = k.float(), v.float()                                        # (B, KVH, L, D)
    if mask is None:
        mask = torch.ones(Lq, L, dtype=torch.bool, device=q.device).tril()   # (Lq, L)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)   # (B, H, Lq, D)
    for i in range(0, Lq, SOFTCAP_ROWS):
        rows = min(SOFTCAP_ROWS, Lq - i)
        # GQA without repeating K/V per query head: query head h reads kv head h // group, so
        # the rows of one kv head's group of heads stack into one matrix against that head's K.
        qg = q[:, :, i:i + rows].float().reshape(B, KVH, -1, D)       # (B, KVH, group * rows, D)
        s = (qg @ k.transpose(-1, -2) * scale).view(B, H, rows, L)     # (B, H, rows, L)
        s = tanh_softcap(s, softcap)
        seen = mask if mask.shape[-2] == 1 else mask[..., i:i + rows, :]   # (a decode's: every row)
        p = s.masked_fill(~seen, float("-inf")).softmax(-1).view(B, KVH, -1, L)   # (B, KVH, group * rows, L)
        out[:, :, i:i + rows] = (p @ v).view(B, H, rows, D)           # (B, KVH, group * rows, D) -> (B, H, rows, D)
    return out.to(q.dtype)


class PagedAttention:
    """The attention object the model calls: out = attn(layer_idx, q, k, v, window).

    The model hands over its new q (T, H, D), k and v (T, KVH, D) and its sliding window
    (None: full attention); this writes k and v into the paged cache at the step's
    slot_mapping, then attends over each sequence's blocks (with a window, over the positions
    inside it only: the blocks wholly before it may be dropped, see BlockTable.drop_before).
    The engine calls begin_step() with the flat batch's metadata before each forward pass,
    and end_step() after it. The backend is chosen once: "torch" (the fast torch path
    above), "cpu" (the same, with the decode rows on kernels_cpu.c) or "cuda" (kernels.cu).
    """

    def __init__(self, pool: BlockPool, scale: float, ops=None, softcap: float | None = None, decode_kernel=None):
        check_softcap(softcap)
        if ops is not None and softcap is not None:
            raise ValueError("the CUDA kernel has no softcap for the attention scores")
        if ops is not None and decode_kernel is not None:
            raise ValueError("attention runs on the CUDA kernel or on the CPU one, not both")
        self.pool, self.scale, self.ops, self.softcap, self.decode_kernel = pool, scale, ops, softcap, decode_kernel
        self.backend = "cuda" if ops is not None else "cpu" if decode_kernel is not None else "torch"

    def begin_step(self, slot_mapping, block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len):
        self.slot_mapping, self.block_tables = slot_mapping, block_tables
        self.seq_lens, self.query_start_loc = seq_lens, query_start_loc
        self.max_query_len, self.max_seq_len = max_query_len, max_seq_len
        self.plans = {}  # the torch path's gather plans by window, shared by all layers of the step

    def end_step(self):
        """Let go of the step's metadata and plans: a long prefill's mask, a decode batch's
        gathered keys, can take tens of MB (a GB, at 32k tokens of a big model), which an idle
        engine has no use for."""
        self.begin_step(None, None, None, None, 0, 0)

    def __call__(self, layer_idx: int, q, k, v, window: int | None = None):
        k_cache, v_cache = self.pool.k_cache[layer_idx], self.pool.v_cache[layer_idx]
        if self.ops is not None:
            self.ops.write_kv(k, v, k_cache, v_cache, self.slot_mapping)
            return self.ops.paged_attention(q, k_cache, v_cache, self.block_tables, self.seq_lens,
                                            self.query_start_loc, self.scale,
                                            self.max_query_len, self.max_seq_len, window=window or 0)  # 0: none
        write_kv(k_cache, v_cache, k, v, self.slot_mapping)
        if window not in self.plans:
            self.plans[window] = GatherPlan(self.block_tables, self.seq_lens, self.query_start_loc,
                                            self.pool.block_size, window,
                                            gather_decodes=self.decode_kernel is None)
        return paged_attention(q, k_cache, v_cache, self.block_tables, self.seq_lens, self.query_start_loc,
                               self.scale, window, plan=self.plans[window], softcap=self.softcap,
                               decode_kernel=self.decode_kernel)

    def copy_blocks(self, copies):
        """Copy-on-write's block copies, in every layer, before the forward pass reads them."""
        if not copies:
            return
        if self.ops is None:
            caches = (*self.pool.k_cache, *self.pool.v_cache)
            copy_blocks(caches, caches, copies)
            return
        # The kernel copies a launch's pairs all at once, in no set order; the torch copy above
        # reads every source before it writes. A block can be both: read by a copy-on-write,
        # then freed (its last other holder preempted later in the same schedule()) and handed
        # to a later copy-on-write as its destination (or be a destination twice so). Such a
        # copy waits for a launch of its own.
        for wave in copy_waves(copies):
            pairs = torch.tensor(wave, dtype=torch.int64, device=self.pool.k_cache[0].device)   # (P, 2)
            for cache in (*self.pool.k_cache, *self.pool.v_cache):
                self.ops.copy_blocks(cache, pairs)


# -----------------------------------------------------------------------------
# 3. The engine
#
# One step (LLM._step): Scheduler.schedule() picks the work and allocates its blocks ->
# _prepare builds one flat batch (no padding) -> swaps and copy-on-write copies run -> the
# model's forward pass, whose attention layers write K/V through slot_mapping and read them
# through block_tables -> the logits of every sequence that reached its last token are
# sampled (or, for a beam search, chosen by _beam_step), and the logprobs asked for taken
# (_logprobs) -> _commit records the step
# (Scheduler.update). The bookkeeping at both ends runs under defer_ctrl_c (LLM._bookkeeping,
# which has a last resort should it raise itself); a step that raises in between is undone
# by Scheduler.rollback. The block trace's lines are collected
# during the step and written at its end (_flush_trace).


# vLLM's prompt dicts, to write them as vLLM's scripts do (TokensPrompt(prompt_token_ids=ids)):
# at run time they are plain dicts, which _parse_prompt reads
class TextPrompt(TypedDict, total=False):   # (prompt required)
    prompt: str
    cache_salt: str            # its blocks shared in the prefix cache only with prompts of the same salt


class TokensPrompt(TypedDict, total=False):   # (prompt_token_ids required: _parse_prompt says so)
    prompt_token_ids: list[int]
    prompt: str                # its text, if given: not tokenized, the output's prompt
    cache_salt: str


class Prompt(NamedTuple):
    """A prompt as _parse_prompt reads it."""
    text: str | None           # None if given as token ids alone
    ids: list[int]
    specials: tuple = (0, 0)   # special tokens at its head and tail (Tokenizer.specials_around: kept by truncation)
    cache_salt: str | None = None   # (a prompt dict's)


@dataclass
class Logprob:
    logprob: float             # natural log of the token's probability
    rank: int | None = None    # 1 the likeliest: 1 + the tokens likelier or as likely (ties count
                               # against it); for one of the top k, its place among them
    decoded_token: str | None = None   # None where the request asked for no text (detokenize=False)


@dataclass
class CompletionOutput:
    index: int                 # which of the request's n samples
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "repetition" (SamplingParams.repetition_detection),
                               # "abort", "error" (non-finite logits, or no token left to draw): vLLM's words
    stop_reason: int | str | None = None   # the stop string or stop token id that ended it (EOS: None;
                                           # finish_reason "repetition": "repetition_detected")
    # with SamplingParams.logprobs = k: one {token id: Logprob} per token id, the token's first,
    # then the k most likely (k + 1 entries, or k when it is among them); and their sum
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    lora_request: None = None  # (vLLM's; always None: nanopaged has no LoRA adapters)

    def finished(self) -> bool:   # (vLLM's)
        return self.finish_reason is not None


def own_copy(out: CompletionOutput) -> CompletionOutput:
    """A copy of out whose lists are its own: a caller may change (append to) the output it
    got without changing the next one, which the engine makes from the same kept final."""
    return replace(out, token_ids=list(out.token_ids), logprobs=None if out.logprobs is None else list(out.logprobs))


@dataclass
class RequestOutput:
    request_id: object
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int     # prompt tokens not computed thanks to the prefix cache (under a
                               # sliding window, those before the window too: not read, not cached)
    ttft: float                # seconds from arrival to first token
    latency: float             # seconds from arrival to the last sample's finish
    # with SamplingParams.prompt_logprobs = k: the same per prompt token, None for the first
    # (and for each one up to prompt_logprob_start, where that is given)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # with SamplingParams.prompt_logprob_token_ids: a numpy float32 (rows, ids) array, row i the
    # logprobs of its ids as prompt token prompt_logprob_start + i + 1 (-inf where -1 pads it)
    prompt_token_id_logprobs: object = None
    finished: bool = True      # False: an output before the request's end (SamplingParams.output_kind)
    # vLLM's, always None here (a script may test them): its offline LLM logs no per-request
    # metrics either (ttft and latency above, llm.stats); no LoRA, encoder or KV transfer
    metrics: None = None
    lora_request: None = None
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
    kv_transfer_params: None = None


@dataclass
class BeamSearchSequence:
    """One result of a beam search (vLLM's)."""
    tokens: list[int]          # the prompt's, then the output's
    logprobs: list[dict[int, Logprob]]   # per output token (a final EOS too): the candidates of
                               # its beam at that step, {token id: Logprob}, the chosen one first
    cum_logprob: float = 0.0   # the sum of the output tokens' log-probabilities (a final EOS's too)
    text: str | None = None    # all the tokens decoded, prompt included (special tokens: skip_special_tokens)
    finish_reason: str | None = None   # "stop" (EOS), "length", "abort" or "error" (vLLM sets only
                                       # "abort", and "length" at max_model_len; else None)
    stop_reason: int | str | None = None   # with "stop": the EOS id, the last of tokens (nanopaged's)


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]   # the best first: beam_width of them (fewer if fewer ended)


class GenerationError(RuntimeError):
    """A request failed inside the engine: its model gave non-finite logits, or its
    constraints (allowed_token_ids, bad_words) left it no token to draw."""


# why a sequence failed (Sequence.error), when it ends with finish_reason "error"
NOT_FINITE = "the model's logits are not finite (NaN or inf)"


class IncrementalDetokenizer:
    """The text of a sample's growing output, decoded as tokens arrive: each call decodes
    only the tokens added since the last one, where decoding the whole output every step
    would cost time quadratic in its length. A character whose UTF-8 bytes are split
    across tokens (an emoji, often) comes out once its last byte has arrived."""

    def __init__(self, tokenizer, skip_special_tokens: bool = False):
        self.tokenizer, self.num_tokens, self.skip_special_tokens = tokenizer, 0, skip_special_tokens
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def new_text(self, token_ids: list[int]) -> str:
        """The text that token_ids[self.num_tokens:] add."""
        new = self.tokenizer.decode_bytes(token_ids[self.num_tokens:], self.skip_special_tokens)
        self.num_tokens = len(token_ids)   # (after decoding: a decode that fails skips nothing)
        return self.utf8.decode(new)


class GrowingText:
    """A sample's text as its tokens arrive, and how much of it is settled: sure to begin its
    final text. Its last len(longest stop string) - 1 characters could begin a stop string,
    before which the final text ends: they wait until the next tokens tell. (With
    include_stop_str_in_output the final text keeps a stop string: nothing waits.) What
    stream() yields, and step()'s outputs show before a request ends (RequestOutputKind)."""

    def __init__(self, tokenizer, params: SamplingParams):
        self.detokenizer, self.text = IncrementalDetokenizer(tokenizer, params.skip_special_tokens), ""
        self.hold = 0 if params.include_stop_str_in_output else max(map(len, params.stop or ()), default=1) - 1

    def settled(self, token_ids: list[int]) -> int:
        """Decode the tokens added since the last call; return how many characters of the text are settled."""
        self.text += self.detokenizer.new_text(token_ids)
        return max(len(self.text) - self.hold, 0)


class StopStringScan:
    """Finds the first stop string to end in a sample's text as it grows. A stop string that
    appears now ends in the new text, so it began at most len(longest stop) - 1
    characters before it: only that tail and the new text are searched."""

    def __init__(self, tokenizer, stops: list[str], skip_special_tokens: bool = False):
        self.detokenizer, self.stops = IncrementalDetokenizer(tokenizer, skip_special_tokens), stops
        self.keep = max(map(len, stops)) - 1
        self.tail, self.tail_start = "", 0   # the text's last `keep` characters, and where they begin
        self.found: int | None = None        # where the first stop string begins, once one has appeared
        self.stop: str | None = None         # and which it is

    def find(self, token_ids: list[int], armed: bool = True) -> int | None:
        """Scan the text that token_ids add; return (and keep) where a stop string that it
        completes begins. armed=False scans without stopping (SamplingParams.min_tokens)."""
        window = self.tail + self.detokenizer.new_text(token_ids)
        # only a stop string that ends in the new text (one that ends in the tail was seen
        # before, and did not count then: armed=False). Of two that the new text completes,
        # the one that ends first wins, as if the text came a character at a time; of two
        # that end together, the first listed (vLLM's rule since 0.27)
        best = None   # (where it ends, where it begins, the stop string)
        for stop in self.stops if armed else ():
            i = window.find(stop, max(len(self.tail) - len(stop) + 1, 0))
            if i >= 0 and (best is None or i + len(stop) < best[0]):
                best = (i + len(stop), i, stop)
        if best is not None:
            self.found, self.stop = self.tail_start + best[1], best[2]
            return self.found
        cut = max(len(window) - self.keep, 0)
        self.tail, self.tail_start = window[cut:], self.tail_start + cut
        return None


class Shown(NamedTuple):
    """How much of a sample the outputs handed out so far held (its last output's, or under DELTA their sum)."""
    tokens: int = 0
    chars: int = 0
    ended: bool = False   # its finish_reason was handed out

    def after(self, c: CompletionOutput) -> "Shown":
        """Once c is handed out too (from Shown() where c holds all the sample so far)."""
        return Shown(self.tokens + len(c.token_ids), self.chars + len(c.text), c.finished())

    def news(self, num_tokens: int, finished: bool) -> bool:
        """Whether a sample of num_tokens tokens has something not handed out: tokens, or its end."""
        return num_tokens > self.tokens or (finished and not self.ended)


@dataclass(eq=False)
class Request:
    """The engine's record of one request, from add_request until its final output is handed out (LLM._requests):
    what its output is made of, beside the Sequences the scheduler runs."""
    prompt: str | None                # the text, None if given as token ids alone
    params: SamplingParams            # the request's own copy (request_copy), limits filled in
    seqs: list                        # its Sequences: the samples (n > 1: forked as the prompt ends), or beams
    stop_scans: dict = field(default_factory=dict)   # sample index -> its StopStringScan
    logprobs: dict = field(default_factory=dict)     # sample index -> one {token id: Logprob} per output token
    cumulative: dict = field(default_factory=dict)   # sample index -> the sum of its tokens' logprobs so far
    prompt_logprobs: list | None = None              # one entry per prompt position, filled as the prompt runs
    prompt_token_id_logprobs: torch.Tensor | None = None   # (scored rows, ids) float32 on the CPU,
                                                     # filled as the prompt runs (NaN: a row not computed yet)
    # A beam search's (see _beam_step):
    # live beam -> (cumulative logprob, its history: its candidates at each step, as a linked
    # list (the steps before, this step's) that the beams it forks into share; see beam_history)
    beams: dict = field(default_factory=dict)
    parked: dict = field(default_factory=dict)       # beam -> its candidates, computed before its siblings' were
    done: list = field(default_factory=list)         # (output ids, cumulative logprob, history, "stop"): ended in EOS
    # What its outputs before the end handed out (output_kind CUMULATIVE, DELTA; see _request_output):
    texts: dict = field(default_factory=dict)        # sample index -> its GrowingText
    finals: dict = field(default_factory=dict)       # sample index -> its CompletionOutput, once it finished
    shown: dict = field(default_factory=dict)        # sample index -> Shown: what was handed out of it (empty:
                                                     # no output yet; DELTA gives the prompt logprobs in the first)


@dataclass
class RunningMean:
    """The mean of numbers as they come, kept as their count and sum: an engine serving
    add_request / step for ever (never reset) would otherwise keep every request's number."""
    count: int = 0
    total: float = 0.0

    def add(self, x: float):
        self.count, self.total = self.count + 1, self.total + x

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None


@dataclass
class Stats:
    """What --stats prints. generate() and stream() reset it; each step adds its counts and
    peaks (_record_usage, _commit), each reported request its TTFT, TPOTs and prompt tokens."""
    steps: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    elapsed: float = 0.0       # seconds spent in steps
    ttft: RunningMean = field(default_factory=RunningMean)   # seconds, of each request reported with a token
    tpot: RunningMean = field(default_factory=RunningMean)   # seconds, of each sample of 2+ tokens
    peak_blocks_used: int = 0
    peak_running: int = 0      # (not in the summary: bench.py's memory comparison reads it)
    peak_blocks_listed: int = 0   # the running sequences' tables' blocks, a shared one once per table:
                                  # what unshared copies would use (bench.py's beam search reads it)
    allocated_slots: int = 0   # summed over steps, per sequence: blocks held x block_size
    filled_slots: int = 0      # ... and slots actually holding a token
    preemptions: int = 0
    swapped_out: int = 0       # of the preemptions, those by swapping
    prefix_hit_tokens: int = 0
    prefix_query_tokens: int = 0

    def summary(self, num_blocks: int) -> str:
        # (a mean of none, "n/a": no request had a first token, or a second one to time)
        ms = lambda m: f"{1000 * m.mean:9.1f} ms (mean)" if m.count else f"{'n/a':>9}"  # noqa: E731
        per_s = lambda n: n / self.elapsed if self.elapsed else float("nan")  # noqa: E731
        waste = 100 * (1 - self.filled_slots / self.allocated_slots) if self.allocated_slots else 0.0
        hit = 100 * self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
        return "\n".join([
            f"time to first token   {ms(self.ttft)}",
            f"time per output token {ms(self.tpot)}",
            f"throughput            {per_s(self.output_tokens):9.1f} output tok/s, "
            f"{per_s(self.prompt_tokens + self.output_tokens):.1f} total tok/s "
            f"({self.output_tokens} output + {self.prompt_tokens} prompt tokens in {self.elapsed:.2f} s, "
            f"{self.steps} steps)",
            f"peak KV blocks used   {self.peak_blocks_used:9d} of {num_blocks}",
            f"KV waste              {waste:9.2f} % of allocated slots unfilled",
            f"prefix-cache hit rate {hit:9.1f} % of prompt tokens",
            f"preemptions           {self.preemptions:9d}"
            + (f" ({self.swapped_out} by swapping to CPU memory)" if self.swapped_out else ""),
        ])


@contextlib.contextmanager
def defer_ctrl_c():
    """Hold a Ctrl-C that arrives inside the block until the block's end. Python raises
    KeyboardInterrupt between any two bytecodes; in the middle of moving a sequence between
    queues or a block between owners, it would leave a sequence in no queue or a block
    owned by nobody. (Signals reach the main thread only: elsewhere nothing to hold.)"""
    held = []   # the Ctrl-Cs that came inside the block
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield   # (None: a handler installed outside Python, which we could not put back)
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:
            signal.raise_signal(signal.SIGINT)   # now: the usual handler raises KeyboardInterrupt


# vLLM's LLM(...) options for what nanopaged leaves out (README: "What nanopaged leaves to
# production engines"), or does its own way: name -> (the values that ask for nothing it lacks,
# what to say of any other). A vLLM script runs unchanged where it passes those values (vLLM's
# examples write tensor_parallel_size=1, enforce_eager=True...), and any other value is refused
# by name, not with a TypeError about an unexpected keyword.
VLLM_ONLY_OPTIONS = {
    "tensor_parallel_size": ((1,), "nanopaged runs on one device: no tensor parallelism"),
    "pipeline_parallel_size": ((1,), "nanopaged runs on one device: no pipeline parallelism"),
    "data_parallel_size": ((1,), "nanopaged runs one engine: no data parallelism"),
    "quantization": ((None,), "nanopaged has no quantized weights (a GGUF's are dequantized as it is converted)"),
    "calculate_kv_scales": ((False,), "nanopaged's float8 KV cache has no scales (vLLM's default, 1.0): "
                                      "K and V are stored as they are, saturated at the format's largest value"),
    "enable_lora": ((False,), "nanopaged has no LoRA adapters"),
    "speculative_config": ((None,), "nanopaged has no speculative decoding"),
    # (either value: False only allows CUDA graphs, True only permits a model's own code)
    "enforce_eager": ((True, False), "nanopaged always runs eagerly, without CUDA graphs"),
    "trust_remote_code": ((True, False), "nanopaged runs no code from a model's files"),
    "disable_log_stats": ((True,), "nanopaged logs no stats as it runs: llm.stats holds them"),
    "gpu_memory_utilization": ((None,), "nanopaged sizes its KV cache by kv_cache_memory (bytes) or num_blocks"),
    "task": (("auto", "generate"), "nanopaged generates: no other task"),
    "runner": (("auto", "generate"), "nanopaged generates: no other runner"),
    "logprobs_mode": (("raw_logprobs",), "nanopaged's logprobs are the model's own, a log_softmax of its logits"),
    # (the model and its tokenizer come from local files, as they are)
    "tokenizer_mode": (("auto", "hf"), "nanopaged reads the model's tokenizer.json, as HF's fast tokenizer does"),
    "skip_tokenizer_init": ((False,), "nanopaged always loads the tokenizer"),
    "revision": ((None,), "nanopaged loads local files: no revisions"),
    "tokenizer_revision": ((None,), "nanopaged loads local files: no revisions"),
    "download_dir": ((None,), "nanopaged loads local files: no downloads"),
    "hf_token": ((None,), "nanopaged loads local files: no downloads"),
    "hf_overrides": ((None, {}), "nanopaged reads config.json as it is"),
    "enable_chunked_prefill": ((True, None), "nanopaged chunks a prefill past the token budget: "
                                             "a max_num_batched_tokens of the longest prompt chunks none"),
    "cpu_offload_gb": ((0,), "nanopaged keeps the weights on the device"),
    "enable_sleep_mode": ((False,), "nanopaged has no sleep mode"),
    "distributed_executor_backend": ((None,), "nanopaged runs in one process"),
    "compilation_config": ((None,), "nanopaged always runs eagerly, without torch.compile or CUDA graphs"),
    "structured_outputs_config": ((None,), "nanopaged has no structured outputs (grammar-constrained decoding)"),
    "logits_processors": ((None, []), "nanopaged has no custom logits processors (SamplingParams has "
                                      "logit_bias, allowed_token_ids and bad_words)"),
    "profiler_config": ((None,), "nanopaged has no profiler of its own: run it under cProfile or torch.profiler"),
    "enable_prompt_embeds": ((False,), "nanopaged takes token ids or text as prompts, not embeddings"),
    "config_format": (("auto", "hf"), "nanopaged reads config.json, HF's format"),
    "attention_config": ((None,), "nanopaged picks its attention with attn_backend"),
    "quantization_config": ((None,), "nanopaged has no quantized weights"),
    "pooler_config": ((None,), "nanopaged generates: no pooling"),
    "convert": (("auto", "none"), "nanopaged runs the model as it is: no conversion to another task"),
    "spec_method": ((None,), "nanopaged has no speculative decoding"),
    "spec_model": ((None,), "nanopaged has no speculative decoding"),
    "spec_tokens": ((None,), "nanopaged has no speculative decoding"),
}
# vLLM's kv_cache_dtype: what the KV cache stores ("auto": the model's dtype). float8 halves a
# bfloat16 cache (quarters a float32 one): twice the blocks, so twice the tokens, in the same
# memory, each K and V rounded to 3 mantissa bits (e4m3) or 2 (e5m2, which reaches further).
# (vLLM's fp8_inc and fp8_ds_mla are Intel Gaudi's and DeepSeek MLA's own layouts.)
KV_CACHE_DTYPES = {"bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                   "fp8_e5m2": torch.float8_e5m2}
# vLLM's names for two of nanopaged's options: vLLM's option -> nanopaged's
VLLM_ALIASES = {"kv_cache_memory_bytes": "kv_cache_memory", "num_gpu_blocks_override": "num_blocks"}
MAX_LOGPROBS = 20   # vLLM's default max_logprobs: the most top tokens a request may ask for


def _check_vllm_options(options: dict):
    for name, value in options.items():
        if name not in VLLM_ONLY_OPTIONS:   # (a typo: as Python says it)
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}")
        accepted, why = VLLM_ONLY_OPTIONS[name]
        # (None and the flags by identity; numbers and strings by value: numpy's 1 is 1)
        if not any(value is a or (a is not None and not isinstance(a, bool) and not isinstance(value, bool)
                                  and is_one_of(value, (a,))) for a in accepted):
            took = f" (it takes {' or '.join(map(repr, accepted))})" if accepted else ""
            raise ValueError(f"{name}={value!r}: {why}{took}")


def load_chat_template(chat_template) -> str | None:
    """LLM(chat_template=...), as vLLM reads it: a Jinja template, or the path of a file that
    holds one (a string with no "{", "}" or line break is taken for a path)."""
    if chat_template is None:
        return None
    if not isinstance(chat_template, (str, Path)):
        raise ValueError(f"chat_template must be a Jinja template or a file's path, got {_describe(chat_template)}")
    if isinstance(chat_template, str) and any(c in chat_template for c in "{}\n"):
        return chat_template
    path = Path(chat_template)
    try:
        if not path.is_file():   # (a FIFO would hang the read)
            raise OSError("no such file")
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"chat_template={str(chat_template)!r} is no Jinja template (it has no '{{'), and "
                         f"no file's path that can be read ({e})") from None


class LLM:
    """The engine, with vLLM's API: LLM(...).generate(prompts, SamplingParams(...))."""

    def __init__(self, model=None, dtype=None, device=None, block_size: int = 16,
                 num_blocks: int | None = None, kv_cache_memory: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 max_model_len: int | None = None, enable_prefix_caching: bool = True,
                 attn_backend: str = "auto", load_format: str = "auto", generation_config: str = "auto",
                 preemption_mode: str = "recompute", swap_space: float = 4, seed: int | None = 0,
                 max_logprobs: int = MAX_LOGPROBS, tokenizer=None, override_generation_config: dict | None = None,
                 chat_template: str | Path | None = None, scheduling_policy: str = "fcfs",
                 kv_cache_dtype: str = "auto", **vllm_options):
        """In order: the arguments checked that need no model file; the model's config (and
        the arguments checked against it), its sampling advice, tokenizer and weights; the KV
        cache (the BlockPool, and the swap space); the Scheduler, and the PagedAttention
        object the model calls."""
        ours = {"kv_cache_memory": kv_cache_memory, "num_blocks": num_blocks}
        for alias in VLLM_ALIASES.keys() & vllm_options.keys():
            if ours[VLLM_ALIASES[alias]] is not None:
                raise ValueError(f"{VLLM_ALIASES[alias]} and {alias} (vLLM's name for it) were both given: give one")
            ours[VLLM_ALIASES[alias]] = vllm_options.pop(alias)
        kv_cache_memory, num_blocks = ours["kv_cache_memory"], ours["num_blocks"]
        _check_vllm_options(vllm_options)
        self.chat_template = load_chat_template(chat_template)   # (vLLM's: chat()'s, where it is given none)
        if seed is not None and not (is_integer(seed) and 0 <= seed < 2**63):
            raise ValueError(f"seed must be None or an integer in [0, 2**63), got {seed!r}")
        if not (is_integer(max_logprobs) and max_logprobs >= -1):
            raise ValueError(f"max_logprobs must be -1 (the whole vocabulary) or an integer >= 0, got {max_logprobs!r}")
        # the most logprobs a request may ask for, per token (vLLM's, and its default: a dict of
        # k entries per token costs k decodes, and a whole vocabulary's is large)
        self.max_logprobs = int(max_logprobs)
        device = _parse_device(device)
        dtype = None if is_one_of(dtype, (None, "auto")) else _parse_dtype(dtype)   # (None: once the config is read)
        sizes = {"block_size": block_size, "max_num_seqs": max_num_seqs, "num_blocks": num_blocks,
                 "kv_cache_memory": kv_cache_memory, "max_num_batched_tokens": max_num_batched_tokens,
                 "max_model_len": max_model_len}
        for name, value in sizes.items():
            optional = name not in ("block_size", "max_num_seqs")
            if (value is None and optional) or (is_integer(value) and value >= 1):
                continue
            raise ValueError(f"{name} must be an integer >= 1{' (or None for the default)' if optional else ''}, "
                             f"got {value!r}")
        # plain Python ints from here on (a numpy uint8 block_size would overflow in the arithmetic)
        block_size, max_num_seqs, num_blocks, kv_cache_memory, max_num_batched_tokens, max_model_len = (
            None if value is None else int(value) for value in sizes.values())
        if not isinstance(enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {enable_prefix_caching!r}")
        if not is_one_of(attn_backend, ("auto", "torch", "cuda", "cpu")):
            raise ValueError(f"unknown attn_backend {attn_backend!r}: use auto, torch, cuda or cpu")
        if attn_backend in ("cuda", "cpu") and device.type != attn_backend:
            raise ValueError(f"attn_backend={attn_backend!r} needs device={attn_backend!r}")
        if not is_one_of(load_format, ("auto", "dummy")):
            raise ValueError(f"unknown load_format {load_format!r}: use auto, or dummy (random weights)")
        if not is_one_of(preemption_mode, ("recompute", "swap")):
            raise ValueError(f"unknown preemption_mode {preemption_mode!r}: use recompute, or swap (to CPU memory)")
        # vLLM's: "fcfs", first come, first served; "priority": requests by their priority (lower
        # first), then arrival, for admission and, reversed, for preemption (Sequence.rank)
        if not is_one_of(scheduling_policy, ("fcfs", "priority")):
            raise ValueError(f"unknown scheduling_policy {scheduling_policy!r}: use fcfs (first come, first served) "
                             f"or priority (lower priority values first, then first come)")
        self.scheduling_policy = scheduling_policy
        if not is_one_of(kv_cache_dtype, ("auto", *KV_CACHE_DTYPES)):
            raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}: use auto (the model's dtype), bfloat16, "
                             f"fp8 (fp8_e4m3) or fp8_e5m2")
        if not (isinstance(swap_space, numbers.Real) and not isinstance(swap_space, bool) and 0 < swap_space < 2**40):
            raise ValueError(f"swap_space must be a number of GiB > 0, got {swap_space!r}")
        if not is_one_of(generation_config, ("auto", "vllm")) and not (isinstance(generation_config, (str, os.PathLike))
                                                              and os.path.isdir(generation_config)):
            raise ValueError(f"unknown generation_config {generation_config!r}: use auto (the model's "
                             "generation_config.json), vllm (SamplingParams' own defaults), or a directory "
                             "that holds a generation_config.json")
        # The config first, so that arguments the model cannot take are refused before its weights load
        model_dir = resolve_model_dir(model)
        cfg = ModelConfig.from_json(model_dir / "config.json")
        dtype = dtype or auto_dtype(device, cfg)
        if dtype == torch.float16 and cfg.model_type in NO_FLOAT16:   # (vLLM refuses it too)
            raise ValueError(f"dtype = float16: {cfg.model_type}'s activations overflow float16 (past 65,504, "
                             "into NaN logits); use bfloat16 or float32")
        self.device, self.dtype = device, dtype
        self.kv_cache_dtype = dtype if kv_cache_dtype == "auto" else KV_CACHE_DTYPES[kv_cache_dtype]
        if self.kv_cache_dtype == torch.bfloat16 and dtype == torch.float16:
            raise ValueError("kv_cache_dtype = bfloat16 with dtype = float16: a cache no smaller, less precise, and "
                             "of another range (past float16's 65,504): use auto or fp8")
        # What a request without SamplingParams samples with (vLLM's rule): the model's advice in
        # generation_config.json, such as a temperature, where generation_config is "auto" (or
        # another directory's, whose EOS ids also end requests), with override_generation_config's
        # values over it
        source, advice, gen_eos = model_dir / "generation_config.json", {}, []
        if generation_config == "auto":
            advice = cfg.sampling_defaults
        elif generation_config != "vllm":
            source = Path(generation_config) / "generation_config.json"
            gen_eos, advice = read_generation_config(source, cfg.vocab_size)
        advice = override_sampling_defaults(advice, {} if override_generation_config is None else override_generation_config)
        try:
            self._default_params = SamplingParams(**advice)
        except ValueError as e:
            source = f"{source} with override_generation_config" if override_generation_config else source
            raise ValueError(f"{source} advises {advice} (in SamplingParams' names): "
                             f"{e}; LLM(generation_config='vllm') ignores the file") from None
        if max_model_len is not None and max_model_len > cfg.context_length:
            raise ValueError(f"max_model_len = {max_model_len} exceeds the model's context of "
                             f"{cfg.context_length} tokens (max_position_embeddings"
                             f"{', stretched by its rope scaling' if cfg.context_length > cfg.max_position_embeddings else ''})")
        self.max_model_len = max_model_len or cfg.context_length
        # (vLLM's tokenizer=: another's, such as a GGUF's original model's, with its chat template)
        try:
            self.tokenizer = load_tokenizer(model_dir if tokenizer is None else tokenizer, cfg)
        except ModelError as e:
            if tokenizer is None:
                raise
            raise ModelError(f"tokenizer={tokenizer!r}: {e}") from None
        self.model = load_model(model_dir, dtype=dtype, device=device, dummy=(load_format == "dummy"),
                                max_model_len=self.max_model_len, config=cfg)
        self.config = self.model.config   # (cfg, but for an LM head the checkpoint unties)

        # The KV cache: sized by a block count, or by a memory budget in bytes.
        self.bytes_per_block = BlockPool.bytes_per_block(cfg.num_hidden_layers, block_size,
                                                         cfg.num_key_value_heads, cfg.head_dim, self.kv_cache_dtype)
        asked = (f"num_blocks = {num_blocks}" if num_blocks is not None else
                 None if kv_cache_memory is None else f"kv_cache_memory = {kv_cache_memory} bytes")
        if num_blocks is None:
            if kv_cache_memory is None:
                kv_cache_memory = _default_kv_cache_memory(device)
            num_blocks = kv_cache_memory // self.bytes_per_block
            if num_blocks < 1:
                raise ValueError(f"kv_cache_memory = {kv_cache_memory} bytes holds no block of "
                                 f"{self.bytes_per_block} bytes ({block_size} tokens): use a smaller "
                                 f"block_size or give more memory")
        # A pool the device could never hold is refused now: the OS hands out untouched memory
        # freely (overcommit), so it would allocate, and fail (the OOM killer) once it filled up.
        memory, size = device_memory(device), num_blocks * self.bytes_per_block
        if asked and memory is not None and size > memory:
            raise ValueError(f"{asked}: a KV cache of {num_blocks} blocks x {block_size} tokens ({size / 2**30:,.1f} "
                             f"GiB) is more than all {memory / 2**30:,.1f} GiB of the {device.type} memory")
        self.pool = BlockPool(num_blocks, block_size, cfg.num_hidden_layers, cfg.num_key_value_heads,
                              cfg.head_dim, self.kv_cache_dtype, device)
        # The swap space (vLLM's swap_space, in GiB): a second pool, in CPU memory, that
        # preemption copies a sequence's blocks to instead of dropping them
        self.swap_pool = None
        if preemption_mode == "swap":
            num_cpu_blocks = int(swap_space * 2**30) // self.bytes_per_block
            if num_cpu_blocks < 1:
                raise ValueError(f"swap_space = {swap_space} GiB holds no block of {self.bytes_per_block} bytes")
            cpu_memory = device_memory(torch.device("cpu"))   # (refused as the pool above is, for the same reason)
            if cpu_memory is not None and num_cpu_blocks * self.bytes_per_block > cpu_memory:
                raise ValueError(f"swap_space = {swap_space} GiB is more than all {cpu_memory / 2**30:,.1f} GiB "
                                 f"of the CPU memory")
            try:
                self.swap_pool = BlockPool(num_cpu_blocks, block_size, cfg.num_hidden_layers,
                                           cfg.num_key_value_heads, cfg.head_dim, self.kv_cache_dtype, "cpu")
            except ValueError as e:
                raise ValueError(f"swap_space = {swap_space} GiB: {e}") from None
        # The token budget of a step. On the CPU, 1024 measured best on the benchmark workload
        # (93, 105, 96 output tok/s at 512, 1024, 2048): big enough for efficient prefill
        # matmuls, small enough that decodes do not wait long behind prefill chunks.
        max_num_batched_tokens = max_num_batched_tokens or (8192 if device.type == "cuda" else 1024)
        # The ids that end a request (EOS): the model's (config.json's, generation_config.json's)
        # and, as vLLM, the tokenizer's own, where those lists leave it out
        eos = self.tokenizer.eos_token_id
        eos_token_ids = list(dict.fromkeys(cfg.eos_token_id + gen_eos + ([] if eos is None else [eos])))
        # Where every layer looks through the same sliding window, the blocks that slid out of
        # it are freed as a sequence goes on (a layer that sees everything needs them all).
        self.scheduler = Scheduler(self.pool, max_num_seqs, max_num_batched_tokens, self.max_model_len,
                                   enable_prefix_caching, eos_token_ids, self.swap_pool,
                                   sliding_window=cfg.window_everywhere)
        if self.scheduler.max_num_batched_tokens < max_num_batched_tokens:
            print(f"nanopaged: note: max_num_batched_tokens {max_num_batched_tokens} -> "
                  f"{self.scheduler.max_num_batched_tokens}, so that a step's chunk and the sliding window of "
                  f"{cfg.window_everywhere} tokens fit the pool of {self.pool.num_blocks} blocks", file=sys.stderr)
        kernel_args = (attn_backend, device, cfg, block_size, dtype, self.kv_cache_dtype)
        self.attn = PagedAttention(self.pool, cfg.attn_scale, _pick_kernels(*kernel_args),
                                   softcap=cfg.attn_logit_softcapping, decode_kernel=_pick_cpu_kernel(*kernel_args))
        # The draws of requests without a seed of their own come from this generator, seeded once
        # (vLLM's LLM(seed=0), its default: a script's sampled output is the same each run it
        # makes the same calls); seed=None leaves them to torch's global generator.
        self._rng = None if seed is None else torch.Generator(device).manual_seed(int(seed))
        self.stats = Stats()
        self._requests: dict[object, Request] = {}   # request id -> its Request, until reported
        self._to_report: dict = {}   # ids of requests run or aborted and not reported yet (an ordered set)
        self._next_id = 0
        self._open_stream = None   # the request id of a stream() being read
        self._generating = False   # whether generate() is running (its steps own the engine)
        # Set as generate() or stream() begins, cleared once nothing of theirs is left (by
        # _generate when all is reported, or by _drop_all, which frees what an error or a
        # closed stream left): should a second Ctrl-C cut that short, their leftovers are
        # dropped as the engine is next used.
        self._cleanup_due = False
        self._trace: list[str] | None = None   # the block trace's lines of this step; None: off

    def get_tokenizer(self):
        return self.tokenizer

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """vLLM's: forget every cached block (a cold start, for a benchmark; or new weights,
        which make the cached K and V wrong). Only while no block is held, as vLLM: False, and
        nothing done, while a request holds some. (vLLM's two options, taken at False: nanopaged
        does not preempt its running requests for it, and has no KV connector.)"""
        for name, value in (("reset_running_requests", reset_running_requests), ("reset_connector", reset_connector)):
            if value is not False:
                raise ValueError(f"{name}={value!r}: nanopaged resets its prefix cache only while no request "
                                 f"holds a block, and has no KV connector (it takes False)")
        if self.pool.num_used or (self.swap_pool is not None and self.swap_pool.num_used):
            return False
        self.pool.reset_prefix_cache()   # (the swap space caches nothing)
        return True

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate, chat, stream and add_request use when given no SamplingParams."""
        return copy.deepcopy(self._default_params)

    def describe_kv_cache(self) -> str:
        c, pool = self.config, self.pool
        per_token, kv_bytes = self.bytes_per_block // pool.block_size, self.kv_cache_dtype.itemsize
        return (f"KV cache: {pool.num_blocks} blocks x {pool.block_size} tokens = "
                f"{pool.num_blocks * pool.block_size} token slots, "
                f"{pool.num_blocks * self.bytes_per_block / 2**20:.1f} MiB; "
                f"{per_token} bytes/token = {c.num_hidden_layers} layers x 2 (K,V) x {c.num_key_value_heads} kv heads "
                f"x {c.head_dim} dims x {kv_bytes} byte{'s' if kv_bytes > 1 else ''}"
                + (f" ({str(self.kv_cache_dtype).removeprefix('torch.')})" if self.kv_cache_dtype != self.dtype else "")
                + f"; {self.bytes_per_block} bytes/block; "
                + (f"swap space: {self.swap_pool.num_blocks} blocks in CPU memory; " if self.swap_pool else "")
                + f"attention backend: {self.attn.backend}")

    # --- requests ---
    def add_request(self, prompt, params: SamplingParams | BeamSearchParams | None = None, request_id=None,
                    priority: int = 0):
        """Queue one prompt: text, a list of token ids, or, as vLLM writes them, {"prompt":
        text} or {"prompt_token_ids": ids}; with BeamSearchParams, a beam search (its outputs:
        the beams, best first). priority: under LLM(scheduling_policy="priority"), lower runs
        first (vLLM's; else 0). Bad input raises ValueError and leaves the engine as it was."""
        self._check_free("add_request()")
        if isinstance(request_id, (SamplingParams, BeamSearchParams)):
            raise ValueError("add_request takes (prompt, params, request_id=None), nanopaged's order: vLLM's "
                             "LLMEngine.add_request takes the request id first")
        return self._add(self._parse_prompt(prompt), params, request_id, priority=priority)

    def _parse_prompt(self, prompt, add_special_tokens: bool = True) -> Prompt:
        """A prompt's text, token ids (a text's encoded with the tokenizer's special tokens, a
        BOS..., where add_special_tokens), how many of those there are at the head and the
        tail, and its cache_salt."""
        text, salt = None, None
        if isinstance(prompt, dict):   # vLLM's TextPrompt and TokensPrompt
            # (vLLM's other keys, at None, ask for nothing; at a value, for what nanopaged lacks)
            asked = {k: v for k, v in prompt.items() if v is not None or k in ("prompt", "prompt_token_ids")}
            known = {"prompt", "prompt_token_ids", "cache_salt"}
            if not {"prompt", "prompt_token_ids"} & asked.keys() or asked.keys() - known:
                why = {"multi_modal_data": "no multimodal inputs", "mm_processor_kwargs": "no multimodal inputs",
                       "prompt_embeds": "token ids or text as prompts, not embeddings"}
                lacks = sorted({why[k] for k in asked if k in why})
                raise ValueError('a prompt dict holds "prompt" (text), "prompt_token_ids", or both (the ids '
                                 f"run, the text is the output's prompt), and maybe a \"cache_salt\", got keys "
                                 f"{sorted(map(str, asked))}" + (f" (nanopaged has {'; '.join(lacks)})" if lacks else ""))
            for key, value in asked.items():
                of_ids = key == "prompt_token_ids"
                if not (_is_token_ids(value) if of_ids else isinstance(value, str)):
                    raise ValueError(f"{key} must be {'a list of token ids' if of_ids else 'a string'}, "
                                     f"got {_describe(value)}")
            # (a TokensPrompt's ids run; its text, if any, is not tokenized)
            text, prompt = asked.get("prompt"), asked.get("prompt_token_ids", asked.get("prompt"))
            salt = asked.get("cache_salt")
        if isinstance(prompt, str):
            # ("" too, where the tokenizer adds a BOS: unconditional text, as vLLM takes it)
            ids = self.tokenizer.encode(prompt, add_special_tokens)
            return Prompt(prompt, ids, self.tokenizer.specials_around(ids, add_special_tokens), salt)
        if _is_token_ids(prompt):
            return Prompt(text, [int(t) for t in prompt], (0, 0), salt)   # numpy and torch integers become ints
        raise ValueError(f"a prompt is a string or a list of token ids (integers), got {_describe(prompt)}")

    def _add(self, prompt: Prompt, params: SamplingParams | BeamSearchParams | None, request_id=None,
             final_only: bool = False, priority: int = 0):
        """add_request's; final_only: the request's copy of its params gets output_kind FINAL_ONLY
        (generate() and stream(): no output before the end, as vLLM's LLM sets for its own)."""
        ids = prompt.ids
        check_priority(priority)
        if priority != 0 and self.scheduling_policy != "priority":   # (vLLM refuses it too)
            raise ValueError(f"priority={priority!r}, but the scheduler is first-come-first-served: "
                             f"LLM(scheduling_policy='priority') runs requests by priority")
        advised = params is None
        params = self._default_params if advised else params
        if isinstance(params, BeamSearchParams):   # a beam search: its beams are the request's sequences
            beam = request_copy(params)
            params = SamplingParams(n=beam.beam_width, temperature=0.0, max_tokens=beam.max_tokens,
                                    ignore_eos=beam.ignore_eos, allowed_token_ids=beam.allowed_token_ids,
                                    output_kind=RequestOutputKind.FINAL_ONLY)   # (its beams are not results)
            params.beam = beam
        elif isinstance(params, SamplingParams):
            params = request_copy(params)
            if final_only:
                params.output_kind = RequestOutputKind.FINAL_ONLY
        else:
            raise ValueError(f"sampling params must be a SamplingParams (or BeamSearchParams), "
                             f"got {type(params).__name__}")
        if params.truncate_prompt_tokens is not None:   # (vLLM's field before 0.20: -1 leaves room for max_tokens)
            keep = params.truncate_prompt_tokens
            if keep > self.max_model_len:   # (as vLLM refuses it, however short the prompt)
                raise ValueError(f"truncate_prompt_tokens = {keep} exceeds max_model_len = {self.max_model_len}")
            ids = truncated(ids, max(self.max_model_len - (params.max_tokens or 1), 1) if keep == -1 else keep,
                            specials=prompt.specials)
        beams = params.n if params.beam else 1
        if len(ids) >= self.max_model_len:   # (vLLM's rule: a prompt leaves room for one output token)
            raise ValueError(f"prompt ({len(ids)} tokens) leaves no room for an output token in the "
                             f"context served, max_model_len = {self.max_model_len} tokens")
        if advised or params.max_tokens is None:   # a max_tokens the caller never wrote (generation_config.json's),
            # or None (vLLM's "up to the context"), stops at the context, or at what the whole pool
            # holds (under a sliding window, the whole context may take fewer blocks than the pool)
            limit = self.max_model_len
            if beams * self.scheduler.blocks_at_most(limit) > self.pool.num_blocks:
                limit = min(limit, self.pool.num_blocks // beams * self.pool.block_size)
            room = limit - len(ids)
            # (short of the pool, one token: under a sliding window the prompt may still fit, since
            # its blocks before the window are dropped; else the scheduler says what the pool lacks)
            params.max_tokens = max(min(params.max_tokens or room, room), 1)
        # As in vLLM, an output stops at the end of the context (finish_reason "length"), whatever
        # max_tokens says: the request's copy is cut to fit (and min_tokens with it)
        params.max_tokens = min(params.max_tokens, self.max_model_len - len(ids))
        params.min_tokens = min(params.min_tokens, params.max_tokens)
        # (a text prompt too: a tokenizer may know more tokens than config.json's vocab_size)
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {self.config.vocab_size}) (the model's "
                             f"vocab_size): got {bad[:5]}")
        self._check_constraints(params)
        scored_rows = len(ids) - 1 - (params.prompt_logprob_start or 0)   # (logits at position t score token t + 1)
        if params.prompt_logprob_start and scored_rows < 1:
            raise ValueError(f"prompt_logprob_start = {params.prompt_logprob_start} leaves no prompt token to "
                             f"score: it must be less than the prompt's {len(ids)} tokens - 1")
        if params.prompt_logprob_token_ids is not None and len(params.prompt_logprob_token_ids) != scored_rows:
            raise ValueError(f"prompt_logprob_token_ids has {len(params.prompt_logprob_token_ids)} rows, but the "
                             f"prompt has {max(scored_rows, 0)} to score (its {len(ids)} tokens - 1 - "
                             f"prompt_logprob_start = {params.prompt_logprob_start or 0})")
        chosen = request_id is not None
        if not chosen:
            while self._next_id in self._requests:   # skip ids the caller chose
                self._next_id += 1
            request_id = self._next_id
        elif _check_request_id(request_id) in self._requests:   # (the scheduler knows only the unfinished ones)
            raise ValueError(f"request id {request_id!r} is already in use (by a request not reported yet)")
        seq = None
        try:
            with defer_ctrl_c():   # queued in the scheduler means known here
                seq = self.scheduler.add(request_id, ids, params, int(priority), prompt.cache_salt)
                self._requests[request_id] = Request(
                    prompt.text, params, [seq], beams={seq: (0.0, None)} if params.beam else {},
                    prompt_logprobs=None if params.prompt_logprobs is None else [None] * len(ids),
                    prompt_token_id_logprobs=None if params.prompt_logprob_token_ids is None else torch.full(
                        (scored_rows, len(params.prompt_logprob_token_ids[0])), math.nan))
        except BaseException:   # (a Ctrl-C held until the request was queued; memory running out):
            if seq is not None:   # the caller never got its id, so nothing of the request may stay
                self.scheduler.abort(request_id)
                self._requests.pop(request_id, None)
            raise
        if not chosen:
            self._next_id += 1   # an id is never handed out twice, even once its request finished
        return request_id

    def _check_constraints(self, params: SamplingParams):
        """The token ids a request names must be the model's, and its constraints must leave
        some token to draw from its first step. Fills params.bad_words_token_ids and
        params.disallowed_mask, and makes logprobs / prompt_logprobs = -1 the vocabulary's size."""
        V = self.config.vocab_size
        most = V if self.max_logprobs == -1 else self.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and (V if k == -1 else k) > most:
                asked = f"{name} = -1 (the whole vocabulary: {V} tokens)" if k == -1 else f"{name} = {k}"
                raise ValueError(f"{asked} exceeds max_logprobs = {self.max_logprobs} (LLM(max_logprobs=...) "
                                 f"allows more; -1: the whole vocabulary)")
            if k == -1:   # vLLM's: the whole vocabulary, as many as the model's logits (in the request's copy)
                setattr(params, name, V)
        if params.bad_words:
            params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        # (stop_token_ids too, as vLLM 0.30 on: one past the vocabulary could never be drawn)
        id_rows = params.prompt_logprob_token_ids or []
        if id_rows and len(id_rows[0]) > most:   # (vLLM's bound too: the ids of a row, as prompt_logprobs = k)
            raise ValueError(f"prompt_logprob_token_ids has {len(id_rows[0])} token ids a row, more than "
                             f"max_logprobs = {self.max_logprobs} (LLM(max_logprobs=...) allows more)")
        for name, ids in (("logit_bias", params.logit_bias), ("allowed_token_ids", params.allowed_token_ids),
                          ("stop_token_ids", params.stop_token_ids), ("logprob_token_ids", params.logprob_token_ids),
                          ("prompt_logprob_token_ids", [t for row in id_rows for t in row if t != -1]),
                          ("bad_words", sum(params.bad_words_token_ids or [], []))):
            bad = sorted(t for t in ids or () if not 0 <= t < V)
            if bad:
                raise ValueError(f"{name} has token ids outside [0, {V}) (the model's vocab_size): {bad[:5]}")
        banned = {w[0] for w in params.bad_words_token_ids or () if len(w) == 1}   # always
        if params.min_tokens:   # at first
            banned |= set(min_tokens_bans(params, self.scheduler.eos_token_ids, V))
        allowed = params.allowed_token_ids
        if (len(banned) == V) if allowed is None else set(allowed) <= banned:
            raise ValueError(nothing_to_draw(params))
        if allowed is not None:
            params.disallowed_mask = torch.ones(V, dtype=torch.bool, device=self.device)
            params.disallowed_mask[allowed] = False

    def abort(self, request_id) -> RequestOutput:
        """Stop a request now; its blocks return to the pool at once. Returns what it had.
        (A stream's own request may be aborted while it is read; generate()'s may not.)"""
        self._check_not_generating("abort()")
        if _check_request_id(request_id) in self.scheduler.requests or request_id not in self._requests:
            with defer_ctrl_c():   # (else it finished, and no step() reported it yet)
                self.scheduler.abort(request_id)
                self._to_report[request_id] = None
            self._flush_trace()
        output = self._request_output(request_id)
        self._hand_back([output])
        return output

    def has_unfinished_requests(self) -> bool:
        """Whether some request added has not been reported finished yet (by step() or abort())."""
        return bool(self._requests)

    # --- one step ---
    def step(self) -> list[RequestOutput]:
        """Run one engine step; return the outputs of the requests that finished in it (or in
        an earlier step that raised after finishing them), and of those that sampled in it
        under output_kind CUMULATIVE or DELTA (see _request_output). [] when idle."""
        self._check_free("step()")
        return self._step()

    def _step(self) -> list[RequestOutput]:
        if not self.scheduler.has_unfinished():
            self._check_none_lost()
            return self._collect_outputs()   # what an interrupted step finished, if anything
        start = time.perf_counter()
        try:
            # The bookkeeping (queues, block tables, ref counts) must not stop halfway, so a
            # Ctrl-C waits for the end of it. The forward pass and sampling may stop anywhere:
            # then the step did not happen, and is rolled back.
            with self._bookkeeping():
                if self._trace is not None:
                    self._trace.append(f"--- step {self.stats.steps + 1} ---")
                out = self.scheduler.schedule()
                if not out.seqs:
                    raise RuntimeError("the scheduler found nothing to run")  # cannot happen: add() checks fit
                self._record_usage()
                if self._trace is not None:
                    self._trace_step(out)
            input_ids, positions, logits_indices, prompt_rows = self._prepare(out)
            # swaps first: a block swapped out may be handed to a copy-on-write in this same
            # step, so its data leaves before anything else lands in it. (No step swaps both
            # ways: Scheduler.schedule swaps out in its step 1 alone, which then admits nothing.)
            try:
                swap_blocks(self.pool, self.swap_pool, out.swap_out)
                swap_blocks(self.swap_pool, self.pool, out.swap_in)
                self.attn.copy_blocks(out.copies)
                with torch.inference_mode():
                    logits = self.model(input_ids, positions, self.attn, logits_indices)  # (S + R, vocab)
            finally:
                self.attn.end_step()   # (begin_step ran in _prepare)
            due = [seq for seq, sampled_now in zip(out.seqs, out.do_sample) if sampled_now]   # one row each
            # (S + R,): a NaN or inf anywhere in a row makes its sum not finite (no (S + R, vocab) mask)
            finite = logits.sum(dim=-1, dtype=torch.float32).isfinite().tolist()
            sampled, broken = self._sample(due, logits[:len(due)], finite)   # (rows past these score prompts)
            beams, broken_beams, beam_plan = self._beam_step(due, logits[:len(due)], finite)
            token_logprobs, prompt_logprobs, broken_prompts = self._logprobs(due, logits, finite, sampled, prompt_rows)
            with self._bookkeeping():
                self._commit(out, sampled | beams, broken | broken_beams | broken_prompts, start,
                             token_logprobs, prompt_logprobs, beam_plan)
        except BaseException:
            # Out of memory, a KeyboardInterrupt...: unless Scheduler.update recorded it, the
            # step did not happen. Its slots were reserved (and maybe written): its sequences
            # are preempted and will be recomputed, so that nothing they write later lands one
            # step off. (Should a second Ctrl-C come before the rollback begins, the next
            # schedule() does it.)
            with defer_ctrl_c():
                self.scheduler.rollback()
            self._record_counts()
            self._flush_trace()
            raise
        self._flush_trace()
        return self._collect_outputs()

    @contextlib.contextmanager
    def _bookkeeping(self):
        """A step's bookkeeping: under defer_ctrl_c, and with a last resort should it raise
        itself (a bug, or memory running out), halfway through moving sequences between queues
        and blocks between owners. No rollback can trust what it left, so every unfinished
        request fails (finish_reason "error"; add_request's are reported by the next step,
        generate() and stream() raise), the pools are cleared, and the engine serves on."""
        with defer_ctrl_c():
            try:
                yield
            except Exception as e:
                failed = self.scheduler.fail_all()
                for pool in (self.pool, self.swap_pool):
                    if pool is not None:
                        pool.clear()
                # (a request the scheduler knew that LLM did not, half added, is only forgotten)
                failed = [rid for rid in failed if rid in self._requests]
                self._to_report |= dict.fromkeys(failed)
                if self._trace is not None:
                    self._trace.append(f"  internal error ({type(e).__name__}): requests {', '.join(map(str, failed)) or 'none'} "
                                       f"failed, every block free, the prefix cache empty")
                raise RuntimeError(f"internal error in the engine's bookkeeping ({type(e).__name__}: {e}): its "
                                   f"{len(failed)} unfinished requests failed (finish_reason 'error': add_request's "
                                   f"are reported by the next step()); the engine serves on") from e

    def _commit(self, out, sampled: dict, broken: dict, start: float, token_logprobs: dict, prompt_logprobs: list,
                beam_plan: dict):
        """Record a step that ran, all of it (the caller holds Ctrl-C): fail the rows whose
        logits broke, hand the tokens to Scheduler.update (appends, forks, EOS and length
        finishes, dropped beams), keep their logprobs and the beams' scores, check stop
        strings, add the step's stats."""
        # first: should a line below raise (a bug), what the step finished is still reported
        self._to_report |= dict.fromkeys(seq.request_id for seq in out.seqs)   # forks share their ids
        for seq, why in broken.items():   # a broken row must not take the batch down: fail its request
            seq.error = why
            self.scheduler.finish(seq, "error")
            sampled.pop(seq, None)   # (a prompt row broke: what its last row drew is void)
        if self._trace is not None:
            words = {seq: [self.tokenizer.decode([x], continuation=True) for x in tokens]
                     for seq, tokens in sampled.items()}   # (several tokens: a fork's first ones)
            self._trace.append("  sampled: " + (", ".join(f"{seq} -> {' | '.join(map(repr, w)) or '(dropped)'}"
                                                          for seq, w in words.items())
                                                or "nothing"))   # (a prefill chunk: its prompt goes on)
        appended = [seq for seq in sampled if seq.status is Status.RUNNING]   # update() skips the rest
        forked = self.scheduler.update(out, sampled)   # {parent: its new children}
        children = [child for kids in forked.values() for child in kids]
        for child in children:
            self._requests[child.request_id].seqs.append(child)
        self._record_beams(beam_plan, forked)
        # sample j of a fork's tokens went to the sequence sample_index + j: a sampling fork is
        # sample 0's first token, and Scheduler.fork numbers its children from 1
        for seq in appended:
            req = self._requests[seq.request_id]
            for j, entry in enumerate(token_logprobs.get(seq, ())):
                i = seq.sample_index + j
                req.logprobs.setdefault(i, []).append(entry)
                # summed as they come (re-summed for each output, a long one's would cost O(L^2)); an
                # entry holds the token drawn first
                req.cumulative[i] = req.cumulative.get(i, 0.0) + next(iter(entry.values())).logprob
        for seq, first, entries, at, scores in prompt_logprobs:   # by position: a recompute overwrites its own
            req = self._requests[seq.request_id]
            if entries is not None:
                req.prompt_logprobs[first:first + len(entries)] = entries
            if scores is not None:
                req.prompt_token_id_logprobs[at:at + len(scores)] = scores
        self._check_stop_strings([*sampled, *children])
        self.stats.output_tokens += sum(len(sampled[seq]) for seq in appended)
        self.stats.elapsed += time.perf_counter() - start

    def _prepare(self, out):
        """The flat batch of this step (the inputs listed in section 2): token ids, positions
        and slots of every scheduled token, back to back; per sequence its query range,
        context length and block table; which rows' logits to sample; and, after those, the
        rows that score prompt tokens (prompt_logprobs, prompt_logprob_token_ids): (seq, the
        first prompt token they score (one past its row's position), count)."""
        input_ids, positions, slot_mapping, seq_lens, qsl, logits_indices = [], [], [], [], [0], []
        prompt_indices, prompt_rows = [], []
        for i, (seq, n, slots) in enumerate(zip(out.seqs, out.num_scheduled_tokens, out.slots)):
            start = seq.num_computed_tokens
            input_ids += seq.token_ids[start:start + n]
            positions += range(start, start + n)
            slot_mapping += slots
            seq_lens.append(start + n)
            qsl.append(qsl[-1] + n)
            if out.do_sample[i]:
                logits_indices.append(qsl[-1] - 1)   # the last token of the sequence
            # The logits at position t score prompt token t + 1, from prompt_logprob_start on.
            # (A recomputed sequence that has sampled scored its whole prompt the first time.)
            if seq.params.scores_prompt and seq.num_output_tokens == 0:
                first, end = max(start, seq.params.prompt_logprob_start or 0), min(start + n, seq.num_prompt_tokens - 1)
                if first < end:   # (position t's row: qsl[-2], the sequence's first row, + t - start)
                    prompt_indices += range(qsl[-2] + first - start, qsl[-2] + end - start)
                    prompt_rows.append((seq, first + 1, end - first))
        max_blocks = max(len(s.block_table.block_ids) for s in out.seqs)
        # padded entries (past a sequence's blocks) and DROPPED ones (before its window) are never read.
        # Filled a row at a time into a numpy array: torch.tensor of a list of lists converts its
        # ints one by one (3.1 ms a step for 256 sequences of 200 blocks, where this takes 0.7 ms)
        tables = np.zeros((len(out.seqs), max_blocks), dtype=np.int32)        # (B, max_blocks)
        for row, s in zip(tables, out.seqs):
            row[:len(s.block_table.block_ids)] = s.block_table.block_ids
        dev = self.device
        self.attn.begin_step(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=dev),
            block_tables=torch.from_numpy(tables).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            max_query_len=max(out.num_scheduled_tokens), max_seq_len=max(seq_lens))
        return (torch.tensor(input_ids, dtype=torch.int64, device=dev),
                torch.tensor(positions, dtype=torch.int64, device=dev),
                torch.tensor(logits_indices + prompt_indices, dtype=torch.int64, device=dev),
                prompt_rows)

    # --- sampling ---
    def _sample(self, due: list, logits, finite: list) -> tuple[dict, dict]:
        """Pick the next token of every sequence that reached its end (due; logits (S, vocab),
        a row each; finite[row]: no NaN or inf in it), beams aside: _beam_step chooses theirs,
        and reports their broken rows. Greedy rows share one argmax; the others are sampled
        one by one, a seeded request's from a generator of its own (_generator), so that it
        gives the same tokens whatever else is in the batch (unseeded ones share the
        engine's). Returns {seq: its tokens (one, or n where it forks)} and {seq: why} for
        those that cannot draw: logits broken (NaN or inf), or every token banned by their
        constraints."""
        logits, drawable = logits.float(), list(finite)
        edited = [row for row, seq in enumerate(due) if finite[row] and edits_logits(seq)]
        if edited:
            logits = logits.clone()   # (S, vocab) the logprobs are the raw logits'
            for row in edited:
                process_logits(logits[row], due[row], self.scheduler.eos_token_ids)
            # add_request refuses constraints that ban every token from the start, but the bad
            # words an output begins may ban the last allowed ones later
            for row, ok in zip(edited, logits[edited].amax(dim=-1).isfinite().tolist()):
                drawable[row] = ok
        # (one argmax over all rows, only where a row is greedy: 2.7 ms for 64 rows of 49,152 logits
        # on a CPU core, more than the draws of 64 sampled rows)
        if any(seq.params.temperature == 0 and not seq.params.beam for seq in due):
            greedy = logits.argmax(dim=-1).tolist()
        sampled, broken = {}, {}
        for row, seq in enumerate(due):
            if seq.params.beam:
                continue   # (its tokens are chosen by _beam_step)
            if not drawable[row]:
                broken[seq] = NOT_FINITE if not finite[row] else nothing_to_draw(seq.params)
                continue
            p, k = seq.params, seq.pending_samples
            if p.temperature == 0:
                tokens = [greedy[row]] * k
            else:
                probs = sampling_probs(logits[row], p)
                tokens = [draw(probs, self._generator(seq, seq.sample_index + j)) for j in range(k)]
            sampled[seq] = tokens
        return sampled, broken

    def _logprobs(self, due: list, logits, finite: list, sampled: dict, prompt_rows: list) -> tuple[dict, list, dict]:
        """vLLM's logprobs of this step, from one batched log_softmax: {seq: one {token id:
        Logprob} per token it sampled} for the sequences that ask for them; for those that score
        their prompt, (seq, the first prompt token scored, one {token id: Logprob} per prompt token or
        None, the first row of prompt_logprob_token_ids scored, their (count, ids) logprobs or
        None); and {seq: NOT_FINITE} for those whose prompt rows are broken (NaN or inf): they
        fail, as a broken sampled row does. logits: (S + R, vocab), the S rows of due, then the
        R prompt rows; finite: per row."""
        rows, targets, picks, contexts = [], [], [], []   # the rows that make {token id: Logprob}s
        for row, seq in enumerate(due):
            if seq in sampled and seq.params.num_logprobs is not None:
                k = len(sampled[seq])
                rows += [row] * k
                targets += sampled[seq]
                picks += [seq.params.logprob_token_ids or seq.params.logprobs] * k
                contexts += [seq.token_ids[-4:] if seq.params.detokenize else None] * k
        scored, id_rows, broken, r = [], [], {}, len(due)   # r: the next prompt row
        for seq, first, count in prompt_rows:
            p = seq.params
            if not all(finite[r:r + count]):
                broken[seq] = NOT_FINITE
            else:
                if p.prompt_logprobs is not None:
                    rows += range(r, r + count)
                    targets += seq.token_ids[first:first + count]
                    picks += [p.prompt_logprobs] * count
                    contexts += [seq.token_ids[max(q - 4, 0):q] if p.detokenize else None
                                 for q in range(first, first + count)]
                if p.prompt_logprob_token_ids is not None:
                    id_rows += range(r, r + count)
                scored.append((seq, first, count))
            r += count
        if not rows and not id_rows:
            return {}, [], broken
        # (M + I, vocab): the M rows above (sampled tokens, then prompt_logprobs), the I of prompt_logprob_token_ids
        lp = torch.log_softmax(logits[rows + id_rows].float(), dim=-1)
        entries = iter(logprob_dicts(lp[:len(rows)], targets, picks, self.tokenizer, contexts))
        token_logprobs = {seq: [next(entries) for _ in sampled[seq]] for seq in due
                          if seq in sampled and seq.params.num_logprobs is not None}
        prompt_logprobs, i = [], len(rows)   # i: the next of the I rows
        for seq, first, count in scored:
            p = seq.params
            dicts = [next(entries) for _ in range(count)] if p.prompt_logprobs is not None else None
            # at: the row of prompt_logprob_token_ids that scores prompt token `first` (row i
            # scores token prompt_logprob_start + i + 1)
            at, scores = first - 1 - (p.prompt_logprob_start or 0), None
            if p.prompt_logprob_token_ids is not None:
                ids = torch.tensor(p.prompt_logprob_token_ids[at:at + count], device=lp.device)   # (count, ids)
                # (count, ids): each row's ids' logprobs, -inf where -1 pads a row
                scores = lp[i:i + count].gather(1, ids.clamp(min=0)).masked_fill(ids < 0, -math.inf).cpu()
                i += count
            prompt_logprobs.append((seq, first, dicts, at, scores))
        return token_logprobs, prompt_logprobs, broken

    def _generator(self, seq, sample_index):
        """The generator of one draw of a seeded request, seeded by a hash of (seed, sample,
        position): a draw depends on nothing else, not on the batch around it, and not on a
        step that failed after drawing and was rolled back. (Well mixed: seeds 0 and 1 share
        no sample, where seed + i would share n - 1.) A request without a seed draws from the
        engine's generator."""
        if seq.params.seed is None:
            return self._rng   # (the engine's: see __init__)
        # hash_block as a seed mixer: the seed in the parent's place, (sample, position) as tokens
        seed = hash_block(seq.params.seed, [sample_index, seq.num_output_tokens])
        return torch.Generator(self.device).manual_seed(seed)

    # --- beam search ---
    def _beam_step(self, due: list, logits, finite: list) -> tuple[dict, dict, dict]:
        """Beam search's step, in place of sampling for the beams of beam_search requests
        (logits (S, vocab): a row per sequence of due; finite[row]: no NaN or inf in it).

        A beam's candidates are its 2 * beam_width likeliest next tokens. A search moves on
        once every live beam has its candidates: mostly all in the same step, but a beam that
        was preempted, or left out of a step by the token budget, comes later, and those that
        came sooner wait for it, parked (with nothing left to compute, the scheduler skips
        them). Then, of all the candidates, the ones that end in EOS are put aside, finished,
        and the beam_width best of the others live on, ranked by cumulative logprob: a beam
        that k of them continue forks into k beams, sharing its blocks (the copy-on-write of
        its last, partial block splits them as they write), and a beam that none continues
        is dropped, its blocks freed. This is the chapter's beam search; vLLM's LLM.beam_search
        gets the sharing from its prefix cache instead, full blocks only.

        Returns {beam: its tokens} for Scheduler.update (none: dropped), {beam: why} for the
        beams whose logits broke, and {request id: (beams parked, {beam: [(token,
        cumulative logprob, candidates)] per token it got}, the candidates that ended)} for
        _record_beams. Changes nothing: the step may still be rolled back."""
        rows = [row for row, seq in enumerate(due) if seq.params.beam]
        if not rows:
            return {}, {}, {}
        k = min(max(2 * due[row].params.n for row in rows), logits.shape[-1])
        lp = torch.log_softmax(logits[rows].float(), dim=-1)               # (beams, vocab)
        for i, row in enumerate(rows):   # allowed_token_ids: candidates among those only (their logprobs as they were)
            if due[row].params.disallowed_mask is not None:
                lp[i].masked_fill_(due[row].params.disallowed_mask, -math.inf)
        top = lp.topk(k, dim=-1)                                           # (beams, k), best first
        fresh, broken = {}, {}   # fresh: {request id: {beam: its candidates}}
        for seq, row, ids, lps in zip([due[r] for r in rows], rows, top.indices.tolist(), top.values.tolist()):
            if finite[row]:   # (token, logprob), best first; none that allowed_token_ids leaves out (-inf)
                kept = [(t, x) for t, x in zip(ids, lps) if x > -math.inf][:2 * seq.params.n]
                fresh.setdefault(seq.request_id, {})[seq] = kept
            else:
                broken[seq] = NOT_FINITE
        sampled, plan = {}, {}
        for rid in dict.fromkeys(due[row].request_id for row in rows):
            req = self._requests[rid]
            # a parked beam preempted since has its candidates again when it is recomputed
            ready = {seq: c for seq, c in req.parked.items() if seq.parked}
            ready |= fresh.get(rid, {})
            live = [seq for seq in self.scheduler.requests[rid] if seq not in broken]
            if not live or not all(seq in ready for seq in live):   # (none: every beam broke)
                plan[rid] = (ready, {}, [])   # wait for the others
                continue
            p = req.params
            eos = set() if p.ignore_eos else self.scheduler.eos_token_ids
            # candidates: (cumulative logprob, beam, token, its candidates); ended: as req.done
            candidates, ended = [], []
            for seq in sorted(live, key=lambda q: q.sample_index):
                cum, history = req.beams[seq]
                for token, token_lp in ready[seq]:
                    if token in eos:
                        ended.append((seq.output_token_ids + [token], cum + token_lp, (history, ready[seq]), "stop"))
                    else:
                        candidates.append((cum + token_lp, seq, token, ready[seq]))
            best = sorted(candidates, key=lambda c: -c[0])[:p.n]   # (stable: ties go to the earlier beam)
            chosen = {seq: [] for seq in live}
            for cum, seq, token, cands in best:
                chosen[seq].append((token, cum, cands))
            sampled |= {seq: [token for token, _, _ in picks] for seq, picks in chosen.items()}
            plan[rid] = ({}, chosen, ended)
        return sampled, broken, plan

    def _record_beams(self, plan: dict, forked: dict):
        """Keep what _beam_step decided, once Scheduler.update made it so (forked: {beam: its
        new children}): each beam's score and history, token j of a beam's picks having gone
        to its j-th sequence (itself, then its children). Of the beams that ended, only the
        beam_width best stay: the others can never be among the results. The dropped beams
        are forgotten."""
        for rid, (parked, chosen, ended) in plan.items():
            req = self._requests[rid]
            req.parked = parked
            beams = req.beams
            for seq, picks in chosen.items():
                _, history = beams.pop(seq)
                for target, (_, cum, cands) in zip([seq, *forked.get(seq, ())], picks):
                    beams[target] = (cum, (history, cands))   # (nothing copied: O(1) a step)
            if ended:
                penalty = req.params.beam.length_penalty
                req.done = sorted(req.done + ended, key=lambda h: beam_rank(h, penalty))[:req.params.n]
            # A dropped beam is never a result. Kept, they would pile up: up to beam_width a step,
            # each with all its tokens. (Beam 0 stays even dropped: it holds the request's prompt
            # and start, which _request_output reads.)
            req.seqs = [q for q in req.seqs if q.finish_reason != "dropped" or q.sample_index == 0]

    def _beam_results(self, req) -> list[CompletionOutput]:
        """A finished beam search's beam_width best: of those that ended in EOS, and of the
        beams that ran to max_tokens (or were aborted, or failed)."""
        hypotheses = req.done + [(seq.output_token_ids, cum, history, seq.finish_reason)
                                 for seq, (cum, history) in req.beams.items()]
        beam = req.params.beam
        best = sorted(hypotheses, key=lambda h: beam_rank(h, beam.length_penalty))[:req.params.n]
        results = []
        prompt = req.seqs[0].prompt_token_ids[-4:]   # (the context token_texts looks back on)
        for i, (ids, cum, history, reason) in enumerate(best):
            # each token's entry: its beam's candidates at that step, the chosen one first
            tokens, logprobs = prompt + ids, []
            for j, (token, cands) in enumerate(zip(ids, beam_history(history)), start=len(prompt)):
                text = token_texts(self.tokenizer, tokens[max(j - 4, 0):j])
                logprobs.append({t: Logprob(lp, rank, text(t)) for rank, (t, lp)
                                 in sorted(enumerate(cands, 1), key=lambda c: c[1][0] != token)})
            # an EOS ends the text, unless include_stop_str_in_output; stop_reason as for samples
            eos = ids[-1] if reason == "stop" else None
            text = self.tokenizer.decode(without_stop_token(ids, eos, beam.include_stop_str_in_output),
                                         skip_special_tokens=beam.skip_special_tokens, continuation=True)
            results.append(CompletionOutput(i, text, ids, reason, self._stop_reason(eos, False), logprobs, cum))
        return results

    def _check_stop_strings(self, seqs):
        """Finish the sequences whose text now contains a stop string; the text ends before it.
        A stop string completed by the last token max_tokens allows (or by the token that
        completes a repetition) still counts: "stop". So does one that a stop token (or EOS)
        completes where include_stop_str_in_output keeps its text (vLLM's rule): the stop
        string is then the stop_reason."""
        for seq in seqs:
            kept_stop_token = seq.finish_reason == "stop" and seq.params.include_stop_str_in_output
            if not seq.params.stop or not (seq.finish_reason in (None, "length", "repetition") or kept_stop_token):
                continue
            req = self._requests[seq.request_id]
            scan = req.stop_scans.get(seq.sample_index)
            if scan is None:
                scan = StopStringScan(self.tokenizer, seq.params.stop, seq.params.skip_special_tokens)
                req.stop_scans[seq.sample_index] = scan
            # A stop string that the first min_tokens tokens complete does not count (the text is
            # scanned all the same): as vLLM, which looks once the output is longer.
            if scan.find(seq.output_token_ids, armed=seq.num_output_tokens > seq.params.min_tokens) is not None:
                if seq.status is not Status.FINISHED:   # (running; or waiting for a seat: Scheduler._defer)
                    self.scheduler.finish(seq, "stop")
                else:
                    seq.finish_reason = "stop"   # finished this step, by length or repetition

    # --- bookkeeping ---
    def _record_usage(self):
        """Right after scheduling, when this step's blocks are allocated: peaks, and the KV
        waste (slots allocated to a sequence but not filled: at most one partial block each)."""
        s, pool, sched = self.stats, self.pool, self.scheduler
        s.steps += 1
        s.peak_blocks_used = max(s.peak_blocks_used, pool.num_used)
        s.peak_running = max(s.peak_running, len(sched.running))
        listed = sum(seq.block_table.num_held for seq in sched.running)   # (a shared block once per table)
        s.peak_blocks_listed = max(s.peak_blocks_listed, listed)
        s.allocated_slots += listed * pool.block_size
        for seq in sched.running:
            s.filled_slots += seq.block_table.num_tokens - seq.block_table.num_dropped * pool.block_size
        self._record_counts()

    def _check_none_lost(self):
        """With the scheduler idle every request has finished, so each is due to be reported. One
        that is not (a bug: a report lost on some path) would keep has_unfinished_requests() True
        for good, and a loop of step() calls, generate's too, would spin forever. Fail fast
        instead, marking them: the next step() reports them."""
        lost = [rid for rid in self._requests if rid not in self._to_report]
        if lost:
            self._to_report |= dict.fromkeys(lost)
            raise RuntimeError(f"internal error: {len(lost)} finished request(s) ({', '.join(map(reprlib.repr, lost[:3]))}"
                               f"{', ...' if len(lost) > 3 else ''}) were never reported; the next step() reports them")

    def _record_counts(self):
        """The scheduler's counts so far (after a step is scheduled, or rolled back: its
        sequences preempted)."""
        s, sched = self.stats, self.scheduler
        s.preemptions, s.swapped_out, s.prefix_hit_tokens, s.prefix_query_tokens = (
            sched.num_preemptions, sched.num_swapped_out, sched.prefix_hit_tokens, sched.prefix_query_tokens)

    def _collect_outputs(self) -> list[RequestOutput]:
        """The outputs to return now: of the requests that finished and were not reported yet
        (this step's, and those of a step that was interrupted after it finished them), and
        of the unfinished ones that sampled since their last output, by their output_kind
        (FINAL_ONLY: none). In the order the engine first ran them."""
        outputs = []   # all built first: an interrupt here loses none
        for rid in self._to_report:
            req = self._requests[rid]
            if rid in self.scheduler.requests and (req.params.output_kind is RequestOutputKind.FINAL_ONLY or not any(
                    req.shown.get(q.sample_index, Shown()).news(q.num_output_tokens, q.finish_reason is not None)
                    for q in req.seqs)):
                continue   # running, and nothing to say yet (a prefill chunk, a preempted request)
            outputs.append(self._request_output(rid))
        self._hand_back(outputs)
        return outputs

    def _request_output(self, request_id) -> RequestOutput:
        """A request's RequestOutput (changing nothing but what _sample_result keeps): its final
        one once it finished; before, its samples so far, as its output_kind asks: CUMULATIVE
        all of them, each with its settled text (GrowingText); DELTA only what each added
        since the outputs handed out (Request.shown), the prompt's logprobs in the first alone.
        (A beam search's beams are not its results: it has only a final one.)"""
        req = self._requests[request_id]
        seqs = sorted(req.seqs, key=lambda q: q.sample_index)
        first, finished = seqs[0], request_id not in self.scheduler.requests
        now = time.perf_counter()
        first_token = min((q.first_token_time for q in seqs if q.first_token_time), default=first.finish_time or now)
        outputs = self._beam_results(req) if first.params.beam else self._sample_results(req, seqs)
        prompt_logprobs, prompt_token_id_logprobs = req.prompt_logprobs, req.prompt_token_id_logprobs
        if req.params.output_kind is RequestOutputKind.DELTA:
            outputs = [delta(c, shown) for c in outputs
                       if (shown := req.shown.get(c.index, Shown())).news(len(c.token_ids), c.finished())]
            if req.shown:
                prompt_logprobs = prompt_token_id_logprobs = None
        return RequestOutput(request_id, req.prompt, first.prompt_token_ids, outputs, first.num_cached_tokens,
                             first_token - first.arrival_time,
                             (max(q.finish_time for q in seqs) if finished else now) - first.arrival_time,
                             prompt_logprobs, None if prompt_token_id_logprobs is None
                             else prompt_token_id_logprobs.numpy().copy(), finished)

    def _stop_reason(self, stop_token: int | None, ignore_eos: bool) -> int | None:
        """vLLM's stop_reason for an output that a stop token ended (None: it did not): the
        token id, but None for the tokenizer's EOS (even where stop_token_ids lists it too,
        unless ignore_eos makes it a plain stop token). The model's other EOS ids
        (generation_config.json's, Llama 3's <|eom_id|>...) are named: vLLM counts them among
        the stop tokens. (A stop string, length, abort and error are the caller's.)"""
        if stop_token is None or (stop_token == self.tokenizer.eos_token_id and not ignore_eos):
            return None
        return stop_token

    def _sample_results(self, req, seqs: list) -> list[CompletionOutput]:
        """A request's n samples (seqs: its sequences, by sample index)."""
        outputs = [self._sample_result(req, q) for q in seqs]
        # A request that ended before its first token (aborted, or its logits broke) never
        # forked: its n samples all ended there, empty.
        first, scored = seqs[0], req.params.num_logprobs is not None
        return outputs + [CompletionOutput(j, "", [], first.finish_reason, logprobs=[] if scored else None,
                                           cumulative_logprob=0.0 if scored else None)
                          for j in range(len(seqs), first.params.n)]

    def _sample_result(self, req, q) -> CompletionOutput:
        """One sample's CompletionOutput: once it finished, its final one (kept in req.finals,
        for the outputs its request gives until all its samples end); before, its settled text."""
        if q.sample_index in req.finals:
            return own_copy(req.finals[q.sample_index])   # (a caller may change the one it got)
        ids, p = q.output_token_ids, q.params
        if q.finish_reason is None:
            if p.detokenize and q.sample_index not in req.texts:
                req.texts[q.sample_index] = GrowingText(self.tokenizer, p)
            growing, text = req.texts.get(q.sample_index), ""
            if growing:
                settled = growing.settled(ids)   # (first: it decodes the new tokens into growing.text)
                text = growing.text[:settled]
            out = CompletionOutput(q.sample_index, text, ids, None)   # (output_token_ids: a fresh slice)
        else:
            # a stop token ends the text but is not part of it (an ignored EOS is), unless
            # include_stop_str_in_output
            stop_token = (ids[-1] if q.finish_reason == "stop" and ids and ids[-1] in stop_token_set(
                p, self.scheduler.eos_token_ids) else None)
            # (an output continues its prompt: the space a SentencePiece token starts with stays)
            text = self.tokenizer.decode(without_stop_token(ids, stop_token, p.include_stop_str_in_output),
                                         p.skip_special_tokens, continuation=True) if p.detokenize else ""
            stop_reason = "repetition_detected" if q.finish_reason == "repetition" else self._stop_reason(
                stop_token, p.ignore_eos)   # (vLLM's words)
            scan = req.stop_scans.get(q.sample_index)
            if scan and scan.found is not None:   # the text ends before the stop string, or after it
                text = text[:scan.found + (len(scan.stop) if p.include_stop_str_in_output else 0)]
                stop_reason = scan.stop
            out = CompletionOutput(q.sample_index, text, ids, q.finish_reason, stop_reason)
        if p.num_logprobs is not None:
            out.logprobs = list(req.logprobs.get(q.sample_index, []))
            out.cumulative_logprob = req.cumulative.get(q.sample_index, 0.0)
        if out.finished() and p.output_kind is not RequestOutputKind.FINAL_ONLY:
            req.finals[q.sample_index] = own_copy(out)   # (a full decode: once)
        return out

    def _hand_back(self, outputs: list[RequestOutput]):
        """Outputs about to be returned: the finished requests' counted in the stats and
        forgotten, the others' recorded as handed out (Request.shown), all or none. A Ctrl-C
        halfway would lose the outputs, which the caller never gets: so it is held, everything
        is put back, and the next step() returns them (under DELTA, what they held within the
        next ones). (One in the few bytecodes between this and the caller's hands can still lose them.)"""
        if not outputs:
            return   # (most decode steps finish nothing)
        s = self.stats
        before, forgotten, shown_before = (copy.copy(s.ttft), copy.copy(s.tpot), s.prompt_tokens), {}, {}
        try:
            with defer_ctrl_c():
                for output in outputs:
                    if not output.finished:
                        req = self._requests[output.request_id]
                        shown_before[req] = req.shown
                        summed = req.params.output_kind is RequestOutputKind.DELTA   # (else c holds it all)
                        req.shown = req.shown | {c.index: (req.shown.get(c.index, Shown()) if summed
                                                           else Shown()).after(c) for c in output.outputs}
                        continue
                    forgotten[output.request_id] = req = self._requests.pop(output.request_id)
                    self._to_report.pop(output.request_id, None)
                    if any(q.first_token_time for q in req.seqs):   # (one aborted or failed before
                        s.ttft.add(output.ttft)                      # its first token has no TTFT)
                    for q in req.seqs:
                        if q.first_token_time and q.num_output_tokens > 1 and q.finish_reason != "dropped":
                            # (time from the first token to the last, per token after it; of a beam
                            # search, the beams not dropped: those that ran to the end)
                            s.tpot.add((q.finish_time - q.first_token_time) / (q.num_output_tokens - 1))
                    s.prompt_tokens += len(output.prompt_token_ids)
        except KeyboardInterrupt:   # held until the block's end (even one that came as it ended): the
            with defer_ctrl_c():    # caller will not get them, so all back, for the next step() to return
                self._requests |= forgotten
                self._to_report |= dict.fromkeys(forgotten)
                s.ttft, s.tpot, s.prompt_tokens = before
                for req, shown in shown_before.items():
                    req.shown = shown
            raise

    # --- the whole loop ---
    def generate(self, prompts, sampling_params=None, use_tqdm: bool = False, *, lora_request=None,
                 priority: list[int] | None = None, tokenization_kwargs: dict | None = None,
                 mm_processor_kwargs=None) -> list[RequestOutput]:
        """Generate for every prompt (each as add_request takes it); outputs come back in the
        order of the prompts. sampling_params: one SamplingParams for all prompts, or a list
        with one per prompt. use_tqdm: draw a progress line on stderr (vLLM's name; nanopaged
        draws its own, and is quiet by default). lora_request: vLLM's, taken at what asks for
        nothing (None); priority: vLLM's, one for all the prompts or one each (None: 0), lower
        first under LLM(scheduling_policy="priority"). tokenization_kwargs: vLLM's, see Tokenization;
        mm_processor_kwargs: vLLM's, None (no multimodal inputs)."""
        tokenization = Tokenization.of(tokenization_kwargs, mm_processor_kwargs, self.max_model_len,
                                       add_special_tokens=True)
        prompts = [p._replace(ids=tokenization.truncate(p.ids, p.specials))
                   for p in self._parse_prompts(prompts, tokenization.add_special_tokens)]
        priorities = _check_per_prompt(len(prompts), lora_request, priority)
        return self._generate(prompts, sampling_params, use_tqdm, priorities=priorities)

    def beam_search(self, prompts, params: BeamSearchParams, lora_request=None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None, priority=None) -> list[BeamSearchOutput]:
        """vLLM's beam search: for each prompt (as generate takes them), the params.beam_width
        best outputs, best first (see _beam_step). (generate and add_request take
        BeamSearchParams too, and give RequestOutputs, their outputs the beams.)
        concurrency_limit: search at most that many prompts at once (None: all). lora_request
        and priority: vLLM's, as generate takes them."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        if concurrency_limit is not None and not (is_integer(concurrency_limit) and concurrency_limit >= 1):
            raise ValueError(f"concurrency_limit must be None or an integer >= 1, got {concurrency_limit!r}")
        prompts = self._parse_prompts(prompts)
        priorities = _check_per_prompt(len(prompts), lora_request, priority)
        at_once = concurrency_limit or max(len(prompts), 1)
        outputs = []
        for start in range(0, len(prompts), at_once):
            for r in self._generate(prompts[start:start + at_once], params, use_tqdm, "beam_search()",
                                    priorities[start:start + at_once]):
                sequences = []
                for o in r.outputs:
                    # as vLLM's LLM.beam_search: a final EOS stays in the tokens, and in the text
                    # where skip_special_tokens=False or it is no special token, whatever
                    # include_stop_str_in_output says (vLLM's server reads it; its offline search,
                    # as generate here, its RequestOutput's text); stop_reason is nanopaged's
                    eos = o.token_ids[-1] if o.finish_reason == "stop" else None
                    tokens = r.prompt_token_ids + o.token_ids
                    text = self.tokenizer.decode(tokens, skip_special_tokens=params.skip_special_tokens)
                    sequences.append(BeamSearchSequence(tokens, o.logprobs, o.cumulative_logprob, text,
                                                        o.finish_reason, eos))
                outputs.append(BeamSearchOutput(sequences))
        return outputs

    def _parse_prompts(self, prompts, add_special_tokens: bool = True) -> list[Prompt]:
        """One prompt, or a list of them, as _parse_prompt reads each."""
        if isinstance(prompts, (str, dict)) or (_is_token_ids(prompts) and len(prompts) > 0):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a string, a list of token ids, or a list of those; "
                             f"got {_describe(prompts)}")
        parsed = []
        for i, prompt in enumerate(prompts):
            try:
                parsed.append(self._parse_prompt(prompt, add_special_tokens))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        return parsed

    def chat(self, messages, sampling_params=None, use_tqdm: bool = False, lora_request=None, priority=None,
             chat_template: str | None = None, chat_template_content_format: str = "auto",
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None,
             tokenization_kwargs: dict | None = None, mm_processor_kwargs=None) -> list[RequestOutput]:
        """vLLM's chat (its arguments, in its order): one conversation (a list of messages such
        as {"role": "user", "content": ...}) or a list of conversations, each rendered with the
        model's chat template, or `chat_template` (a template, a file's path or the name of one
        of the model's named templates; else LLM's), (render_chat) and generated for; one
        RequestOutput per conversation, whose prompt is the rendered text.
        continue_final_message, tools and chat_template_kwargs (the template's own variables)
        go to apply_chat_template. lora_request and priority: as generate takes them;
        chat_template_content_format: "auto", the only one (apply_chat_template picks as vLLM's
        auto does). tokenization_kwargs and mm_processor_kwargs: as generate takes them, but
        add_special_tokens defaults to False, as in vLLM (the template wrote them)."""
        tokenization = Tokenization.of(tokenization_kwargs, mm_processor_kwargs, self.max_model_len,
                                       add_special_tokens=False)
        if not is_one_of(chat_template_content_format, ("auto",)):
            raise ValueError(f"chat_template_content_format={chat_template_content_format!r}: nanopaged hands a "
                             f"message's content over as vLLM's 'auto' does (it takes 'auto')")
        if chat_template_kwargs is not None and not (isinstance(chat_template_kwargs, dict)
                                                     and all(isinstance(k, str) for k in chat_template_kwargs)):
            raise ValueError(f"chat_template_kwargs must be a dict with string keys, got {reprlib.repr(chat_template_kwargs)}")
        if "tokenize" in (chat_template_kwargs or {}):   # (vLLM refuses it too)
            raise ValueError("chat_template_kwargs cannot set tokenize: chat() encodes the rendered text itself")
        # as vLLM merges them: chat_template_kwargs may also set the named options
        # (a name of the model's named templates, or as LLM(chat_template=...) takes one: a
        # template or a file's path, never the path itself rendered as the prompt's text)
        if chat_template is not None and not (isinstance(chat_template, str)
                                              and chat_template in self.tokenizer.named_templates):
            chat_template = load_chat_template(chat_template)
        options = dict(chat_template=self.chat_template if chat_template is None else chat_template,
                       add_generation_prompt=add_generation_prompt,
                       continue_final_message=continue_final_message, tools=tools) | (chat_template_kwargs or {})
        # (refused, rather than a string message passed on unrendered)
        if not self.tokenizer.has_chat_template and options["chat_template"] is None:
            raise ValueError("this model has no chat template: give chat() one (chat_template=...) "
                             "or generate() a plain prompt")
        batch = isinstance(messages, (list, tuple)) and bool(messages) and isinstance(messages[0], (list, tuple))
        parsed = []
        for i, conversation in enumerate(messages if batch else [messages]):
            try:
                text, ids = render_chat(self.tokenizer, vllm_messages(conversation),
                                        add_special_tokens=tokenization.add_special_tokens, **options)
                specials = self.tokenizer.specials_around(ids, tokenization.add_special_tokens)
                parsed.append(Prompt(text, tokenization.truncate(ids, specials), specials))
            except ValueError as e:
                raise ValueError(f"conversation {i}: {e}" if batch else str(e)) from None
        priorities = _check_per_prompt(len(parsed), lora_request, priority)
        return self._generate(parsed, sampling_params, use_tqdm, "chat()", priorities)

    def _generate(self, prompts: list[Prompt], sampling_params, use_tqdm: bool,
                  caller: str = "generate()", priorities: list | None = None):
        """Run prompts (as _parse_prompt reads them) to the end, alone in the
        engine; outputs in their order. (caller: the public method, for its errors; priorities:
        one per prompt, None: all 0.)"""
        one_each = isinstance(sampling_params, (list, tuple))
        params = list(sampling_params) if one_each else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        if not (isinstance(use_tqdm, bool) or callable(use_tqdm)):
            raise ValueError(f"use_tqdm must be True, False, or a function that makes a progress bar "
                             f"(vLLM's: tqdm's signature), got {use_tqdm!r}")
        self._check_alone(caller)
        ids, first_id, bar = [], self._next_id, None
        try:
            self._generating = self._cleanup_due = True   # (before its requests exist: a step elsewhere would run them)
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                try:
                    ids.append(self._add(prompt, p, final_only=True, priority=priorities[i] if priorities else 0))
                except ValueError as e:
                    self._next_id = first_id   # (the ids of the prompts before it: never seen by the caller)
                    raise ValueError(f"prompt {i}: {e}") from None
            self.reset_stats()   # (once all were accepted: a refused batch leaves them as they were)
            if callable(use_tqdm):   # (vLLM's: a bar of the caller's, tqdm or one like it)
                bar = use_tqdm(total=len(ids), desc="Processed prompts")
            results = {}
            while self.has_unfinished_requests():
                finished = self._step()
                for r in finished:
                    results[r.request_id] = r
                if bar is not None:
                    bar.update(len(finished))
                elif use_tqdm:
                    _progress(len(results), len(ids), self.stats)
            self._cleanup_due = False   # (all reported: nothing left)
        except BaseException:
            self._drop_all()   # a refused prompt, an interrupt...: leave nothing behind
            raise
        finally:
            self._generating = False
            if bar is not None:
                bar.close()
        if use_tqdm is True:
            print(file=sys.stderr)
        return [results[rid] for rid in ids]

    def _check_alone(self, caller: str):
        """generate() and stream() run the engine until their own requests finish: requests
        queued with add_request would run too, and their outputs would be lost."""
        self._check_free(caller)
        if self.has_unfinished_requests():
            raise ValueError(f"{caller} cannot run while {len(self._requests)} request(s) queued with "
                             "add_request() are not reported finished: step() them to the end, or abort() them")

    def _check_free(self, caller: str):
        """While generate() runs, or a stream is open, it owns the engine: a step taken
        elsewhere (from a trace callback, another thread) would finish its requests behind
        its back, and a request added beside them would be run by its steps, its output lost."""
        self._check_not_generating(caller)
        if self._open_stream is not None:
            raise ValueError(f"{caller} cannot run while a stream() is being read: read it to the end, "
                             "or close() it")
        if self._cleanup_due:   # neither runs any more: what they left is nobody's
            self._drop_all()

    def _check_not_generating(self, caller: str):
        if self._generating:
            raise ValueError(f"{caller} cannot run while generate() is running (called from its trace "
                             "callback, or another thread: the engine is not thread-safe)")

    def _drop_all(self):
        """Abort every request, where unfinished, and forget them all (generate() and
        stream() run alone: every request is theirs, even one whose id an interrupt kept
        from them)."""
        with defer_ctrl_c():
            for rid in list(self._requests):
                if rid in self.scheduler.requests:
                    self.scheduler.abort(rid)
                del self._requests[rid]
            self._to_report.clear()
            self._cleanup_due = False
        self._flush_trace()

    def reset_stats(self):
        self.stats = Stats()
        self.scheduler.reset_counters()

    # --- streaming and the block trace ---
    def stream(self, prompt, params: SamplingParams | None = None):
        """Generate for one prompt, yielding its text piece by piece as tokens arrive."""
        if isinstance(params, SamplingParams) and params.n != 1:   # (None: the defaults, n = 1)
            raise ValueError("stream() generates one sample: use generate() for n > 1")
        if isinstance(params, BeamSearchParams):
            raise ValueError("stream() generates one sample: use beam_search() for a beam search")
        if isinstance(params, SamplingParams) and not params.detokenize:
            raise ValueError("stream() yields text, which detokenize=False leaves out: add_request() and "
                             "step() give the token ids")
        self._check_alone("stream()")
        pieces = self._stream(prompt, params)
        # Run the generator to its first yield, which comes right after it queued the request:
        # bad input raises here, at the call. From then on, closing the stream or dropping it
        # unread runs its `finally`, which frees the request. (A generator that never
        # started has no `finally` to run: its request would stay queued for good.)
        next(pieces)
        self.reset_stats()   # (after the request was accepted: a refused one leaves them as they were)
        return pieces

    def _stream(self, prompt, params):
        try:
            self._cleanup_due = True   # (stream() checked the engine was free: add, unchecked)
            rid = self._add(self._parse_prompt(prompt), params, final_only=True)
            req = self._requests[rid]
            seq, self._open_stream = req.seqs[0], rid
            # the text shown so far: what is settled (its own copy of the params: the caller's
            # may have changed since)
            growing, shown = GrowingText(self.tokenizer, seq.params), 0
            yield ""   # where stream() leaves us, primed
            while rid in self.scheduler.requests:   # until it finishes, or someone aborts it
                finished = [r for r in self._step() if r.request_id == rid]
                if finished:
                    out = finished[0].outputs[0]
                    yield out.text[shown:]
                    if out.finish_reason == "error":
                        raise GenerationError(f"{seq.error}: generation stopped")
                    return
                settled = growing.settled(seq.output_token_ids)
                if settled > shown:
                    yield growing.text[shown:settled]
                    shown = settled
            # aborted (between two pieces): the rest of the text abort() returned (a character
            # cut short shows as U+FFFD)
            if rest := self._sample_result(req, seq).text[shown:]:
                yield rest
        finally:   # the caller stopped reading early, or a step raised: free its blocks
            self._open_stream = None   # (first, and with no call before it: no Ctrl-C lands ahead of it)
            self._drop_all()

    def enable_trace(self, emit=print):
        """Narrate every step: the chapter's figures, live. The lines are collected during
        the step and written at its end by _flush_trace (also when it raises), so that an
        emitter that fails (a closed pipe) cannot stop the bookkeeping halfway."""
        if not callable(emit):   # (else the TypeError would come at every step's end)
            raise ValueError(f"emit must be a function that takes a line, got {_describe(emit)}")
        lines = self._trace = []
        self._emit = emit
        self.pool.trace = lambda msg: lines.append("  " + msg)   # pool and scheduler events, in order

    def disable_trace(self):
        self._flush_trace()
        self._trace = self.pool.trace = None

    def _flush_trace(self):
        """Write the lines collected since the last flush. The buffer is emptied first: if
        the emitter raises, the rest of these lines are dropped, not written twice."""
        if self._trace:
            lines = self._trace.copy()
            self._trace.clear()
            for line in lines:
                self._emit(line)

    def _trace_step(self, out):
        """After scheduling: what runs, and every running sequence's block table as
        logical block -> physical block [its tokens] filled/size ref_count."""
        ran = ", ".join(f"{seq} {'prefill' if n > 1 or seq.num_computed_tokens < seq.num_prompt_tokens else 'decode'} "
                        f"{n} token{'s' * (n > 1)}" for seq, n in zip(out.seqs, out.num_scheduled_tokens))
        self._trace.append(f"  ran: {ran}")
        bs, pool = self.pool.block_size, self.pool
        for seq in self.scheduler.running:
            table, cells = seq.block_table, []
            if table.num_dropped:
                cells.append(f"0..{table.num_dropped - 1} slid out of the window")
            for i, block in enumerate(table.block_ids[table.num_dropped:], table.num_dropped):
                filled = min(bs, table.num_tokens - i * bs)
                words = "|".join(one_line(self.tokenizer.decode([t], continuation=True))
                                 for t in seq.token_ids[i * bs:i * bs + filled])
                cells.append(f"{i}->{block} [{words}] {filled}/{bs} ref={pool.ref_count[block]}")
            self._trace.append(f"  {seq}: " + "  ".join(cells))
        self._trace.append(f"  blocks: {pool.num_free} free, {pool.num_evictable} evictable, {pool.num_used} used")


# -----------------------------------------------------------------------------
# 3b. Beam search's history and rank, the stop token's cut, and text kept on one line


def beam_history(history) -> list:
    """A beam's candidates at each step, first step first, from its linked list (the steps
    before, the last step's), which the beams forked from one share instead of each copying
    a list every step."""
    steps = []
    while history is not None:
        history, cands = history
        steps.append(cands)
    return steps[::-1]


def beam_rank(hypothesis: tuple, length_penalty: float) -> float:
    """Where a beam search result (output ids, cumulative logprob, ...) ranks, lowest first.
    vLLM (0.33 on) and transformers rank by the score cumulative logprob / length **
    length_penalty, highest first, where the length counts the output's tokens, a final EOS
    included (at least 1: an aborted beam may have none). (vLLM before 0.33 counted the
    prompt too, and not a final EOS.) The score is <= 0 (so is the logprob), so ranking by
    log(-score) = log(-cumulative logprob) - length_penalty * log(length), lowest first, is
    the same order, and neither overflows nor underflows (length ** 1000 would)."""
    ids, cum = hypothesis[:2]
    return -math.inf if cum >= 0 else math.log(-cum) - length_penalty * math.log(max(len(ids), 1))


def delta(c: CompletionOutput, shown: Shown) -> CompletionOutput:
    """What c adds to the outputs of its sample handed out so far (RequestOutputKind.DELTA;
    cumulative_logprob stays the sum over all its tokens, as in vLLM)."""
    return replace(c, text=c.text[shown.chars:], token_ids=c.token_ids[shown.tokens:],
                   logprobs=None if c.logprobs is None else c.logprobs[shown.tokens:])


def without_stop_token(ids: list[int], stop_token: int | None, include_stop_str_in_output: bool) -> list[int]:
    """An output's ids less the stop token that ended it (EOS, or one of stop_token_ids; None:
    none did): vLLM leaves it out of the text, unless include_stop_str_in_output."""
    return ids[:-1] if stop_token is not None and not include_stop_str_in_output else ids


def one_line(text: str) -> str:
    """Text that must stay on its line, with newlines, tabs and other control characters
    written out as escapes: a token's text in the block trace's tables (a chat template puts
    newlines in the prompt), and an error message on the command line (a path may hold any
    character, a newline too)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


# -----------------------------------------------------------------------------
# 3c. Sampling: logits processors, probabilities, logprobs


def edits_logits(seq) -> bool:
    """Whether process_logits has work for seq."""
    p = seq.params
    return (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            or seq.num_output_tokens < p.min_tokens or p.logit_bias is not None
            or p.disallowed_mask is not None or p.bad_words_token_ids is not None)


class TokenCounts:
    """A sequence's tokens, counted as they come, for the penalties: which tokens its prompt
    and output hold (repetition_penalty), and how often its output holds each (presence and
    frequency penalties). Counting the whole history again at every step would cost time
    quadratic in its length (0.6 ms a row, a step, at 4,000 tokens); this counts each token once."""

    def __init__(self, vocab_size: int, device):
        self.seen: set[int] = set()   # the tokens in the prompt or the output
        # the same as a tensor (len(seen),): the repetition penalty indexes the logits by it, touching
        # only those (a torch.where over all V of them takes 8x as long on a CPU: 144 us of 49k)
        self.seen_ids = torch.zeros(0, dtype=torch.int64, device=device)
        self.output = torch.zeros(vocab_size, dtype=torch.float32, device=device)  # (V,) times in the output
        self.num_counted = 0   # the first tokens of seq.token_ids, counted (they are only ever appended)

    def update(self, seq) -> "TokenCounts":
        """Count the tokens seq has gained since the last update."""
        new = seq.token_ids[self.num_counted:]
        if first_seen := list(dict.fromkeys(t for t in new if t not in self.seen)):
            self.seen.update(first_seen)
            self.seen_ids = torch.cat([self.seen_ids, torch.tensor(first_seen, device=self.seen_ids.device)])
        out = torch.tensor(new[max(seq.num_prompt_tokens - self.num_counted, 0):], dtype=torch.int64,
                           device=self.output.device)   # (the new tokens that are output)
        # (index_put_ with accumulate, not bincount: on a GPU bincount waits for the GPU to learn its size)
        self.output.index_put_((out,), torch.ones_like(out, dtype=self.output.dtype), accumulate=True)
        self.num_counted = len(seq.token_ids)
        return self


def process_logits(logits, seq, eos_token_ids):
    """vLLM's logits processors, in place on one row of logits (V,) of a sequence whose params
    edits_logits, before temperature: logit_bias, the penalties, then the bans. The bans come
    last so that a banned token's -inf meets no arithmetic (the repetition penalty's clamp would
    make it finite); vLLM bans first, with the same result, since no penalty moves a -inf."""
    p, V = seq.params, logits.numel()
    if p.logit_bias is not None:
        logits[list(p.logit_bias)] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype,
                                                   device=logits.device)
    if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
        seq.token_counts = counts = (seq.token_counts or TokenCounts(V, logits.device)).update(seq)
    if p.repetition_penalty != 1.0:
        # CTRL's rule, on every token of the prompt and the output so far: a positive logit
        # divided by the penalty, a negative one multiplied, both less likely for a penalty > 1
        x = logits[counts.seen_ids]
        big = torch.finfo(x.dtype).max   # (a huge or tiny penalty must not make a logit inf: no softmax survives that)
        logits[counts.seen_ids] = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty).clamp(-big, big)
    if p.presence_penalty or p.frequency_penalty:   # (OpenAI's: on the output's tokens only)
        logits -= p.frequency_penalty * counts.output + p.presence_penalty * (counts.output > 0)
    if p.disallowed_mask is not None:   # (allowed_token_ids)
        logits.masked_fill_(p.disallowed_mask, float("-inf"))
    banned = []
    if p.bad_words_token_ids is not None:
        # A bad word's last token is banned where the output ends with the rest of the word
        # (its first tokens; for a word of one token, always), so the word is never completed.
        out = seq.output_token_ids
        banned += [w[-1] for w in p.bad_words_token_ids
                   if len(w) - 1 <= len(out) and out[len(out) - len(w) + 1:] == w[:-1]]
    if seq.num_output_tokens < p.min_tokens:   # too early to stop: no token that would stop it
        banned += min_tokens_bans(p, eos_token_ids, V)
    if banned:
        logits[banned] = float("-inf")


def nothing_to_draw(p: SamplingParams) -> str:
    """Why a request has no token to draw: the constraints it has that ban tokens."""
    named = [name for name, given in (("allowed_token_ids", p.allowed_token_ids is not None),
                                      ("bad_words", p.bad_words),
                                      ("min_tokens' stop tokens (EOS, stop_token_ids)", p.min_tokens)) if given]
    return f"no token is left to draw: {', '.join(named)} ban them all"


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each of SamplingParams.bad_words as token ids, spelled as vLLM spells it: as the text
    begins ("word") and, where a BPE tokenizer gives another first token for it after a space
    (" word") in as many tokens, that way too."""
    spellings = []
    for word in words:
        alone, spaced = (tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False) for prefix in ("", " "))
        if not alone or not spaced:   # (a tokenizer that drops bytes its vocab lacks can spell nothing)
            raise ValueError(f"bad_words: the tokenizer spells {word!r} with no token")
        spellings += [alone] + ([spaced] if spaced[0] != alone[0] and len(spaced) == len(alone) else [])
    return spellings


def min_tokens_bans(p: SamplingParams, eos_token_ids, vocab_size: int) -> list[int]:
    """The tokens min_tokens holds back: the stop tokens and every EOS id, under ignore_eos too
    (vLLM's rule: 'at least min_tokens before an EOS' holds whether or not EOS would stop),
    those the model can draw (ids past the vocabulary never come)."""
    return sorted(t for t in stop_token_set(p, eos_token_ids) | set(eos_token_ids) if 0 <= t < vocab_size)


NUCLEUS_LOOK = 1024   # top-p looks for its set among this many likeliest tokens first, then 8x (sampling_probs)


def sampling_probs(logits, p: SamplingParams):
    """Next-token probabilities (V,) after temperature, top-k, min-p and top-p (nucleus)
    filtering (vLLM's order: min-p before top-p, which renormalizes what is left)."""
    # Shift the top logit to 0 before dividing: a tiny temperature then sends the others
    # to -inf (probability 0: the greedy limit) instead of overflowing them all to inf.
    x = (logits.double() - logits.max()) / p.temperature   # float64: a temperature of 1e-46 is not 0
    if p.top_k > 0 and p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.min_p > 0:
        # min_p keeps the tokens at least min_p times as likely as the likeliest. The top logit
        # is 0 here, weight e^0 = 1, so a token's weight e^x is its ratio to it: keep x >= ln(min_p).
        x = x.masked_fill(x < math.log(p.min_p), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        # keep the smallest set of most likely tokens whose probability reaches top_p. That set
        # is often a few hundred tokens: look among the likeliest NUCLEUS_LOOK first (a topk:
        # 0.2-0.5 ms of a 49k vocabulary on a CPU core); where they fall short, among 8 times as
        # many (0.8-1 ms: a model unsure of itself spreads its nucleus over thousands), and sort
        # the whole vocabulary (2.3-2.8 ms) only where those fall short too. The second look is
        # skipped where the first holds less than half of top_p: a flat row (a high temperature),
        # whose nucleus is wider still. (In bench.py sampling's rows, top_p 0.95, each nucleus that
        # 8,192 tokens held had 0.74 or more in its first 1,024; at temperature 1.5, 500 of 512
        # rows needed the sort, and 398 of those held less than half in the first 1,024.)
        V = probs.numel()
        top, order = probs.topk(min(NUCLEUS_LOOK, V))   # (min(NUCLEUS_LOOK, V),) each, likeliest first
        mass = top.cumsum(-1)
        if p.top_p / 2 <= mass[-1] < p.top_p and top.numel() < V:   # short, but not flat
            top, order = probs.topk(min(8 * NUCLEUS_LOOK, V))
            mass = top.cumsum(-1)
        if mass[-1] < p.top_p and top.numel() < V:   # short still, or flat: sort them all
            top, order = sort_descending(probs)
            mass = top.cumsum(-1)
        outside = mass - top >= p.top_p   # mass before this token already enough
        probs = torch.zeros_like(probs).scatter(0, order, top.masked_fill(outside, 0.0))
    return probs.to(logits.dtype)


def sort_descending(x) -> tuple:
    """x (V,) sorted, largest first, and the order that sorts it, as torch.sort gives them.
    On the CPU through numpy: torch's CPU sort takes 3.5 ms of 49k float64s, numpy's argsort
    and the gather 2.3-2.8 ms (on a GPU, torch's is the fast one)."""
    if x.device.type != "cpu":
        return x.sort(descending=True)
    order = torch.from_numpy(np.argsort(-x.numpy()))   # (V,)
    return x[order], order


def draw(probs, generator) -> int:
    """A token drawn from probs (V,), weights summing to about 1, by inverse transform
    sampling: the first token whose running sum reaches a uniform draw u in (0, sum]. One
    random number a draw, where torch.multinomial makes one per token (0.8 ms of a 49k
    vocabulary on a CPU core, against 0.03 ms). A token of probability 0 is never drawn:
    the running sum reaches nothing new at it, so the token before it is found first."""
    cdf = probs.double().cumsum(0)                                                            # (V,)
    u = 1.0 - torch.rand(1, dtype=torch.float64, generator=generator, device=probs.device)   # (0, 1]
    return int(torch.searchsorted(cdf, u * cdf[-1]))   # (u * sum <= sum: rounding never passes the end)


def logprob_dicts(lp, targets: list[int], picks: list, tokenizer,
                  contexts: list[list[int] | None]) -> list[dict[int, Logprob]]:
    """For each row of log-probabilities lp (M, V): {token id: Logprob} of its target token,
    then of its pick: an int k, its k most likely tokens (ranked by their place among them); or
    a list of token ids (logprob_token_ids), those tokens (each ranked in the whole vocabulary,
    as the target is, where vLLM numbers them 1 to n). These are the model's own
    probabilities (a log_softmax of its logits, in float32), before the penalties, the
    constraints, temperature, top-k, min-p and top-p (vLLM's default). contexts: per row, the
    sequence's last few tokens before its position, for token_texts; None where no text is
    wanted (detokenize=False: decoded_token None)."""
    target_lp = lp.gather(1, torch.tensor(targets, device=lp.device)[:, None])   # (M, 1)
    ranks = (lp >= target_lp).sum(dim=-1).tolist()                       # (M,) ties count against it
    # (a k past a tiny vocabulary, up to LLM(max_logprobs), is all of it: topk would raise)
    k_most = max((k for k in picks if isinstance(k, int)), default=0)
    top_lp, top_ids = lp.topk(min(k_most, lp.shape[-1]), dim=-1)         # (M, k_most), most likely first
    result = []
    for m, (target, t_lp, rank, pick, row_lp, row_ids, context) in enumerate(zip(
            targets, target_lp[:, 0].tolist(), ranks, picks, top_lp.tolist(), top_ids.tolist(), contexts)):
        text = (lambda t: None) if context is None else token_texts(tokenizer, context)
        d = {target: Logprob(t_lp, rank, text(target))}
        if isinstance(pick, int):
            for r, (x, t) in enumerate(zip(row_lp[:pick], row_ids[:pick]), start=1):
                d[t] = Logprob(x, r, text(t))   # (the target among them keeps its place, first)
        else:
            chosen = lp[m, pick]                                          # (n,)
            chosen_ranks = (lp[m, None, :] >= chosen[:, None]).sum(dim=-1)   # (n, V) -> (n,)
            for t, x, r in zip(pick, chosen.tolist(), chosen_ranks.tolist()):
                d[t] = Logprob(x, r, text(t))
        result.append(d)
    return result


def token_texts(tokenizer, context: list[int]):
    """Logprob entries' texts at one position: a function that gives, for a token, the text it
    adds after `context`, up to 4 of the sequence's tokens before it (decoded once for all of
    the position's candidates).

    A token that holds whole characters gives the token decoded alone, a SentencePiece token's
    leading space kept (a real one, as in an output's text): vLLM's texts (0.14 and 0.26 on).
    A UTF-8 character cut between tokens (byte fallback, byte-level BPE) belongs to the token
    that holds its last byte: a token that only begins one gives "", one that holds "世" and
    the first bytes of the next gives "世", and bytes that make no character give U+FFFD, as
    in the text. So the chosen tokens' texts add up to the output's text (vLLM's do only where
    every token ends a character), but for one case: an output cut short inside a character
    ends in U+FFFD, which its last token's entry, not knowing it is the last, does not show.
    Four tokens are enough: the character a token may complete began at most 3 bytes, so at
    most 3 tokens, before it."""
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    utf8.decode(tokenizer.decode_bytes(context))   # (keeps the bytes of a character the context leaves cut)
    after_context = utf8.getstate()

    def text(token: int) -> str:
        utf8.setstate(after_context)
        return utf8.decode(tokenizer.decode_bytes([token]))
    return text


def logprob_table(c: CompletionOutput, k: int) -> str:
    """The CLI's view of a sample's logprobs: one line per token, its log-probability and
    rank, then the k likeliest tokens at that position."""
    lines = []
    for d in c.logprobs:
        chosen = next(iter(d.values()))
        top = sorted(d.values(), key=lambda e: e.rank)[:k]
        lines.append((f"  {one_line(repr(chosen.decoded_token)):>16} {chosen.logprob:8.3f}  rank {chosen.rank:<6}" +
                      "  ".join(f"{one_line(repr(e.decoded_token))} {e.logprob:.2f}" for e in top)).rstrip())
    return "\n".join(lines + [f"  cumulative logprob {c.cumulative_logprob:.3f}"])


# -----------------------------------------------------------------------------
# 3d. Helpers: devices, dtypes, the kernels' choice, chat rendering, request ids, progress


def _parse_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError, ValueError):   # (TypeError: not a string or index at all, 1.5;
        # ValueError: an index past a C long, 2**63)
        raise ValueError(f"unknown device {device!r}: use cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}: no CUDA GPU is available to torch {torch.__version__}")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {str(device)!r} is not supported: use cpu or cuda")
    return device


def auto_dtype(device, cfg: ModelConfig) -> torch.dtype:
    """dtype "auto" (or None): float32 on the CPU, where its matmuls are as fast as any and
    exact; on a GPU, as vLLM's "auto": the checkpoint's half precision, float16 or bfloat16
    as stored, bfloat16 for a float32 checkpoint, and for Gemma 2 and 3 (whose activations
    overflow float16: vLLM refuses float16 for them)."""
    if device.type != "cuda":
        return torch.float32
    return torch.float16 if cfg.torch_dtype == "float16" and cfg.model_type not in NO_FLOAT16 else torch.bfloat16


def _parse_dtype(dtype) -> torch.dtype:
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
    if isinstance(dtype, torch.dtype) and dtype in names.values():
        return dtype
    if isinstance(dtype, str) and dtype in names:
        return names[dtype]
    raise ValueError(f"unsupported dtype {dtype!r}: use one of {', '.join(names)}, or torch.float32, "
                     "torch.bfloat16, torch.float16")


def _default_kv_cache_memory(device) -> int:
    """The KV budget when none is given: 2 GiB on the CPU; on a GPU, 40% of what is free
    once the weights are loaded."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(0.4 * free)
    return 2 << 30


def _pick_kernels(backend: str, device, cfg, block_size: int, dtype: torch.dtype, kv_cache_dtype=None):
    """The CUDA kernel's ops when attention should run on it, else None (the torch path)."""
    if backend == "torch" or device.type != "cuda":
        return None
    if cfg.attn_logit_softcapping is not None:
        ops, reason = None, "the kernel has no softcap for the attention scores (Gemma 2's)"
    else:
        ops = build_ext.load_kernels()   # the first use on a machine compiles it (about a minute)
        reason = build_ext.unavailable_reason() if ops is None else None
    dtype_name = str(dtype).removeprefix("torch.")
    if ops is not None and dtype_name not in build_ext.SUPPORTED_DTYPES:
        ops, reason = None, f"the kernel is built for {build_ext.SUPPORTED_DTYPES}, not {dtype_name}"
    if ops is not None and kv_cache_dtype not in (None, dtype):
        kv_name = str(kv_cache_dtype).removeprefix("torch.")
        ops, reason = None, f"the kernel reads a KV cache of the model's dtype, not {kv_name}"
    if ops is not None and cfg.head_dim not in build_ext.SUPPORTED_HEAD_DIMS:
        ops, reason = None, (f"the kernel is built for head_dim {build_ext.SUPPORTED_HEAD_DIMS}, "
                             f"not {cfg.head_dim}")
    if ops is not None and block_size & (block_size - 1):
        ops, reason = None, f"the kernel needs a power-of-two block_size, not {block_size}"
    if ops is None:
        if backend == "cuda":
            raise ValueError(f"attn_backend='cuda' is not available: {reason}")
        print(f"nanopaged: attention runs on the torch path: {reason}", file=sys.stderr)
    return ops


def _pick_cpu_kernel(backend: str, device, cfg, block_size: int, dtype: torch.dtype, kv_cache_dtype=None):
    """kernels_cpu.c's decode attention when it should serve the decode rows, else None. (It
    reads every KV cache dtype LLM's kv_cache_dtype makes.)"""
    if backend not in ("auto", "cpu") or device.type != "cpu":
        return None
    kernel = build_ext.load_cpu_kernels()   # the first use on a machine compiles it (a few seconds)
    reason = build_ext.cpu_unavailable_reason() if kernel is None else \
        kernel.unsupported(dtype, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, block_size,
                           kv_cache_dtype)
    if reason is None:
        return kernel
    if backend == "cpu":
        raise ValueError(f"attn_backend='cpu' is not available: {reason}")
    print(f"nanopaged: decode attention runs on the torch path: {reason}", file=sys.stderr)
    return None


def render_chat(tokenizer, conversation, /, add_special_tokens: bool = False, **options) -> tuple[str, list[int]]:
    """A conversation as an instruct model reads it: the text its chat template renders (with
    apply_chat_template's options), and that text's token ids (the tokenizer's encode_chat:
    no special tokens added, as HF and vLLM encode it, unless add_special_tokens)."""
    text = tokenizer.apply_chat_template(conversation, **options)
    ids = tokenizer.encode(text) if add_special_tokens else tokenizer.encode_chat(text)
    if not ids:   # (else "the prompt is empty", of a prompt the caller never wrote)
        raise ValueError(f"the chat template rendered the conversation as {text!r}, no tokens: is the template empty?")
    return text, ids


def vllm_messages(conversation):
    """A conversation as vLLM's chat hands it to the template: a content that is None or
    left out becomes no parts ([], which a template that reads content as a string gets as
    ""): OpenAI's API sends content=None in an assistant turn that only calls tools; each
    assistant tool call's arguments, a JSON string in OpenAI's API, become the dict tool-use
    templates read (what the JSON holds, as in vLLM; empty or invalid JSON: {}, where vLLM's
    request fails), and an empty tool_calls list is dropped, which keeps a template on its
    plain assistant path. (transformers' apply_chat_template passes them on as they are;
    nanopaged's refuses a message without content unless it calls tools.) The caller's
    messages are not changed."""
    if not isinstance(conversation, (list, tuple)):
        return conversation   # (one user turn, or what render_chat refuses)
    messages = []
    for m in conversation:
        if isinstance(m, dict) and m.get("content") is None:
            m = m | {"content": []}
        calls = m.get("tool_calls") if isinstance(m, dict) and m.get("role") == "assistant" else None
        if isinstance(calls, (list, tuple)):   # (vLLM makes a tuple a list first)
            m = {key: value for key, value in m.items() if key != "tool_calls"}
            if calls:
                m["tool_calls"] = [_parsed_tool_call(call) for call in calls]
        messages.append(m)
    return messages


def _parsed_tool_call(call):
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call   # (for the template to read as it is)
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args else {}
        except (ValueError, RecursionError):   # not JSON, an int past Python's 4,300 digits, nested too
            args = {}                           # deeply: the turn goes on, and so does the conversation
    return call | {"function": function | {"arguments": args}}


def request_copy(params: SamplingParams | BeamSearchParams) -> SamplingParams | BeamSearchParams:
    """A request's own copy of its params, checked again: the caller may change its object
    after this (or did since making it), and may reuse it for the next request (vLLM copies
    too). Made anew from the constructor's fields, so that what the engine fills in
    (disallowed_mask, bad_words_token_ids, beam) never comes from the caller's object; made
    as the base class itself, SamplingParams or BeamSearchParams, from its own fields (a
    subclass may have an __init__ of its own, taking other arguments, or fields more)."""
    base, values = BeamSearchParams if isinstance(params, BeamSearchParams) else SamplingParams, {}
    for f in fields(base):
        if f.init:
            value = getattr(params, f.name)
            try:
                values[f.name] = copy.deepcopy(value)
            except Exception as e:   # (a generator, a lock: deepcopy's TypeError, from deep inside copy)
                raise ValueError(f"{f.name} = {reprlib.repr(value)} cannot be copied into the request "
                                 f"({type(e).__name__}: {e})") from None
    return base(**values)


def _check_per_prompt(num_prompts: int, lora_request, priority) -> list:
    """vLLM's lora_request and priority: one for all the prompts, or a list of one each (a
    list of another length refused, as vLLM does); lora_request taken where it asks for
    nothing (None: no adapter). Returns each prompt's priority (None: 0; LLM._add checks them)."""
    if lora_request is not None and not (isinstance(lora_request, (list, tuple))
                                         and all(r is None for r in lora_request)):
        raise ValueError(f"lora_request={reprlib.repr(lora_request)}: nanopaged has no LoRA adapters (it takes None)")
    for name, value in (("lora_request", lora_request), ("priority", priority)):
        if isinstance(value, (list, tuple)) and len(value) != num_prompts:
            raise ValueError(f"{name} has {len(value)} entries for {num_prompts} prompts")
    if isinstance(priority, (list, tuple)):
        return list(priority)
    return [0 if priority is None else priority] * num_prompts


@dataclass(frozen=True)
class Tokenization:
    """vLLM's tokenization_kwargs for generate and chat: how a prompt becomes token ids.
    add_special_tokens: encode a text with the tokenizer's special tokens (a BOS...).
    keep: truncate a prompt to that many ids (None: no truncation), its last ones
    (side "left", vLLM's for generation: the end of a prompt matters most) or its first; the
    special tokens put around a text stay (HF's truncation, which vLLM's tokenizer does).
    limit: max_length, given: the most ids a prompt may have once truncated (vLLM's renderer
    takes it as the input limit and refuses a longer prompt; None: max_model_len decides)."""
    add_special_tokens: bool
    keep: int | None = None
    side: str = "left"
    limit: int | None = None

    # the keys read, as vLLM's renderer reads them (0.21+; HF's encode names its last two)
    KEYS = ("add_special_tokens", "truncate_prompt_tokens", "truncation_side", "truncation", "max_length")

    @classmethod
    def of(cls, kwargs, mm_processor_kwargs, max_model_len: int, add_special_tokens: bool) -> "Tokenization":
        """From generate's or chat's tokenization_kwargs (None: the defaults)."""
        if mm_processor_kwargs is not None:
            raise ValueError(f"mm_processor_kwargs={mm_processor_kwargs!r}: nanopaged has no multimodal "
                             f"inputs (it takes None)")
        kwargs = {} if kwargs is None else kwargs
        if not isinstance(kwargs, dict):
            raise ValueError(f"tokenization_kwargs must be a dict or None, got {_describe(kwargs)}")
        unknown = [k for k in kwargs if k not in cls.KEYS]
        if unknown:   # (vLLM logs that it ignores them: a script that asks for them gets what it asked, or this)
            raise ValueError(f"tokenization_kwargs: nanopaged takes {', '.join(cls.KEYS)}; not {', '.join(map(repr, unknown))}")
        add = kwargs.get("add_special_tokens", add_special_tokens)
        if not isinstance(add, bool):
            raise ValueError(f"tokenization_kwargs: add_special_tokens must be True or False, got {add!r}")
        keep = kwargs.get("truncate_prompt_tokens")
        ok, why = truncate_prompt_tokens_check(keep)
        if not ok:
            raise ValueError(f"tokenization_kwargs: {why}")
        limit = kwargs.get("max_length")
        if limit is not None and not (is_integer(limit) and limit >= 1):
            raise ValueError(f"tokenization_kwargs: max_length must be an integer >= 1, got {limit!r}")
        max_length = max_model_len if limit is None else limit
        # HF's spelling: truncate to max_length, or not at all. Without max_length, vLLM's renderer
        # (TokenizeParams.with_kwargs) cuts to max_model_len, a prompt its input processor then refuses
        # for leaving no room for an output token; so does nanopaged (checked in vLLM's source, 2026-12)
        truncation = kwargs.get("truncation")
        if is_one_of(truncation, (True, "longest_first")):
            keep = max_length
        elif is_one_of(truncation, (False, "do_not_truncate")):
            keep = None
        elif truncation is not None:
            raise ValueError(f"tokenization_kwargs: truncation must be True, False, 'longest_first' or "
                             f"'do_not_truncate', got {truncation!r}")
        side = kwargs.get("truncation_side")
        side = "left" if side is None else side   # (vLLM's tokenizer side for generation)
        if not is_one_of(side, ("left", "right")):
            raise ValueError(f"tokenization_kwargs: truncation_side must be 'left' or 'right', got {side!r}")
        if keep == -1:   # (vLLM 0.34: max_length, else one short of the context, for one output token)
            keep = max_model_len - 1 if limit is None else limit
        for bound, name in ((max_model_len, "max_model_len"), (limit, "max_length")):
            if keep is not None and bound is not None and keep > bound:   # (as vLLM refuses it)
                raise ValueError(f"tokenization_kwargs: truncating to {keep} tokens exceeds {name} = {bound}")
        return cls(add, None if keep is None else int(keep), side, None if limit is None else int(limit))

    def truncate(self, ids: list[int], specials: tuple = (0, 0)) -> list[int]:
        """(specials: the special tokens around a text's ids, which stay, as HF's truncation keeps them)"""
        ids = ids if self.keep is None else truncated(ids, self.keep, self.side, specials)
        if self.limit is not None and len(ids) > self.limit:
            raise ValueError(f"prompt ({len(ids)} tokens) is longer than tokenization_kwargs max_length = "
                             f"{self.limit} (truncation=True cuts it to fit)")
        return ids


def _check_request_id(request_id):
    """A request id is a dict key: anything hashable that equals itself (a NaN equals
    nothing, itself included: its beams, matched to it by ==, never would be)."""
    try:
        hash(request_id)
    except TypeError:
        raise ValueError(f"a request id must be hashable, got {type(request_id).__name__}") from None
    try:
        same = bool(request_id == request_id)
    except Exception:   # (an array's == answers element by element: it has no one truth)
        same = False
    if not same:
        raise ValueError(f"a request id must equal itself, got {reprlib.repr(request_id)}")
    return request_id


def _is_token_ids(x) -> bool:
    """A list or tuple of integer token ids (a 1-D numpy array or tensor too; no bools)."""
    if getattr(x, "ndim", None) == 1 and hasattr(x, "tolist"):
        x = x.tolist()
    # (type(t) is int first: is_integer's ABC check takes 0.6 us a token, 0.5 s for 800k prompt tokens)
    return isinstance(x, (list, tuple)) and all(type(t) is int or is_integer(t) for t in x)


def _describe(x) -> str:
    return f"{type(x).__name__} {reprlib.repr(x)}"


def _progress(done: int, total: int, stats: Stats):
    bar = "#" * (30 * done // total)
    rate = stats.output_tokens / stats.elapsed if stats.elapsed else 0.0
    print(f"\r[{bar:<30}] {done}/{total} requests, {stats.output_tokens} output tokens, "
          f"{rate:.1f} tok/s", end="", file=sys.stderr, flush=True)


# -----------------------------------------------------------------------------
# 4. The command line

EXAMPLES = """examples:
  python nanopaged.py --prompt "What is the capital of France?"
  python nanopaged.py --prompt "Once upon a time," --raw --max-tokens 40 --stats
  python nanopaged.py --prompt "Tell me a joke." --temperature 0.8 --top-p 0.9 --seed 1 --n 3
  python nanopaged.py --prompt "Hi!" --prompt "Name three colors." --stats
  python nanopaged.py --prompt "Four score and seven years ago our" --raw --block-size 4 --num-blocks 64 --max-tokens 3 --trace
  python nanopaged.py --prompt "List three colors." --stop "3." --max-tokens 64
  python nanopaged.py --prompt "The capital of France is" --raw --max-tokens 4 --logprobs 3
  python nanopaged.py --prompt "What is the capital of France?" --beam-width 3
  python nanopaged.py --chat --stats
  python nanopaged.py --model path/to/hf_dir_or_file.gguf --prompt "..."
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message):   # one line and status 2, like every other bad input
        self.exit(2, f"nanopaged: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(
        prog="nanopaged.py", epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="A minimal PagedAttention inference engine. Without --model it runs the "
                    "embedded SmolLM2-135M-Instruct, offline.")
    ap.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    ap.add_argument("--chat", action="store_true",
                    help="a conversation: each line typed (or read from stdin) is a turn, answered in a stream; "
                         "the earlier turns stay in the prompt, and their blocks in the prefix cache (Ctrl-C "
                         "stops an answer, Ctrl-D ends)")
    ap.add_argument("--model", help="a local Hugging Face layout directory (Llama, Mistral (Small 3.1/3.2 too), "
                                    "Ministral, Qwen 2/2.5/3, Phi-3/3.5/4-mini, SmolLM3, Gemma 1/2/3, OLMo 2/3, "
                                    "EXAONE 4, Ernie 4.5, Seed-OSS, Cohere 1/2, Granite 3, StableLM 2, StarCoder 2, "
                                    "Mixtral, Qwen 2/3 MoE, OLMoE, Granite MoE, GPT-2, OPT, GPT-NeoX / Pythia, "
                                    "Phi-1.5/2, GPT-J) or a Llama, Qwen, Phi-2/3, SmolLM3, Gemma, Granite, OLMo 2/3, "
                                    "EXAONE 4, StarCoder 2, Ernie 4.5, Cohere 1/2, StableLM, Mixtral, Qwen 2/3 MoE, "
                                    "OLMoE or Granite MoE GGUF file (a .gguf, or an Ollama blob) "
                                    "(default: SmolLM2-135M-Instruct)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens to generate, at most (default: %(default)s)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0 is greedy (default); --top-k, --top-p, --min-p, --seed and distinct --n samples need > 0")
    ap.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (default: 0, all)")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default: %(default)s, off)")
    ap.add_argument("--min-p", type=float, default=0.0,
                    help="drop tokens less than min-p times as likely as the likeliest (default: 0, off)")
    ap.add_argument("--seed", type=int, help="makes sampling reproducible (default: none, each run draws anew)")
    ap.add_argument("--n", type=int, default=1, help="samples per prompt, prefilled once then forked (default: 1)")
    ap.add_argument("--beam-width", type=int, metavar="K",
                    help="beam search: the K likeliest outputs by the model's own log-probabilities, best first "
                         "(its beams share their blocks: --trace shows the forks and copy-on-writes)")
    ap.add_argument("--stop", action="append", help="a stop string, which ends the output before it (repeatable)")
    ap.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token")
    ap.add_argument("--repetition-penalty", type=float, default=1.0,
                    help="> 1 makes tokens already in the prompt or output less likely (default: 1, off)")
    ap.add_argument("--logprobs", type=int, metavar="K",
                    help=f"after the text, each token's log-probability and the K likeliest tokens (0 to {MAX_LOGPROBS})")
    ap.add_argument("--raw", action="store_true", help="no chat template: the prompt is the model's input as is")
    ap.add_argument("--system", help="a system prompt, rendered by the chat template before each prompt")
    ap.add_argument("--dtype", help="float32 (CPU default), bfloat16, float16 (GPU default: the checkpoint's "
                                    "half precision, bfloat16 for a float32 one, as vLLM's auto; bfloat16 "
                                    "for Gemma, which refuses float16)")
    ap.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: %(default)s)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *KV_CACHE_DTYPES],
                    help="what the KV cache stores: auto (the model's dtype), bfloat16, fp8 (fp8_e4m3) or fp8_e5m2, "
                         "which hold twice a bfloat16 cache's tokens in the same memory")
    ap.add_argument("--max-model-len", type=int, help="the longest prompt + output served (default: the model's "
                                                      "context). One no longer than the original context (4096 "
                                                      "for Phi-3 128k / 3.5 / 4-mini) keeps LongRoPE's short factors")
    ap.add_argument("--num-blocks", type=int, help="KV blocks in the pool (default: as many as 2 GiB hold on "
                                                   "the CPU, 40%% of free memory on a GPU)")
    ap.add_argument("--max-num-seqs", type=int, default=256,
                    help="sequences in one step, at most (a sample or beam is one) (default: %(default)s)")
    ap.add_argument("--max-num-batched-tokens", type=int,
                    help="tokens in one step, at most: a longer prompt is prefilled in chunks (default: 1024 "
                         "on the CPU, 8192 on a GPU)")
    ap.add_argument("--no-prefix-caching", action="store_true", help="compute every prompt in full")
    ap.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"],
                    help="when the KV pool runs dry, the newest sequence's blocks are dropped and recomputed "
                         "later (default), or swapped to CPU memory (4 GiB of it) and copied back")
    ap.add_argument("--attn-backend", default="auto", choices=["auto", "torch", "cuda", "cpu"],
                    help="auto (default): the CUDA kernel on a GPU where it builds; on the CPU, the torch path "
                         "with decode attention on kernels_cpu.c where a C compiler builds it (cpu forces that)")
    ap.add_argument("--stats", action="store_true", help="print latency, throughput and KV-cache use")
    ap.add_argument("--trace", action="store_true", help="print every step's block tables and events")
    return ap


def chat_loop(llm: LLM, params: SamplingParams, system: list[dict], show, stats: bool) -> int:
    """--chat: read a user turn per line until end of input, and stream each answer; returns how
    many turns were refused (each said in a line as it happened: main's exit status). Every
    turn's prompt is the whole conversation, rendered by the chat template again; the
    blocks of the turns before it are still in the prefix cache (the previous prompt and
    answer filled them), so mostly the new turn is computed (and the partial block the previous
    answer ended in: only full blocks are cached): --stats shows the hit rate. Typed, a Ctrl-C
    during an answer stops it; at the prompt, it ends the chat."""
    conversation, refused = list(system), 0
    # A setting that leaves no room for any turn (a --system prompt that fills the context, a
    # pool too small) is said once, before the first turn is read, rather than at every turn: a
    # one-word turn's request, made and closed unrun (stream() checks a request as it queues
    # it). (A template that fails fails here, once: main's error.)
    _, word = render_chat(llm.tokenizer, conversation + [{"role": "user", "content": "Hi"}])
    try:
        llm.stream(word, params).close()
    except ValueError as e:
        raise ValueError(f"--chat has no room for even a one-word turn: {e}") from None
    # bytes that are no UTF-8 (a Latin-1 file piped in) read as U+FFFD, as a --prompt's do, and
    # as in the C locale: a UTF-8 locale's stdin would raise UnicodeDecodeError, ending the chat
    if hasattr(sys.stdin, "reconfigure"):   # (a TextIOWrapper)
        sys.stdin.reconfigure(errors="replace")
    prompt = "> " if sys.stdin.isatty() else ""   # (none to echo when the turns are piped in)
    if prompt:
        with contextlib.suppress(ImportError):   # (not on every platform)
            import readline  # noqa: F401  imported, it gives input() line editing and history
    while True:
        try:
            line = input(prompt)
        except (EOFError, KeyboardInterrupt) as stop:   # Ctrl-D (or the end of piped input), Ctrl-C
            print(end="\n" if prompt else "")   # the shell's prompt, or main's message, on a line of its own
            if isinstance(stop, KeyboardInterrupt):
                raise
            return refused
        except OSError as e:   # stdin open for writing only (0>file), an I/O error: one line, not a traceback
            if isinstance(e, BrokenPipeError):   # (input() writing its prompt to a closed stdout: main's)
                raise
            raise ValueError(f"--chat cannot read its turns from stdin: {e.strerror or e}") from None
        if not line.strip():
            continue
        # a CRLF line end (turns written on Windows) is a line end: its \r is not the turn's text
        conversation.append({"role": "user", "content": line.removesuffix("\r")})
        text = llm.tokenizer.apply_chat_template(conversation)   # (a template that fails: main's error, exit 2)
        try:   # (render_chat's two steps, apart: a turn the tokenizer refuses ends no conversation)
            ids = llm.tokenizer.encode_chat(text)
        except ValueError as e:   # (a run of 500,000 spaces...)
            print(f"nanopaged: error: {one_line(str(e))}; the turn is left out", file=sys.stderr)
            conversation.pop()
            refused += 1
            continue
        try:
            pieces = llm.stream(ids, params)
        except ValueError as e:   # the conversation outgrew the context, or the KV pool
            print(f"nanopaged: error: {one_line(in_flags(str(e)))}; the conversation starts over", file=sys.stderr)
            conversation = list(system)
            refused += 1
            continue
        shown = []
        try:
            show(pieces, shown)
        except KeyboardInterrupt:   # typed: Ctrl-C stops the answer, the conversation goes on with what
            if not prompt:          # it said (Ctrl-D, or Ctrl-C at the prompt, ends it); piped turns: main's
                raise
            pieces.close()   # (its request freed now, not once the generator is collected)
            show((), [])     # the answer's line ended
        else:
            if stats:   # (a stopped answer has none: its request was never reported)
                print(llm.stats.summary(llm.pool.num_blocks), file=sys.stderr)
        conversation.append({"role": "assistant", "content": "".join(shown)})


class OutputError(Exception):
    """The command line's answer could not be written: stdout on a full disk, or open for reading."""


class CheckedStdout:
    """sys.stdout while the command line runs: a write or flush that fails raises OutputError,
    which run_cli reports in one line (status 1). As a bare OSError it could not be told from the engine's
    own (a model file that cannot be read), and the flush that input() does before reading a
    --chat turn would read as stdin's failure. A closed pipe stays a BrokenPipeError: the
    reader of `| head` has gone, which is no error to report."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        with self._checked():
            return self.stream.write(text)

    def flush(self):
        with self._checked():
            self.stream.flush()

    @contextlib.contextmanager
    def _checked(self):
        try:
            yield
        except BrokenPipeError:
            raise
        except OSError as e:
            raise OutputError(f"cannot write the output: {e.strerror or e}") from None

    def __getattr__(self, name):   # fileno(), isatty(), reconfigure(): the stream's own
        return getattr(self.stream, name)


def main(argv=None) -> int:
    # A descriptor closed when the process started is None in sys: print(file=None) writes to
    # stdout, so with stderr closed (2>&-) the notes and errors would land in the answer, and with
    # stdout closed (>&-) the answer would vanish without a word, status 0.
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")   # (the notes are dropped; the exit status still tells)
    if sys.stdout is None:
        print("nanopaged: error: stdout is closed: the answer has nowhere to go", file=sys.stderr)
        return 1
    stdout, sys.stdout = sys.stdout, CheckedStdout(sys.stdout)
    try:
        return run_cli(argv)
    finally:
        sys.stdout = stdout


# The options the command line sets, by their Python names: its error messages name the flags
CLI_OPTIONS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "n", "beam_width", "stop",
               "logprobs", "repetition_penalty", "block_size", "max_model_len", "num_blocks", "max_num_seqs",
               "max_num_batched_tokens", "preemption_mode", "attn_backend", "dtype", "device", "kv_cache_dtype")
_CLI_OPTION = re.compile(rf"(^)?\b({'|'.join(CLI_OPTIONS)})\b( = |=)?")


def in_flags(message: str) -> str:
    """An error of the Python API in the command line's words: "beam_width = 3 exceeds
    max_num_seqs = 2" -> "--beam-width 3 exceeds --max-num-seqs 2". An option is renamed where
    it has a value, starts the message, or has a name no English word has (an underscore)."""
    def flag(m):
        first, name, equals = m.groups()
        if not (first is not None or equals or "_" in name):
            return m.group(0)   # (a word: "stop string")
        return "--" + name.replace("_", "-") + (" " if equals else "")
    return _CLI_OPTION.sub(flag, message)


def cli_params(args) -> tuple[SamplingParams | BeamSearchParams, list[str]]:
    """The command line's flags checked together (before the model loads), as the request's
    params; and the flags that shape a random draw, where given."""
    if args.chat and (args.prompt or args.n > 1 or args.logprobs is not None or args.trace or args.raw):
        raise ValueError("--chat reads its turns from stdin and streams one answer at a time: "
                         "--prompt, --n, --logprobs, --trace and --raw go without it")
    # the flags that shape a random draw, where given (greedy decoding ignores them)
    drawing = [flag for flag, given in (("--top-k", args.top_k not in (-1, 0)), ("--top-p", args.top_p != 1.0),
                                        ("--min-p", args.min_p != 0.0), ("--seed", args.seed is not None))
               if given]
    sampling = [flag for flag, given in (
        ("--chat", args.chat), ("--n", args.n != 1), ("--temperature", args.temperature != 0)) if given]
    sampling += drawing + [flag for flag, given in (
        ("--stop", args.stop), ("--logprobs", args.logprobs is not None),
        ("--repetition-penalty", args.repetition_penalty != 1.0)) if given]
    if args.beam_width is not None and sampling:
        raise ValueError(f"--beam-width ranks outputs by the model's own log-probabilities and stops at EOS: "
                         f"{', '.join(sampling)} {'goes' if len(sampling) == 1 else 'go'} without it")
    if not args.prompt and not args.chat:
        raise ValueError("give at least one --prompt (or --chat)")
    if args.chat and sys.stdin is None:   # (started with stdin closed, <&-: said before the model loads)
        raise ValueError("--chat reads its turns from stdin, which is closed")
    if any(not p.strip() for p in args.prompt):
        raise ValueError("a --prompt is empty")
    if args.logprobs is not None and not 0 <= args.logprobs <= MAX_LOGPROBS:   # (the engine's default)
        raise ValueError(f"--logprobs must be an integer in [0, {MAX_LOGPROBS}], got {args.logprobs}")
    for flag, value in (("--max-tokens", args.max_tokens), ("--block-size", args.block_size),
                        ("--num-blocks", args.num_blocks), ("--max-model-len", args.max_model_len),
                        ("--max-num-seqs", args.max_num_seqs),
                        ("--max-num-batched-tokens", args.max_num_batched_tokens)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    params = SamplingParams(n=args.n, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            min_p=args.min_p, max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos,
                            seed=args.seed, logprobs=args.logprobs, repetition_penalty=args.repetition_penalty)
    if args.beam_width is not None:
        params = BeamSearchParams(args.beam_width, args.max_tokens, ignore_eos=args.ignore_eos)
    return params, drawing


def cli_prompts(llm: LLM, args) -> tuple[list[str] | list[list[int]], list[dict]]:
    """The prompts as the model is given them: rendered with its chat template and
    tokenized (unless --raw, or the model has no chat template: the text as typed), and
    --system's message."""
    tok = llm.get_tokenizer()
    chat = tok.has_chat_template and not args.raw
    if chat and tok.chat_template is None:   # (the CLI has no flag to name one)
        raise ValueError(f"the model's chat templates are all named ({', '.join(sorted(tok.named_templates))}), "
                         f"none 'default', which the CLI renders with: --raw sends the prompt as it is")
    if args.chat and not chat:
        raise ValueError("--chat needs the model's chat template: this model has none")
    if args.system is not None and not chat:
        raise ValueError("--system needs the model's chat template (" +
                         ("--raw skips it)" if args.raw else "this model has none)"))
    system = [] if args.system is None else [{"role": "system", "content": args.system}]
    prompts = ([render_chat(tok, [*system, {"role": "user", "content": p}])[1] for p in args.prompt]
               if chat else args.prompt)
    return prompts, system


def run_cli(argv) -> int:
    """The command line: its flags checked, the model loaded, the prompts answered (or --chat's
    turns). Returns the exit status: 0, 1 where the model failed or output could not be
    written, 2 for bad input, 130 for Ctrl-C."""
    # The model writes any character: where stdout's encoding lacks one (an ASCII or Latin-1 locale,
    # cp1252 on Windows when redirected), a "?" shows, rather than a UnicodeEncodeError cutting the
    # answer off halfway (a ValueError: it read as bad input, status 2)
    if hasattr(sys.stdout, "reconfigure"):   # (a TextIOWrapper's)
        sys.stdout.reconfigure(errors="replace")
    line_open = False   # streamed text waits on its line: an error message starts a new one

    def show(pieces, shown: list):
        """Print a stream's pieces as they come, each added to `shown` (the text so far, should
        a Ctrl-C stop the stream)."""
        nonlocal line_open
        for piece in pieces:
            shown.append(piece)
            print(piece, end="", flush=True)
            if piece:
                line_open = not piece.endswith("\n")
        print()
        line_open = False

    try:
        args = build_parser().parse_args(argv)   # (in here: --help's text fails to write as any answer does)
        params, drawing = cli_params(args)
        llm = LLM(args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                  num_blocks=args.num_blocks, max_model_len=args.max_model_len,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  enable_prefix_caching=not args.no_prefix_caching,
                  attn_backend=args.attn_backend, preemption_mode=args.preemption_mode,
                  kv_cache_dtype=args.kv_cache_dtype,
                  generation_config="vllm",   # (the flags' own defaults sample: greedy)
                  seed=None)   # (without --seed, each run draws anew, as a command line's user expects)
        prompts, system = cli_prompts(llm, args)
        if args.temperature == 0 and args.beam_width is None:   # greedy: say so, rather than ignore what was asked
            notes = [f"{', '.join(drawing)} {'has' if len(drawing) == 1 else 'have'} no effect"] if drawing else []
            notes += [f"--n {args.n} gives {args.n} identical samples"] if args.n > 1 else []
            if notes:
                print(f"nanopaged: note: at --temperature 0 (greedy), {'; '.join(notes)}", file=sys.stderr)
        rope = llm.config.rope_scaling or {}
        if llm.config.longrope_long(llm.max_model_len) and rope["long_factor"] != rope["short_factor"]:
            # (one set of factors for every request: model.rope_tables says why)
            original = rope["original_max_position_embeddings"]
            print(f"nanopaged: note: LongRoPE uses its long-context factors for every request (the context "
                  f"served, {llm.max_model_len} tokens, exceeds the original {original}); --max-model-len "
                  f"{original} uses the short ones, as transformers does for texts up to {original} tokens",
                  file=sys.stderr)
        if args.trace:
            print(llm.describe_kv_cache())
            llm.enable_trace()
        elif args.stats:
            print(llm.describe_kv_cache(), file=sys.stderr)
        refused = 0   # --chat's turns that were bad input: status 2 once the rest are answered
        if args.chat:
            refused = chat_loop(llm, params, system, show, args.stats)
        elif len(prompts) == 1 and args.n == 1 and not args.trace and args.logprobs is None and not args.beam_width:
            # one prompt, one sample: it streams
            show(llm.stream(prompts[0], params), [])
        else:
            failed = False
            for i, r in enumerate(llm.generate(prompts, params)):
                for c in r.outputs:
                    failed |= c.finish_reason == "error"
                    if args.beam_width:
                        print(f"[prompt {i}, beam {c.index}] {c.text}  ({c.finish_reason}, "
                              f"cumulative logprob {c.cumulative_logprob:.3f})")
                        continue
                    label = f"[prompt {i}" + (f", sample {c.index}]" if args.n > 1 else "]")
                    print(f"{label} {c.text}  ({c.finish_reason})")
                    if c.logprobs is not None:
                        print(logprob_table(c, args.logprobs))
            if failed:
                raise GenerationError(f"{NOT_FINITE} for the samples marked (error)")
        if args.stats and not args.chat:   # (--chat prints them after each answer)
            print(llm.stats.summary(llm.pool.num_blocks), file=sys.stderr)
        sys.stdout.flush()   # (a write that fails fails here, not at exit, where no one would report it)
    except ValueError as e:   # bad input of any kind: one clear line, exit status 2
        # (in the flags' words; a model file's problem as it is: its path may hold any name)
        print(f"nanopaged: error: {one_line(str(e) if isinstance(e, ModelError) else in_flags(str(e)))}",
              file=sys.stderr)
        return 2
    except GenerationError as e:  # the model failed (broken weights): one line, status 1
        print("\n" * line_open + f"nanopaged: error: {one_line(str(e))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: no traceback, the shell's usual status
        print("\n" * line_open + "nanopaged: interrupted", file=sys.stderr)
        return 130
    except (BrokenPipeError, OutputError) as e:   # `| head`: the reader has gone; say nothing more
        if isinstance(e, OutputError):
            print("\n" * line_open + f"nanopaged: error: {e}", file=sys.stderr)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # (Python would flush into it at exit)
        return 1
    return 2 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
