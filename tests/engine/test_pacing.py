"""`itl_target_ms` (`mii.engine.pacing`): the streams' latency averages, the learned step costs, the cap they give a
step's prompt chunks, and a pipeline on a tiny random Llama run on a simulated clock, with and without a target."""
import random

import pytest

import mii
from mii.engine import pacing
from mii.engine.kv_cache import KVCacheManager
from mii.engine.pacing import Pacer, StepCosts, StreamGaps
from mii.engine.requests import InputProcessor
from mii.engine.scheduler import Scheduler
from mii.engine.sequence import Sequence
from mii.errors import ValidationError
from tests.engine.conftest import VOCAB
from tests.reference import prompts_for


def ema_by_definition(gaps, span=16):
    """pandas' `ewm(span).mean()` with adjust=True at the last gap: weights (1 - a)^(n - i) over all gaps."""
    a = 2 / (span + 1)
    n = len(gaps)
    weights = [(1 - a) ** (n - 1 - i) for i in range(n)]
    return sum(w * g for w, g in zip(weights, gaps)) / sum(weights)


def test_stream_gaps_are_fastgens_average_and_say_the_longest_next_gap():
    gaps = [0.004, 0.006, 0.2, 0.005, 0.005, 0.03, 0.004]
    g, now = StreamGaps(10.0), 10.0
    for i, gap in enumerate(gaps):
        now += gap
        g.add(now)
        assert g.mean == pytest.approx(ema_by_definition(gaps[: i + 1]))
        longest = g.longest_gap(0.05)
        # exactly that gap next puts the average on the target, a longer one over it (after the 200 ms gap: none fits)
        assert ema_by_definition(gaps[: i + 1] + [longest]) == pytest.approx(0.05)
        assert ema_by_definition(gaps[: i + 1] + [longest + 1e-4]) > 0.05
    assert StreamGaps(0.0).longest_gap(0.05) == 0.05  # a new stream's first gap is its whole average


def test_step_costs_interpolate_extrapolate_and_never_decrease():
    c = StepCosts()
    assert c.predict(c.points(), 100) == 0.0  # nothing seen: no cap yet (the first steps learn)
    c.record(1, 0.004)
    c.record(64, 0.050)
    pts = c.points()
    assert c.predict(pts, 1) == 0.004
    assert c.predict(pts, 32) == pytest.approx(0.004 + 0.046 * 31 / 63)
    assert c.predict(pts, 128) == pytest.approx(0.100)  # past the largest seen: its time per row
    c.record(16, 0.002)  # a noisy small step: a bigger step is never predicted faster than a smaller one
    assert [t for _, t in c.points()] == [0.004, 0.004, 0.050]
    c.record(1, 0.008)  # a bin's mean follows new steps by COST_WEIGHT
    assert c.points()[0][1] == pytest.approx(0.004 + pacing.COST_WEIGHT * 0.004)
    pts = c.points()
    for base in (1, 3, 9):
        for seconds in (0.0, 0.004, 0.011, 0.03, 0.07, 1.0):
            brute = max([k for k in range(200) if c.predict(pts, base + k) <= seconds], default=0)
            assert c.most_rows(base, 199, seconds) == brute


class _Seq:
    def __init__(self, uid):
        self.uid = uid


def _pacer_with_costs(target_ms=20.0):
    p = Pacer(target_ms)
    p.costs.record(1, 0.004)
    p.costs.record(128, 0.132)  # 0.004 + 0.001 a row more
    return p


def test_a_young_stream_lets_through_less_than_one_with_short_gaps():
    p = _pacer_with_costs()
    assert p.share() == pytest.approx(1 / 1.3)  # no error seen yet: a spread of 0.1 assumed
    a = _Seq(1)
    p.observe(200, [1], started=0.0, now=0.2)  # a's prompt step gave its first token
    assert p.prompt_cap([], 500, now=0.2) is None  # no stream: no cap
    # a's first gap must stay within 20 ms: the share of it planned (~0.77) is ~15.5 ms of step, 1 decode row + 11
    # prompt rows
    assert p.prompt_cap([a], 500, now=0.2) == p.costs.most_rows(1, 500, p.share() * 0.020) == 11
    t = 0.2
    for _ in range(30):  # 30 gaps of 4 ms: the average has room for a long step
        t += 0.004
        p.observe(1, [1], started=t - 0.004, now=t)
    room = p.gaps[1].longest_gap(0.020)
    assert room > 0.1
    assert p.prompt_cap([a], 500, now=t) == p.costs.most_rows(1, 500, p.share() * room) > 64
    # time already passed since a's last token counts against the room
    assert p.prompt_cap([a], 500, now=t + 0.05) < p.prompt_cap([a], 500, now=t)


def test_the_share_of_the_room_follows_the_predictions_error():
    """Steps as predicted: the whole room; steps 1.5x their prediction: two thirds; steps that scatter: less."""
    steady, late, scattered = _pacer_with_costs(), _pacer_with_costs(), _pacer_with_costs()
    rng = random.Random(0)
    for _ in range(200):
        steady.observe(128, [], started=0.0, now=0.132)
        late.observe(128, [], started=0.0, now=0.132 * 1.5)
        late.costs.bins[(128).bit_length()][1] = 0.132  # (keep its prediction where it was)
        scattered.observe(128, [], started=0.0, now=0.132 * rng.choice([0.7, 1.3]))
    assert steady.share() == pytest.approx(1.0, abs=0.01)
    assert late.share() == pytest.approx(1 / 1.5, rel=0.02)
    assert 0.5 <= scattered.share() < 0.65


