"""Bad input gets a precise, typed error and leaves the pipeline usable."""
import sys

import pytest

import mii
from mii.errors import KVCacheError, PromptTooLongError, UnknownArgument, ValidationError


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(max_new_tokenz=3), UnknownArgument, "max_new_tokenz"),
    (dict(max_new_tokens=0), ValidationError, "max_new_tokens"),
    (dict(max_new_tokens=-5), ValidationError, "max_new_tokens"),
    (dict(top_p=0.0), ValidationError, "top_p"),
    (dict(top_p=1.5), ValidationError, "top_p"),
    (dict(temperature=-0.1), ValidationError, "temperature"),
    (dict(stop=5), ValidationError, "stop"),
    (dict(stop=["ok", 3]), ValidationError, "stop"),
    (dict(top_k="ten"), ValidationError, "top_k"),
    (dict(max_new_tokens=[1, 2, 3]), ValidationError, "3 values for 1 prompts"),
    # found by a sweep of the pipeline's inputs: these escaped as TypeError / RecursionError
    (dict(logit_bias=((1, 2.0),)), ValidationError, "logit_bias"),
    (dict(logit_bias=[(1, 2.0)]), ValidationError, "logit_bias"),
    (dict(json_schema="[" * 100_000 + "]" * 100_000), ValidationError, "json_schema: is nested too deeply"),
])
def test_bad_generation_arguments(default_pipe, kwargs, error, words):
    with pytest.raises(error, match=words):
        default_pipe("Hello", **kwargs)
    assert default_pipe.engine.has_unfinished() is False
    assert default_pipe("Hello", max_new_tokens=2, do_sample=False)[0].generated_length == 2


@pytest.mark.parametrize("prompts, words", [
    ([], "empty"),
    ("", "empty"),
    (["fine", ""], r"prompts\[1\]"),
    ([None], r"prompts\[0\]"),
    (42, "prompts"),
])
def test_bad_prompts(default_pipe, prompts, words):
    with pytest.raises(ValidationError, match=words):
        default_pipe(prompts, max_new_tokens=2)
    assert default_pipe("Hello", max_new_tokens=2, do_sample=False)[0].generated_length == 2


def test_bad_chat_messages(default_pipe):
    """apply_chat_template refuses what its template cannot render, naming the message, with a typed error."""
    cases = [("hi", "messages"), (None, "messages"), ([], "messages"), ([{"role": 5, "content": "x"}], "messages[0]"),
             ([{"role": "user", "content": 5}], "messages[0].content"),
             ([{"role": "user", "content": "a\ud800"}], "messages[0].content"),
             ([{"role": "user"}], "messages")]  # (SmolLM2's template reads every message's content)
    for messages, field in cases:
        with pytest.raises(ValidationError) as e:
            default_pipe.apply_chat_template(messages)
        assert e.value.field == field, (messages, e.value)
    assert "<|im_start|>user\nhi" in default_pipe.apply_chat_template([{"role": "user", "content": "hi"}])


def test_prompt_longer_than_context(default_pipe):
    ctx = default_pipe.engine_plan.max_context
    with pytest.raises(PromptTooLongError, match=rf"maximum context length is {ctx} tokens.*{ctx + 10} tokens"):
        default_pipe(["fine", [5] * (ctx + 10)], max_new_tokens=2)
    # nothing of the failed call was queued; the good prompt of that call can be served now
    assert not default_pipe.engine.has_unfinished()
    assert default_pipe("fine", max_new_tokens=2, do_sample=False)[0].generated_length == 2


def test_token_ids_outside_vocabulary(default_pipe):
    with pytest.raises(ValidationError, match="outside the vocabulary"):
        default_pipe([[1, 2, 10**7]], max_new_tokens=2)


