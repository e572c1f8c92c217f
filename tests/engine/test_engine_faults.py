"""The engine on a tiny random Llama under faults and at its limits: a request that fails inside a step costs only
itself, a bad seed or stop id is refused at admission, lengths past the context are typed errors, and the default
sampling seed is fresh entropy while an explicit one reproduces."""
import pytest

import mii
from mii.engine.requests import InputProcessor
from mii.errors import EngineStepError, PromptTooLongError, ValidationError
from tests.engine.conftest import VOCAB
from tests.reference import prompts_for


MARK = 666  # the seed that marks the request whose steps fail


@pytest.fixture
def faulty(pipe, monkeypatch):
    """The pipeline's runner fails any step that samples the marked request's fourth token or later; returns the
    sizes of the batches it was asked to run."""
    runner = pipe.engine.runner
    real, sizes = runner.run, []

    def run(batch):
        sizes.append(len(batch.chunks))
        if any(c.samples and c.seq.params.seed == MARK and c.seq.num_generated >= 3 for c in batch.chunks):
            raise IndexError("injected fault")
        return real(batch)

    monkeypatch.setattr(runner, "run", run)
    return sizes


def assert_engine_empty(engine):
    assert not engine.has_unfinished() and len(engine.scheduler) == 0
    assert engine.kv.allocator.num_free == engine.kv.num_blocks


