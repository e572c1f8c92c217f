"""The engine loop: requests in, one scheduled forward per `step()`, incremental outputs back.

Narrow API (after DeepSpeed inference v2): `add_requests`, `step`, `abort`, `has_unfinished`. The engine owns the
scheduler (pure Python), the model runner (tensors) and one detokenizer per request. It admits `EngineRequest`s
that `mii.engine.requests` validated against its `limits`, and checks nothing of them again.

A step that fails costs only the requests that make it fail: the step is run again in halves until each failure
is pinned to one sequence, which ends with an `EngineStepError` in its output; the others go on. Under tensor
parallelism the ranks must run the same steps, so a failure is raised to the caller as it is.
"""
from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from mii.config import ModelConfig
from mii.engine.constraints import GrammarCompiler
from mii.engine.cuda_graphs import plan_cuda_graphs
from mii.engine.detokenizer import Detokenizer
from mii.engine.kv_cache import KVCacheManager
from mii.engine.model_runner import ModelRunner
from mii.engine.pacing import Pacer
from mii.engine.plan import EnginePlan, plan_device, plan_memory
from mii.engine.requests import EngineRequest, RequestLimits
from mii.engine.scheduler import ScheduledBatch, ScheduledChunk, Scheduler
from mii.engine.sequence import Sequence
from mii.errors import EngineStepError, KVCacheError, MIIError, ValidationError
from mii.response import FinishReason

log = logging.getLogger("mii")
PLAN_LOG = "mii engine plan for %s:\n%s"  # the log record of the plan (`mii explain` prints the plan instead)

DEFAULT_MAX_LENGTH = 1024  # MII's default max_length (prompt + generated)


@dataclass
class RequestOutput:
    """What one step added to one request."""

    uid: int
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: FinishReason  # NONE while running, then STOP or LENGTH
    prompt_length: int
    generated_length: int
    logprobs: list = field(default_factory=list)
    """Per new token: (token id, logprob, {top id: logprob}) when the request asked for logprobs."""
    error: Optional[MIIError] = None
    """Set when the request failed inside a step (an EngineStepError, or a ValidationError where its own input could
    not be honoured): it is finished and gone from the engine (finish_reason NONE)."""
    prompt_logprobs: Optional[list] = None
    """On a request's first output, with params.prompt_logprobs: (token id, logprob, {top id: logprob}) per prompt
    token; the first has logprob None (nothing precedes it)."""
    cached_tokens: int = 0
    """Prompt tokens found in the prefix cache (not computed) when the request started."""


@dataclass
class _Request:
    seq: Sequence
    detok: Detokenizer


def finish_plan_and_build_runner(loaded, model_config: ModelConfig, plan: EnginePlan,
                                 tp_group=None) -> tuple[EnginePlan, ModelRunner]:
    """Finish the plan with what loading tells (the KV cache size, the same on every tensor-parallel rank: the
    smallest any rank can hold; the linear backend) and build the runner on it. Every rank of a group calls it;
    `tp_group` is its `mii.parallel.TPGroup`."""
    per_token = ModelRunner.kv_bytes_per_block(loaded.model, 1, plan.kv_torch_dtype)
    plan = plan_memory(plan, model_config, per_token, loaded.cfg.max_position,
                       (loaded.cfg.hidden_size, loaded.cfg.intermediate_size or 4 * loaded.cfg.hidden_size))
    if loaded.prepacked:
        plan.linear_backend = f"oneDNN prepacked bf16 ({loaded.prepacked} weights)"
        plan.reasons["linears"] = "bf16 on CPU: blocked layout, 1.3-2x faster at decode batch sizes"
    if tp_group is not None:
        blocks = tp_group.min_int(plan.kv_num_blocks)
        if blocks != plan.kv_num_blocks:
            plan.kv_cache_bytes = plan.kv_cache_bytes // plan.kv_num_blocks * blocks
            plan.kv_num_blocks = blocks
            plan.reasons["kv_blocks"] += "; the smallest of the tensor-parallel ranks"
    runner = ModelRunner(loaded.model, plan.kv_num_blocks, plan.kv_block_size, plan.kv_torch_dtype,
                         torch.device(plan.device), loaded.eos_token_ids, loaded.cfg.vocab_size,
                         tp_group=tp_group if tp_group is not None and tp_group.rank == 0 else None,
                         attention=plan.attention)
    if plan.device.startswith("cuda"):
        plan_cuda_graphs(runner, plan, model_config.cuda_graphs, tp_group)
    return plan, runner


