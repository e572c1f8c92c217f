"""Automatic prefix caching.

Without a model: the KV manager's invariants under a long random run (reference counts, every block in exactly
one state, a shared block never written, what a sequence reads is what its tokens wrote), the scheduler's use of
cached blocks (the budget counts only what is computed, at least one token is computed, preemption, admission).
With the tiny random Llama (and Mistral's sliding window), fp32 greedy: tokens identical and logprobs within
1e-4 with caching on and off: single requests, many requests sharing prefixes block-aligned and not, sequences
sharing a prefix at once, prompt logprobs, a cache small enough to preempt and evict.
"""
import random
from collections import Counter

import pytest
from transformers import MistralConfig

import mii
from mii.engine.kv_cache import BlockAllocator, KVCacheManager, block_hash, root_hash
from mii.engine.scheduler import Scheduler
from mii.engine.sequence import Sequence
from mii.errors import KVCacheError
from tests.engine.conftest import VOCAB
from tests.reference import TINY, prompts_for, tiny_checkpoint

BS = 4


def seq(uid, prompt, max_new=8, **kw):
    return Sequence(uid, list(prompt), max_total=len(prompt) + max_new, **kw)


def step(s: Scheduler, token=7):
    batch = s.schedule()
    s.update(batch, {c.seq.uid: token for c in batch.chunks if c.samples})
    return batch


def test_block_hashes_chain_tokens_and_salt():
    a, b = root_hash(b""), root_hash(b"lora-1")
    assert a != b
    h1 = block_hash(a, [1, 2, 3, 4])
    assert h1 == block_hash(a, [1, 2, 3, 4]) and h1 != block_hash(b, [1, 2, 3, 4]) != block_hash(a, [1, 2, 3, 5])
    # the same block after a different parent is a different block
    assert block_hash(h1, [5, 6, 7, 8]) != block_hash(block_hash(a, [9, 2, 3, 4]), [5, 6, 7, 8])
    kv = KVCacheManager(8, BS, prefix_caching=True)
    x, y = seq(0, range(1, 10)), seq(1, range(1, 10), cache_salt=b"lora-1")
    s = Scheduler(kv, 64, 8)
    s.add(x)
    step(s)
    s.add(y)
    assert kv.cached_prefix(y) == [] and len(kv.cached_prefix(seq(2, range(1, 10)))) == 2


def test_allocator_sharing_idle_pool_and_eviction_order():
    a = BlockAllocator(4)
    x = a.allocate(3)                                        # [0, 1, 2]
    assert a.register(x[0], b"h0") and a.register(x[1], b"h1")
    assert not a.register(x[2], b"h1")                       # a twin of cached content stays private
    a.share([x[0]])
    assert a.ref_count(x[0]) == 2
    a.free(x)
    assert a.ref_count(x[0]) == 1 and a.num_free == 3 and a.num_idle == 1   # x[2] to the free list, x[1] idle
    with pytest.raises(KVCacheError, match="not in the prefix cache"):
        a.share([x[2]])
    a.free([x[0]])
    assert a.num_idle == 2 and a.lookup(b"h0") == x[0]
    # the free list first (blocks 2 and 3), then the idle pool, least recently used first (block 1, then 0)
    got = a.allocate(3)
    assert got == [2, 3, 1] and a.lookup(b"h1") is None and a.lookup(b"h0") == 0
    with pytest.raises(KVCacheError):
        a.allocate(2)
    assert a.num_free == 1 and a.lookup(b"h0") == 0          # a failed call changes nothing


def test_allocator_reuses_idle_blocks_before_untouched_memory():
    """With lazily faulted memory (`resident`: blocks below it are in place), an idle cached block is taken
    before a free block never used whose pages are not in place; blocks used before, or faulted in, first."""
    resident = [2]
    a = BlockAllocator(8, resident=lambda: resident[0])
    x = a.allocate(3)                                        # [0, 1, 2]: 2 is past `resident`, the list had no idle
    for i, b in enumerate(x):
        assert a.register(b, b"h%d" % i)
    a.free(x)                                                # all idle; the free list holds 3..7, never used
    assert a.allocate(2) == [2, 1] and a.num_evictions == 2  # idle (least recently used: the tail first)
    a.free([2])                                              # not cached any more: to the free list, used before
    assert a.allocate(1) == [2]                              # used before: no page faults, so the free list
    resident[0] = 5                                          # the background thread faulted in blocks 3 and 4
    assert a.allocate(2) == [3, 4] and a.lookup(b"h0") == 0  # now in place: the free list, the cache kept
    assert a.allocate(2) == [0, 5]                           # 5 untouched: idle block 0 first; then nothing idle
    plain = BlockAllocator(4)                                # no `resident`: all memory in place
    assert plain.num_reusable() == 4
    y = plain.allocate(1)
    assert plain.register(y[0], b"h")
    plain.free(y)
    assert plain.allocate(1) == [1] and plain.lookup(b"h") == 0