def test_bad_pipeline_arguments(default_model_path):
    with pytest.raises(UnknownArgument, match="replicas"):
        mii.pipeline(default_model_path, replicas=2)
    with pytest.raises(ValidationError, match="dtype"):
        mii.pipeline(default_model_path, dtype="int3")
    with pytest.raises(UnknownArgument, match="kv_blocks"):
        mii.pipeline(default_model_path, inference_engine_config={"state_manager": {"kv_blocks": 3}})
    with pytest.raises(ValidationError, match="num_threads"):  # libgomp aborted the process at 10**9
        mii.pipeline(default_model_path, num_threads=10 ** 9)


@pytest.mark.parametrize("state_manager, words", [
    ({"memory_config": {"mode": "allocate", "size": 10 ** 15}}, r"asks for 1000000000000000 KV blocks .* GiB of RAM"),
    ({"kv_block_size": 10 ** 9}, "the KV cache gets 0 blocks of 1000000000 tokens"),
])
def test_a_kv_cache_this_host_cannot_hold_is_refused(default_model_path, state_manager, words):
    with pytest.raises(KVCacheError, match=words):
        mii.pipeline(default_model_path, inference_engine_config={"state_manager": state_manager})


def test_error_info_round_trip_across_processes():
    """Errors cross processes as JSON: mii's typed errors come back typed; a foreign exception that shares a
    mii class's name (pydantic's ValidationError) comes back as MIIError with its name in the message."""
    import pydantic

    from mii.errors import MIIError, PromptTooLongError, ValidationError, error_from_info, error_info

    e = error_from_info(error_info(ValidationError("top_p", "must be in (0, 1]")))
    assert isinstance(e, ValidationError) and e.field == "top_p" and "(0, 1]" in str(e)
    e = error_from_info(error_info(PromptTooLongError(9000, 8192)))
    assert isinstance(e, PromptTooLongError) and "8192" in str(e)
    try:
        pydantic.TypeAdapter(int).validate_python("x")
    except pydantic.ValidationError as foreign:
        e = error_from_info(error_info(foreign))
    assert type(e) is MIIError and str(e).startswith("ValidationError: ")


@pytest.mark.parametrize("kwargs, words", [
    (dict(deployment_type="aml"), "deployment_type='aml' is not supported: only 'local'"),
    (dict(mii_config={"deployment_type": "AML"}), "deployment_type='AML' is not supported"),
    (dict(hostfile="/etc/hosts"), "hostfile='/etc/hosts' is not supported: to serve from several machines, make "
                                  "them one Ray cluster.*cluster='ray'"),
    (dict(ray_address="auto"), "ray_address='auto' is given but cluster='local': set cluster='ray'"),
    (dict(sync_debug=True), "sync_debug=True is not supported.*CUDA_LAUNCH_BLOCKING=1"),
    (dict(profile_model_time=True), "profile_model_time=True is not supported.*/metrics"),
])
def test_mii_fields_that_would_be_ignored_are_refused(kwargs, words):
    """MII's fields that mean nothing here (other deployment types, multi-node hostfiles, debugging switches) are
    refused with what to do instead, before any process starts; their defaults are accepted (MII's forms)."""
    with pytest.raises(ValidationError, match=words):
        mii.serve("no/such/model", **kwargs)
    from mii.serving.launch import build_mii_config

    cfg = build_mii_config("m", deployment_type="local", hostfile="/job/hostfile", sync_debug=False)
    assert cfg.deployment_type == "local" and cfg.model_config_.seed is None


def test_ray_without_ray_says_how_to_install_it(monkeypatch):
    """Ray is an optional extra: without it, a deployment on Ray is refused in the caller, before any process
    starts, with the command that installs it."""
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as where it is not installed
    with pytest.raises(ValidationError, match=r"cluster='ray' needs Ray.*pip install 'mii\[ray\]'"):
        mii.serve("no/such/model", cluster="ray")


@pytest.mark.parametrize("value, words", [(-1, "greater than or equal to 0"), (float("nan"), "finite number"),
                                          ("x", "valid number"), (10**6, "less than or equal to 10000")])
def test_a_bad_stream_interval_is_refused_before_any_process_starts(value, words):
    with pytest.raises(ValidationError, match=f"stream_interval_ms: .*{words}"):
        mii.serve("no/such/model", stream_interval_ms=value)
