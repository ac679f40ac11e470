"""
bench.py: nanopaged's benchmarks, measured, never asserted. Each prints a table; the
README quotes them with the command that produced them.

  python bench.py load        loading the default model: first run (conversion) and later runs
  python bench.py attention   paged attention on the CPU: fast path vs reference vs contiguous SDPA vs
                              the decode rows on kernels_cpu.c
  python bench.py scheduler   the scheduler's own time per step, no model: 256 running sequences; and one
                              decoding under a window of 4,096 while a 32k-token request waits
  python bench.py seats       n parallel samples, the scheduler alone: seated one per free seat (prefix
                              cache on) vs a seat for each sample (off): steps, tokens, seats used, waits
  python bench.py engine      the 64-request offline workload (+ transformers side by side), memory report
  python bench.py backends    the same workload on attn_backend "torch" and "cpu" (kernels_cpu.c), in turns
  python bench.py prefix      a ~1,000-token shared system prompt: TTFT with prefix caching on vs off
  python bench.py parallel    n = 4 parallel sampling: KV blocks with copy-on-write vs without sharing
  python bench.py preempt     a pool too small for the workload: preemption by recomputing vs by swapping
                              to CPU memory, against a pool that holds it all
  python bench.py priority    urgent requests behind a queue, and one arriving in a full KV pool: their time
                              to first token first come, first served vs under scheduling_policy="priority"
  python bench.py beam        beam search (width 4): forked beams sharing blocks vs vLLM's way, each step
                              a request per beam that finds the earlier ones' blocks in the prefix cache
  python bench.py sampling    what logprobs, prompt logprobs, penalties and constraints cost, against plain greedy
  python bench.py dtype       float32 vs bfloat16 vs float16 on the CPU: one chat request, and a batch
  python bench.py kv-dtype    kv_cache_dtype auto (float32) vs bfloat16 vs fp8 vs fp8_e5m2 in one KV budget:
                              blocks, preemptions, time, and how far the greedy tokens stay float32's
  python bench.py kernel      (GPU) the CUDA kernel's bandwidth vs the card's copy bandwidth, the split-K
                              sweep, and prefill / chunk / GQA-8 steps against the torch path
  python bench.py all         every CPU benchmark above

Benchmarks get their own file because they are not part of the engine: they drive it
from outside, as a user would, and compare it with other ways of doing the same work.
"""

import argparse
import itertools
import math
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import build_ext
import nanopaged
from nanopaged import GatherPlan, BlockPool, paged_attention, paged_attention_ref, to_cache_dtype
from scheduler import BeamSearchParams, SamplingParams, Scheduler


def median_times(fns, repeats=5, warmup=1):
    """The median time of each fn, timed in turns (fn 1, fn 2, ..., fn 1, fn 2, ...): the
    machine's drift during the run then weighs on all of them alike."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return [statistics.median(ts) for ts in times]


# -----------------------------------------------------------------------------
# loading the default model

LOAD_SCRIPT = """
import resource, sys, time
t = time.perf_counter()
from model import load_model, load_tokenizer
model, tok = load_model(), load_tokenizer()
print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


def bench_load(args):
    """Load the default model in a fresh process: first into an empty cache (the GGUF is
    converted), then again from the converted directory. Time includes importing torch."""
    import os
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NANOPAGED_CACHE": cache}
        for label in ("first run (converts the GGUF)", "later runs (safetensors)"):
            runs = [subprocess.run([sys.executable, "-c", LOAD_SCRIPT], env=env, capture_output=True, text=True,
                                   check=True, cwd=sys.path[0]).stdout.split()
                    for _ in range(1 if label.startswith("first") else args.repeats)]
            secs, rss = statistics.median(float(r[0]) for r in runs), max(float(r[1]) for r in runs)
            print(f"{label:32s} {secs:6.2f} s (median of {len(runs)}), peak RSS {rss:.0f} MiB")


# -----------------------------------------------------------------------------
# paged attention on the CPU


def bench_attention(args):
    """A decode batch: 64 sequences with mixed context lengths up to 2,048, SmolLM2's head
    shape (9 query heads, 3 kv heads, head_dim 64), float32, block size 16."""
    H, KVH, D, bs, B = 9, 3, 64, 16, 64
    rng = random.Random(0)
    lens = [rng.randint(16, 2048) for _ in range(B)]
    lens[0] = 2048
    blocks = [-(-n // bs) for n in lens]
    num_blocks = sum(blocks)
    perm = torch.randperm(num_blocks).tolist()
    k_cache = torch.randn(num_blocks, bs, KVH, D)
    v_cache = torch.randn(num_blocks, bs, KVH, D)
    tables = torch.zeros(B, max(blocks), dtype=torch.int32)
    start = 0
    for b, n in enumerate(blocks):
        tables[b, :n] = torch.tensor(perm[start:start + n], dtype=torch.int32)
        start += n
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    qsl = torch.arange(B + 1, dtype=torch.int32)
    q = torch.randn(B, H, D)
    scale = D ** -0.5
    plan = GatherPlan(tables, seq_lens, qsl, bs)
    window = 512   # a sliding window's row (another result): it gathers at most 512 positions
    window_plan = GatherPlan(tables, seq_lens, qsl, bs, window)
    # the same data stored contiguously, padded to the longest sequence: (B, KVH, Lmax, D)
    starts = torch.zeros(B, dtype=torch.long)
    slots, valid = GatherPlan._slots(tables, starts, seq_lens.long(), max(lens), bs)   # (B, Lmax)
    k_dense = k_cache.view(-1, KVH, D)[slots].transpose(1, 2).contiguous()
    v_dense = v_cache.view(-1, KVH, D)[slots].transpose(1, 2).contiguous()
    mask = valid[:, None, None, :]

    def contiguous_sdpa():
        return F.scaled_dot_product_attention(q.view(B, KVH, H // KVH, D), k_dense, v_dense,
                                              attn_mask=mask, scale=scale)

    torch.testing.assert_close(contiguous_sdpa().reshape(B, H, D),
                               paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, scale))
    kernel = build_ext.load_cpu_kernels()
    variants = [
        ("contiguous SDPA (no paging, padded)", contiguous_sdpa),
        ("paged fast path (plan per call)",
         lambda: paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, scale)),
        ("paged fast path (plan + workspace shared)",
         lambda: paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, scale, plan=plan)),
        (f"  same, sliding window of {window} positions",
         lambda: paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, scale, window, plan=window_plan)),
    ]
    if kernel is None:
        print(f"(no row for kernels_cpu.c: {build_ext.cpu_unavailable_reason()})")
    else:
        # the engine's "cpu" backend: a plan without the decode gathers, the kernel reading the blocks
        kernel_plan = GatherPlan(tables, seq_lens, qsl, bs, gather_decodes=False)
        torch.testing.assert_close(contiguous_sdpa().reshape(B, H, D), paged_attention(
            q, k_cache, v_cache, tables, seq_lens, qsl, scale, plan=kernel_plan, decode_kernel=kernel))
        variants.append(("paged, decode rows on kernels_cpu.c", lambda: paged_attention(
            q, k_cache, v_cache, tables, seq_lens, qsl, scale, plan=kernel_plan, decode_kernel=kernel)))
        # the same over a float8 cache (kv_cache_dtype="fp8"): a quarter of the bytes, widened as read
        k8, v8 = to_cache_dtype(k_cache, torch.float8_e4m3fn), to_cache_dtype(v_cache, torch.float8_e4m3fn)
        variants.append(("  same, float8 (e4m3) K/V", lambda: paged_attention(
            q, k8, v8, tables, seq_lens, qsl, scale, plan=kernel_plan, decode_kernel=kernel)))
    rows = list(zip([name for name, _ in variants], median_times([fn for _, fn in variants], args.repeats)))
    rows.append(("paged reference (loops; one call)", median_times(
        [lambda: paged_attention_ref(q, k_cache, v_cache, tables, seq_lens, qsl, scale)], 1, 0)[0]))
    base = rows[0][1]
    print(f"decode batch: {B} sequences, context {min(lens)}..{max(lens)} (sum {sum(lens)}), "
          f"H={H} KVH={KVH} D={D} fp32, block size {bs}, {torch.get_num_threads()} threads; median of {args.repeats}")
    print(f"{'':42s} {'ms/layer':>9s} {'vs contiguous':>14s}")
    for name, t in rows:
        print(f"{name:42s} {1000 * t:9.2f} {t / base:13.2f}x")
    if kernel is not None:
        single_sequence(kernel, H, KVH, D, bs, args.repeats)


