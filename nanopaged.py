"""
nanopaged: a minimal, readable PagedAttention inference engine.

This file is the chapter on KV-cache management, top to bottom:
  1. the paged KV cache: BlockPool (physical blocks, ref_count, free list, prefix-cache
     index) and BlockTable (one per sequence: logical block -> physical block, copy-on-write)
  2. paged attention: the KV write, the block copy, the readable online-softmax reference
     and the fast torch path, and PagedAttention, the object the model calls
  3. the engine: LLM.generate's step loop (schedule -> batch -> forward -> sample -> update)
  4. the command line

The scheduler (who runs next) lives in scheduler.py, the model in model.py, the CUDA
kernel in kernels.cu (built by build_ext.py).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque

import torch
import torch.nn.functional as F

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
      used    ref_count > 0: held by one or more BlockTables
      cached  ref_count == 0 but registered in the prefix cache: its KV data is still
              valid and a later request with the same prefix can revive it; evicted in
              least-recently-used order, and only when no plain free block is left
      free    ref_count == 0, on the free list
    so that free + cached + used == num_blocks at all times.
    """

    def __init__(self, num_blocks: int, block_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device="cpu"):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a BlockPool needs num_blocks >= 1 and block_size >= 1, "
                             f"got {num_blocks} and {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        # The KV data, preallocated once: one K and one V tensor per layer.
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.ref_count = [0] * num_blocks
        self.free_list = deque(range(num_blocks))  # O(1) popleft / append
        # The prefix cache: full blocks indexed by the hash of their whole prefix.
        self.cached_blocks: dict[int, int] = {}      # prefix hash -> block id
        self.block_hash: dict[int, int] = {}         # block id -> prefix hash
        self.block_tokens: dict[int, tuple] = {}     # block id -> its token ids (to confirm a hit)
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks with ref_count 0, LRU first
        # (src, dst) block copies that copy-on-write recorded; the engine runs them
        # before the next forward pass, so the data moves before anyone reads it.
        self.pending_copies: list[tuple[int, int]] = []
        self.trace = None  # a callable(str) to narrate every event (the --trace option)

    @staticmethod
    def bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype) -> int:
        """The chapter's formula: layers x (K and V) x block_size x kv_heads x head_dim x bytes."""
        return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8

    # --- counters ---
    @property
    def num_free(self) -> int:
        return len(self.free_list)

    @property
    def num_cached(self) -> int:
        return len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free - self.num_cached

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
            raise ValueError(f"free of block {block}, which is already free")
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

    def _uncache(self, block: int):
        del self.cached_blocks[self.block_hash.pop(block)]
        del self.block_tokens[block]

    def new_table(self) -> "BlockTable":
        """A fresh, empty BlockTable on this pool (the scheduler calls this; it never
        imports this file)."""
        return BlockTable(self)


