"""`mii.pipeline` on the embedded SmolLM2 (fp32, dequantized): reference match, invariance, sampling, stops, streaming."""
from pathlib import Path

import pytest
import torch

import mii
from tests.reference import compare_greedy, hf_greedy

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def chat_prompt(default_pipe):
    return default_pipe.apply_chat_template(QUESTION)


def mixed_prompts(pipe, n=16):
    words = "the quick brown fox jumps over a lazy dog while seven bright stars shine above the quiet sea".split()
    texts = [" ".join(words[: 3 + (i * 5) % 17]) * (1 + i % 4) for i in range(n)]
    return texts


def test_smollm2_greedy_matches_transformers(default_pipe, default_model_path, chat_prompt):
    from transformers import AutoModelForCausalLM

    path = Path(default_model_path)
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tok = default_pipe.tokenizer
    prompts = [tok.encode(p) for p in (chat_prompt, "The history of Paris", "def fibonacci(n):\n    ")]
    ref = hf_greedy(None, prompts, 32, hf_model=hf)
    compare_greedy(default_pipe, prompts, ref, 32, atol=2e-3)


def test_capital_of_france(default_pipe, chat_prompt):
    out = default_pipe(chat_prompt, max_new_tokens=30, do_sample=False)[0]
    assert "Paris" in out.generated_text
    assert out.finish_reason == "stop" and out.prompt_length == len(default_pipe.tokenizer.encode(chat_prompt))


def assert_same_responses(got, want, atol: float = 1e-4):
    """Text, counts and finish reason (`Response.__eq__`), and also token ids and logprobs, which `==` ignores.
    Log-probabilities may differ in the last digits between batch shapes (fp32 sums in another order)."""
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a == b, f"sequence {i}"
        assert a.token_ids == b.token_ids and len(a.token_ids) == a.generated_length, f"sequence {i}"
        assert (a.logprobs is None) == (b.logprobs is None), f"sequence {i}"
        if a.logprobs is None:
            continue
        assert len(a.logprobs) == len(b.logprobs) == a.generated_length, f"sequence {i}"
        for step, (x, y) in enumerate(zip(a.logprobs, b.logprobs)):
            assert x["token_id"] == y["token_id"] and abs(x["logprob"] - y["logprob"]) < atol, f"{i} step {step}"
            assert len(x["top_logprobs"]) == len(y["top_logprobs"]), f"sequence {i} step {step}"
            xs, ys = (sorted(d.values(), reverse=True) for d in (x["top_logprobs"], y["top_logprobs"]))
            assert all(abs(u - v) < atol for u, v in zip(xs, ys)), f"sequence {i} step {step}: {xs} != {ys}"


@pytest.mark.parametrize("quant", ["none", "auto"])
def test_invariance_batch_chunking_preemption(default_pipe, chat_prompt, quant):
    """The same greedy tokens and (within 1e-4) logprobs alone, batched with 15 other prompts, with a 16-token
    step budget (prompts chunked), and with a KV cache so small that sequences are preempted and recomputed; with
    the weights dequantized and with the GGUF's int4/int8 blocks (the default). Their kernel rounds x to int16 on
    every path alike, but an fp32 summation-order difference upstream (a batched prompt's attention) can move a
    value across a rounding step, 2^-15 of the largest value of its 32 (large where an outlier channel sits among
    them), and 30 layers carry that on: the tokens are the same, logprobs agree within 5e-3 there."""
    kwargs = dict(max_new_tokens=40, do_sample=False, logprobs=5)
    atol = 1e-4 if quant == "none" else 5e-3
    pipe = default_pipe if quant == "none" else mii.pipeline(dtype="float32", quantization=quant)
    try:
        alone = pipe(chat_prompt, **kwargs)
        prompts = mixed_prompts(pipe)
        prompts[5] = chat_prompt
        batched = pipe(prompts, **kwargs)
    finally:
        if pipe is not default_pipe:
            pipe.destroy()
    assert_same_responses(batched[5:6], alone, atol)
    small_budget = mii.pipeline(dtype="float32", quantization=quant,
                                inference_engine_config={"state_manager": {"max_ragged_batch_size": 16}})
    try:
        assert_same_responses(small_budget(prompts, **kwargs), batched, atol)
    finally:
        small_budget.destroy()
    # 24 blocks of 8 tokens: the 16 prompts cannot all stay in the cache, so sequences are preempted and recomputed
    tiny_kv = mii.pipeline(dtype="float32", quantization=quant, inference_engine_config={"state_manager": {
        "kv_block_size": 8, "memory_config": {"mode": "allocate", "size": 24}}})
    try:
        again = tiny_kv(prompts, **kwargs)
        assert tiny_kv.engine.scheduler.num_preemptions > 0
        assert_same_responses(again, batched, atol)
        assert tiny_kv.engine.kv.allocator.num_free == 24
    finally:
        tiny_kv.destroy()