def test_reusable_blocks_are_those_that_need_no_new_memory():
    """`num_reusable` (KVPrefault's `spare`): idle cached blocks, free blocks used before, and free blocks whose
    memory is in place; never a block past both what was used and what `resident` says."""
    resident = [0]
    a = BlockAllocator(10, resident=lambda: resident[0])
    assert a.num_reusable() == 0                             # nothing used, nothing faulted in
    resident[0] = 3
    assert a.num_reusable() == 3                             # blocks 0-2 in place
    x = a.allocate(4)                                        # [0, 1, 2, 3]: 3 was untouched
    assert x == [0, 1, 2, 3] and a.num_reusable() == 0
    assert a.register(x[0], b"h0")
    a.free(x)                                                # 0 idle, 1-3 back on the free list
    assert a.num_idle == 1 and a.num_reusable() == 4
    resident[0] = 6                                          # 4 and 5 faulted in
    assert a.num_reusable() == 6
    resident[0] = 50                                         # past the cache: clamped
    assert a.num_reusable() == 10
    assert a.allocate(10) and a.num_reusable() == 0


def test_shared_prefix_computes_only_the_rest():
    kv = KVCacheManager(32, BS, prefix_caching=True)
    s = Scheduler(kv, max_batch_tokens=6, max_batch_seqs=8)
    a = seq(0, range(1, 11))                                 # 10 tokens: 2 full blocks
    s.add(a)
    while a.num_generated == 0:
        step(s)
    assert a.num_cached_tokens == 0 and kv.allocator.num_cached == 2
    b, c = seq(1, list(range(1, 9)) + [50, 51, 52]), seq(2, range(1, 9))   # 8 shared tokens; the same 8 alone
    s.add(b)
    s.add(c)
    batch = step(s)
    # a's decode, then b past its 2 cached blocks (3 tokens), then c: its 8 tokens are cached but its last one is
    # computed (its logits give the first token), so 1 block is used; the budget counts only computed tokens
    assert [(ch.seq.uid, ch.start, ch.length) for ch in batch.chunks] == [(0, 10, 1), (1, 8, 3), (2, 4, 2)]
    assert (b.num_cached_tokens, c.num_cached_tokens) == (8, 4)
    assert b.block_table[:2] == a.block_table[:2] and c.block_table[0] == a.block_table[0]
    assert [kv.allocator.ref_count(x) for x in a.block_table[:2]] == [3, 2]
    s.finish(a)
    assert [kv.allocator.ref_count(x) for x in b.block_table[:2]] == [2, 1]
    s.finish(b)
    s.finish(c)
    assert kv.allocator.num_free == 32 and kv.allocator.num_idle == kv.allocator.num_cached == 2
    assert (kv.queried_tokens, kv.hit_tokens) == (10 + 11 + 8, 0 + 8 + 4)


def test_off_shares_nothing():
    kv = KVCacheManager(32, BS, prefix_caching=False)
    s = Scheduler(kv, 64, 8)
    a, b = seq(0, range(1, 11)), seq(1, range(1, 11))
    s.add(a)
    step(s)
    s.add(b)
    assert step(s).chunks[1].start == 0 and b.num_cached_tokens == 0
    assert not set(a.block_table) & set(b.block_table) and kv.allocator.num_cached == 0
    assert (kv.queried_tokens, kv.hit_tokens) == (0, 0)