def single_sequence(kernel, H, KVH, D, bs, repeats):
    """One sequence decoding (a long chat): its KVH (sequence, kv head) work items are fewer
    than two a thread (with 2 threads or more; with one, nothing is split and the last two
    columns agree), so kernels_cpu.c cuts the context into partitions (split-K); against
    the same kernel on the whole context, and the torch fast path."""
    print(f"one sequence decoding, {torch.get_num_threads()} threads; ms/layer, median of {repeats}")
    print(f"{'context':>8s} {'fast path':>10s} {'kernel, whole':>14s} {'kernel, split-K':>16s} {'items':>6s}")
    for L in (2048, 8192, 32768):
        n = -(-L // bs)
        k_cache, v_cache = torch.randn(n, bs, KVH, D), torch.randn(n, bs, KVH, D)
        tables = torch.randperm(n, dtype=torch.int32)[None]                 # (1, n), shuffled blocks
        seq_lens, qsl = torch.tensor([L], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
        q, out, seqs = torch.randn(1, H, D), torch.empty(1, H, D), torch.tensor([0])
        plan = GatherPlan(tables, seq_lens, qsl, bs)

        def decode(partition_size=0):   # (0: the kernel's choice; L: the whole context, unsplit)
            return kernel.decode_attention(q, k_cache, v_cache, tables, seq_lens, qsl, seqs, D ** -0.5, out,
                                           partition_size=partition_size)
        torch.testing.assert_close(decode(), paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, D ** -0.5))
        items = kernel.work_items
        times = median_times([lambda: paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, D ** -0.5, plan=plan),
                              lambda: decode(L), decode], repeats)
        print(f"{L:8d} {1000 * times[0]:10.3f} {1000 * times[1]:14.3f} {1000 * times[2]:16.3f} {items:6d}")


# -----------------------------------------------------------------------------
# the scheduler alone


def bench_scheduler(args):
    """schedule() + update() with 256 sequences decoding, a fake token for each: the
    scheduler's own cost per step, to set against the model's step time. Then a step under a
    sliding window while a 32k-token request waits: the prefix-cache lookup scans all its
    blocks each step (under a window a miss does not end it), its hashes kept from the first."""
    pool = BlockPool(num_blocks=256 * 80, block_size=16, num_layers=1, num_kv_heads=1, head_dim=1)
    sched = Scheduler(pool, max_num_seqs=256, max_num_batched_tokens=256 * 600, max_model_len=4096)
    rng = random.Random(0)
    for i in range(256):
        sched.add(i, [rng.randint(3, 999) for _ in range(rng.randint(16, 512))],
                  SamplingParams(max_tokens=1000, ignore_eos=True))
    sched_step(sched)  # the prefill step
    med, out = median_step(sched, args.steps)
    assert len(out.seqs) == 256 and all(n == 1 for n in out.num_scheduled_tokens)
    print(f"scheduler, 256 running sequences decoding (block size 16, prefix caching on): "
          f"median {1000 * med:.2f} ms per step over {args.steps} steps "
          f"({1e6 * med / 256:.1f} us per sequence)")

    # A 4,500-token request holds most of a 400-block pool (its window of 4,096 and a chunk);
    # the 32k-token one behind it does not fit until it ends.
    pool = BlockPool(num_blocks=400, block_size=16, num_layers=1, num_kv_heads=1, head_dim=1)
    sched = Scheduler(pool, max_num_batched_tokens=512, max_model_len=40_000, sliding_window=4096)
    sched.add("long", [rng.randint(3, 999) for _ in range(4500)], SamplingParams(max_tokens=30_000, ignore_eos=True))
    for _ in range(12):
        sched_step(sched)
    sched.add("waits", [rng.randint(3, 999) for _ in range(32_768)], SamplingParams(max_tokens=1, ignore_eos=True))
    med, out = median_step(sched, args.steps)
    assert [s.request_id for s in out.seqs] == ["long"] and sched.waiting[0].request_id == "waits"
    print(f"scheduler, 1 sequence decoding under a window of 4,096 while a 32,768-token request waits: "
          f"median {1000 * med:.2f} ms per step over {args.steps} steps")


def sched_step(sched):
    """A step with a fake model: token 7 for every sequence that samples."""
    out = sched.schedule()
    sched.update(out, {seq: [7] for i, seq in enumerate(out.seqs) if out.do_sample[i]})
    return out


def median_step(sched, steps):
    """(median seconds per step over `steps` steps, the last step's SchedulerOutput)."""
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        out = sched_step(sched)
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def bench_seats(args):
    """Seats for samples, the scheduler alone: 64 requests of the offline workload's lengths, a
    share of them with n parallel samples (n uniform in 2..max_num_seqs), through Scheduler with
    a fake token. With the prefix cache on, a request is seated one sample per free seat
    (Scheduler._grant), its samples without a seat waiting at the fork to be recomputed from the
    cache; off, it waits for a seat for each: side by side on the same requests. The wait is a
    request's, to its first scheduled token; the latency, to its last sample's last token (it
    counts what samples sent back at the fork wait)."""
    print("| max_num_seqs, share with n > 1, arrivals | rule | steps | tokens over the fewest "
          "| seats used | mean wait, steps | mean latency, steps |")
    print("|---|---|---|---|---|---|---|")
    for seats, share, gap in ((8, 0.25, None), (8, 0.25, 30), (16, 0.25, None), (16, 0.5, None)):
        rows = {caching: [] for caching in (False, True)}
        for seed in range(4):
            rng, t, requests = random.Random(seed), 0.0, []
            for _ in range(64):
                n = rng.randint(2, seats) if rng.random() < share else 1
                prompt = [rng.randint(3, 30_000) for _ in range(rng.randint(16, 512))]
                requests.append((int(t), prompt, n, rng.randint(32, 256)))
                t += rng.expovariate(1 / gap) if gap else 0
            # the fewest tokens: each prompt once, and each sample's tokens but its last
            fewest = sum(len(p) + n * (m - 1) for _, p, n, m in requests)
            for caching in rows:
                rows[caching].append(seats_run(requests, seats, caching) + (fewest,))
        for caching, runs in rows.items():
            steps = sum(r[0] for r in runs) / len(runs)
            over = statistics.mean(r[1] / r[5] - 1 for r in runs)
            used = statistics.mean(r[2] / r[0] / seats for r in runs)
            wait, latency = statistics.mean(r[3] for r in runs), statistics.mean(r[4] for r in runs)
            rule = "one per free seat (cache on)" if caching else "a seat for each (cache off)"
            print(f"| {seats}, {share:.0%}, {f'gaps of {gap}' if gap else 'together'} | {rule} | {steps:,.0f} "
                  f"| {over:+.1%} | {used:.2f} | {wait:,.0f} | {latency:,.0f} |")


