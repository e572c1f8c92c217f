"""Allocator and Dynamic SplitFuse scheduler, without a model: a fake runner samples token 7 for every
sequence whose chunk reaches its end."""
import pytest

from mii.engine.kv_cache import BlockAllocator, KVCacheManager
from mii.engine.scheduler import Scheduler
from mii.engine.sequence import Sequence, SeqStatus
from mii.errors import KVCacheError


def seq(uid, prompt_len, max_new=100):
    return Sequence(uid, list(range(1, prompt_len + 1)), max_total=prompt_len + max_new)


def run_step(s: Scheduler):
    batch = s.schedule()
    s.update(batch, {c.seq.uid: 7 for c in batch.chunks if c.samples})
    return batch


def test_allocator_free_list_and_validation():
    a = BlockAllocator(4)
    got = a.allocate(3)
    assert sorted(got) == [0, 1, 2] and a.num_free == 1
    with pytest.raises(KVCacheError):
        a.allocate(2)
    assert a.num_free == 1  # a failed call changes nothing
    a.free([got[0]])
    with pytest.raises(KVCacheError, match="not allocated"):
        a.free([got[0]])
    with pytest.raises(KVCacheError):
        a.free([99])
    assert a.num_free == 2


def test_kv_manager_grows_by_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    s = seq(0, 5)
    assert kv.blocks_for(s, 5) == 2
    assert kv.grow(s, 5) and len(s.block_table) == 2
    s.num_computed = 5
    assert kv.blocks_for(s, 3) == 0 and kv.blocks_for(s, 4) == 1
    kv.release(s)
    assert s.block_table == [] and kv.allocator.num_free == 10


def test_budget_respected_and_long_prompt_chunked():
    kv = KVCacheManager(100, 4)
    s = Scheduler(kv, max_batch_tokens=16, max_batch_seqs=8)
    long = seq(0, 40)
    s.add(long)
    sizes = []
    while long.num_generated == 0:
        b = run_step(s)
        assert b.num_tokens <= 16
        sizes.append([(c.start, c.length, c.samples) for c in b.chunks])
    assert sizes == [[(0, 16, False)], [(16, 16, False)], [(32, 8, True)]]
    assert long.num_computed == 40 and long.token_ids[-1] == 7


def test_decode_first_then_prompt_chunks_fcfs():
    kv = KVCacheManager(100, 4)
    s = Scheduler(kv, max_batch_tokens=10, max_batch_seqs=8)
    a, b = seq(0, 3), seq(1, 3)
    s.add(a); s.add(b)
    run_step(s)  # both prompts fit: 6 tokens
    assert a.num_generated == b.num_generated == 1
    c, d = seq(2, 20), seq(3, 5)
    s.add(c); s.add(d)
    batch = run_step(s)
    kinds = [(ch.seq.uid, ch.length) for ch in batch.chunks]
    # two decode tokens first, then 8 tokens of the older waiting prompt; the newer one waits
    assert kinds == [(0, 1), (1, 1), (2, 8)]
    assert d.status is SeqStatus.WAITING


def test_sequence_cap():
    kv = KVCacheManager(100, 4)
    s = Scheduler(kv, max_batch_tokens=100, max_batch_seqs=2)
    for i in range(3):
        s.add(seq(i, 2))
    assert len(run_step(s).chunks) == 2


def test_preemption_frees_blocks_and_recomputes():
    kv = KVCacheManager(num_blocks=4, block_size=4)  # 16 tokens in all
    s = Scheduler(kv, max_batch_tokens=64, max_batch_seqs=8)
    a, b = seq(0, 7, max_new=8), seq(1, 7, max_new=8)
    s.add(a); s.add(b)
    run_step(s)                       # prompts: 7 tokens each in 2 blocks: the cache is full
    run_step(s)                       # decode at position 7 still fits in the 2nd block
    assert kv.allocator.num_free == 0
    batch = run_step(s)               # a's next token needs a 3rd block: b (newest) is preempted
    assert batch.preempted == [b] and b.status is SeqStatus.WAITING and b.num_computed == 0
    assert b.block_table == [] and b.num_generated == 2  # generated tokens kept
    assert [c.seq.uid for c in batch.chunks] == [0]
    s.finish(a)
    assert kv.allocator.num_free == 4
    batch = run_step(s)               # b is recomputed from prompt + generated tokens in one chunk
    assert [(c.seq.uid, c.start, c.length, c.samples) for c in batch.chunks] == [(1, 0, 9, True)]
    assert b.num_generated == 3


def test_finish_returns_blocks_for_waiting_and_running():
    kv = KVCacheManager(10, 4)
    s = Scheduler(kv, max_batch_tokens=4, max_batch_seqs=8)
    a, b = seq(0, 12), seq(1, 3)
    s.add(a); s.add(b)
    run_step(s)  # a holds a partial prompt
    assert a.status is SeqStatus.RUNNING and kv.allocator.num_free == 9
    s.finish(a); s.finish(b)
    assert kv.allocator.num_free == 10 and len(s) == 0


def test_no_deadlock_when_prompts_fill_the_cache():
    kv = KVCacheManager(num_blocks=6, block_size=4)  # 24 tokens
    s = Scheduler(kv, max_batch_tokens=8, max_batch_seqs=8)
    seqs = [seq(i, 10, max_new=2) for i in range(4)]
    for q in seqs:
        s.add(q)
    for _ in range(200):
        batch = run_step(s)
        for q in seqs:
            if q.status is SeqStatus.RUNNING and q.num_tokens >= q.max_total:
                s.finish(q)
        if all(q.status is SeqStatus.FINISHED for q in seqs):
            break
    assert all(q.status is SeqStatus.FINISHED for q in seqs)
    assert all(q.token_ids[10:] == [7, 7] for q in seqs)
    assert kv.allocator.num_free == 6


def test_num_queued_counts_what_finds_no_room():
    """Admission bounds sequences that would wait for room, not those that arrived since the last step: a burst
    into an idle engine that fits its running slots and KV blocks queues nothing."""
    kv = KVCacheManager(10, 4)  # 40 tokens
    s = Scheduler(kv, max_batch_tokens=8, max_batch_seqs=3)
    new = lambda *lengths: [seq(100 + i, n) for i, n in enumerate(lengths)]
    assert s.num_queued(new(4, 4, 4)) == 0           # 3 slots, 3 of 10 blocks
    assert s.num_queued(new(4, 4, 4, 4)) == 1        # a 4th finds no slot
    assert s.num_queued(new(20, 20, 4)) == 1         # 5 + 5 blocks fill the cache
    assert s.num_queued(new(20, 24, 4)) == 2         # 6 blocks do not fit; first come first served: nor does 4
    for i in range(3):
        s.add(seq(i, 4))
    assert s.num_queued() == 0 and len(s.waiting) == 3  # waiting, but about to run: not queued
    run_step(s)                                          # budget 8: two start, the third still waits
    assert len(s.running) == 2 and s.num_queued() == 0 and s.num_queued(new(4)) == 1
