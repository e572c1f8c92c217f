"""Schemathesis over the running gateway's own /openapi.json: generated requests, valid and invalid, to every route
of a real deployment; no answer is a 5xx, and every answer (errors included) has the status, content type and
body its schema documents. A bounded number of cases, each asking for a few tokens of the tiny model."""
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.generation.modes import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import (content_type_conformance, response_schema_conformance,  # noqa: E402
                                               status_code_conformance)

EXAMPLES = 25  # per route and generation mode (valid / invalid)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
SMALL = {"max_tokens": 3, "max_completion_tokens": 3, "max_new_tokens": 3, "n": 2, "best_of": 2, "min_tokens": 3,
         "logprobs": 3, "top_logprobs": 3}


def _small(body: dict) -> None:
    """Keep a generated request's work small: counts given as numbers are capped (other values, valid or not, are
    left as generated), and a generation gets a few tokens when it asks for no number."""
    for name, cap in SMALL.items():
        value = body.get(name)  # JSON Schema's integers include 3.0
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > cap:
            body[name] = cap
    if "prompt" in body or "messages" in body:  # OpenAI's default: the rest of the context (~1000 tokens)
        body.setdefault("max_tokens", 3)
    if "prompts" in body:
        body.setdefault("max_new_tokens", 3)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_answer_matches_the_schema(base_url, mode):
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                                             "/metrics", "/tokenize", "/detokenize", "/mii/{deployment_name}",
                                             "/engine_plan", "/", "/v1/models/{model_id}", "/version"}
    if mode is GenerationMode.NEGATIVE:  # a GET route here takes no input that could be invalid
        operations = [op for op in operations if op.method.upper() == "POST"]
    calls = []
    for op in operations:
        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                  database=None, phases=[Phase.generate])  # no shrinking: a failure is reported as found
        def run(case):
            if isinstance(case.body, dict):
                _small(case.body)
            response = case.call_and_validate(checks=CHECKS, timeout=60)
            calls.append((op.path, response.status_code))

        run()
    assert len(calls) >= len(operations)
    if mode is GenerationMode.POSITIVE:  # valid requests reach the engine on every route, not only errors
        # (but a generated model id is never the served one: that route's 200 is test_openai.py's test_models)
        ok = {op.path for op in operations} - {"/v1/models/{model_id}"}
        assert {path for path, status in calls if status == 200} == ok, calls
        assert {status for path, status in calls if path == "/v1/models/{model_id}"} == {404}