def test_a_stream_far_over_the_target_does_not_hold_the_others():
    p = _pacer_with_costs()
    a, b = _Seq(1), _Seq(2)
    p.observe(10, [1, 2], started=0.0, now=0.01)
    p.observe(2, [1, 2], started=0.01, now=0.014)
    p.observe(2, [1], started=0.014, now=0.5)  # b preempted or stalled: a's gap is 486 ms
    assert p.gaps[1].mean > 2 * p.target
    assert p.prompt_cap([a, b], 500, now=0.5) == p.prompt_cap([b], 500, now=0.5)
    p.forget(2)
    assert p.prompt_cap([a], 500, now=0.5) is None and 2 not in p.gaps


def test_the_scheduler_caps_prompt_chunks_only_beside_decode_tokens():
    kv = KVCacheManager(100, 4)
    s = Scheduler(kv, max_batch_tokens=64, max_batch_seqs=8)
    a, b = Sequence(0, [1, 2, 3], 50), Sequence(1, list(range(1, 41)), 80)
    s.add(a)
    first = s.schedule(prompt_cap=0)  # nothing decodes yet: the cap does not apply
    assert [(c.seq.uid, c.length) for c in first.chunks] == [(0, 3)]
    s.update(first, {0: 7})
    s.add(b)
    assert s.decoding() == [a] and s.has_prompts()
    batch = s.schedule(prompt_cap=5)
    assert [(c.seq.uid, c.length, c.samples) for c in batch.chunks] == [(0, 1, True), (1, 5, False)]
    s.update(batch, {0: 7})
    batch = s.schedule(prompt_cap=0)
    assert [(c.seq.uid, c.length) for c in batch.chunks] == [(0, 1)]
    s.update(batch, {0: 7})
    s.update(s.schedule(), {0: 7, 1: 7})  # no cap: b's 35 prompt tokens left fit the budget
    assert not s.has_prompts() and s.decoding() == [a, b]


def test_bad_targets_are_refused_by_name():
    for value, words in [(0, "greater than 0"), (float("inf"), "finite number"), (-5, "greater than 0")]:
        with pytest.raises(ValidationError, match=f"itl_target_ms.*{words}"):
            mii.pipeline("no/such/model", inference_engine_config={"state_manager": {"itl_target_ms": value}})


class _Clock:
    """perf_counter for the engine: a step costs 2 ms + 1 ms a row (the runner advances it)."""
    def __init__(self):
        self.now = 100.0

    def perf_counter(self):
        return self.now


def _run_on_clock(pipe, monkeypatch, prompts, arrivals, kw):
    """Run `prompts` through the engine, adding prompt i once `arrivals[i]` steps have run; every step advances the
    simulated clock by its cost. Returns (tokens by prompt, token times by prompt, step row counts)."""
    engine, clock = pipe.engine, _Clock()
    monkeypatch.setattr("mii.engine.engine.time", clock)
    real, rows = engine.runner.run, []

    def run(batch):
        rows.append(batch.num_tokens)
        clock.now += 0.002 + 0.001 * batch.num_tokens
        return real(batch)

    monkeypatch.setattr(engine.runner, "run", run)
    inputs = InputProcessor(pipe.tokenizer, engine.limits)
    uids, tokens, times, steps = {}, {}, {}, 0
    while len(uids) < len(prompts) or engine.has_unfinished():
        for i, at in enumerate(arrivals):
            if at == steps and i not in uids:
                (uids[i],) = engine.add_requests(inputs.process([prompts[i]], kw)[0])
        for o in engine.step():
            i = next(k for k, u in uids.items() if u == o.uid)
            tokens.setdefault(i, []).extend(o.token_ids)
            times.setdefault(i, []).append(clock.now)
        steps += 1
    monkeypatch.undo()
    return [tokens[i] for i in range(len(prompts))], [times[i] for i in range(len(prompts))], rows


def _worst_average(times):
    gaps = [b - a for a, b in zip(times, times[1:])]
    return max(ema_by_definition(gaps[: i + 1]) for i in range(len(gaps)))


def test_streams_keep_the_target_while_long_prompts_arrive(tiny, monkeypatch):
    """One stream decodes; prompts of 200 and 150 tokens arrive while it runs, then a short one. Without a target,
    a 200-token prompt step holds the stream ~200 ms; with a 20 ms target every stream's average stays within it
    at every token, the prompts still complete, and every request gets the same tokens (fp32: batching does not
    change them)."""
    prompts = prompts_for(VOCAB, lengths=(6, 200, 150, 9))
    arrivals, kw = [0, 3, 25, 26], dict(max_new_tokens=40, do_sample=False, ignore_eos=True)
    plain = mii.pipeline(str(tiny), dtype="float32", enable_prefix_caching=False)
    paced = mii.pipeline(str(tiny), dtype="float32", enable_prefix_caching=False,
                         inference_engine_config={"state_manager": {"itl_target_ms": 20}})
    try:
        assert plain.engine.pacer is None and paced.engine.plan.itl_target_ms == 20
        assert "inter-token latency within 20 ms" in paced.engine.plan.describe()
        expected = [r.token_ids for r in plain(prompts, **kw)]
        tokens, times, rows = _run_on_clock(plain, monkeypatch, prompts, arrivals, kw)
        assert tokens == expected
        assert _worst_average(times[0]) > 0.05  # the 200-token prompt in one step: the test can fail
        tokens, times, paced_rows = _run_on_clock(paced, monkeypatch, prompts, arrivals, kw)
        assert tokens == expected
        for t in times:
            assert _worst_average(t) <= 0.020
        assert max(paced_rows) < max(rows) and sum(paced_rows) == sum(rows)
    finally:
        plain.destroy()
        paced.destroy()