class Engine:
    def __init__(self, loaded, model_config: ModelConfig, plan: EnginePlan, tp_group=None):
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.config = model_config
        self.plan, self.runner = finish_plan_and_build_runner(loaded, model_config, plan, tp_group)
        plan = self.plan
        prefault = self.runner.prefault
        self.kv = KVCacheManager(plan.kv_num_blocks, plan.kv_block_size, prefix_caching=plan.prefix_caching,
                                 resident=None if prefault is None else prefault.resident)
        if prefault is not None:
            prefault.spare = self.kv.allocator.num_reusable
        self.scheduler = Scheduler(self.kv, plan.max_batch_tokens, plan.max_batch_seqs)
        plan.itl_target_ms = model_config.inference_engine_config.state_manager.itl_target_ms
        self.pacer = Pacer(plan.itl_target_ms) if plan.itl_target_ms is not None else None
        if self.kv.capacity_tokens < plan.max_context:  # a longer sequence could never run
            plan.max_context = self.kv.capacity_tokens
            plan.reasons["max context"] = f"capped by the KV cache ({plan.kv_num_blocks} blocks of {plan.kv_block_size})"
        self.eos = frozenset(loaded.eos_token_ids)
        self.grammars = GrammarCompiler(self.tokenizer, loaded.cfg.vocab_size, loaded.eos_token_ids)
        """Compiles the requests' constraints (`InputProcessor` calls it at admission), cached per constraint."""
        self.requests: dict[int, _Request] = {}
        self._uids = itertools.count()
        self._seed_rng = random.Random(model_config.seed)  # None: fresh entropy in every process
        self.max_tracked = model_config.inference_engine_config.state_manager.max_tracked_sequences
        self.default_max_length = min(model_config.max_length or DEFAULT_MAX_LENGTH, plan.max_context)

    # --- requests ------------------------------------------------------------------------------------------------

    @property
    def limits(self) -> RequestLimits:
        """What this engine can take; `mii.engine.requests.InputProcessor` checks every request against it."""
        return RequestLimits(self.plan.max_context, self.default_max_length, self.kv.capacity_tokens,
                             self.loaded.cfg.vocab_size, self.max_tracked)

    def add_requests(self, requests: list[EngineRequest]) -> list[int]:
        """Admit all of `requests` (validated by `InputProcessor`) or none; their uids, in order."""
        if len(self.scheduler) + len(requests) > self.max_tracked:
            raise KVCacheError(f"max_tracked_sequences={self.max_tracked}: {len(self.scheduler)} sequences are in "
                               f"the engine, {len(requests)} more do not fit")
        uids = []
        for r in requests:
            uid = next(self._uids)
            seed = r.params.seed if r.params.seed is not None else self._seed_rng.getrandbits(63)
            seq = Sequence(uid, list(r.prompt_ids), r.max_total, r.params, seed)
            if r.grammar is not None:
                seq.constraint = r.grammar.matcher()
            if r.params.prompt_logprobs is not None:
                seq.prompt_logprobs = []
            p = r.params
            self.requests[uid] = _Request(seq, Detokenizer(self.tokenizer, seq.prompt_ids, p.stop,
                                                           p.include_stop_str_in_output, p.skip_special_tokens))
            self.scheduler.add(seq)
            uids.append(uid)
        return uids

    def abort(self, uid: int) -> None:
        req = self.requests.pop(uid, None)
        if req is not None:
            self._finish(req.seq)

    def _finish(self, seq: Sequence) -> None:
        """A sequence leaves: its blocks go back, its matcher is dropped."""
        self.scheduler.finish(seq)
        seq.constraint = None
        if self.pacer is not None:
            self.pacer.forget(seq.uid)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def num_queued(self, requests: list[EngineRequest] = ()) -> int:
        """Sequences that would wait for room (a running slot, KV blocks) if `requests` were added now; what a
        server's `max_waiting_requests` bounds."""
        return self.scheduler.num_queued(Sequence(-1, list(r.prompt_ids), r.max_total, prompt_logprobs=(
            [] if r.params.prompt_logprobs is not None else None)) for r in requests)

    # --- the loop ------------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        pacer = self.pacer
        if pacer is None:
            batch = self.scheduler.schedule()
        else:
            started = time.perf_counter()
            batch = pacer.schedule(self.scheduler, started)
        if not batch:
            return []
        results = self._run(batch)
        if pacer is not None:
            pacer.stepped(batch, started, time.perf_counter())
        return results

    def _run(self, batch: ScheduledBatch) -> list[RequestOutput]:
        try:
            parts, failed = [(batch, self.runner.run(batch))], []
        except Exception as e:
            if self.runner.tp_group is not None:
                raise
            log.error("engine step failed; running its %d sequences again in halves to find the cause",
                      len(batch.chunks), exc_info=True)
            parts, failed = self._isolate(batch.chunks, e)
        results = [self._fail(seq, e) for seq, e in failed]
        for part, out in parts:
            results += self._advance(part, out)
        return results

    def _isolate(self, chunks: list[ScheduledChunk], error: Exception):
        """Run a failed step's chunks again in halves (bisection: at most 2 × chunks runs) until every failure is
        pinned to one sequence: ([(sub-batch, its StepOutput)], [(sequence, its error)]). A chunk's result does not
        depend on its batch (the KV writes are its own, the sampling noise is counter-based)."""
        if len(chunks) == 1:
            return [], [(chunks[0].seq, error)]
        parts, failed = [], []
        for half in (chunks[: len(chunks) // 2], chunks[len(chunks) // 2:]):
            sub = ScheduledBatch(list(half))
            try:
                parts.append((sub, self.runner.run(sub)))
            except Exception as e:
                more_parts, more_failed = self._isolate(half, e)
                parts += more_parts
                failed += more_failed
        return parts, failed

    def _fail(self, seq: Sequence, e: Exception) -> RequestOutput:
        """End one request on `e`: a ValidationError (its own input could not be honoured, e.g. a constraint this
        tokenizer cannot write) as it is, anything else as an EngineStepError."""
        if isinstance(e, ValidationError):
            log.warning("request %d ended: %s", seq.uid, e)
            error = e
        else:
            log.error("request %d failed in an engine step and was dropped: %s: %s", seq.uid, type(e).__name__, e)
            error = EngineStepError(f"the request failed inside the engine ({type(e).__name__}: {e}); "
                                    "other requests were not affected")
        self._finish(seq)
        self.requests.pop(seq.uid, None)
        return RequestOutput(seq.uid, "", [], True, FinishReason.NONE, seq.num_prompt, seq.num_generated,
                             error=error)

    def _advance(self, batch: ScheduledBatch, out) -> list[RequestOutput]:
        """Apply one forward's sampled tokens: stops, detokenized text, logprobs; finished sequences leave."""
        self.scheduler.update(batch, out.tokens_by_uid())
        for uid, entries in out.prompt_logprobs.items():
            self.requests[uid].seq.prompt_logprobs.extend(entries)
        results = []
        s = out.sampled
        for row, uid in enumerate(out.uids):
            req = self.requests[uid]
            seq, p = req.seq, req.seq.params
            token = seq.token_ids[-1]
            n = seq.num_generated
            may_stop = n > p.min_new_tokens  # EOS and stop ids are masked before that in sampling
            try:
                if may_stop and ((token in self.eos and not p.ignore_eos) or token in p.stop_token_ids):
                    reason, text = FinishReason.STOP, req.detok.flush()  # the EOS token itself is not in the text
                else:
                    # a constrained request also ends where its grammar is complete
                    complete = seq.constraint is not None and seq.constraint.advance(token)
                    reason = (FinishReason.STOP if complete else
                              FinishReason.LENGTH if seq.num_tokens >= seq.max_total else FinishReason.NONE)
                    text = req.detok.add(token, final=reason is not FinishReason.NONE, check_stop=may_stop)
                    if req.detok.stopped:
                        reason = FinishReason.STOP
            except Exception as e:  # the detokenizer (or the matcher) failed on this request's tokens: it alone ends
                results.append(self._fail(seq, e))
                continue
            final = reason is not FinishReason.NONE
            lp = []
            if s.logprobs is not None and p.logprobs is not None:
                top = {}
                if p.logprobs > 0:
                    top = dict(zip(s.top_ids[row][: p.logprobs], s.top_logprobs[row][: p.logprobs]))
                lp = [(token, s.logprobs[row], top)]
            prompt_lp = None
            if seq.prompt_logprobs is not None and n == 1:  # the first prompt token has no logprob
                prompt_lp = [(seq.prompt_ids[0], None, {})] + seq.prompt_logprobs
            results.append(RequestOutput(uid, text, [token], final, reason, seq.num_prompt, n, lp,
                                         prompt_logprobs=prompt_lp, cached_tokens=seq.num_cached_tokens or 0))
            if final:
                self._finish(seq)
                del self.requests[uid]
        return results
