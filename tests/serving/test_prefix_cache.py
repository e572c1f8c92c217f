"""Prefix caching as a deployment shows it: `usage.prompt_tokens_details.cached_tokens` through the `openai`
client (completions and chat, whole and streamed answers), the Prometheus counters of prefix-cache queries and
hits, and `mii serve --no-prefix-caching`."""
import random

import httpx

from tests.serving.conftest import metric

BLOCK = 16  # the `deployment` fixture's kv_block_size


def _counters(base_url) -> tuple[float, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return metric(text, "mii_prefix_cache_queries_total"), metric(text, "mii_prefix_cache_hits_total")


def _completion(oai, model_id, prompt, stream: bool):
    kw = dict(model=model_id, prompt=prompt, max_tokens=4, temperature=0)
    if not stream:
        return oai.completions.create(**kw).usage
    chunks = list(oai.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    return chunks[-1].usage


def _chat(oai, model_id, messages, stream: bool):
    kw = dict(model=model_id, messages=messages, max_tokens=4, temperature=0)
    if not stream:
        return oai.chat.completions.create(**kw).usage
    return list(oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))[-1].usage


def test_cached_tokens_in_usage_and_metrics(oai, model_id, base_url):
    """The same new prompt four times over the deployment's two replicas (the balancer takes them in turn when
    they are idle): the first on each replica computes it all, the second finds every full block but the one of
    its last token; the counters grow by exactly the prompts' tokens and the cached ones."""
    rng = random.Random()
    before = _counters(base_url)
    prompt = [rng.randrange(1000, 40000) for _ in range(150)]
    order = (False, True, True, False)  # whole, streamed, streamed, whole
    usages = [_completion(oai, model_id, prompt, stream) for stream in order]
    words = " ".join(f"w{rng.randrange(10**6)}" for _ in range(60))
    messages = [{"role": "system", "content": f"You answer in one word. {words}"},
                {"role": "user", "content": "What is the capital of France?"}]
    usages += [_chat(oai, model_id, messages, stream) for stream in order]
    for part in (usages[:4], usages[4:]):
        p = part[0].prompt_tokens
        assert p > BLOCK and all(u.prompt_tokens == p for u in part)
        full = (p - 1) // BLOCK * BLOCK
        assert [u.prompt_tokens_details.cached_tokens for u in part] == [0, 0, full, full]
    queries, hits = _counters(base_url)
    assert queries - before[0] == sum(u.prompt_tokens for u in usages)
    assert hits - before[1] == sum(u.prompt_tokens_details.cached_tokens for u in usages)


def test_serve_flag_turns_it_off(monkeypatch):
    from mii import cli
    from mii.serving import deployment

    seen = []
    monkeypatch.setattr(deployment, "run", lambda cfg, announce: seen.append(cfg))
    for flags, on in (([], True), (["--no-prefix-caching"], False)):
        args = cli.build_parser().parse_args(["serve", "some/model", *flags])
        assert args.func(args) == 0
        assert seen[-1].model_config_.enable_prefix_caching is on