def seats_run(requests, seats, caching):
    """One run of bench_seats' requests ((arrival step, prompt, n, max_tokens) each) in a roomy
    pool of 4,000 blocks of 16: (steps, tokens computed, sequences scheduled over all steps,
    mean steps from a request's arrival to its first scheduled token, and to its end)."""
    pool = BlockPool(num_blocks=4000, block_size=16, num_layers=1, num_kv_heads=1, head_dim=1)
    sched = Scheduler(pool, max_num_seqs=seats, max_num_batched_tokens=1024, max_model_len=4096,
                      enable_prefix_caching=caching)
    pending, arrived, first, end = sorted(requests, key=lambda r: r[0]), {}, {}, {}
    step = tokens = scheduled = 0
    while pending or sched.has_unfinished():
        while pending and pending[0][0] <= step:
            at, prompt, n, max_tokens = pending.pop(0)
            arrived[len(arrived)] = at
            sched.add(len(arrived) - 1, prompt, SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True))
        step += 1
        if not sched.has_unfinished():
            continue   # (idle until the next arrival)
        out = sched.schedule()
        tokens, scheduled = tokens + sum(out.num_scheduled_tokens), scheduled + len(out.seqs)
        for seq in out.seqs:
            first.setdefault(seq.request_id, step - 1)
        # token 7 for every sequence that samples (one for each sample where it forks)
        sched.update(out, {seq: [7] * seq.pending_samples for i, seq in enumerate(out.seqs) if out.do_sample[i]})
        for seq in out.seqs:   # (a request ends in a step that ran its last sample)
            if seq.request_id not in sched.requests:
                end.setdefault(seq.request_id, step)
    return (step, tokens, scheduled, statistics.mean(first[i] - arrived[i] for i in arrived),
            statistics.mean(end[i] - arrived[i] for i in arrived))


# -----------------------------------------------------------------------------
# the engine on the offline workload


def offline_workload(vocab_size, seed=0, num_requests=64):
    """64 requests: prompt lengths uniform in 16..512 tokens (random ids), output lengths
    uniform in 32..256, greedy, ignore_eos so that every request produces exactly its
    output length."""
    rng = random.Random(seed)
    prompts, params = [], []
    for _ in range(num_requests):
        prompts.append([rng.randrange(17, vocab_size) for _ in range(rng.randint(16, 512))])
        params.append(SamplingParams(temperature=0, max_tokens=rng.randint(32, 256), ignore_eos=True))
    return prompts, params


def new_engine(args, **options):
    """An engine for a bench: the command line's model, dtype, attention backend and token
    budget, but for the options the bench sets itself."""
    from nanopaged import LLM
    return LLM(args.model, **({"dtype": args.dtype, "attn_backend": args.attn_backend,
                              "max_num_batched_tokens": args.max_num_batched_tokens} | options))


def fresh_engine(args, **options):
    """An engine for the offline workload, warmed up on prompts it shares nothing with."""
    llm = new_engine(args, **options)
    llm.generate([[17] * 64] * 2, SamplingParams(temperature=0, max_tokens=4))
    return llm


