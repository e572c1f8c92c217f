"""Constrained decoding in the engine (mii.engine.constraints) on a tiny random Llama, whose output is noise: only
the constraint can make it valid. JSON schemas validated with the `jsonschema` package, regex / choice / grammar on
every sample, bad constraints refused naming the field, constrained rows batched with unconstrained ones (which
must not change), a constraint across preemption, logit_bias."""
import json
import re

import jsonschema
import pytest

import mii
from mii.engine.constraints import Constraint, GrammarCompiler
from mii.errors import ValidationError
from tests.engine.conftest import VOCAB
from tests.reference import prompts_for

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                     "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}


def test_json_schema_on_a_random_model(pipe):
    outs = pipe(["Describe a user:", "JSON:"], json_schema=SCHEMA, n=4, seed=7, temperature=1.0, top_p=1.0,
                max_new_tokens=300)
    assert len(outs) == 8
    for o in outs:
        assert o.finish_reason == "stop", o.generated_text  # ended by the grammar, not the length
        jsonschema.validate(json.loads(o.generated_text), SCHEMA)
    assert len({o.generated_text for o in outs}) > 4  # sampled, not one forced answer


def test_json_object_regex_choice_grammar(pipe):
    objects = pipe(["a", "b"], json_object=True, seed=1, max_new_tokens=48)
    for o in objects:  # any object may be endless on a random model: those that end must parse
        assert o.generated_text.lstrip().startswith("{")
        assert o.finish_reason == "length" or isinstance(json.loads(o.generated_text), dict)
    for o in pipe("phone:", regex=r"\+1 \d{3}-[0-9]{4}", n=4, seed=2, max_new_tokens=30):
        assert re.fullmatch(r"\+1 [0-9]{3}-[0-9]{4}", o.generated_text) and o.finish_reason == "stop"
    choices = ["yes", "no", "maybe not"]
    outs = pipe("?", choice=choices, n=6, seed=3, max_new_tokens=10)
    assert all(o.generated_text in choices and o.finish_reason == "stop" for o in outs)
    gbnf = 'root ::= "(" item ("," item){0,3} ")"\nitem ::= [a-c] | [0-9]{1,3}'
    shapes = r"\(([a-c]|[0-9]{1,3})(,([a-c]|[0-9]{1,3})){0,3}\)|<[xyz]{1,4}>"
    lark = 'start: "<" NAME ">"\nNAME: /[xyz]{1,4}/'
    for o in pipe(["g"] * 4, grammar=[gbnf] * 2 + [lark] * 2, seed=4, max_new_tokens=40):
        assert re.fullmatch(shapes, o.generated_text) and o.finish_reason == "stop", o.generated_text
    # per-prompt constraints, one of them none
    a, b, c = pipe(["x", "y", "z"], regex=[r"[01]{5}", None, r"z+"], max_new_tokens=8, seed=5, ignore_eos=True)
    assert re.fullmatch(r"[01]{5}", a.generated_text) and re.fullmatch("z+", c.generated_text)
    assert b.finish_reason == "length" and b.generated_length == 8


def test_stop_strings_apply_to_constrained_output(pipe):
    o = pipe("x", regex=r"abc;def", stop=[";"], max_new_tokens=20)[0]
    assert o.generated_text == "abc" and o.finish_reason == "stop"


