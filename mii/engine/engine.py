"""The engine loop: requests in, one scheduled forward per `step()`, incremental outputs back.

Narrow API (after DeepSpeed inference v2): `add_request`, `step`, `abort`, `has_unfinished`. The engine owns the
scheduler (pure Python), the model runner (tensors) and one detokenizer per request.
"""
from __future__ import annotations

import itertools
import logging
import random
from dataclasses import dataclass, field
from typing import Optional

import torch

from mii.config import ModelConfig
from mii.engine.detokenizer import Detokenizer
from mii.engine.kv_cache import KVCacheManager
from mii.engine.model_runner import ModelRunner
from mii.engine.params import GenerationParams
from mii.engine.plan import EnginePlan, plan_device, plan_memory
from mii.engine.scheduler import Scheduler
from mii.engine.sequence import Sequence
from mii.errors import KVCacheError, PromptTooLongError, ValidationError

log = logging.getLogger("mii")

DEFAULT_MAX_LENGTH = 1024  # MII's default max_length (prompt + generated)


@dataclass
class RequestOutput:
    """What one step added to one request."""

    uid: int
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str  # "none" while running, then "stop" | "length" | "abort"
    prompt_length: int
    generated_length: int
    logprobs: list = field(default_factory=list)
    """Per new token: (token id, logprob, {top id: logprob}) when the request asked for logprobs."""


@dataclass
class _Request:
    seq: Sequence
    detok: Detokenizer


def finish_plan_and_build_runner(loaded, model_config: ModelConfig, plan: EnginePlan,
                                 tp=None) -> tuple[EnginePlan, ModelRunner]:
    """Finish the plan with what loading tells (the KV cache size, the same on every tensor-parallel rank: the
    smallest any rank can hold; the linear backend) and build the runner on it. Every rank of a group calls it;
    `tp` is its `mii.parallel.TPGroup`."""
    per_token = ModelRunner.kv_bytes_per_block(loaded.model, 1, plan.torch_dtype)
    plan = plan_memory(plan, model_config, per_token, loaded.cfg.max_position)
    if loaded.prepacked:
        plan.linear_backend = f"oneDNN prepacked bf16 ({loaded.prepacked} weights)"
        plan.reasons["linears"] = "bf16 on CPU: blocked layout, 1.3-2x faster at decode batch sizes"
    if tp is not None:
        blocks = tp.min_int(plan.kv_num_blocks)
        if blocks != plan.kv_num_blocks:
            plan.kv_cache_bytes = plan.kv_cache_bytes // plan.kv_num_blocks * blocks
            plan.kv_num_blocks = blocks
            plan.reasons["kv_blocks"] += "; the smallest of the tensor-parallel ranks"
    runner = ModelRunner(loaded.model, plan.kv_num_blocks, plan.kv_block_size, plan.torch_dtype,
                         torch.device(plan.device), loaded.eos_token_ids, loaded.cfg.vocab_size,
                         tp=tp if tp is not None and tp.rank == 0 else None)
    return plan, runner


class Engine:
    def __init__(self, loaded, model_config: ModelConfig, plan: EnginePlan, tp=None):
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.config = model_config
        self.plan, self.runner = finish_plan_and_build_runner(loaded, model_config, plan, tp)
        plan = self.plan
        self.kv = KVCacheManager(plan.kv_num_blocks, plan.kv_block_size)
        self.scheduler = Scheduler(self.kv, plan.max_batch_tokens, plan.max_batch_seqs)
        self.eos = frozenset(loaded.eos_token_ids)
        self.requests: dict[int, _Request] = {}
        self._uids = itertools.count()
        self._seed_rng = random.Random(model_config.seed)
        self.max_tracked = model_config.inference_engine_config.state_manager.max_tracked_sequences
        self.default_max_length = min(model_config.max_length or DEFAULT_MAX_LENGTH, plan.max_context)
        log.info("mii engine plan for %s:\n%s", loaded.source.name, plan.describe())

    # --- requests ------------------------------------------------------------------------------------------------

    def max_total(self, prompt_len: int, p: GenerationParams) -> int:
        """Validate lengths; return the sequence length at which the request ends with "length"."""
        ctx = self.plan.max_context
        if prompt_len == 0:
            raise ValidationError("prompt", "must not be empty")
        if prompt_len >= ctx:
            raise PromptTooLongError(prompt_len, ctx)
        limit = ctx
        if p.max_length is not None:
            if prompt_len >= p.max_length:
                raise ValidationError("max_length", f"{p.max_length} leaves no room after a {prompt_len}-token prompt")
            limit = min(limit, p.max_length)
        if p.max_new_tokens is not None:
            limit = min(limit, prompt_len + p.max_new_tokens)
        elif p.max_length is None:
            limit = min(limit, max(self.default_max_length, prompt_len + 1))
        if limit > self.kv.capacity_tokens:
            limit_cap = self.kv.capacity_tokens
            if prompt_len >= limit_cap:
                raise KVCacheError(f"the prompt has {prompt_len} tokens; the KV cache holds only {limit_cap}")
            limit = limit_cap
        return limit

    def add_request(self, prompt_ids: list[int], params: GenerationParams) -> int:
        if len(self.scheduler) >= self.max_tracked:
            raise KVCacheError(f"max_tracked_sequences={self.max_tracked} requests are already in the engine")
        bad = [t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < self.loaded.cfg.vocab_size)]
        if bad:
            raise ValidationError("prompt", f"token id {bad[0]!r} is outside the vocabulary (0..{self.loaded.cfg.vocab_size - 1})")
        uid = next(self._uids)
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        seq = Sequence(uid, list(prompt_ids), self.max_total(len(prompt_ids), params), params, seed)
        self.requests[uid] = _Request(seq, Detokenizer(self.tokenizer, seq.prompt_ids, params.stop))
        self.scheduler.add(seq)
        return uid

    def abort(self, uid: int) -> None:
        req = self.requests.pop(uid, None)
        if req is not None:
            self.scheduler.finish(req.seq)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # --- the loop ------------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if not batch:
            return []
        out = self.runner.run(batch)
        self.scheduler.update(batch, out.tokens_by_uid())
        results = []
        s = out.sampled
        for row, uid in enumerate(out.uids):
            req = self.requests[uid]
            seq, p = req.seq, req.seq.params
            token = seq.token_ids[-1]
            n = seq.num_generated
            may_stop = n > p.min_new_tokens  # EOS and stop ids are masked before that in sampling
            if may_stop and ((token in self.eos and not p.ignore_eos) or token in p.stop_token_ids):
                reason, text = "stop", req.detok.flush()  # the EOS token itself is not part of the text
            else:
                reason = "length" if seq.num_tokens >= seq.max_total else "none"
                text = req.detok.add(token, final=reason == "length", check_stop=may_stop)
                if req.detok.stopped:
                    reason = "stop"
            final = reason != "none"
            lp = []
            if s.logprobs is not None and p.logprobs is not None:
                top = {}
                if p.logprobs > 0:
                    top = dict(zip(s.top_ids[row][: p.logprobs], s.top_logprobs[row][: p.logprobs]))
                lp = [(token, s.logprobs[row], top)]
            results.append(RequestOutput(uid, text, [token], final, reason, seq.num_prompt, n, lp))
            if final:
                self.scheduler.finish(seq)
                del self.requests[uid]
        return results
