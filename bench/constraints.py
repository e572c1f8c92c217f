"""What a JSON-schema constraint costs (issue 11): compile time (the llguidance tokenizer, built once per engine;
a schema's first compile; a cache hit), the constraint's own work per decode step at batch 1 and 32 (token masks
computed on the CPU, unpacked and applied to the logits, matchers advanced), and end-to-end per-token time with
and without the constraint on the same engine, at batch 1 and 32. Ratios are the result: absolute numbers depend on
the machine and its load.

    .venv/bin/python -m bench.constraints [--model PATH] [--tokens 64]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

import mii
from mii.engine.constraints import Constraint, GrammarCompiler, fill_bitmask
from mii.engine.sampler import apply_allowed

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city"]},
    },
    "required": ["name", "age", "role"],
}
SAMPLE = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "role": "admin",
          "tags": ["math", "engines"], "address": {"street": "12 St James's Square", "city": "London",
                                                   "zip": "10001"}}


def timed(fn, repeat: int = 1) -> float:
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t) / repeat


def compile_times(engine) -> dict:
    fresh = GrammarCompiler(engine.tokenizer, engine.runner.vocab_size, engine.loaded.eos_token_ids)
    first = Constraint("json_schema", json.dumps(SCHEMA))
    t_tok_and_schema = timed(lambda: fresh.compile(first))
    other = Constraint("json_schema", json.dumps({**SCHEMA, "required": ["name"]}))
    t_schema = timed(lambda: fresh.compile(other))
    t_hit = timed(lambda: fresh.compile(other), repeat=100)
    return {"first (llguidance tokenizer + schema) s": t_tok_and_schema, "another schema ms": 1e3 * t_schema,
            "cache hit us": 1e6 * t_hit}


def mask_cost(engine, batch: int) -> dict:
    """The constraint's work per step for `batch` rows walking through SAMPLE's tokens: masks (llguidance, CPU),
    unpacking to [B, V] bools, applying to [B, V] logits, advancing the matchers."""
    V = engine.runner.vocab_size
    grammar = engine.grammars.compile(Constraint("json_schema", json.dumps(SCHEMA)))
    tokens = engine.tokenizer.encode(json.dumps(SAMPLE), add_special_tokens=False)
    matchers = [grammar.matcher() for _ in range(batch)]
    logits = torch.randn(batch, V)
    rows = torch.arange(batch)
    t_mask = t_apply = t_advance = 0.0
    for tok in tokens:
        t = time.perf_counter()
        bits = fill_bitmask(matchers, V)
        t_mask += time.perf_counter() - t
        t = time.perf_counter()
        allowed = torch.from_numpy(np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :V]
                                   .view(np.bool_))
        apply_allowed(logits, rows, allowed)
        t_apply += time.perf_counter() - t
        assert allowed[0, tok], "the sample must follow the schema"
        t = time.perf_counter()
        for m in matchers:
            m.advance(tok)
        t_advance += time.perf_counter() - t
    n = len(tokens)
    return {"steps": n, "mask ms/step": 1e3 * t_mask / n, "unpack+apply ms/step": 1e3 * t_apply / n,
            "advance ms/step": 1e3 * t_advance / n,
            "total us/token": 1e6 * (t_mask + t_apply + t_advance) / (n * batch)}


def end_to_end(pipe, batch: int, tokens: int) -> dict:
    prompt = pipe.apply_chat_template([{"role": "user", "content": "Invent a user profile as JSON."}])
    kw = dict(n=batch, seed=0, max_new_tokens=tokens)  # constrained answers may end sooner (the grammar is done)
    t = time.perf_counter()
    plain = pipe([prompt], ignore_eos=True, **kw)
    t_plain = (time.perf_counter() - t) / sum(r.generated_length for r in plain)
    t = time.perf_counter()
    constrained = pipe([prompt], json_schema=SCHEMA, **kw)
    t_con = (time.perf_counter() - t) / sum(r.generated_length for r in constrained)
    return {"plain ms/token": 1e3 * t_plain, "json_schema ms/token": 1e3 * t_con,
            "overhead": f"{100 * (t_con / t_plain - 1):+.1f}%",
            "constrained tokens": sum(r.generated_length for r in constrained)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per sequence end to end")
    args = ap.parse_args()
    pipe = mii.pipeline(args.model, dtype="float32")
    engine = pipe.engine
    print("compile:", json.dumps(compile_times(engine), indent=1))
    for batch in (1, 32):
        print(f"constraint work, batch {batch}:", json.dumps(mask_cost(engine, batch), indent=1))
    for batch in (1, 32):
        print(f"end to end, batch {batch}:", json.dumps(end_to_end(pipe, batch, args.tokens), indent=1))
    pipe.destroy()


if __name__ == "__main__":
    main()