def bench_engine(args):
    """The offline workload through a fresh engine per run (so that no run finds the
    previous one's prompts in the prefix cache), each run followed by transformers'
    batched generate on the same requests: the ratio is taken side by side, as the
    machine's speed drifts."""
    llm = fresh_engine(args)
    prompts, params = offline_workload(llm.config.vocab_size)
    n_prompt, n_out = sum(map(len, prompts)), sum(p.max_tokens for p in params)
    max_len = max(len(p) + q.max_tokens for p, q in zip(prompts, params))
    print(f"workload: {len(prompts)} requests, {n_prompt} prompt + {n_out} output tokens, "
          f"{llm.config.num_hidden_layers}-layer model in {llm.dtype}, {torch.get_num_threads()} threads")
    print(llm.describe_kv_cache())
    runs, walls, hf_walls = [], [], []
    for run in range(args.runs):
        llm = llm if run == 0 else fresh_engine(args)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=True)
        walls.append(time.perf_counter() - start)
        runs.append(llm.stats)
        print(f"run {run + 1}: nanopaged {walls[-1]:.1f} s", end="")
        if args.hf:
            hf_walls.append(hf_generate(args.model, llm.dtype, prompts, params))
            if hf_walls[-1]:
                print(f", transformers {hf_walls[-1]:.1f} s: {hf_walls[-1] / walls[-1]:.2f}x", end="")
        print()
    median_run = sorted(range(len(runs)), key=walls.__getitem__)[len(runs) // 2]   # (its index)
    stats, wall = runs[median_run], walls[median_run]
    print(f"nanopaged, the median of {len(runs)} run{'s' * (len(runs) > 1)}: {wall:.1f} s, "
          f"{n_out / wall:.1f} output tok/s")
    print(stats.summary(llm.pool.num_blocks))
    if hf_walls and all(hf_walls):
        hf = statistics.median(hf_walls)
        ratio = statistics.median(h / w for h, w in zip(hf_walls, walls))   # each run's pair, side by side
        print(f"transformers batched generate, median of {len(hf_walls)}: {hf:.1f} s, {n_out / hf:.1f} output tok/s "
              f"(counting the tokens requested; as one static batch it computes {len(prompts)} x "
              f"{max(p.max_tokens for p in params)}). nanopaged is {ratio:.2f}x faster (median of the runs' ratios)")
    # Memory: at most peak_running requests ran at once, never in more than peak_blocks_used blocks
    # (two maxima, maybe of different steps: the budget below is an upper bound).
    # A contiguous cache reserves each request's maximum length up front; in the same memory
    # it holds far fewer requests, depending on what "maximum" it can know.
    bs = llm.pool.block_size
    budget = stats.peak_blocks_used * bs
    print(f"memory: {llm.bytes_per_block // bs} bytes of KV per token, {llm.bytes_per_block} per block of {bs}. "
          f"At the peak, {stats.peak_running} requests ran in at most {stats.peak_blocks_used} blocks ({budget} token "
          f"slots, {budget * llm.bytes_per_block / bs / 2**20:.0f} MiB). Reserving contiguously, that budget holds:")
    finals, oracle = [len(p) + q.max_tokens for p, q in zip(prompts, params)], 0
    while oracle < len(finals) and sum(finals[:oracle + 1]) <= budget:
        oracle += 1
    for label, fits in ((f"the model's context ({llm.max_model_len} tokens) per request", budget // llm.max_model_len),
                        (f"the workload's longest request ({max_len} tokens) per request", budget // max_len),
                        ("each request's exact final length (an oracle)", oracle)):
        print(f"  {label:58s} {fits:3d} requests: paged holds {stats.peak_running / max(fits, 1):5.1f}x more")


def bench_backends(args):
    """The offline workload on the CPU's two attention backends, in turns, a fresh engine
    each time: "torch" (every sequence's blocks gathered for SDPA) and "cpu" (the decode rows
    on kernels_cpu.c, reading the blocks in place; the default where it builds)."""
    if build_ext.load_cpu_kernels() is None:
        raise ValueError(f"kernels_cpu.c is not available: {build_ext.cpu_unavailable_reason()}")
    walls = {"torch": [], "cpu": []}
    for run in range(args.runs):
        for backend in walls:
            llm = fresh_engine(args, attn_backend=backend)
            prompts, params = offline_workload(llm.config.vocab_size)
            start = time.perf_counter()
            llm.generate(prompts, params)
            walls[backend].append(time.perf_counter() - start)
        print(f"run {run + 1}: torch {walls['torch'][-1]:.1f} s, cpu {walls['cpu'][-1]:.1f} s: "
              f"{walls['torch'][-1] / walls['cpu'][-1]:.2f}x")
    n_out = sum(p.max_tokens for p in params)
    for backend, times in walls.items():
        wall = statistics.median(times)
        print(f"attn_backend={backend!r}: median of {len(times)} {wall:.1f} s, {n_out / wall:.1f} output tok/s")
    ratio = statistics.median(t / c for t, c in zip(walls["torch"], walls["cpu"]))
    print(f"the kernel's engine is {ratio:.2f}x as fast (median of the runs' ratios)")


def hf_generate(model_name, dtype, prompts, params):
    """The same requests through Hugging Face transformers' batched generate: one static
    batch, left-padded, running until its longest request is done. Seconds, or None when
    transformers is not installed."""
    try:
        import transformers
    except ImportError:
        print("\ntransformers: not installed (pip install transformers): comparison skipped", end="")
        return None
    from model import resolve_model_dir
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(resolve_model_dir(model_name), dtype=dtype)
    model.generation_config.eos_token_id = None      # ignore_eos, like the workload
    model.generation_config.pad_token_id = 0
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        # warmed up first, as the engine is (fresh_engine): a first call's one-time costs
        # (allocator, kernels' first dispatch) are no part of either's speed
        model.generate(input_ids=ids[:2, -8:], attention_mask=mask[:2, -8:], max_new_tokens=4, do_sample=False)
        t = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(p.max_tokens for p in params),
                       do_sample=False)
        return time.perf_counter() - t


# -----------------------------------------------------------------------------
# prefix caching: a shared system prompt


def bench_prefix(args):
    system = ("You are a meticulous assistant for a library. " * 120)
    questions = ["Where are the maps?", "When do you open?", "Can I renew a book?", "Is there wifi?",
                 "Who wrote Dracula?", "Do you have audiobooks?", "How much is a late fee?", "Where can I print?"]
    row = {}
    for caching in (True, False):
        llm = new_engine(args, enable_prefix_caching=caching)
        n_system = len(llm.get_tokenizer().encode(system))
        llm.generate(system + "Hello.", SamplingParams(temperature=0, max_tokens=1))  # the first visitor
        ttfts = [llm.generate(system + q, SamplingParams(temperature=0, max_tokens=1))[0].ttft for q in questions]
        row[caching] = statistics.median(ttfts)
    print(f"shared system prompt of {n_system} tokens, {len(questions)} requests one after another, "
          f"median time to first token: prefix caching on {1000 * row[True]:.0f} ms, "
          f"off {1000 * row[False]:.0f} ms: {row[False] / row[True]:.1f}x lower with caching")
    # The same questions arriving together, after a shorter system prompt, so that all fit in
    # a step's token budget: the first computes the prompt, the others share its blocks in
    # that very step. Each call starts its prompts with a new session number: a cold cache.
    system, sessions = system[:len(system) // 6], iter(range(10**6))
    engines = {caching: new_engine(args, enable_prefix_caching=caching) for caching in (True, False)}
    hits = {}

    def together(caching):
        llm, session = engines[caching], next(sessions)
        prompts = [f"Session {session}. {system}{q}" for q in questions]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1))
        hits[caching] = (llm.stats.prefix_hit_tokens, llm.stats.prompt_tokens, llm.stats.steps)
    on, off = median_times([lambda: together(True), lambda: together(False)], repeats=args.repeats)
    n_system = len(engines[True].get_tokenizer().encode(f"Session 0. {system}"))
    print(f"shared system prompt of {n_system} tokens, {len(questions)} requests together (1 output token each), "
          f"median of {args.repeats}: prefix caching on {1000 * on:.0f} ms ({hits[True][0]} of {hits[True][1]} "
          f"prompt tokens shared, {hits[True][2]} step(s)), off {1000 * off:.0f} ms ({hits[False][2]} step(s)): "
          f"{off / on:.1f}x faster with caching")


# -----------------------------------------------------------------------------
# parallel sampling: copy-on-write


def bench_parallel(args):
    prompts = ["Write a story about a dragon who learns to read, in the style of a fairy tale, "
               "with a happy ending and a moral about patience. " * 6, "List ten uses for a paperclip."]
    rows = []
    for label, n, copies, caching in (("n=4, blocks shared + copy-on-write", 4, 1, True),
                                       ("4 independent requests, no sharing", 1, 4, False)):
        llm = new_engine(args, enable_prefix_caching=caching)
        p = SamplingParams(n=n, temperature=0.8, seed=0, max_tokens=64, ignore_eos=True)
        llm.generate([q for q in prompts for _ in range(copies)], p)
        rows.append((label, llm.stats.peak_blocks_used, llm.stats.output_tokens))
    print(f"{len(prompts)} prompts, 4 samples each, 64 tokens per sample, block size 16:")
    for label, blocks, tokens in rows:
        print(f"  {label:38s} peak KV blocks used {blocks:5d} ({tokens} output tokens)")
    print(f"  copy-on-write uses {rows[1][1] / rows[0][1]:.2f}x fewer blocks")


def bench_preempt(args):
    """16 requests of 100 random prompt tokens + 100 greedy output tokens, arriving together,
    in a pool of 64 blocks of 16 (1,024 token slots, where they need 3,200): the engine
    admits the prompts that fit whole with a block each to grow, then preempts as they grow
    further. Recomputing a preempted sequence prefills its prompt and output again;
    swapping copies its blocks to CPU memory and back (on this CPU, from one part of RAM to
    another: what is measured is the copy against the recompute). Medians of args.repeats,
    the three engines timed in turns."""
    rng = random.Random(0)
    engines = {"roomy pool (no preemption)": new_engine(args, num_blocks=512, enable_prefix_caching=False),
               "64 blocks, recompute": new_engine(args, num_blocks=64, enable_prefix_caching=False),
               "64 blocks, swap": new_engine(args, num_blocks=64, enable_prefix_caching=False,
                                             preemption_mode="swap")}
    vocab = next(iter(engines.values())).config.vocab_size
    prompts = [[rng.randrange(17, vocab) for _ in range(100)] for _ in range(16)]
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    tokens, stats, computed = {}, {}, {}

    def counting(name, forward):   # the tokens each run puts through the model
        def forward_counted(input_ids, *rest):
            computed[name] += len(input_ids)
            return forward(input_ids, *rest)
        return forward_counted
    for name, llm in engines.items():
        llm.model.forward = counting(name, llm.model.forward)

    def run(name):
        computed[name] = 0
        outs = engines[name].generate(prompts, params)
        tokens[name], stats[name] = [o.outputs[0].token_ids for o in outs], engines[name].stats
    times = median_times([lambda name=name: run(name) for name in engines], repeats=args.repeats)
    print(f"16 requests x (100 prompt + 100 output tokens), greedy, block size 16, {torch.get_num_threads()} CPU "
          f"threads; medians of {args.repeats}, timed in turns:")
    print(f"  {'':28s} {'time':>8s} {'preemptions':>12s} {'swapped':>8s} {'tokens computed':>16s}  same tokens")
    first = next(iter(engines))
    for (name, t) in zip(engines, times):
        s = stats[name]
        print(f"  {name:28s} {t:7.2f} s {s.preemptions:12d} {s.swapped_out:8d} "
              f"{computed[name]:16d}  {tokens[name] == tokens[first]}")


def bench_priority(args):
    """24 requests of 100 random prompt tokens + 64 greedy output tokens arriving together,
    at most 4 running at once (max_num_seqs=4: the others queue), the last 4 urgent. First
    come, first served, those wait for the 20 before them; under scheduling_policy="priority",
    given priority -1, they go first. The mean time to first token of each group, and the
    batch's time: medians of args.repeats, the two engines timed in turns."""
    rng = random.Random(0)
    engines = {policy: new_engine(args, max_num_seqs=4, enable_prefix_caching=False, scheduling_policy=policy)
               for policy in ("fcfs", "priority")}   # (no prefix cache: each repeat computes it all)
    vocab = engines["fcfs"].config.vocab_size
    prompts = [[rng.randrange(17, vocab) for _ in range(100)] for _ in range(24)]
    params, urgent = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), range(20, 24)
    ttfts, tokens = {policy: [] for policy in engines}, {}

    def run(policy):
        priority = [-1 if i in urgent else 0 for i in range(24)] if policy == "priority" else None
        outs = engines[policy].generate(prompts, params, priority=priority)
        tokens[policy] = [o.outputs[0].token_ids for o in outs]
        ttfts[policy].append((statistics.mean(outs[i].ttft for i in urgent),
                              statistics.mean(o.ttft for i, o in enumerate(outs) if i not in urgent)))
    times = median_times([lambda policy=policy: run(policy) for policy in engines], repeats=args.repeats)
    print(f"24 requests x (100 prompt + 64 output tokens) arriving together, greedy, max_num_seqs 4, the last 4 "
          f"urgent, {torch.get_num_threads()} CPU threads; medians of {args.repeats}, timed in turns:")
    print(f"  {'':30s} {'urgent TTFT':>12s} {'others TTFT':>12s} {'batch time':>11s}  same tokens")
    for (policy, t), label in zip(zip(engines, times), ("fcfs (first come, first served)", "priority (urgent: -1)")):
        timed = ttfts[policy][1:]   # (the first run was median_times' warm-up)
        urgent, others = (statistics.median(row[k] for row in timed) for k in (0, 1))
        print(f"  {label:30s} {urgent:10.2f} s {others:10.2f} s {t:9.2f} s  {tokens[policy] == tokens['fcfs']}")
    bench_priority_in_a_full_pool(args, rng, vocab)