def test_seeded_sampling(default_pipe, chat_prompt):
    kw = dict(max_new_tokens=24, do_sample=True, temperature=1.0, top_p=0.95)
    a = default_pipe([chat_prompt], seed=123, **kw)[0]
    b = default_pipe([chat_prompt, "Once upon a time"], seed=123, **kw)[0]  # other company, same seed
    c = default_pipe([chat_prompt], seed=124, **kw)[0]
    d = default_pipe([chat_prompt], seed=125, **kw)[0]
    e = default_pipe([chat_prompt], seed=-123, **kw)[0]  # negative seeds too (vLLM takes any int64)
    f = default_pipe([chat_prompt, "Once upon a time"], seed=-123, **kw)[0]
    assert a.generated_text == b.generated_text and e.generated_text == f.generated_text
    assert len({a.generated_text, c.generated_text, d.generated_text, e.generated_text}) == 4


def test_sampling_follows_the_distribution(default_pipe):
    """top_k=2 sampling of one token, many seeds: only the two most likely tokens appear, in roughly their odds."""
    prompt = "My favourite colour is"
    out = default_pipe([prompt], max_new_tokens=1, do_sample=False, logprobs=2)[0]
    top = out.logprobs[0]["top_logprobs"]
    (t1, l1), (t2, l2) = sorted(top.items(), key=lambda kv: -kv[1])
    p1 = torch.tensor([l1, l2]).softmax(0)[0].item()
    outs = default_pipe([prompt] * 200, max_new_tokens=1, do_sample=True, top_k=2, top_p=1.0, temperature=1.0,
                        seed=list(range(200)))
    ids = [o.token_ids[0] for o in outs]
    assert set(ids) <= {t1, t2}
    assert abs(ids.count(t1) / 200 - p1) < 0.12


def test_stop_string_spanning_tokens(default_pipe, chat_prompt):
    tok = default_pipe.tokenizer
    full = default_pipe(chat_prompt, max_new_tokens=30, do_sample=False)[0]
    ids = full.token_ids
    # a stop string made of the end of one token and the start of the next
    pieces = [tok.decode(ids[: i + 1]) for i in range(len(ids))]
    i = next(i for i in range(1, len(ids)) if len(pieces[i]) - len(pieces[i - 1]) >= 2 and len(pieces[i - 1]) >= 2)
    stop = pieces[i - 1][-2:] + pieces[i][len(pieces[i - 1]): len(pieces[i - 1]) + 1]
    cut = full.generated_text.index(stop)
    out = default_pipe(chat_prompt, max_new_tokens=30, do_sample=False, stop=[stop, "no such text"])[0]
    assert out.generated_text == full.generated_text[:cut]
    assert out.finish_reason == "stop"
    streamed = "".join(c.generated_text for c in default_pipe.stream(chat_prompt, max_new_tokens=30, do_sample=False, stop=stop))
    assert streamed == out.generated_text