def test_preemption_releases_and_the_sequence_finds_its_prefix_again():
    kv = KVCacheManager(num_blocks=6, block_size=BS, prefix_caching=True)   # 24 tokens
    s = Scheduler(kv, max_batch_tokens=64, max_batch_seqs=8)
    a, b = seq(0, range(1, 10), max_new=6), seq(1, range(101, 110), max_new=6)
    s.add(a)
    s.add(b)
    for _ in range(4):                                       # 9-token prompts in 3 blocks each, then 3 decodes
        step(s)
    assert kv.allocator.num_free == 0 and a.num_computed == 12
    batch = step(s)                                          # a's 13th token needs a 4th block: b is preempted
    assert batch.preempted == [b] and b.num_computed == 0 and b.block_table == [] and b.num_generated == 4
    # b's 3 full blocks stayed cached; a's new block evicted the least recently used: b's last one
    assert kv.allocator.num_idle == 2
    batch = step(s)                                          # b's 2 cached blocks are idle: taking them leaves no
    assert [c.seq.uid for c in batch.chunks] == [0]          # room for its other 5 tokens, so it waits
    s.finish(a)
    batch = step(s)
    assert [(c.seq.uid, c.start, c.length) for c in batch.chunks] == [(1, 8, 5)]   # its own prefix, found again
    assert b.num_cached_tokens == 0 and kv.hit_tokens == 8   # cached_tokens is what it found when it first started
    s.finish(b)
    assert kv.allocator.num_free == 6


def test_prompt_logprobs_compute_every_prompt_position_not_scored():
    kv = KVCacheManager(32, BS, prefix_caching=True)
    s = Scheduler(kv, 64, 8)
    s.add(seq(0, range(1, 14)))
    step(s)
    wants = seq(1, range(1, 14), prompt_logprobs=[])
    assert wants.max_cached_tokens == 0 and kv.cached_prefix(wants) == []
    wants.prompt_logprobs = [None] * 9                       # scored up to token 9 before it was preempted
    assert wants.max_cached_tokens == 9 and len(kv.cached_prefix(wants)) == 2
    wants.prompt_logprobs = [None] * 12                      # the whole prompt is scored: only the last token left
    assert wants.max_cached_tokens == 12 and len(kv.cached_prefix(wants)) == 3


def test_admission_counts_the_blocks_a_request_needs():
    for caching, queued in ((True, 0), (False, 1)):
        kv = KVCacheManager(10, BS, prefix_caching=caching)
        s = Scheduler(kv, 64, 8)
        s.add(seq(0, range(1, 17)))
        step(s)                                              # 4 blocks held, 6 free
        new = seq(1, list(range(1, 17)) + list(range(50, 62)))   # 7 blocks, of which 4 are cached
        assert kv.blocks_to_start(new) == (3 if caching else 7)
        assert s.num_queued([new]) == queued


def _check_invariants(kv: KVCacheManager, live: list[Sequence]) -> None:
    refs, free, idle, cached = kv.allocator.state()
    holders = Counter(b for q in live for b in q.block_table)
    assert all(r >= 0 for r in refs)
    assert refs == [holders[b] for b in range(kv.num_blocks)]            # a reference per holding sequence
    assert not set(free) & set(idle) and len(set(free)) == len(free)     # never free twice, never free and idle
    assert all(refs[b] == 0 for b in free + idle)                        # never free (or idle) and referenced
    assert len(free) + len(idle) + sum(r > 0 for r in refs) == kv.num_blocks   # every block accounted for
    assert set(idle) <= set(cached.values()) and not set(free) & set(cached.values())
    assert len(set(cached.values())) == len(cached)
    for q in live:
        for i, b in enumerate(q.block_table):
            if refs[b] > 1:  # shared: full, and below what every holder has computed
                assert (i + 1) * kv.block_size <= q.num_computed