def bench_priority_in_a_full_pool(args, rng, vocab):
    """An urgent request of 900 prompt tokens arriving while 4 requests (100 + 200 tokens)
    decode in a pool of 80 blocks of 16, which holds them to their end but not it beside
    them. First come, first served, it waits for room; under priorities it preempts the newest
    of them (Scheduler._preempt_outranked), which is recomputed later. Its time to first
    token, the 4 others' mean latency and the whole run's time, medians of args.repeats."""
    engines = {policy: new_engine(args, num_blocks=80, block_size=16, enable_prefix_caching=False,
                                  scheduling_policy=policy) for policy in ("fcfs", "priority")}
    lows = [[rng.randrange(17, vocab) for _ in range(100)] for _ in range(4)]
    urgent = [rng.randrange(17, vocab) for _ in range(900)]
    results = {policy: [] for policy in engines}

    def run(policy):
        llm, outs = engines[policy], {}
        llm.reset_stats()   # (add_request and step keep counting: this run's preemptions alone)
        for prompt in lows:
            llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        for _ in range(10):   # (prefilled, and decoding)
            llm.step()
        rid = llm.add_request(urgent, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                              priority=-1 if policy == "priority" else 0)
        while llm.has_unfinished_requests():
            outs |= {o.request_id: o for o in llm.step() if o.finished}
        others = [o for r, o in outs.items() if r != rid]
        results[policy].append((outs[rid].ttft, statistics.mean(o.latency for o in others),
                                llm.stats.preemptions, [o.outputs[0].token_ids for _, o in sorted(outs.items())]))
    times = median_times([lambda policy=policy: run(policy) for policy in engines], repeats=args.repeats)
    print(f"an urgent request (900 prompt + 16 tokens) arriving while 4 requests (100 + 200 tokens) decode "
          f"in 80 blocks of 16, greedy; medians of {args.repeats}, timed in turns:")
    print(f"  {'':30s} {'urgent TTFT':>12s} {'others latency':>15s} {'run time':>9s} {'preemptions':>12s}  same tokens")
    for (policy, t), label in zip(zip(engines, times), ("fcfs (first come, first served)", "priority (urgent: -1)")):
        timed = results[policy][1:]   # (the first run was median_times' warm-up)
        ttft, latency = (statistics.median(row[k] for row in timed) for k in (0, 1))
        same = all(row[3] == results["fcfs"][0][3] for row in timed)
        print(f"  {label:30s} {ttft:10.2f} s {latency:13.2f} s {t:7.2f} s {timed[-1][2]:12d}  {same}")


def beam_search_by_requests(llm, prompt: list[int], width: int, max_tokens: int):
    """Beam search as vLLM's LLM.beam_search does it (ignoring EOS, as the bench does):
    each step, one request of one token per beam, whose 2 * width logprobs are the
    candidates. Nothing is forked: a beam's blocks are shared with the beams before it only
    through the prefix cache, full blocks only, and its partial last block is recomputed.
    Returns the beams' output ids, best first, and the peak KV blocks used."""
    beams, peak = [(list(prompt), 0.0)], 0
    one = SamplingParams(temperature=0, max_tokens=1, logprobs=2 * width, ignore_eos=True)
    for _ in range(max_tokens):
        outs = llm.generate([tokens for tokens, _ in beams], one)
        peak = max(peak, llm.stats.peak_blocks_used)
        candidates = [(tokens + [t], cum + lp.logprob) for (tokens, cum), out in zip(beams, outs)
                      for t, lp in out.outputs[0].logprobs[0].items()]
        beams = sorted(candidates, key=lambda b: -b[1])[:width]
    return [tokens[len(prompt):] for tokens, _ in beams], peak


def bench_beam(args):
    """Beam search, width 4, on a 190-token chat prompt, 64 tokens (EOS ignored, so that
    every beam runs the whole way): nanopaged's forks, whose beams share their blocks in
    the pool (copy-on-write splits a partial last block), against vLLM's way on the same
    engine. Peak KV blocks used, against the blocks the live beams' tables list (what
    unshared copies would hold), and time; medians, timed in turns. Each run's prompt
    begins with its own number, so that no run finds another's blocks in the prefix cache."""
    from nanopaged import render_chat
    width, max_tokens = 4, 64
    llm = new_engine(args)
    story = ("You are a storyteller for children. Your stories are gentle, vivid and full of small "
             "details: the colour of a scarf, the smell of bread, the sound of rain on a tin roof. ") * 4
    runs, results = itertools.count(), {}

    def prompt():
        return render_chat(llm.get_tokenizer(), [{"role": "system", "content": f"Run {next(runs)}. {story}"},
                                                 {"role": "user", "content": "Write a story about a dragon."}])[1]

    def forked():
        ids = prompt()
        llm.add_request(ids, BeamSearchParams(width, max_tokens, ignore_eos=True))
        llm.reset_stats()
        while llm.has_unfinished_requests():
            for r in llm.step():
                results["forked"] = [c.token_ids for c in r.outputs[:1]]
        # (both peaks, as the vLLM-style side's, taken right after scheduling, when a step's
        # blocks are allocated and before its dropped beams free theirs)
        results["forked peaks"] = (llm.stats.peak_blocks_used, llm.stats.peak_blocks_listed)
        results["length"] = len(ids)

    def by_requests():
        beams, results["requests peak"] = beam_search_by_requests(llm, prompt(), width, max_tokens)
        results["requests"] = beams[:1]
    t_forked, t_requests = median_times([forked, by_requests], repeats=args.repeats)
    used, listed = results["forked peaks"]
    print(f"beam search, width {width}, a {results['length']}-token chat prompt, {max_tokens} tokens, block size "
          f"{llm.pool.block_size}, {torch.get_num_threads()} CPU threads; medians of {args.repeats}:")
    print(f"  {'':44s} {'peak KV blocks used':>20s} {'time':>9s}")
    print(f"  {'forked beams (blocks shared, copy-on-write)':44s} {used:20d} {t_forked:8.2f} s")
    print(f"  {'vLLM-style: a request per beam per step':44s} {results['requests peak']:20d} {t_requests:8.2f} s")
    print(f"  the live beams' block tables list {listed} blocks at most: sharing holds them in {used} "
          f"({listed / used:.2f}x fewer); the best beam the same both ways: {results['forked'] == results['requests']}")


# -----------------------------------------------------------------------------
# the sampler's extras: logprobs, prompt logprobs, penalties, constraints