class BlockTable:
    """One sequence's view of the cache: logical block i lives in physical block block_ids[i].

    num_tokens counts the slots handed out so far; token t of the sequence lives in
    slot block_ids[t // block_size] * block_size + t % block_size.
    """

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.block_ids: list[int] = []
        self.num_tokens = 0

    def _last_block_is_shared_and_partial(self) -> bool:
        return (self.num_tokens % self.pool.block_size != 0
                and self.pool.ref_count[self.block_ids[-1]] > 1)

    def blocks_needed(self, n: int) -> int:
        """How many new blocks slots_for(n) will allocate (copy-on-write included)."""
        if n <= 0:
            return 0
        total = -(-(self.num_tokens + n) // self.pool.block_size)  # ceil division
        return total - len(self.block_ids) + self._last_block_is_shared_and_partial()

    def slots_for(self, n: int) -> list[int]:
        """Reserve slots for n new tokens and return their physical slot ids. Allocates blocks
        as needed, all or nothing (OutOfBlocks leaves the table and the pool unchanged)."""
        bs = self.pool.block_size
        new_blocks = self.pool.allocate(self.blocks_needed(n))
        if n > 0 and self._last_block_is_shared_and_partial():
            # Copy-on-write: the block we are about to append into is also someone else's.
            # Copy its filled slots into a fresh block, point *our* table at the copy, and
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

    def fork(self) -> "BlockTable":
        """A second table sharing every block (ref_count + 1 each, nothing allocated)."""
        child = BlockTable(self.pool)
        for block in self.block_ids:
            self.pool.incref(block)
        child.block_ids, child.num_tokens = list(self.block_ids), self.num_tokens
        return child

    def release(self):
        """Give back every block. Freed last-block-first, so that when cached blocks are later
        evicted (least recently used first), a prefix's tail goes before its head: the head is
        what other requests are most likely to share."""
        for block in reversed(self.block_ids):
            self.pool.free(block)
        self.block_ids, self.num_tokens = [], 0


# -----------------------------------------------------------------------------
# 2. Paged attention
#
# Inputs of one step, over a flat batch of T query tokens from B sequences (no padding):
#   q               (T, H, D)    queries, RoPE applied
#   k_cache/v_cache (num_blocks, block_size, KVH, D)   one layer's cache
#   block_tables    (B, max_blocks) int32   padded entries are never read
#   seq_lens        (B,) int32   context length of each sequence, this step's tokens included
#   query_start_loc (B+1,) int32 sequence b owns rows query_start_loc[b]:query_start_loc[b+1]
# Query j of a sequence with q_len queries sits at position seq_len - q_len + j and sees
# context positions 0..that position (causal). With grouped-query attention, query head h
# reads kv head h // (H // KVH).


def write_kv(k_cache, v_cache, k, v, slot_mapping):
    """Store this step's k, v (T, KVH, D) into their slots: slot = block * block_size + offset."""
    kvh, d = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, k)  # cache seen as (slots, KVH, D)
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, v)


def copy_blocks(k_caches, v_caches, copies):
    """Run copy-on-write's (src, dst) block copies in every layer."""
    if not copies:
        return
    device = k_caches[0].device
    src = torch.tensor([s for s, _ in copies], device=device)
    dst = torch.tensor([d for _, d in copies], device=device)
    for cache in (*k_caches, *v_caches):
        cache[dst] = cache[src]


def paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale):
    """The chapter's algorithm, written to be read: walk each sequence's blocks through its
    block table, and fold them into the output one block at a time with online softmax.

    For each query we keep a running max m, a running sum of exponentials l and an
    unnormalized output acc. When a block with scores s arrives:
        m_new = max(m, max(s));  alpha = exp(m - m_new)        (rescales what we had)
        p = exp(s - m_new);      l = l * alpha + sum(p);   acc = acc * alpha + p @ V_block
    and at the end out = acc / l: the softmax over the whole context, without ever
    holding more than one block of scores.
    """
    T, H, D = q.shape
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
        for i in range(-(-seq_len // block_size)):                    # logical blocks in order
            block = int(block_tables[b, i])                           # -> physical block
            n = min(block_size, seq_len - i * block_size)             # filled slots of this block
            kb = k_cache[block, :n].float().repeat_interleave(group, dim=1)  # (n, H, D)
            vb = v_cache[block, :n].float().repeat_interleave(group, dim=1)  # (n, H, D)
            s = torch.einsum("qhd,khd->qhk", qb, kb) * scale          # (q_len, H, n)
            k_pos = torch.arange(i * block_size, i * block_size + n, device=q.device)
            causal = k_pos[None, :] <= q_pos[:, None]                 # (q_len, n)
            s = s.masked_fill(~causal[:, None, :], float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))                  # (q_len, H)
            alpha = torch.exp(m - m_new)        # m is finite after block 0: position 0 is visible to all
            p = torch.exp(s - m_new[..., None])                       # (q_len, H, n)
            l = l * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + torch.einsum("qhk,khd->qhd", p, vb)
            m = m_new
        out[start:end] = (acc / l[..., None]).to(q.dtype)
    return out


class AttentionPlan:
    """What the fast torch path derives from a step's metadata, once per step rather than
    once per layer (the 30 layers of a step share it).

    The fast path gathers each sequence's context from its blocks into a dense tensor and
    runs one scaled_dot_product_attention. Decode sequences (one query each) are stacked
    into one batched call; sequences with several queries (prefill chunks) get one call each.
    The gather indices point only at slots inside the context: positions past a sequence's
    end are clamped to its position 0 and masked out, so padding never reads a slot the
    sequence does not own (a NaN there could otherwise leak in through 0 * NaN).
    """

    def __init__(self, block_tables, seq_lens, query_start_loc, block_size):
        device = block_tables.device
        lens = seq_lens.tolist()
        qsl = query_start_loc.tolist()
        q_lens = [qsl[b + 1] - qsl[b] for b in range(len(lens))]
        decode = [b for b, n in enumerate(q_lens) if n == 1]
        # Decode group: (Bd, Lmax) slot indices and a (Bd, 1, 1, Lmax) mask. When every
        # sequence decodes, q's rows are the sequences in order and need no gather.
        self.has_decode = bool(decode)
        self.all_decode = len(decode) == len(lens)
        if decode:
            idx = torch.tensor(decode, device=device)
            self.decode_rows = None if self.all_decode else query_start_loc[idx].long()
            self.decode_slots, valid = self._slots(block_tables[idx], seq_lens[idx].long(),
                                                   max(lens[b] for b in decode), block_size)
            self.decode_mask = valid[:, None, None, :]                # (Bd, 1, 1, Lmax)
        # Prefill sequences: (row range, slots, bottom-right-aligned causal mask) each.
        self.prefills = []
        for b, n in enumerate(q_lens):
            if n <= 1:
                continue
            L = lens[b]
            slots, _ = self._slots(block_tables[b:b + 1], seq_lens[b:b + 1].long(), L, block_size)
            q_pos = torch.arange(L - n, L, device=device)
            mask = torch.arange(L, device=device)[None, :] <= q_pos[:, None]   # (q_len, L)
            self.prefills.append((qsl[b], qsl[b + 1], slots[0], mask))

    @staticmethod
    def _slots(tables, lens, max_len, block_size):
        """Slot of every context position (B, max_len), positions past the end clamped to 0."""
        pos = torch.arange(max_len, device=tables.device)[None, :]   # (1, L)
        valid = pos < lens[:, None]                                    # (B, L)
        pos = torch.where(valid, pos, 0)
        blocks = tables.long().gather(1, pos // block_size)           # (B, L) physical block ids
        return blocks * block_size + pos % block_size, valid


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, plan=None):
    """The fast torch path: same inputs and result as paged_attention_ref."""
    if plan is None:
        plan = AttentionPlan(block_tables, seq_lens, query_start_loc, k_cache.shape[1])
    T, H, D = q.shape
    kvh = k_cache.shape[2]
    group = H // kvh
    k_flat = k_cache.view(-1, kvh, D)                                  # (slots, KVH, D)
    v_flat = v_cache.view(-1, kvh, D)
    out = q.new_empty(T, H, D)
    if plan.has_decode:
        qd = q if plan.all_decode else q[plan.decode_rows]             # (Bd, H, D)
        Bd = qd.shape[0]
        # GQA without copying K/V: the `group` query heads that share a kv head become
        # `group` query rows of that kv head, (Bd, KVH, group, D) against (Bd, KVH, L, D).
        qd = qd.view(Bd, kvh, group, D)
        kd = k_flat[plan.decode_slots].transpose(1, 2)                 # (Bd, KVH, L, D)
        vd = v_flat[plan.decode_slots].transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=plan.decode_mask, scale=scale)
        od = od.reshape(Bd, H, D)                                      # (Bd, KVH, group, D) -> (Bd, H, D)
        if plan.all_decode:
            out = od
        else:
            out[plan.decode_rows] = od
    for start, end, slots, mask in plan.prefills:
        n = end - start
        # Same GQA trick: (q_len, H, D) -> (KVH, group * q_len, D); the causal mask is
        # repeated for each of the group's heads.
        qp = q[start:end].view(n, kvh, group, D).permute(1, 2, 0, 3).reshape(kvh, group * n, D)
        kp = k_flat[slots].transpose(0, 1)                             # (KVH, L, D)
        vp = v_flat[slots].transpose(0, 1)
        mp = mask.repeat(group, 1)                                     # (group * q_len, L)
        op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mp, scale=scale)
        out[start:end] = op.view(kvh, group, n, D).permute(2, 0, 1, 3).reshape(n, H, D)
    return out
