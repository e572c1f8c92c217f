"""`mii.serve` / `mii.client` / `MIIClient`: blocking, streaming and async calls, from this and another process."""
import asyncio
import json
import subprocess
import sys

import pytest

import mii
from mii.errors import (DeploymentExistsError, DeploymentNotFoundError, PromptTooLongError, UnknownArgument,
                        ValidationError)
from mii.serving.launch import build_mii_config


def test_generate_in_prompt_order(deployment):
    out = deployment.generate(["DeepSpeed is", "Seattle is"], max_new_tokens=4, do_sample=False)
    assert [type(r) for r in out] == [mii.Response, mii.Response]
    assert all(r.generated_length == 4 and r.finish_reason == "length" for r in out)
    single = deployment("Seattle is", max_new_tokens=4, do_sample=False)  # __call__, a plain str prompt
    assert single == [out[1]]  # Responses compare by value
    assert deployment.mii_config.deployment_name == deployment.deployment_name


def test_token_ids_n_and_return_full_text(deployment):
    out = deployment.generate([[1, 2, 3], "Hi"], max_new_tokens=3, n=2, seed=5, return_full_text=True)
    assert len(out) == 4 and out[0].prompt_length == 3
    assert out[2].generated_text.startswith("Hi")
    again = deployment.generate([[1, 2, 3], "Hi"], max_new_tokens=3, n=2, seed=5, return_full_text=True)
    assert [r.generated_text for r in again] == [r.generated_text for r in out]  # seeds reproduce


def test_streaming_fn_several_prompts(deployment):
    chunks = []
    final = deployment.generate(["one", "two two"], streaming_fn=chunks.append, max_new_tokens=6, do_sample=False)
    # the first tokens at once, the rest within the deployment's stream interval (20 ms) and at the finish
    assert len(chunks) >= 2 and all(isinstance(c, list) and len(c) == 2 for c in chunks)
    for i in range(2):
        assert "".join(c[i].generated_text for c in chunks) == final[i].generated_text
    assert [c[0].finish_reason for c in chunks][-1] == "length"


def test_async_api_inside_a_running_loop(deployment):
    async def main():
        whole, streamed = await asyncio.gather(
            deployment.agenerate("async", max_new_tokens=5, do_sample=False),
            _collect(deployment.astream("async", max_new_tokens=5, do_sample=False)))
        seen = []
        await deployment.agenerate(["a", "b"], streaming_fn=seen.append, max_new_tokens=3)
        return whole, streamed, seen

    async def _collect(stream):
        return [c async for c in stream]

    whole, streamed, seen = asyncio.run(main())
    assert "".join(c.generated_text for c in streamed) == whole[0].generated_text
    assert isinstance(streamed[0], mii.Response) and streamed[-1].finish_reason == "length"
    assert seen and all(len(c) == 2 for c in seen)


def test_typed_errors(deployment):
    with pytest.raises(UnknownArgument, match="max_new_tokenz"):
        deployment.generate("x", max_new_tokenz=3)
    with pytest.raises(ValidationError, match="top_p"):
        deployment.generate("x", top_p=2.0)
    with pytest.raises(PromptTooLongError, match="maximum context length is 1024 tokens"):
        deployment.generate([[5] * 1500], max_new_tokens=2)
    with pytest.raises(PromptTooLongError, match=r"you requested 1100 tokens \(1000 in the prompt, 100 for") as e:
        deployment.generate([[5] * 1000], max_new_tokens=100)
    assert (e.value.prompt_length, e.value.completion_tokens, e.value.max_context) == (1000, 100, 1024)
    with pytest.raises(ValidationError, match="seed: must be <= 9223372036854775805"):
        deployment.generate("x", max_new_tokens=2, seed=2**63 - 1, n=3)


def test_client_from_another_process(deployment):
    expected = deployment.generate("Hello", max_new_tokens=4, do_sample=False)[0].generated_text
    code = ("import json, mii\n"
            f"c = mii.client({deployment.deployment_name!r})\n"
            "r = c.generate('Hello', max_new_tokens=4, do_sample=False)[0]\n"
            "print(json.dumps([r.generated_text, c.mii_config.deployment_name]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [expected, deployment.deployment_name]


def test_client_not_found():
    with pytest.raises(DeploymentNotFoundError, match="no-such-deployment"):
        mii.client("no-such-deployment")


def test_second_serve_with_the_same_name_is_an_error(deployment, tiny_model):
    with pytest.raises(DeploymentExistsError, match="already running"):
        mii.serve(tiny_model, deployment_name=deployment.deployment_name)


def test_mii_config_forms():
    cfg = build_mii_config(mii_config={"deployment_name": "d1", "port_number": 50123, "enable_restful_api": True,
                                       "model_config": {"model_name_or_path": "m", "task": "text-generation",
                                                        "device_map": "auto", "replica_num": 2}})
    assert cfg.deployment_name == "d1" and cfg.model_config_.replica_num == 2 and cfg.port_number == 50123
    cfg = build_mii_config("path/to/llama", model_config={"max_length": 64}, tensor_parallel=1, replica_num=3)
    assert cfg.deployment_name == "llama-mii-deployment" and cfg.model_config_.max_length == 64
    assert cfg.model_config_.replica_num == 3
    # the embedded model has one name whether it is given or not, so mii.client(mii.default_model()) finds `mii serve`'s
    assert build_mii_config(mii.default_model()).deployment_name == "SmolLM2-135M-Instruct-mii-deployment"
    assert build_mii_config("").deployment_name == "SmolLM2-135M-Instruct-mii-deployment"
    with pytest.raises(UnknownArgument, match="bogus"):
        build_mii_config("m", bogus=1)
    with pytest.raises(ValidationError, match="deployment_name"):
        build_mii_config("m", deployment_name="bad name/..")