def bench_sampling(args):
    llm = new_engine(args, enable_prefix_caching=False)   # (else repeats skip the prompts)
    rng = random.Random(0)
    prompts = [[rng.randrange(17, llm.config.vocab_size) for _ in range(100)] for _ in range(16)]
    base = dict(temperature=0, max_tokens=32, ignore_eos=True)
    variants = [("plain greedy", {}), ("logprobs=5", dict(logprobs=5)), ("prompt_logprobs=5", dict(prompt_logprobs=5)),
                ("logprob_token_ids (3 ids)", dict(logprob_token_ids=[17, 18, 19])),
                ("prompt_logprob_token_ids (3 ids a row)", dict(prompt_logprob_token_ids=[[17, 18, 19]] * 99)),
                ("penalties (repetition 1.2, presence 0.5, frequency 0.5)",
                 dict(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5)),
                ("constraints (logit_bias 100 ids, allowed_token_ids half the vocab, 2 bad_words)",
                 dict(logit_bias={t: 1.0 for t in range(1000, 1100)}, allowed_token_ids=list(range(llm.config.vocab_size // 2)),
                      bad_words=["hello world", "goodbye"])),
                ("a draw: temperature 1.0", dict(temperature=1.0, seed=0)),
                ("a draw: temperature 0.8, top_p 0.95", dict(temperature=0.8, top_p=0.95, seed=0))]
    fns = [lambda extra=extra: llm.generate(prompts, SamplingParams(**(base | extra))) for _, extra in variants]
    times = median_times(fns, repeats=args.repeats, warmup=1)
    print(f"{len(prompts)} prompts of 100 tokens, 32 output tokens each (greedy but for the draws), one batch; "
          f"median of {args.repeats}, timed in turns:")
    for (label, _), t in zip(variants, times):
        print(f"  {label:80s} {t:6.2f} s  {t / times[0]:.2f}x")
    # top-p's own cost by the width of the nucleus it finds, on the rows of the last draw and of
    # the same at temperature 1.5 (flat rows): it looks among the likeliest 1,024 tokens
    # (NUCLEUS_LOOK), then 8,192 (unless the first look holds under half of top_p), then sorts
    rows, sampling_probs = [], nanopaged.sampling_probs
    nanopaged.sampling_probs = lambda logits, p: rows.append((logits.clone(), p)) or sampling_probs(logits, p)
    try:
        for temperature in (0.8, 1.5):
            llm.generate(prompts, SamplingParams(**(base | variants[-1][1] | {"temperature": temperature})))
    finally:
        nanopaged.sampling_probs = sampling_probs
    bands = {}
    for logits, p in rows:
        probs = torch.softmax(logits.double() / p.temperature, -1).sort(descending=True).values
        size = int((probs.cumsum(0) - probs < p.top_p).sum())   # the nucleus: the smallest set reaching top_p
        first = float(probs[:1024].sum())   # the first look's mass
        t = time.perf_counter()
        sampling_probs(logits, p)
        t = time.perf_counter() - t
        band = next(b for b in (1024, 8192, len(probs)) if size <= b)
        bands.setdefault((p.temperature, band), []).append((t, first))
    print(f"sampling_probs on those rows and at temperature 1.5 ({torch.get_num_threads()} threads), by the "
          f"nucleus' width:")
    for (temperature, band), ts in sorted(bands.items()):
        firsts = [f for _, f in ts]
        print(f"  temperature {temperature}, up to {band:6,d} tokens: {len(ts):4d} rows, "
              f"{1000 * statistics.median(t for t, _ in ts):.2f} ms a call (median); the likeliest 1,024 tokens "
              f"hold {min(firsts):.2f}-{max(firsts):.2f}")


# -----------------------------------------------------------------------------
# the model's dtype on the CPU


def bench_dtype(args):
    """One request as a chat sends it (a 187-token chat prompt, 128 greedy tokens: decode reads
    every weight once per token, so bytes per weight count), then a batch of 16 requests of
    200 random prompt tokens + 64 greedy ones (where matmuls have rows to share each
    weight), in each dtype, timed in turns.
    Also: for how many tokens the greedy output stays float32's."""
    from nanopaged import render_chat
    dtypes = ["float32", "bfloat16", "float16"]
    engines = {dt: new_engine(args, dtype=dt, enable_prefix_caching=False) for dt in dtypes}
    rng = random.Random(0)
    vocab = engines["float32"].config.vocab_size
    prompts = [[rng.randrange(17, vocab) for _ in range(200)] for _ in range(16)]
    system = ("You are a storyteller for children. Your stories are gentle, vivid and full of small "
              "details: the colour of a scarf, the smell of bread, the sound of rain on a tin roof. ") * 4
    chat = render_chat(engines["float32"].get_tokenizer(), [   # (a chat, so that the tokens mean something)
        {"role": "system", "content": system}, {"role": "user", "content": "Write a long story about a dragon."}])[1]
    one = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    batch = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    single, tokens = {dt: [] for dt in dtypes}, {}

    def run_one(dt):
        out = engines[dt].generate([chat], one)[0]
        single[dt].append((out.ttft, (out.latency - out.ttft) / (len(out.outputs[0].token_ids) - 1)))
        tokens[dt] = out.outputs[0].token_ids
    median_times([lambda dt=dt: run_one(dt) for dt in dtypes], repeats=args.repeats)
    batch_repeats = max(args.repeats // 2, 1)
    batch_times = median_times([lambda dt=dt: engines[dt].generate(prompts, batch) for dt in dtypes],
                               repeats=batch_repeats)
    print(f"on the CPU, {torch.get_num_threads()} threads; medians of {args.repeats} (one request) and "
          f"{batch_repeats} (the batch), the dtypes timed in turns:")
    print(f"  {'dtype':10s} {'time to first token':>20s} {'per output token':>17s} {'16 x (200 + 64) batch':>22s}"
          f"   greedy tokens as float32's")
    for dt, t in zip(dtypes, batch_times):
        ttft = statistics.median(x for x, _ in single[dt][1:])   # (the first run was the warm-up)
        tpot = statistics.median(y for _, y in single[dt][1:])
        same = next((i for i, (a, b) in enumerate(zip(tokens[dt], tokens["float32"])) if a != b), len(tokens[dt]))
        print(f"  {dt:10s} {1000 * ttft:17.0f} ms {1000 * tpot:14.1f} ms {t:20.2f} s   the first {same} of 128")


def bench_kv_dtype(args):
    """16 requests of 100 random prompt tokens + 100 greedy output tokens (3,200 token slots),
    in a KV budget of 64 blocks of 16 of the model's K and V in its dtype (float32 by
    default; 1,024 slots): a narrower cache (kv_cache_dtype) holds more blocks in it, so
    fewer sequences are preempted. Timed in turns, medians of args.repeats. Also: how many of
    the 16 outputs stay those of the model's dtype, and for how many tokens each does (float8
    rounds K and V to 3 or 2 mantissa bits), and the same for one chat request of 128 tokens,
    whose tokens mean something."""
    from nanopaged import render_chat
    names = ["auto", "bfloat16", "fp8", "fp8_e5m2"]
    budget = 64 * new_engine(args, num_blocks=1).bytes_per_block
    engines = {kv: new_engine(args, kv_cache_memory=budget, kv_cache_dtype=kv, enable_prefix_caching=False)
               for kv in names}
    rng = random.Random(0)
    vocab = engines["auto"].config.vocab_size
    prompts = [[rng.randrange(17, vocab) for _ in range(100)] for _ in range(16)]
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    chat = render_chat(engines["auto"].get_tokenizer(), [
        {"role": "user", "content": "Write a long story about a dragon who learns to bake bread."}])[1]
    tokens, stats = {}, {}

    def run(kv):
        outs = engines[kv].generate(prompts + [chat], [params] * 16 + [SamplingParams(temperature=0, max_tokens=128)])
        tokens[kv], stats[kv] = [o.outputs[0].token_ids for o in outs], engines[kv].stats
    times = median_times([lambda kv=kv: run(kv) for kv in names], repeats=args.repeats)

    def agreement(a, b):   # how many first tokens two outputs share
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    print(f"16 requests x (100 random prompt + 100 output tokens) and one chat request (128 tokens), greedy, "
          f"in a KV budget of {budget / 2**20:.1f} MiB (64 blocks of 16 {args.dtype} K/V); {torch.get_num_threads()} "
          f"CPU threads, medians of {args.repeats}, timed in turns:")
    print(f"  {'kv_cache_dtype':15s} {'blocks':>7s} {'preemptions':>12s} {'time':>8s}   outputs as {args.dtype}'s "
          f"(median tokens alike)   the chat's first tokens alike")
    for kv, t in zip(names, times):
        alike = [agreement(a, b) for a, b in zip(tokens[kv][:16], tokens["auto"][:16])]
        print(f"  {kv:15s} {engines[kv].pool.num_blocks:7d} {stats[kv].preemptions:12d} {t:7.2f} s   "
              f"{sum(n == 100 for n in alike):2d} of 16 ({statistics.median(alike):.0f} of 100){'':17s}"
              f"{agreement(tokens[kv][16], tokens['auto'][16]):3d} of {len(tokens['auto'][16])}")


#
# Decode attention on the GPU: the CUDA kernel against the card's copy bandwidth.
#
#     python bench.py kernel
#
# Decode attention reads every cached K and V once per step and does little arithmetic, so
# its speed limit is memory bandwidth. For decode batches of a Llama-3-8B layer (32 query
# heads, 8 kv heads, head_dim 128, bf16, block_size 16) this prints the bandwidth the kernel
# achieves (bytes of K/V read / kernel time) next to the bandwidth of a plain device-to-device
# copy, and the time of the torch fast path (nanopaged.paged_attention) on the same data.
# Times are CUDA-event medians. Each call's K/V, with the copies it rotates through, total
# at least 1 GiB (a small batch is copied and each call reads the next copy; a large one is
# read again whole), so the 50 MB L2 cache does not serve repeats.

BATCHES = [(1, 32768), (64, 4096), (256, 1024)]          # (sequences, context tokens each)
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16
POOL_BYTES = 1 << 30                                      # K+V rotated through, at least
GOAL = (64, 4096, 0.80)                                   # 80% of copy bandwidth at 64 x 4k


def cuda_time_us(fn, calls: int, repeats: int = 7) -> float:
    """Median over `repeats` of the mean time of `calls` back-to-back fn(i), in microseconds.

    Back-to-back calls keep the GPU queue full, so host launch overhead is hidden as long as
    a call takes longer on the GPU than on the CPU.
    """
    fn(0)                                                 # warm-up (and any lazy setup)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(calls):
            fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy: nbytes read plus nbytes written per copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = cuda_time_us(lambda i: dst.copy_(src), calls=5)
    return 2 * nbytes / us / 1e3


def paged_batch(pairs: list[tuple[int, int]], gen: torch.Generator, heads: int = HEADS):
    """A shuffled paged pool holding `copies` independent batches of the (query tokens,
    context tokens) pairs; decode: (1, context) each."""
    contexts = [context for _, context in pairs]
    blocks = [-(-n // BLOCK_SIZE) for n in contexts]
    kv_bytes = sum(contexts) * KV_HEADS * HEAD_DIM * DTYPE.itemsize * 2
    copies = max(1, math.ceil(POOL_BYTES / kv_bytes))
    num_blocks = copies * sum(blocks)
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE)
    v_cache = torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE)
    perm = torch.randperm(num_blocks, generator=gen, device="cuda").to(torch.int32)
    tables = torch.zeros(copies, len(contexts), max(blocks), dtype=torch.int32, device="cuda")
    owned = torch.arange(max(blocks), device="cuda")[None, :] < torch.tensor(blocks, device="cuda")[:, None]
    tables[:, owned] = perm.view(copies, -1)                 # (copies, B, max blocks), padded with 0
    q_lens = [n for n, _ in pairs]
    q = torch.randn(sum(q_lens), heads, HEAD_DIM, generator=gen, device="cuda", dtype=DTYPE)
    seq_lens = torch.tensor(contexts, dtype=torch.int32, device="cuda")
    query_start_loc = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, tables, seq_lens, query_start_loc, kv_bytes


def torch_path_us(q, k_cache, v_cache, tables, seq_lens, qsl, scale, window=None):
    """The torch fast path's time (its per-step plan built beforehand, as the engine does)
    and its output on the first batch; (None, reason) when it cannot run here."""
    try:
        plans = [GatherPlan(t, seq_lens, qsl, BLOCK_SIZE, window) for t in tables]
        run = lambda i: paged_attention(q, k_cache, v_cache, tables[i % len(tables)], seq_lens,  # noqa: E731
                                        qsl, scale, window, plan=plans[i % len(tables)])
        out = run(0)
        return cuda_time_us(run, calls=3, repeats=3), out
    except Exception as e:  # the comparison is optional: an OOM or API change must not end the run
        torch.cuda.empty_cache()
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"


def kernel_vs_torch(ops, pairs, heads, gen, calls, window=None):
    """One step's batch of (query tokens, context) pairs, on the kernel and on the torch
    path: the kernel's time, the K/V bytes it reads (with a sliding window, only the
    positions some query sees), and the torch path's columns of a table row (its time, the
    kernel's speedup, their largest difference: MISMATCH past bf16's tolerance, 2e-2
    absolute or relative)."""
    q, k_cache, v_cache, tables, seq_lens, qsl, kv_bytes = paged_batch(pairs, gen, heads)
    if window:
        kv_bytes = kv_bytes * sum(min(n, window + q_len - 1) for q_len, n in pairs) // sum(n for _, n in pairs)
    try:
        scale, max_q, longest = HEAD_DIM ** -0.5, max(n for n, _ in pairs), max(n for _, n in pairs)
        call = lambda i: ops.paged_attention(q, k_cache, v_cache, tables[i % len(tables)], seq_lens,  # noqa: E731
                                             qsl, scale, max_q, longest, window=window or 0)
        kernel_us = cuda_time_us(call, calls=calls)
        torch_us, torch_out = torch_path_us(q, k_cache, v_cache, tables, seq_lens, qsl, scale, window)
        if torch_us is None:
            return kernel_us, kv_bytes, ("n/a", "", f"({torch_out})")
        out, ref = call(0).float(), torch_out.float()
        max_diff = (out - ref).abs().max().item()
        # (relative too: bf16 keeps 8 bits, so the two paths' roundings of an output near 4,
        # a prefill's first rows, may differ by a unit in the last place, 0.03; NaN mismatches)
        mismatch = "" if torch.allclose(out, ref, rtol=2e-2, atol=2e-2) else "  MISMATCH"
        return kernel_us, kv_bytes, (f"{torch_us:10.1f}", f"{torch_us / kernel_us:7.1f}x", f"{max_diff:10.2e}{mismatch}")
    finally:
        q = k_cache = v_cache = tables = None
        torch.cuda.empty_cache()


def failed(e: Exception) -> str:
    return f"failed: {type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"


# Beyond decode: attn_backend="auto" runs every step on the kernel, prefill too. A prefill
# has many query rows per key, where the torch path's SDPA (tensor cores) may win; a GQA
# group of 8 takes the kernel's 8-row variant, which keeps fewer loads in flight.
# A sliding window (Mistral's 4096) reads only the window: a decode of 8 x 32k then reads
# as much as 8 x 4k, and should take about as long.
OTHER_STEPS = [("prefill 1 x 8192", [(8192, 8192)], HEADS, None),
               ("chunk 2048 of 8192 + 63 decodes x 4096", [(2048, 8192)] + [(1, 4096)] * 63, HEADS, None),
               ("decode 64 x 4096, 64 q heads (G=8)", [(1, 4096)] * 64, 64, None),
               ("decode 8 x 32768, window 4096", [(1, 32768)] * 8, HEADS, 4096),
               ("decode 8 x 4096", [(1, 4096)] * 8, HEADS, None)]


def other_steps(ops, copy_gbs, gen) -> int:
    print(f"\n{'other steps':>40} {'kernel us':>10} {'GB/s':>7} {'of copy':>8} {'torch us':>10} "
          f"{'speedup':>8} {'max|diff|':>10}")
    status = 0
    for label, pairs, heads, window in OTHER_STEPS:
        try:
            kernel_us, kv_bytes, (torch_col, speedup, diff) = kernel_vs_torch(ops, pairs, heads, gen, calls=5,
                                                                              window=window)
        except Exception as e:  # report the step and go on with the next one
            print(f"{label:>40}  {failed(e)}")
            status = 1
            continue
        gbs = kv_bytes / kernel_us / 1e3
        status |= diff.endswith("MISMATCH")
        print(f"{label:>40} {kernel_us:10.1f} {gbs:7.0f} {gbs / copy_gbs:7.0%} {torch_col:>10} {speedup:>8} {diff:>10}")
    print(f"{'':>40} (GB/s: the K/V read once over the kernel's time; a prefill is compute-bound: read its speedup)")
    return status


def bench_kernel(args) -> int:
    if not torch.cuda.is_available():
        print("kernel: no CUDA GPU, nothing to measure")
        return 0
    ops = build_ext.load_kernels()
    if ops is None:
        print(f"kernel: the kernels are unavailable: {build_ext.unavailable_reason()}")
        return 1
    props = torch.cuda.get_device_properties(0)
    copy_gbs = copy_bandwidth_gbs()
    torch.cuda.empty_cache()
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}")
    print(f"device-to-device copy bandwidth (2 GiB, read + write): {copy_gbs:,.0f} GB/s")
    print(f"decode attention: {HEADS} q heads / {KV_HEADS} kv heads, head_dim {HEAD_DIM}, "
          f"{str(DTYPE).removeprefix('torch.')}, block_size {BLOCK_SIZE}\n")
    header = (f"{'batch x context':>16} {'K+V read':>9} {'grid (x,y,z)':>15} {'kernel us':>10} {'GB/s':>7} "
              f"{'of copy':>8} {'torch us':>10} {'speedup':>8} {'max|diff|':>10}")
    print(header)
    print("-" * len(header))

    status = 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    achieved = {}
    for num_seqs, context in BATCHES:
        label = f"{num_seqs} x {context}"
        try:
            kernel_us, kv_bytes, (torch_col, speedup, diff) = kernel_vs_torch(
                ops, [(1, context)] * num_seqs, HEADS, gen, calls=20)
        except Exception as e:  # report the batch and go on with the next one
            print(f"{label:>16}  {failed(e)}")
            status = 1
            continue
        gbs = kv_bytes / kernel_us / 1e3
        achieved[(num_seqs, context)] = gbs / copy_gbs
        grid = ",".join(map(str, ops.describe_plan(num_seqs, num_seqs, HEADS, KV_HEADS, 1, context)["grid"]))
        status |= diff.endswith("MISMATCH")
        print(f"{label:>16} {kv_bytes / 1e6:7.0f}MB {grid:>15} {kernel_us:10.1f} {gbs:7.0f} "
              f"{gbs / copy_gbs:7.0%} {torch_col:>10} {speedup:>8} {diff:>10}")

    seqs, ctx, goal = GOAL
    if (seqs, ctx) in achieved:
        verdict = "met" if achieved[(seqs, ctx)] >= goal else "NOT met"
        print(f"\ngoal {goal:.0%} of copy bandwidth at {seqs} x {ctx}: {achieved[(seqs, ctx)]:.0%}, {verdict}")

    # The planner's split-K choice against fixed partition sizes: at the goal's shape, and
    # for a skewed batch, where the planner (which sees only the longest context) gives the
    # long sequence few, long partitions that may finish well after the rest: the data for
    # tuning kMinPartitionKeys / kTargetCtasPerSm in kernels.cu on this card.
    sweeps = [(f"{seqs} x {ctx}", [ctx] * seqs, (0, 256, 512, 1024, 2048, ctx)),
              ("1 x 32768 + 255 x 1024", [32768] + [1024] * 255, (0, 1024, 2048, 4096))]
    for label, contexts, sizes in sweeps:
        status |= partition_sweep(ops, label, contexts, sizes, copy_gbs, gen)
    return status | other_steps(ops, copy_gbs, gen)


def partition_sweep(ops, label, contexts, sizes, copy_gbs, gen) -> int:
    """One decode batch's time with the planner's partition size (0) and with fixed ones."""
    print(f"\nsplit-K, {label}:")
    print(f"{'asked':>8} {'keys/CTA':>9} {'grid (x,y,z)':>15} {'kernel us':>10} {'GB/s':>7} {'of copy':>8}")
    try:
        q, k_cache, v_cache, tables, seq_lens, qsl, kv_bytes = paged_batch([(1, n) for n in contexts], gen)
        scale, B, longest = HEAD_DIM ** -0.5, len(contexts), max(contexts)
        for asked in sizes:
            plan = ops.describe_plan(B, B, HEADS, KV_HEADS, 1, longest, partition_size=asked)
            us = cuda_time_us(lambda i: ops.paged_attention(q, k_cache, v_cache, tables[i % len(tables)],
                                                            seq_lens, qsl, scale, 1, longest,
                                                            partition_size=asked), calls=20)
            gbs = kv_bytes / us / 1e3
            print(f"{asked or 'auto':>8} {plan['partition_size']:>9} {','.join(map(str, plan['grid'])):>15} "
                  f"{us:10.1f} {gbs:7.0f} {gbs / copy_gbs:7.0%}")
        return 0
    except Exception as e:
        print(f"  {failed(e)}")
        return 1
    finally:
        q = k_cache = v_cache = tables = None
        torch.cuda.empty_cache()


# -----------------------------------------------------------------------------

BENCHES = {"load": bench_load, "attention": bench_attention, "scheduler": bench_scheduler, "seats": bench_seats,
           "engine": bench_engine, "prefix": bench_prefix, "parallel": bench_parallel, "preempt": bench_preempt,
           "priority": bench_priority, "beam": bench_beam, "sampling": bench_sampling, "dtype": bench_dtype,
           "kv-dtype": bench_kv_dtype, "backends": bench_backends, "kernel": bench_kernel}


def count(text: str) -> int:
    """argparse's type for --repeats, --steps, --runs and --max-num-batched-tokens: an int >= 1
    (a median of no timings has no value; a step with no budget computes nothing)."""
    if int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return int(text)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", choices=[*BENCHES, "all"])
    ap.add_argument("--repeats", type=count, default=7)
    ap.add_argument("--steps", type=count, default=200)
    ap.add_argument("--runs", type=count, default=1, help="engine workload runs (the median is shown)")
    ap.add_argument("--model", help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--attn-backend", default="auto", choices=["auto", "torch", "cpu", "cuda"],
                    help="the engines' attention (the numbers before 2026-12-01 were taken on torch)")
    ap.add_argument("--max-num-batched-tokens", type=count, help="the engines' token budget of a step")
    ap.add_argument("--no-hf", dest="hf", action="store_false", help="skip the transformers comparison")
    args = ap.parse_args(argv)
    # These measure a workload of their own (the default model's loading, no model at all, or,
    # dtype, each of the three dtypes; backends, both backends): a flag given them would go unmeasured.
    own = {"load", "attention", "scheduler", "seats", "kernel"}
    for flag, given, ignored_by in (("--model", args.model is not None, own),
                                    ("--dtype", args.dtype != "float32", own | {"dtype"}),
                                    ("--attn-backend", args.attn_backend != "auto", own | {"backends"}),
                                    ("--max-num-batched-tokens", args.max_num_batched_tokens is not None, own)):
        if given and args.which in ignored_by:
            ap.error(f"{flag} is not for '{args.which}', which measures a workload of its own")
    status = 0
    try:
        for name, fn in BENCHES.items():
            if args.which == name or (args.which == "all" and name != "kernel"):
                print(f"== {name} ==")
                status |= fn(args) or 0
    except ValueError as e:   # a --model or --dtype the engine refuses: its one line, as nanopaged.py says it
        print(f"bench.py: error: {nanopaged.one_line(str(e))}", file=sys.stderr)
        return 2
    return status


if __name__ == "__main__":
    sys.exit(main())