def test_a_request_failing_in_a_step_costs_only_itself(pipe, faulty):
    """Five sequences share every step; the marked one makes its steps fail from its fourth token on. The step is
    run again in halves: the marked request ends with EngineStepError, the four others get exactly the tokens they
    get without it."""
    engine = pipe.engine
    prompts = prompts_for(VOCAB, lengths=(5, 12, 20, 9))
    kw = dict(max_new_tokens=10, do_sample=False, ignore_eos=True)
    expected = [r.token_ids for r in pipe(prompts, **kw)]
    faulty.clear()
    requests, _ = InputProcessor(pipe.tokenizer, engine.limits).process(prompts + [prompts[0]],
                                                                        dict(kw, seed=[1, 2, 3, 4, MARK]))
    uids = engine.add_requests(requests)
    tokens, errors = {u: [] for u in uids}, {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.error is not None:
                assert o.finished and o.uid not in errors
                errors[o.uid] = o.error
            else:
                tokens[o.uid] += o.token_ids
    assert list(errors) == [uids[4]]
    assert isinstance(errors[uids[4]], EngineStepError) and "IndexError: injected fault" in str(errors[uids[4]])
    assert [tokens[u] for u in uids[:4]] == expected
    assert len(tokens[uids[4]]) == 3
    assert max(faulty) == 5 and 1 in faulty  # the whole batch failed; the marked chunk was pinned down alone
    assert_engine_empty(engine)


def test_pipeline_call_with_a_failing_sequence_raises_and_others_go_on(pipe, faulty):
    """In `mii.pipeline`: the call that owns the failing sequence raises EngineStepError (its other samples are
    aborted), an interleaved call finishes with its full answer, and the engine is usable afterwards."""
    kw = dict(max_new_tokens=8, do_sample=False, ignore_eos=True)
    expected = pipe("Once upon a time", **kw)[0]
    good = pipe.stream("Once upon a time", **kw)
    bad = pipe.stream(["Hello", "there"], seed=MARK, **kw)
    text = next(good).generated_text
    with pytest.raises(EngineStepError, match="injected fault"):
        for _ in bad:
            text += next(good).generated_text
    text += "".join(c.generated_text for c in good)
    assert text == expected.generated_text
    assert_engine_empty(pipe.engine)
    assert pipe("Hello", **kw)[0].generated_length == 8


def test_replica_engine_loop_fails_only_the_call_that_owns_the_failing_sequence(pipe, faulty):
    """The replica's engine thread: the call whose sequence fails gets the EngineStepError (its other sequence is
    aborted), a call sharing the steps gets its full answer."""
    import asyncio

    from mii.serving.replica import EngineLoop, _Sink

    engine = pipe.engine
    inputs = InputProcessor(pipe.tokenizer, engine.limits)
    kw = dict(max_new_tokens=8, do_sample=False, ignore_eos=True)
    expected = pipe("Once upon a time", **kw)[0].token_ids
    thread = EngineLoop(engine)

    async def call(prompts, kwargs):
        sink = _Sink(asyncio.get_running_loop())
        thread.submit(inputs.process(prompts, kwargs)[0], sink)
        kind, uids = await sink.queue.get()
        assert kind == "added"
        tokens, done = {u: [] for u in uids}, set()
        while len(done) < len(uids):
            kind, value = await asyncio.wait_for(sink.queue.get(), 60)
            if kind == "error":
                return value
            for o in value:
                tokens[o.uid] += o.token_ids
                if o.finished:
                    done.add(o.uid)
        return [tokens[u] for u in uids]

    async def both():
        return await asyncio.gather(call(["Once upon a time"], kw), call(["Hello", "there"], dict(kw, seed=MARK)))

    thread.start()
    try:
        good, bad = asyncio.run(both())
    finally:
        thread.stop()
    assert good == [expected]
    assert isinstance(bad, EngineStepError) and "injected fault" in str(bad)
    assert_engine_empty(engine)


@pytest.mark.parametrize("kwargs, words", [
    (dict(seed=2**63 - 1, n=2, do_sample=True), "seed: must be <= 9223372036854775806"),
    (dict(seed=2**64), "seed: must be <= 9223372036854775807"),
    (dict(stop_token_ids=[VOCAB + 5], min_new_tokens=2), f"stop_token_ids: token id {VOCAB + 5} is outside"),
    (dict(temperature=float("nan")), "temperature: must be a finite number"),
])
def test_values_that_used_to_fail_inside_a_step_are_refused_at_admission(pipe, kwargs, words):
    """Issue 10: these raised inside `engine.step()` (int64 overflow in the sampler's seeds, an index past the
    vocabulary in the EOS ban) or sampled garbage (NaN); now a typed error before anything is queued."""
    with pytest.raises(ValidationError, match=words):
        pipe(["Hello", "there"], max_new_tokens=4, **kwargs)
    assert_engine_empty(pipe.engine)
    # the largest seed that fits, with n samples, runs
    outs = pipe("Hello", max_new_tokens=4, seed=2**63 - 2, n=2, do_sample=True, ignore_eos=True)
    assert [o.generated_length for o in outs] == [4, 4]


def test_length_past_the_context_is_a_typed_error(pipe):
    ctx = pipe.engine.limits.max_context
    assert ctx == 1024  # the tiny model's positions
    prompt = [7] * 1000
    with pytest.raises(PromptTooLongError) as e:
        pipe([prompt], max_new_tokens=25)
    assert str(e.value) == ("prompt: This model's maximum context length is 1024 tokens. However, you requested 1025 "
                            "tokens (1000 in the prompt, 25 for the completion). Please reduce the length of the "
                            "prompt or of the completion.")
    with pytest.raises(PromptTooLongError, match="However, you requested 1100 tokens"):
        pipe([prompt], max_length=1100)
    out = pipe([prompt], max_new_tokens=24, ignore_eos=True, do_sample=False)[0]
    assert out.generated_length == 24 and out.finish_reason == "length"
    # without an explicit length, the rest of the context
    out = pipe([[7] * 1010], ignore_eos=True, do_sample=False)[0]
    assert out.prompt_length + out.generated_length == 1024 and out.finish_reason == "length"


def test_what_could_never_run_is_a_validation_error(tiny):
    """A KV cache of 20 blocks of 8 tokens holds 160 tokens: that is the engine's context, and a longer prompt is
    a 400-class error (PromptTooLongError), not a KV cache error that a client would retry; so is a call with more
    sequences than the engine tracks."""
    small = mii.pipeline(str(tiny), dtype="float32", inference_engine_config={"state_manager": {
        "kv_block_size": 8, "memory_config": {"mode": "allocate", "size": 20}, "max_tracked_sequences": 4}})
    try:
        with pytest.raises(ValidationError, match="make 6 sequences; this engine holds at most 4"):
            small(["a", "b", "c"], n=2, max_new_tokens=2)
        assert len(small(["a", "b"], n=2, max_new_tokens=2)) == 4
        assert small.engine.limits.max_context == 160 and "KV cache" in small.engine_plan.reasons["max context"]
        with pytest.raises(PromptTooLongError, match="maximum context length is 160 tokens"):
            small([[7] * 170], max_new_tokens=2)
        out = small([[7] * 150], ignore_eos=True, do_sample=False)[0]
        assert out.prompt_length + out.generated_length == 160
    finally:
        small.destroy()


def test_default_seed_is_fresh_entropy_and_an_explicit_seed_reproduces(tiny):
    """ModelConfig.seed=None: two pipelines (two runs, two replicas) sample differently; the same explicit seed
    gives the same samples. Three 32-token samples from a near-uniform random model over 49152 tokens: two runs
    agree by chance with probability ~ 49152**-96."""
    prompts = prompts_for(VOCAB, lengths=(5, 9, 13))

    def samples(**config):
        p = mii.pipeline(str(tiny), dtype="float32", **config)
        try:
            return [o.token_ids for o in p(prompts, max_new_tokens=32, do_sample=True, temperature=1.0, top_p=1.0,
                                            ignore_eos=True)]
        finally:
            p.destroy()

    assert samples() != samples()
    assert samples(seed=5) == samples(seed=5) != samples(seed=6)