def test_finish_reasons_and_lengths(default_pipe, chat_prompt):
    eos = default_pipe(chat_prompt, max_new_tokens=30, do_sample=False)[0]
    assert eos.finish_reason == "stop" and eos.generated_length == len(eos.token_ids) < 30
    length = default_pipe(chat_prompt, max_new_tokens=3, do_sample=False)[0]
    assert length.finish_reason == "length" and length.generated_length == 3
    n_prompt = length.prompt_length
    by_max_length = default_pipe(chat_prompt, max_length=n_prompt + 4, do_sample=False)[0]
    assert by_max_length.finish_reason == "length" and by_max_length.generated_length == 4
    stop_id = eos.token_ids[2]
    by_id = default_pipe(chat_prompt, max_new_tokens=30, do_sample=False, stop_token_ids=[stop_id])[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == eos.token_ids[:3]
    longer = default_pipe(chat_prompt, max_new_tokens=30, min_new_tokens=len(eos.token_ids) + 3, do_sample=False)[0]
    assert longer.generated_length >= len(eos.token_ids) + 3
    ignore = default_pipe(chat_prompt, max_new_tokens=len(eos.token_ids) + 3, ignore_eos=True, do_sample=False)[0]
    assert ignore.finish_reason == "length" and ignore.token_ids[: len(eos.token_ids)] == eos.token_ids


def test_streaming_concatenates(default_pipe, chat_prompt):
    prompts = [chat_prompt, "Tell me about the moon. The moon"]
    full = default_pipe(prompts, max_new_tokens=20, do_sample=False)
    chunks = list(default_pipe.stream(chat_prompt, max_new_tokens=20, do_sample=False))
    assert all(isinstance(c, mii.Response) for c in chunks)
    assert "".join(c.generated_text for c in chunks) == full[0].generated_text
    assert [c.finish_reason for c in chunks[:-1]] == ["none"] * (len(chunks) - 1)
    assert chunks[-1].finish_reason == full[0].finish_reason
    texts = ["", ""]
    for step in default_pipe.stream(prompts, max_new_tokens=20, do_sample=False):
        assert isinstance(step, list) and len(step) == 2
        for i, r in enumerate(step):
            texts[i] += r.generated_text
    assert texts == [r.generated_text for r in full]


def test_token_id_prompts_full_text_and_per_prompt_params(default_pipe, chat_prompt):
    ids = default_pipe.tokenizer.encode("The Eiffel Tower is")
    a = default_pipe(ids, max_new_tokens=8, do_sample=False)[0]
    b = default_pipe("The Eiffel Tower is", max_new_tokens=8, do_sample=False)[0]
    assert_same_responses([a], [b])
    assert a.prompt_length == len(ids)
    full = default_pipe("The Eiffel Tower is", max_new_tokens=8, do_sample=False, return_full_text=True)[0]
    assert full.generated_text == "The Eiffel Tower is" + b.generated_text
    outs = default_pipe([ids, chat_prompt], max_new_tokens=[3, 5], do_sample=False, ignore_eos=True)
    assert [o.generated_length for o in outs] == [3, 5]
    assert str(outs[0]) == outs[0].generated_text


def test_penalties_and_logprobs(default_pipe):
    prompt = "one two one two one two one two"
    plain = default_pipe(prompt, max_new_tokens=12, do_sample=False, logprobs=3)[0]
    assert len(plain.logprobs) == 12 and all(len(x["top_logprobs"]) == 3 for x in plain.logprobs)
    assert all(x["logprob"] <= 0 for x in plain.logprobs)
    penalized = default_pipe(prompt, max_new_tokens=12, do_sample=False, repetition_penalty=1.8)[0]
    assert penalized.token_ids != plain.token_ids
    freq = default_pipe(prompt, max_new_tokens=12, do_sample=False, frequency_penalty=2.0, presence_penalty=1.0)[0]
    assert len(set(freq.token_ids)) > len(set(plain.token_ids))
    # a penalty that is 0 in float32 (it is > 0 as given): seen tokens with a positive logit win, sampled or not
    for kw in (dict(do_sample=False), dict(do_sample=True, top_p=0.9, seed=1)):
        near_zero = default_pipe(prompt, max_new_tokens=6, repetition_penalty=5e-324, **kw)[0]
        ids = default_pipe.tokenizer(prompt)["input_ids"]
        assert near_zero.generated_length == 6 and set(near_zero.token_ids) <= set(ids), near_zero.token_ids


def test_mii_compatibility_forms(default_model_path):
    pipe = mii.pipeline(model_config={"model_name_or_path": default_model_path, "task": "text-generation",
                                      "tensor_parallel": 1, "device_map": mii.config.DEVICE_MAP_DEFAULT,
                                      "dtype": "float32"})
    try:
        assert mii.TaskType.TEXT_GENERATION == "text-generation" and mii.DeploymentType.LOCAL == "local"
        out = pipe("DeepSpeed is", max_new_tokens=4, do_sample=False)
        assert isinstance(out, list) and len(out) == 1 and out[0].generated_length == 4
    finally:
        pipe.destroy()
    with pytest.raises(mii.errors.PipelineDestroyedError, match="destroyed"):  # (a RuntimeError too)
        pipe("again")


def test_n_samples_per_prompt(default_pipe, chat_prompt):
    outs = default_pipe([chat_prompt, "Once upon a time"], n=3, max_new_tokens=12, do_sample=True, seed=7,
                        temperature=1.2, top_p=1.0)
    assert len(outs) == 6
    assert len({o.generated_text for o in outs[:3]}) == 3  # three different samples of the first prompt
    again = default_pipe([chat_prompt], n=3, max_new_tokens=12, do_sample=True, seed=7, temperature=1.2, top_p=1.0)
    assert [o.generated_text for o in again] == [o.generated_text for o in outs[:3]]


def test_interleaved_streams_keep_their_outputs(default_pipe, chat_prompt):
    """Two `stream` generators consumed in turns: each gets all of its own text, and a closed one frees its
    sequences."""
    kw = dict(max_new_tokens=10, do_sample=False, ignore_eos=True)
    expected = default_pipe([chat_prompt, "Once upon a time"], **kw)
    a, b = default_pipe.stream(chat_prompt, **kw), default_pipe.stream("Once upon a time", **kw)
    texts, done = ["", ""], [False, False]
    while not all(done):
        for i, gen in enumerate((a, b)):
            if not done[i]:
                chunk = next(gen, None)
                done[i] = chunk is None
                texts[i] += chunk.generated_text if chunk is not None else ""
    assert texts == [r.generated_text for r in expected]
    engine = default_pipe.engine
    left = lambda: {uid: (r.seq.status, r.seq.num_generated) for uid, r in engine.requests.items()}
    assert not engine.has_unfinished(), f"finished streams left requests: {left()}"
    c = default_pipe.stream(chat_prompt, **kw)
    next(c)
    assert len(engine.requests) == 1
    c.close()
    assert not engine.has_unfinished(), f"a closed stream left requests: {left()}"
    assert default_pipe.engine.kv.allocator.num_free == default_pipe.engine.kv.num_blocks


def test_calls_from_several_threads_share_the_steps(default_pipe, chat_prompt, monkeypatch):
    """One pipeline called from four threads at once (a threaded web app's workers), two of them streaming: every
    call gets the greedy tokens it gets alone, their sequences share the engine's steps, and nothing is left in
    the engine. (Unguarded, the threads stepped the engine at once: KeyError and IndexError from inside it. Before
    a stepping thread waited for the calls arriving from other threads, it took the lock straight back after each
    step, and calls joined late: in 10 runs, 14-27 steps for the four calls' 12 tokens each, no step with all four
    in 3 of them; now 13, all four from the second step.)"""
    import threading

    kw = dict(max_new_tokens=12, do_sample=False, ignore_eos=True)
    prompts = [chat_prompt, "Once upon a time", "The capital of France", "def fibonacci(n):"]
    expected = [default_pipe(p, **kw)[0].token_ids for p in prompts]
    engine, steps, admitted = default_pipe.engine, [], {}  # the uids of each step; uid -> steps run before it came
    run, add = engine.runner.run, engine.add_requests
    monkeypatch.setattr(engine.runner, "run", lambda batch: steps.append({c.seq.uid for c in batch.chunks})
                        or run(batch))

    def add_requests(requests):
        uids = add(requests)
        admitted.update((uid, len(steps)) for uid in uids)
        return uids

    monkeypatch.setattr(engine, "add_requests", add_requests)
    start, got, failed = threading.Barrier(len(prompts)), {}, []

    def call(i):
        try:
            start.wait()
            if i % 2:
                got[i] = [t for chunk in default_pipe.stream(prompts[i], **kw) for t in chunk.token_ids]
            else:
                got[i] = default_pipe(prompts[i], **kw)[0].token_ids
        except Exception as e:  # noqa: BLE001 - reported below
            failed.append((i, e))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failed, failed
    assert [got.get(i) for i in range(len(prompts))] == expected
    # each call joins the first step after it is admitted (no step runs without it: however long a busy machine
    # held its thread back), and the four share steps
    first = {uid: next(i for i, step in enumerate(steps) if uid in step) for uid in admitted}
    assert len(admitted) == len(prompts) and first == admitted, (first, admitted)
    assert max(len(step) for step in steps) == len(prompts), steps
    # and they come early: a stepper that took the lock straight back made 14-27 steps; 13 when all four join at
    # once (a few steps to spare for threads that a busy machine holds back before they are admitted)
    assert len(steps) <= kw["max_new_tokens"] + 4, steps
    assert not default_pipe.engine.has_unfinished()
    assert default_pipe.engine.kv.allocator.num_free == default_pipe.engine.kv.num_blocks


def test_a_closed_stream_aborts_at_once(default_pipe, chat_prompt, monkeypatch):
    """Closing a stream aborts its sequences then and there, also while something else (a stored traceback, a
    debugger) still holds the generator that runs the engine's steps."""
    held, steps = [], default_pipe._steps
    monkeypatch.setattr(default_pipe, "_steps", lambda *a: held.append(steps(*a)) or held[-1])
    c = default_pipe.stream([chat_prompt, "Once upon a time"], max_new_tokens=10, ignore_eos=True)
    next(c)
    assert len(default_pipe.engine.requests) == 2
    c.close()
    assert not default_pipe.engine.has_unfinished()
    assert default_pipe.engine.kv.allocator.num_free == default_pipe.engine.kv.num_blocks


def test_sync_debug_and_profile_model_time_are_refused():
    for name in ("sync_debug", "profile_model_time"):
        with pytest.raises(mii.errors.ValidationError, match=f"{name}=True is not supported"):
            mii.pipeline(**{name: True})