def _random_run(caching: bool, seed: int) -> dict[int, list[int]]:
    """A long random run of the scheduler on a small cache (preemption, eviction, aborts), with a fake model that
    writes each token into its KV slot and samples from what it reads back through the block table: a sequence's
    tokens are right only if every block it reads holds its own tokens. Checks the invariants after every step;
    returns the generated tokens of the sequences that finished."""
    rng, aborts = random.Random(seed), random.Random(seed + 100)  # the workload is the same whatever happens
    bases = [[rng.randrange(1, 4) for _ in range(n)] for n in (13, 8, 21)]  # small vocabulary: prefixes collide
    workload = []
    for _ in range(60):
        base = rng.choice(bases)
        prompt = base[: rng.randrange(len(base) + 1)] + [rng.randrange(1, 4) for _ in range(rng.randrange(1, 7))]
        workload.append((prompt, rng.randrange(1, 24), [] if rng.random() < 0.1 else None))
    arrivals = sorted(rng.sample(range(150), len(workload)))
    kv = KVCacheManager(num_blocks=16, block_size=BS, prefix_caching=caching)
    s = Scheduler(kv, max_batch_tokens=16, max_batch_seqs=8)
    slots: dict[int, tuple[int, int]] = {}                 # KV slot -> (token, position) written there
    seqs, done = [], {}
    for t in range(400):
        while len(seqs) < len(workload) and arrivals[len(seqs)] == t:
            prompt, max_new, prompt_logprobs = workload[len(seqs)]
            q = seq(len(seqs), prompt, max_new=max_new, prompt_logprobs=prompt_logprobs)
            seqs.append(q)
            s.add(q)
        batch = s.schedule()
        _, _, _, cached = kv.allocator.state()
        registered = set(cached.values())
        sampled = {}
        for c in batch.chunks:
            q = c.seq
            assert q.prompt_logprobs is None or q.num_cached_tokens == 0  # its prompt positions are all computed
            for pos in range(c.start, c.start + c.length):   # writes only into private, unregistered blocks
                b = q.block_table[pos // BS]
                assert kv.allocator.ref_count(b) == 1 and b not in registered
                slots[b * BS + pos % BS] = (q.token_ids[pos], pos)
            end = c.start + c.length
            read = [slots[q.block_table[p // BS] * BS + p % BS] for p in range(end)]
            assert read == [(q.token_ids[p], p) for p in range(end)]
            if c.samples:
                sampled[q.uid] = 1 + sum(tok * (p + 1) for tok, p in read) % 3
        s.update(batch, sampled)
        for q in list(s.running):
            if q.num_tokens >= q.max_total:
                done[q.uid] = q.generated_ids
                s.finish(q)
        if aborts.random() < 0.03 and len(s):                # an abort, running or waiting
            victim = aborts.choice(list(s.running) + list(s.waiting))
            s.finish(victim)
        _check_invariants(kv, list(s.running) + list(s.waiting))
    while len(s):
        step(s)
        for q in list(s.running):
            if q.num_tokens >= q.max_total:
                done[q.uid] = q.generated_ids
                s.finish(q)
    refs, free, idle, _ = kv.allocator.state()
    assert refs == [0] * kv.num_blocks and len(free) + len(idle) == kv.num_blocks
    if caching:
        assert s.num_preemptions and kv.hit_tokens and kv.allocator.num_evictions
    return done


def test_random_operations_keep_the_invariants_and_the_outputs():
    for seed in range(3):
        on, off = _random_run(True, seed), _random_run(False, seed)
        both = on.keys() & off.keys()
        assert len(both) > 20 and all(on[u] == off[u] for u in both)


# --- the real engine: caching on and off give the same outputs ---------------------------------------------------

STATE = {"kv_block_size": 8, "max_ragged_batch_size": 64}
GEN = dict(max_new_tokens=10, do_sample=False, ignore_eos=True, logprobs=3)


def _pipelines(model, **state):
    cfg = {"state_manager": {**STATE, **state}}
    on = mii.pipeline(str(model), dtype="float32", inference_engine_config=cfg)
    off = mii.pipeline(str(model), dtype="float32", inference_engine_config=cfg, enable_prefix_caching=False)
    return on, off


def _assert_same(a, b, atol=1e-4):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.token_ids == y.token_ids, f"request {i}: {x.token_ids} != {y.token_ids}"
        assert x == y  # text, counts, finish reason
        diffs = [abs(u["logprob"] - v["logprob"]) for u, v in zip(x.logprobs, y.logprobs)]
        assert max(diffs) < atol, f"request {i}: logprobs differ by {max(diffs)}"
        for u, v in zip(x.prompt_logprobs or (), y.prompt_logprobs or ()):
            assert u["token_id"] == v["token_id"] and (u["logprob"] is None) == (v["logprob"] is None)
            assert u["logprob"] is None or abs(u["logprob"] - v["logprob"]) < atol
        assert (x.prompt_logprobs is None) == (y.prompt_logprobs is None)


def _shared_prompts(vocab, seed=3):
    """Prompts on one 100-token base: prefixes block-aligned (16, 64, 96 with 8-token blocks) and not (37, 95),
    each with two different tails; the base's first 64 tokens alone (block-aligned, all cached but its last block)
    and its first 65."""
    base = prompts_for(vocab, (100,), seed=seed)[0]
    tails = prompts_for(vocab, (5, 11), seed=seed + 1)
    return [base[:k] + t for k in (16, 37, 64, 95, 96) for t in tails] + [base[:64], base[:65]]


def _common(a: list, b: list, limit: int) -> int:
    n = 0
    while n < min(len(a), len(b), limit) and a[n] == b[n]:
        n += 1
    return n


def test_on_and_off_give_the_same_outputs(tiny):
    on, off = _pipelines(tiny)
    try:
        assert on.engine.plan.prefix_caching and "prefix caching" in on.engine_plan.describe()
        assert not off.engine.plan.prefix_caching and "enable_prefix_caching=False" in off.engine_plan.describe()
        prompts = _shared_prompts(VOCAB)
        # one at a time: each finds what the ones before it left in the cache
        alone = [on(p, **GEN)[0] for p in prompts]
        _assert_same(alone, off(prompts, **GEN))
        # what each found: the longest run of full blocks computed before (of earlier prompts and their answers),
        # all but its last token (base[:64], block-aligned, finds 56: its last token's block is computed again)
        seen = [p + r.token_ids[:-1] for p, r in zip(prompts, alone)]
        expect = [max([_common(p, q, len(p) - 1) // 8 * 8 for q in seen[:i]], default=0) for i, p in enumerate(prompts)]
        assert [r.cached_tokens for r in alone] == expect and expect[-2] == 56 and min(expect[1:]) >= 16
        # all at once, new tails: sequences running together share the prefix as soon as it is computed
        again = [p[:-3] + [7, 8, 9] for p in prompts]
        _assert_same(on(again, **GEN), off(again, **GEN))
        # prompt logprobs: the prompt is computed in full (and the answer and its logprobs are the same)
        plp = dict(GEN, prompt_logprobs=2)
        with_plp = on(prompts[:4], **plp)
        assert [r.cached_tokens for r in with_plp] == [0] * 4
        _assert_same(with_plp, off(prompts[:4], **plp))
        kv = on.engine.kv
        assert kv.hit_tokens > 0 and kv.allocator.num_free == kv.num_blocks and off.engine.kv.allocator.num_cached == 0
    finally:
        on.destroy()
        off.destroy()


def test_on_and_off_agree_under_preemption_and_eviction(tiny):
    """A cache of 40 blocks of 8 tokens for 24 requests of 40-110 tokens: sequences are preempted and recomputed,
    cached blocks are evicted, and the outputs are those of a run without caching."""
    on, off = _pipelines(tiny, memory_config={"mode": "allocate", "size": 40})
    try:
        prompts = _shared_prompts(VOCAB) + _shared_prompts(VOCAB, seed=9)[:12]
        gen = dict(GEN, max_new_tokens=16)
        _assert_same(on(prompts, **gen), off(prompts, **gen))
        kv = on.engine.kv
        assert on.engine.num_preemptions > 0 and kv.allocator.num_evictions > 0 and kv.hit_tokens > 0
        assert kv.allocator.num_free == kv.num_blocks
    finally:
        on.destroy()
        off.destroy()


def test_sliding_window_on_and_off_agree(tmp_path, tokenizer_dir):
    """Mistral with a 16-token window and prompts of up to 110 tokens: cached blocks are read at their absolute
    positions, so the window masks them as it would have."""
    model = tiny_checkpoint(MistralConfig(vocab_size=VOCAB, sliding_window=16, **TINY), tmp_path, tokenizer_dir)
    on, off = _pipelines(model)
    try:
        prompts = _shared_prompts(VOCAB)
        first = [on(p, **GEN)[0] for p in prompts]
        assert sum(r.cached_tokens for r in first) > 0
        _assert_same(first, off(prompts, **GEN))
    finally:
        on.destroy()
        off.destroy()


def test_off_on_request(tiny):
    """enable_prefix_caching=False as a keyword (above) and in a model_config dict; a wrong type is a typed
    error naming the field."""
    pipe = mii.pipeline(model_config={"model_name_or_path": str(tiny), "dtype": "float32",
                                      "enable_prefix_caching": False})
    try:
        assert not pipe.engine.plan.prefix_caching and not pipe.engine.kv.prefix_caching
    finally:
        pipe.destroy()
    with pytest.raises(mii.errors.ValidationError, match="enable_prefix_caching"):
        mii.pipeline(str(tiny), enable_prefix_caching="sometimes")