def test_bad_constraints_name_their_field(pipe):
    cases = [({"json_schema": {"type": "objectx"}}, "json_schema"), ({"json_schema": "{not json"}, "json_schema"),
             ({"json_schema": [1, 2]}, "json_schema"), ({"regex": "a(b"}, "regex"),
             ({"grammar": "root ::= missing"}, "grammar"), ({"grammar": "start: foo"}, "grammar"),
             ({"choice": []}, "choice"), ({"choice": ["a", 3]}, "choice"), ({"regex": "a", "choice": ["a"]}, "choice"),
             ({"json_object": "yes"}, "json_object"), ({"regex": "x" * (256 * 1024 + 1)}, "regex"),
             # constraints that no output matches (an empty answer "stop"ped at once before)
             ({"regex": r"[^\x00-\x{10FFFF}]"}, "regex"), ({"grammar": "root ::= a\na ::= a"}, "grammar"),
             ({"json_schema": {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}, "json_schema")]
    for kwargs, field in cases:
        with pytest.raises(ValidationError) as e:
            pipe("x", max_new_tokens=4, **kwargs)
        assert e.value.field == field, (kwargs, e.value)
    assert not pipe.engine.has_unfinished()


def test_a_constraint_this_vocabulary_cannot_write_ends_its_request_alone(pipe):
    """U+4CF91 is F1 8C BE 91 in UTF-8, and this byte-level vocabulary has no token for the byte F1: llguidance's
    mask lets a token through that it then refuses. That request ends with a ValidationError naming its field (a
    400 over HTTP, not an engine failure); a request sharing its steps goes on to the same tokens as alone."""
    assert "\u00f1" not in pipe.tokenizer.get_vocab()  # byte F1 as byte-level BPE spells it
    alone = pipe("x", max_new_tokens=12, do_sample=False, ignore_eos=True)[0]
    beside = pipe.stream("x", max_new_tokens=12, do_sample=False, ignore_eos=True)
    first = next(beside)
    for kwargs, field in (({"regex": "ab\U0004cf91"}, "regex"), ({"choice": ["\U0004cf91"]}, "choice"),
                          ({"json_schema": {"const": "\U0004cf91"}}, "json_schema")):
        with pytest.raises(ValidationError, match="cannot go on within the constraint") as e:
            pipe("y", max_new_tokens=8, **kwargs)
        assert e.value.field == field
    ids = first.token_ids + [t for chunk in beside for t in chunk.token_ids]
    assert ids == alone.token_ids
    assert not pipe.engine.has_unfinished()


def test_min_new_tokens_yield_to_a_grammar_that_only_ends(pipe):
    """A grammar that accepts only what was written so far (here: nothing) leaves EOS alone in its mask; the ban
    of EOS and stop ids before min_new_tokens then left no token (the sampler fell on token 0 and the matcher
    refused it). A complete grammar ends its request before min_new_tokens, as documented; one that can go on
    still honours them."""
    eos = pipe.tokenizer.eos_token_id
    for kwargs in ({"grammar": 'root ::= ""'}, {"regex": "x{0}", "stop_token_ids": [5]}):
        o = pipe("x", max_new_tokens=8, min_new_tokens=3, **kwargs)[0]
        assert (o.generated_text, o.token_ids, o.finish_reason) == ("", [eos], "stop"), (kwargs, o)
    o = pipe("x", max_new_tokens=8, min_new_tokens=2, regex="(ab)?", do_sample=False)[0]
    assert o.generated_text == "ab" and o.finish_reason == "stop"  # "" was acceptable too: EOS waited


def test_constrained_rows_leave_the_others_alone(pipe):
    """Greedy fp32: the unconstrained outputs of a batch with constrained requests equal those of a run without
    them (the mask touches only its own rows)."""
    prompts = prompts_for(VOCAB, lengths=(5, 17, 40))
    alone = pipe(prompts, max_new_tokens=24, do_sample=False, ignore_eos=True)
    mixed = pipe(prompts + prompts, max_new_tokens=24, do_sample=False, ignore_eos=True,
                 json_schema=[None] * 3 + [SCHEMA] * 3)
    assert [o.token_ids for o in mixed[:3]] == [o.token_ids for o in alone]
    assert [o.token_ids for o in mixed[3:]] != [o.token_ids for o in alone]
    for o in mixed[3:]:  # 24 tokens may not finish the object: the prefix is still the schema's
        assert o.generated_text.lstrip().startswith("{")


def test_constraint_survives_preemption(tiny, pipe):
    """A KV cache of 12 blocks of 16 tokens for 6 sequences of up to ~90 tokens: sequences are preempted and
    recomputed, their matchers kept; every answer is still valid and equal to the answer without preemption."""
    kwargs = dict(json_schema=SCHEMA, max_new_tokens=150, do_sample=False)
    prompts = [[5 + i, 9, 13] for i in range(6)]
    small = mii.pipeline(str(tiny), dtype="float32", inference_engine_config={"state_manager": {
        "kv_block_size": 16, "memory_config": {"mode": "allocate", "size": 12}}})
    try:
        tight = small(prompts, **kwargs)
        assert small.engine.num_preemptions > 0
    finally:
        small.destroy()
    free = pipe(prompts, **kwargs)  # room for all: no preemption
    assert pipe.engine.num_preemptions == 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in free]
    for o in tight:
        jsonschema.validate(json.loads(o.generated_text), SCHEMA)


