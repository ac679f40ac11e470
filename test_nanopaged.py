"""nanopaged's tests. Run: pytest -q test_nanopaged.py

Chapters: the paged KV cache (BlockPool, BlockTable, copy-on-write, paged attention);
the scheduler (model-free, with a fake runner).
"""

import math
import random

import pytest
import torch

import scheduler as scheduler_module
from scheduler import SamplingParams, Scheduler, Status
from nanopaged import (BlockPool, BlockTable, OutOfBlocks, copy_blocks, paged_attention,
                       paged_attention_ref, write_kv)

# =============================================================================
# The paged KV cache: paged attention against dense softmax attention


def make_paged_batch(specs, block_size, H, KVH, D, dtype=torch.float32, seed=0, spare_blocks=5):
    """A flat batch over a shuffled, NaN-poisoned pool.

    specs: [(q_len, ctx_len)] per sequence. Returns the paged inputs and, per sequence, the
    dense float64 (q, k, v) a plain softmax attention can check them against.
    """
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-ctx // block_size) for _, ctx in specs]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    # Every slot starts as NaN: anything read outside a context poisons the output.
    k_cache = torch.full((num_blocks, block_size, KVH, D), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    perm = torch.randperm(num_blocks, generator=g).tolist()  # random, non-contiguous blocks
    poisoned_block = perm[-1]                                 # never written: pure NaN
    max_blocks = max(blocks_per_seq) + 2
    block_tables = torch.full((len(specs), max_blocks), poisoned_block, dtype=torch.int32)
    qs, dense, qsl, next_block = [], [], [0], 0
    for b, (q_len, ctx) in enumerate(specs):
        ids = perm[next_block:next_block + blocks_per_seq[b]]
        next_block += blocks_per_seq[b]
        block_tables[b, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(ctx, KVH, D, generator=g, dtype=torch.float64)
        v = torch.randn(ctx, KVH, D, generator=g, dtype=torch.float64)
        q = torch.randn(q_len, H, D, generator=g, dtype=torch.float64)
        for t in range(ctx):
            k_cache[ids[t // block_size], t % block_size] = k[t].to(dtype)
            v_cache[ids[t // block_size], t % block_size] = v[t].to(dtype)
        qs.append(q)
        dense.append((q, k, v))
        qsl.append(qsl[-1] + q_len)
    q = torch.cat(qs).to(dtype)
    seq_lens = torch.tensor([ctx for _, ctx in specs], dtype=torch.int32)
    query_start_loc = torch.tensor(qsl, dtype=torch.int32)
    return q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, dense


def dense_attention(q, k, v, scale):
    """Plain causal softmax attention in float64; q (n, H, D) are the last n positions."""
    n, H, D = q.shape
    ctx, KVH = k.shape[0], k.shape[1]
    k = k.repeat_interleave(H // KVH, dim=1)
    v = v.repeat_interleave(H // KVH, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(ctx - n, ctx)[:, None]
    s = s.masked_fill(torch.arange(ctx)[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def check_against_dense(specs, block_size, H, KVH, D=16, seed=0):
    q, kc, vc, bt, sl, qsl, dense = make_paged_batch(specs, block_size, H, KVH, D, seed=seed)
    scale = 1 / math.sqrt(D)
    expected = torch.cat([dense_attention(*d, scale) for d in dense])
    for fn in (paged_attention_ref, paged_attention):
        out = fn(q, kc, vc, bt, sl, qsl, scale)
        assert out.dtype == torch.float32 and out.shape == q.shape
        assert torch.isfinite(out).all(), f"{fn.__name__} read a slot outside a context"
        torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{fn.__name__}: {m}")


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
def test_paged_attention_context_lengths(block_size):
    # decode (one query) over the lengths where block boundaries bite, all in one batch
    lens = [1, max(block_size - 1, 1), block_size, block_size + 1, 300]
    check_against_dense([(1, n) for n in lens], block_size, H=6, KVH=2)


@pytest.mark.parametrize("H,KVH", [(4, 4), (6, 2), (8, 1)])  # GQA ratios 1, 3 and 8
def test_paged_attention_prefill_decode_gqa(H, KVH):
    # a fresh prefill, a chunk with earlier context cached, decodes, one long sequence
    specs = [(7, 7), (5, 18), (1, 33), (1, 1), (20, 260), (3, 3)]
    check_against_dense(specs, block_size=4, H=H, KVH=KVH, seed=H * 10 + KVH)


def test_paged_attention_only_prefill_and_random_batches():
    rng = random.Random(1)
    for trial in range(5):
        specs = []
        for _ in range(rng.randint(1, 6)):
            ctx = rng.randint(1, 200)
            specs.append((rng.randint(1, ctx), ctx))
        check_against_dense(specs, block_size=rng.choice([1, 4, 16, 32]), H=6, KVH=3, seed=trial)


def test_fast_path_equals_reference_half_precision():
    q, kc, vc, bt, sl, qsl, _ = make_paged_batch([(1, 50), (9, 40), (1, 17)], 16, 4, 2, 32,
                                                 dtype=torch.bfloat16)
    ref = paged_attention_ref(q, kc, vc, bt, sl, qsl, 0.2)
    fast = paged_attention(q, kc, vc, bt, sl, qsl, 0.2)
    torch.testing.assert_close(fast.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_write_kv_and_copy_blocks():
    kc = torch.zeros(6, 4, 2, 3)
    vc = torch.zeros(6, 4, 2, 3)
    k, v = torch.randn(3, 2, 3), torch.randn(3, 2, 3)
    write_kv(kc, vc, k, v, torch.tensor([5, 9, 23]))   # slot = block * 4 + offset
    assert torch.equal(kc[1, 1], k[0]) and torch.equal(kc[2, 1], k[1]) and torch.equal(vc[5, 3], v[2])
    assert kc.count_nonzero() == k.count_nonzero()     # nothing else written
    copy_blocks([kc], [vc], [(2, 0), (5, 4)])
    assert torch.equal(kc[0], kc[2]) and torch.equal(vc[4], vc[5]) and torch.equal(vc[0], vc[2])


# =============================================================================
# The paged KV cache: BlockPool and BlockTable invariants


def tiny_pool(num_blocks=8, block_size=4):
    return BlockPool(num_blocks, block_size, num_layers=2, num_kv_heads=1, head_dim=2)


def check_pool_invariants(pool, tables):
    """Each block's ref_count is the number of tables holding it; free + used + cached = total."""
    holders = [0] * pool.num_blocks
    for t in tables:
        for b in t.block_ids:
            holders[b] += 1
    assert pool.ref_count == holders
    assert pool.num_free + pool.num_used + pool.num_cached == pool.num_blocks
    assert pool.num_used == sum(1 for r in pool.ref_count if r > 0)
    assert set(pool.free_list).isdisjoint(pool.evictable)
    assert all(pool.ref_count[b] == 0 for b in (*pool.free_list, *pool.evictable))
    assert all(b in pool.block_hash for b in pool.evictable)


def test_allocate_free_counts_and_all_or_nothing():
    pool = tiny_pool(8)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free == 5 and pool.num_used == 3
    with pytest.raises(OutOfBlocks):
        pool.allocate(6)
    assert pool.num_free == 5 and pool.num_used == 3 and all(pool.ref_count[b] == 1 for b in a)
    pool.free(a[0])
    assert pool.num_free == 6 and pool.ref_count[a[0]] == 0
    with pytest.raises(ValueError, match="already free"):
        pool.free(a[0])
    assert pool.allocate(0) == []


def test_slots_fork_and_release_share_blocks():
    pool = tiny_pool(8, block_size=4)
    t = pool.new_table()
    slots = t.slots_for(6)
    b0, b1 = t.block_ids
    assert slots == [b0 * 4, b0 * 4 + 1, b0 * 4 + 2, b0 * 4 + 3, b1 * 4, b1 * 4 + 1]
    free_before = pool.num_free
    child = t.fork()
    assert child.block_ids == t.block_ids and child.num_tokens == 6
    assert pool.num_free == free_before                      # fork allocates nothing
    assert [pool.ref_count[b] for b in t.block_ids] == [2, 2]
    t.release()
    assert [pool.ref_count[b] for b in child.block_ids] == [1, 1] and pool.num_free == free_before
    child.release()                                          # the last holder frees
    assert pool.num_free == 8 and t.block_ids == [] and child.num_tokens == 0


def test_slots_for_out_of_blocks_changes_nothing():
    pool = tiny_pool(3, block_size=4)
    t = pool.new_table()
    t.slots_for(5)
    with pytest.raises(OutOfBlocks):
        t.slots_for(8)                                       # needs 2 more blocks, 1 left
    assert len(t.block_ids) == 2 and t.num_tokens == 5 and pool.num_free == 1


def test_copy_on_write_only_for_a_shared_partial_last_block():
    pool = tiny_pool(8, block_size=4)
    kc, vc = pool.k_cache, pool.v_cache
    parent = pool.new_table()
    write_kv(kc[0], vc[0], torch.ones(6, 1, 2), torch.ones(6, 1, 2), torch.tensor(parent.slots_for(6)))
    child = parent.fork()
    shared_full, shared_partial = parent.block_ids
    # the child writes into the shared partial block: it gets a copy, the parent keeps its table
    slot = child.slots_for(1)[0]
    new_block = child.block_ids[1]
    assert new_block != shared_partial and child.block_ids[0] == shared_full
    assert parent.block_ids == [shared_full, shared_partial]
    assert slot == new_block * 4 + 2
    assert pool.pending_copies == [(shared_partial, new_block)]
    assert pool.ref_count[shared_partial] == 1 and pool.ref_count[shared_full] == 2
    copy_blocks(kc, vc, pool.pending_copies)
    assert torch.equal(kc[0][new_block, :2], kc[0][shared_partial, :2])   # the data moved too
    # now nobody else holds the parent's partial block: it writes in place, no copy
    pool.pending_copies.clear()
    parent.slots_for(1)
    assert parent.block_ids[1] == shared_partial and pool.pending_copies == []
    # a shared *full* last block is never copied: the next token starts a new block
    a = pool.new_table()
    a.slots_for(4)
    b = a.fork()
    b.slots_for(1)
    assert pool.pending_copies == [] and b.block_ids[0] == a.block_ids[0] and len(b.block_ids) == 2
    check_pool_invariants(pool, [parent, child, a, b])


def test_chapter_example_four_score_and_seven_years_ago():
    # The chapter's walk-through with block size 4. "Four score and seven years ago our" is
    # 7 tokens for SmolLM2's tokenizer (checked in the engine's trace test): the prompt
    # fills logical block 0 and 3 of the 4 slots of logical block 1.
    pool = tiny_pool(8, block_size=4)
    seq = pool.new_table()
    seq.slots_for(7)                                            # prefill
    assert seq.block_ids == [0, 1] and seq.num_tokens == 7 and pool.num_free == 6
    seq.slots_for(1)                                            # decode "fathers": fills block 1
    assert seq.block_ids == [0, 1] and seq.num_tokens == 8 and pool.num_free == 6
    seq.slots_for(1)                                            # decode "brought": a new block
    assert seq.block_ids == [0, 1, 2] and seq.num_tokens == 9 and pool.num_free == 5
    assert [pool.ref_count[b] for b in seq.block_ids] == [1, 1, 1]
    # parallel sampling: a second sample shares all three blocks ...
    sample2 = seq.fork()
    assert [pool.ref_count[b] for b in seq.block_ids] == [2, 2, 2] and pool.num_free == 5
    # ... until it writes into the shared partial block 2: copy-on-write gives it block 3
    sample2.slots_for(1)
    assert sample2.block_ids == [0, 1, 3] and pool.pending_copies == [(2, 3)]
    assert [pool.ref_count[b] for b in range(4)] == [2, 2, 1, 1]


def test_pool_sized_by_memory_budget():
    per_block = BlockPool.bytes_per_block(30, 16, 3, 64, torch.float32)
    assert per_block == 30 * 2 * 16 * 3 * 64 * 4
    assert BlockPool.bytes_per_block(30, 16, 3, 64, torch.bfloat16) == per_block // 2


def test_prefix_cache_index_and_lru_eviction():
    pool = tiny_pool(4, block_size=2)
    t = pool.new_table()
    t.slots_for(4)
    b0, b1 = t.block_ids
    pool.register(b0, 111, (1, 2))
    pool.register(b1, 222, (3, 4))
    t.release()                                   # b1 freed first, then b0: b1 is evicted first
    assert pool.num_cached == 2 and pool.num_free == 2
    assert pool.lookup(111, (1, 2)) == b0
    assert pool.lookup(111, (9, 9)) is None       # a hash collision never counts as a hit
    got = pool.allocate(2)                        # plain free blocks go first
    assert set(got).isdisjoint({b0, b1}) and pool.num_cached == 2
    (evicted,) = pool.allocate(1)                 # then the least recently used cached block
    assert evicted == b1 and pool.lookup(222, (3, 4)) is None and pool.lookup(111, (1, 2)) == b0
    revived = pool.new_table()
    revived.append_cached(b0)                     # a hit revives a cached block: used again
    assert pool.num_cached == 0 and pool.ref_count[b0] == 1 and revived.num_tokens == 2
    with pytest.raises(OutOfBlocks):
        pool.allocate(1)


def test_randomized_pool_and_table_operations():
    rng = random.Random(7)
    pool = tiny_pool(40, block_size=4)
    tables = []
    for step in range(4000):
        op = rng.random()
        try:
            if op < 0.2 or not tables:
                t = pool.new_table()
                t.slots_for(rng.randint(1, 12))
                tables.append(t)
            elif op < 0.55:
                rng.choice(tables).slots_for(rng.randint(1, 3))       # append / write
            elif op < 0.7:
                tables.append(rng.choice(tables).fork())
            elif op < 0.85:
                t = tables.pop(rng.randrange(len(tables)))
                for i, b in enumerate(t.block_ids[: t.num_tokens // 4]):   # full blocks: cacheable
                    pool.register(b, hash((id(t), i)), (i,))
                t.release()
            elif pool.cached_blocks:                                   # a prefix-cache hit
                t = pool.new_table()
                t.append_cached(rng.choice(list(pool.cached_blocks.values())))
                tables.append(t)
                t.slots_for(rng.randint(1, 5))
        except OutOfBlocks:
            t = tables.pop(0)
            t.release()
        pool.pending_copies.clear()
        check_pool_invariants(pool, tables)
    for t in tables:
        t.release()
    check_pool_invariants(pool, [])
    assert pool.num_used == 0


# =============================================================================
# The scheduler, with a fake runner in place of the model

EOS = 1


def fake_token(seq):
    """A deterministic 'model': the next token is a function of the whole sequence so far,
    so recomputing a preempted sequence must give back exactly the same continuation."""
    return 2 + (sum(seq.token_ids) * 31 + 7 * seq.num_tokens + seq.sample_index) % 97


def run_step(sched, check=True, token=fake_token):
    out = sched.schedule()
    if check:
        assert sum(out.num_tokens) <= sched.max_num_batched_tokens
        assert len(out.seqs) <= sched.max_num_seqs and len(sched.running) <= sched.max_num_seqs
        assert all(n >= 1 for n in out.num_tokens)
        assert [len(s) for s in out.slots] == out.num_tokens
    sampled = {}
    for i, seq in enumerate(out.seqs):
        if out.samples(i):
            first_of_many = seq.params.n > 1 and seq.num_output_tokens == 0 and seq.sample_index == 0
            sampled[seq] = [token(seq)] * seq.params.n if first_of_many else token(seq)
    sched.update(out, sampled)
    if check:
        tables = [s.block_table for s in (*sched.running, *sched.waiting)]
        check_pool_invariants(sched.pool, tables)
        assert all(s.status is Status.WAITING for s in sched.waiting)
        assert [s.arrival for s in sched.waiting] == sorted(s.arrival for s in sched.waiting)
        assert [s.order for s in sched.running] == sorted(s.order for s in sched.running)
    return out


def run_all(sched, max_steps=100_000, **kw):
    steps = 0
    while sched.has_unfinished():
        run_step(sched, **kw)
        steps += 1
        assert steps < max_steps, "the scheduler stopped making progress"
    return steps


def make_sched(num_blocks=64, block_size=4, **kw):
    kw.setdefault("eos_token_ids", [EOS])
    kw.setdefault("max_model_len", 10_000)
    return Scheduler(tiny_pool(num_blocks, block_size), **kw)


def finished_outputs(seqs):
    return {(s.request_id, s.sample_index): (s.output_token_ids, s.finish_reason) for s in seqs}


def test_scheduler_randomized_workloads_keep_every_invariant():
    for seed in range(3):
        rng = random.Random(seed)
        sched = make_sched(num_blocks=24, block_size=4, max_num_seqs=6, max_num_batched_tokens=20)
        seqs, next_id, steps = [], 0, 0
        while next_id < 60 or sched.has_unfinished():
            if next_id < 60 and rng.random() < 0.3:
                n = rng.choice([1, 1, 1, 2, 3])
                p = SamplingParams(n=n, max_tokens=rng.randint(1, 25), ignore_eos=rng.random() < 0.5)
                prompt = [rng.randint(2, 50) for _ in range(rng.randint(1, 40))]
                if rng.random() < 0.3:                 # a shared prefix for the prefix cache
                    prompt = [5] * 12 + prompt
                seqs.append(sched.add(next_id, prompt, p))
                next_id += 1
            if sched.requests and rng.random() < 0.02:
                sched.abort(rng.choice(list(sched.requests)))
            if sched.has_unfinished():
                run_step(sched)
            steps += 1
            assert steps < 20_000
        assert sched.num_preemptions > 0 and sched.prefix_hit_blocks > 0   # the workload bit
        assert sched.pool.num_used == 0 and sched.pool.pending_copies == []
        assert not sched.requests


def test_preemption_recomputes_to_the_same_tokens():
    def workload(num_blocks):
        sched = make_sched(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=16)
        seqs = [sched.add(i, list(range(2, 2 + 5 + i)), SamplingParams(max_tokens=20, ignore_eos=True))
                for i in range(6)]
        run_all(sched)
        return finished_outputs(seqs), sched.num_preemptions
    roomy, none = workload(200)
    tight, preemptions = workload(12)
    assert none == 0 and preemptions > 0 and tight == roomy


def test_fcfs_finish_order_and_preemption_victims():
    # equal work: requests finish in arrival order
    sched = make_sched(num_blocks=64, max_num_batched_tokens=8, max_num_seqs=2)
    seqs = [sched.add(i, [3, 4, 5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True)) for i in range(5)]
    finish_order = []
    while sched.has_unfinished():
        run_step(sched)
        finish_order += [s.request_id for s in seqs if s.finish_time and s.request_id not in finish_order]
    assert finish_order == [0, 1, 2, 3, 4]
    # a tight pool: the victim is always the latest-arrived running sequence, and it resumes
    # before anything that arrived after it
    sched = make_sched(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    seqs = [sched.add(i, [3] * 6, SamplingParams(max_tokens=10, ignore_eos=True)) for i in range(3)]
    victims = []
    while sched.has_unfinished():
        running = list(sched.running)                            # kept in arrival order
        out = run_step(sched)
        for v in out.preempted:
            assert v is running.pop()                            # each time: the newest left
            victims.append(v.request_id)
        if out.preempted:
            assert sched.waiting[0] is out.preempted[-1]         # back at the head of the queue
    assert victims and 0 not in victims                          # the oldest is never a victim
    assert [s.finish_reason for s in seqs] == ["length"] * 3


def test_victim_is_latest_arrival_and_resumes_first():
    sched = make_sched(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a = sched.add("a", [3] * 4, SamplingParams(max_tokens=8, ignore_eos=True))
    b = sched.add("b", [3] * 4, SamplingParams(max_tokens=8, ignore_eos=True))
    run_step(sched)                                   # both prefill: 2 blocks used
    c = sched.add("c", [3] * 4, SamplingParams(max_tokens=2, ignore_eos=True))
    out = run_step(sched)                             # a, b need a block each; c gets none
    assert out.seqs == [a, b] and c.status is Status.WAITING
    for _ in range(3):
        run_step(sched)
    out = run_step(sched)                             # a and b each need a 3rd block: only 0 left
    assert out.preempted == [b] and b.status is Status.WAITING
    assert list(sched.waiting) == [b, c]              # b resumes before the later arrival c
    run_all(sched)
    assert b.first_token_time < c.first_token_time
    assert [s.num_output_tokens for s in (a, b, c)] == [8, 8, 2]


def test_chunked_prefill_spreads_a_long_prompt_while_others_decode():
    sched = make_sched(num_blocks=200, block_size=4, max_num_batched_tokens=10)
    decoders = [sched.add(i, [3, 4], SamplingParams(max_tokens=50, ignore_eos=True)) for i in range(2)]
    run_step(sched)                                                   # both prefill (4 tokens)
    long = sched.add("long", list(range(2, 42)), SamplingParams(max_tokens=3, ignore_eos=True))
    steps = 0
    while long.num_computed_tokens < long.num_prompt_tokens:
        out = run_step(sched)
        steps += 1
        assert out.seqs[:2] == decoders and out.num_tokens[:2] == [1, 1]  # decodes keep going
        assert out.num_tokens[2] == min(8, 40 - 8 * (steps - 1))          # the rest of the budget
    assert steps == 5 and long.num_output_tokens == 1                   # 40 tokens / 8 per step


def test_prefix_cache_hits_and_block_ids():
    sched = make_sched(num_blocks=16, block_size=4)
    shared = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]              # three full blocks
    first = sched.add("first", shared + [30, 31], SamplingParams(max_tokens=1, ignore_eos=True))
    run_all(sched)
    first_blocks = sched.pool.cached_blocks.copy()
    assert sched.prefix_hit_blocks == 0 and len(first_blocks) == 3     # 14 prompt tokens: 3 full blocks
    assert sched.pool.num_cached == 3
    second = sched.add("second", shared + [40, 41, 42], SamplingParams(max_tokens=2, ignore_eos=True))
    out = run_step(sched)
    assert second.block_table.block_ids[:3] == list(first_blocks.values())
    assert out.num_tokens == [3] and second.num_cached_tokens == 12      # only the new part computed
    assert sched.prefix_hit_blocks == 3 and sched.prefix_hit_tokens == 12
    run_all(sched)
    # a prompt that is entirely cached still computes its last token (and so has logits):
    # its last full block is recomputed rather than reused
    again = sched.add("again", shared, SamplingParams(max_tokens=1, ignore_eos=True))
    out = run_step(sched)
    assert out.num_tokens == [4] and again.num_cached_tokens == 8 and again.num_output_tokens == 1
    assert sched.prefix_hit_blocks == 5


def test_prefix_cache_eviction_is_lru_and_collisions_are_caught(monkeypatch):
    sched = make_sched(num_blocks=4, block_size=2)
    a = sched.add("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=1, ignore_eos=True))
    run_all(sched)
    (head_hash, a_head), (tail_hash, a_tail) = sched.pool.cached_blocks.items()  # head first
    assert sched.pool.num_cached == 2 and list(sched.pool.evictable) == [a_tail, a_head]
    # a new, unrelated request takes the plain free blocks first, then evicts a's tail
    b = sched.add("b", [20, 21, 22, 23, 24], SamplingParams(max_tokens=2, ignore_eos=True))
    run_step(sched)
    assert a_tail in b.block_table.block_ids and a_head not in b.block_table.block_ids
    assert tail_hash not in sched.pool.cached_blocks and sched.pool.cached_blocks[head_hash] == a_head
    run_all(sched)
    # every hash collides now: the token comparison refuses the false hit
    monkeypatch.setattr(scheduler_module, "hash_block", lambda parent, tokens: 42)
    sched2 = make_sched(num_blocks=8, block_size=2)
    x = sched2.add("x", [5, 6, 7], SamplingParams(max_tokens=1, ignore_eos=True))
    run_all(sched2)
    y = sched2.add("y", [8, 9, 7], SamplingParams(max_tokens=1, ignore_eos=True))
    run_step(sched2)
    assert sched2.prefix_hit_blocks == 0 and y.num_cached_tokens == 0


def test_prefix_caching_off_registers_nothing():
    sched = make_sched(num_blocks=16, block_size=4, enable_prefix_caching=False)
    for i in range(2):
        sched.add(i, list(range(2, 20)), SamplingParams(max_tokens=2, ignore_eos=True))
        run_all(sched)
    assert sched.prefix_hit_blocks == 0 and sched.pool.num_cached == 0 and sched.pool.num_free == 16


def test_fork_shares_the_prompt_then_diverges_by_copy_on_write():
    sched = make_sched(num_blocks=32, block_size=4)
    parent = sched.add("r", [3] * 6, SamplingParams(n=3, max_tokens=4, ignore_eos=True))
    run_step(sched)                                         # prefill, then fork into 3
    samples = sched.requests["r"]
    assert len(samples) == 3 and [s.sample_index for s in samples] == [0, 1, 2]
    assert all(s.block_table.block_ids == parent.block_table.block_ids for s in samples)
    assert [sched.pool.ref_count[b] for b in parent.block_table.block_ids] == [3, 3]
    out = run_step(sched)                                   # each writes into the shared partial block
    assert len(out.copies) == 2                             # the last writer keeps the original
    full = parent.block_table.block_ids[0]
    assert all(s.block_table.block_ids[0] == full for s in samples) and sched.pool.ref_count[full] == 3
    assert len({s.block_table.block_ids[1] for s in samples}) == 3
    run_all(sched)
    assert all(s.num_output_tokens == 4 for s in samples) and sched.pool.num_used == 0


def test_finish_on_eos_stop_tokens_and_length():
    sched = make_sched()
    s1 = sched.add(1, [5], SamplingParams(max_tokens=5))
    s2 = sched.add(2, [5], SamplingParams(max_tokens=5, ignore_eos=True))
    s3 = sched.add(3, [5], SamplingParams(max_tokens=5, stop_token_ids=[9]))
    tokens = {s1: [4, EOS], s2: [EOS, EOS, 4, 4, 4, 4], s3: [4, 9]}
    while sched.has_unfinished():
        run_step(sched, token=lambda s: tokens[s][s.num_output_tokens])
    assert (s1.output_token_ids, s1.finish_reason) == ([4, EOS], "stop")
    assert (s2.output_token_ids, s2.finish_reason) == ([EOS, EOS, 4, 4, 4], "length")
    assert (s3.output_token_ids, s3.finish_reason) == ([4, 9], "stop")


def test_scheduler_bad_input_is_refused_and_nothing_leaks():
    sched = make_sched(num_blocks=4, block_size=4, max_model_len=20)
    with pytest.raises(ValueError, match="prompt is empty"):
        sched.add(1, [], SamplingParams())
    with pytest.raises(ValueError, match="context of 20"):
        sched.add(2, [3] * 15, SamplingParams(max_tokens=6))
    with pytest.raises(ValueError, match="whole pool has 4"):
        make_sched(num_blocks=4, block_size=4).add(3, [3] * 15, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="max_tokens must be"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="unknown request id 'nope'"):
        sched.abort("nope")
    ok = sched.add(4, [3, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    with pytest.raises(ValueError, match="already in use"):
        sched.add(4, [3], SamplingParams())
    run_step(sched)
    sched.abort(4)                                        # abort mid-flight: blocks return at once
    assert ok.finish_reason == "aborted" and sched.pool.num_used == 0 and not sched.has_unfinished()