def test_abort_and_finish_release_the_matcher(pipe):
    stream = pipe.stream("x", json_schema=SCHEMA, max_new_tokens=100)
    next(stream)
    (seq,) = [r.seq for r in pipe.engine.requests.values()]
    assert seq.constraint is not None
    stream.close()  # aborts
    assert seq.constraint is None and not pipe.engine.has_unfinished()


def test_compile_cache_and_eos_only_where_accepted(tiny, pipe):
    compiler = pipe.engine.grammars
    c = Constraint("regex", r"ab+")
    assert compiler.compile(c) is compiler.compile(c)
    m = compiler.compile(c).matcher()
    tok = pipe.tokenizer
    eos = tok.eos_token_id
    from mii.engine.constraints import fill_bitmask

    def allowed(matcher):
        bits = fill_bitmask([matcher], VOCAB)
        return {v for v in range(VOCAB) if bits[0, v // 32] >> (v % 32) & 1}

    assert eos not in allowed(m)  # nothing yet: "" does not match ab+
    assert not m.advance(tok.convert_tokens_to_ids("a"))
    assert eos not in allowed(m)
    assert not m.advance(tok.convert_tokens_to_ids("b"))
    assert eos in allowed(m)  # "ab" matches, "abb..." too
    assert isinstance(GrammarCompiler(tok, VOCAB), GrammarCompiler)


def test_logit_bias(pipe):
    prompt = prompts_for(VOCAB, lengths=(9,))[0]
    plain = pipe([prompt], max_new_tokens=6, do_sample=False, ignore_eos=True)[0].token_ids
    forced = pipe([prompt], max_new_tokens=6, do_sample=False, ignore_eos=True, logit_bias={"4321": 100})[0]
    assert forced.token_ids == [4321] * 6
    banned = pipe([prompt], max_new_tokens=6, do_sample=False, ignore_eos=True, logit_bias={plain[0]: -100})[0]
    assert banned.token_ids[0] != plain[0]
    for bad in ({"x": 1}, {5: 101}, {-1: 1}, {VOCAB: 1}, [1, 2]):
        with pytest.raises(ValidationError) as e:
            pipe([prompt], max_new_tokens=2, logit_bias=bad)
        assert e.value.field == "logit_bias"


def test_json_schema_and_choice_on_smollm2(default_pipe):
    """The embedded SmolLM2 (real weights): a few samples under a schema, all valid, keys in the schema's order."""
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]}}, "required": ["name", "age", "role"], "additionalProperties": False}
    prompt = default_pipe.apply_chat_template([{"role": "user", "content": "Invent a user profile as JSON."}])
    outs = default_pipe([prompt], json_schema=schema, n=2, seed=1, max_new_tokens=100)
    for o in outs:
        assert o.finish_reason == "stop", o.generated_text
        value = json.loads(o.generated_text)
        jsonschema.validate(value, schema)
        assert list(value) == ["name", "age", "role"]
    question = default_pipe.apply_chat_template([{"role": "user", "content": "Is Paris in France? yes or no"}])
    (answer,) = default_pipe([question], choice=["yes", "no"], do_sample=False, max_new_tokens=5)
    assert answer.generated_text in ("yes", "no")
