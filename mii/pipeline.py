"""`mii.pipeline`: a non-persistent deployment living in this process (MII's API), with streaming.

A call goes through the one request path: `InputProcessor` (prompts and keyword arguments → validated engine
requests), `Engine.add_requests`, the engine's steps, `OutputProcessor` (outputs → chunks and `Response`s).
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import threading
import weakref
from typing import Iterator, Optional, Union

import torch

from mii.config import DEVICE_MAP_DEFAULT, ModelConfig, build_config, split_kwargs
from mii.engine.engine import Engine, RequestOutput
from mii.engine.factory import build_engine
from mii.engine.outputs import OutputProcessor
from mii.envs import torchrun_env
from mii.engine.requests import chat_messages
from mii.errors import PipelineDestroyedError, UnknownArgument, ValidationError
from mii.parallel.placement import gpu_count, pipeline_device
from mii.response import Response

log = logging.getLogger("mii")


class MIIPipeline:
    """With `tensor_parallel=N` this process is rank 0 of N (the others are spawned workers, or torchrun's
    processes): it schedules, samples and returns results. Under torchrun the other ranks' pipelines follow rank
    0's calls and return `[]`, or rank 0's results with `all_rank_output=True` (MII's behaviour).

    Calls may interleave (two `stream` generators consumed in turns) and may come from several threads at once:
    whichever call steps the engine puts each other call's outputs in that call's mailbox, so none is lost, and the
    calls' sequences share the engine's steps (batched together, as a server's requests are). The engine is
    touched under one lock: admitting a call's requests, a step, aborting what a call left; a thread about to step
    first lets the calls arriving from other threads admit theirs, so that they join that step."""

    def __init__(self, model_config: ModelConfig, all_rank_output: bool = False):
        self.model_config = model_config
        self.all_rank_output = all_rank_output or model_config.all_rank_output
        built = build_engine(model_config)
        self.engine: Optional[Engine] = built.engine
        self.tokenizer = built.tokenizer
        self.tp_group = built.tp_group
        self._plan = built.plan
        self._follower_runner = built.follower
        self._inputs = built.input_processor() if built.engine is not None else None
        self._destroyed = False
        self._mailboxes: dict[int, collections.deque] = {}  # call → its outputs not yet taken, one list per step
        self._owner: dict[int, int] = {}  # uid → call
        self._calls = itertools.count()
        # held to touch the engine (a step, admitting or aborting requests) and the owners of its sequences: calls
        # from several threads would otherwise step it at once, or a step could finish a sequence before its call
        # owned it (its outputs lost, the call waiting forever)
        self._lock = threading.RLock()
        # calls of other threads about to admit their requests: a thread about to step waits for them, so that their
        # sequences join this step. (Python's locks are not fair: the stepping thread took the lock straight back
        # after each step, and a call from another thread could wait for the whole of the first call.)
        self._arriving = 0
        self._arriving_count = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        if self.tp_group is not None:  # a pipeline dropped without destroy() still stops its ranks
            weakref.finalize(self, self.tp_group.close)

    @property
    def engine_plan(self):
        self._engine()
        return self._plan

    @property
    def is_rank_0(self) -> bool:
        return self.tp_group is None or self.tp_group.rank == 0

    def _engine(self) -> Engine:
        if self._destroyed:
            raise PipelineDestroyedError("this pipeline was destroyed; create a new one with mii.pipeline(...)")
        return self.engine

    def destroy(self) -> None:
        """Free the model and KV cache (and stop the other tensor-parallel ranks); later calls raise
        `PipelineDestroyedError` (a RuntimeError)."""
        self.engine = self._follower_runner = self._inputs = None
        self._mailboxes.clear()
        self._owner.clear()
        self._destroyed = True
        if self.tp_group is not None:
            self.tp_group.close()
            self.tp_group = None

    def _follow(self):
        """A torchrun rank other than 0: run rank 0's steps for the length of its call."""
        self._engine()
        with torch.inference_mode():
            payload = self.tp_group.follow(self._follower_runner.execute)
        return payload if payload is not None and self.all_rank_output else []

    def _end_call(self, results) -> None:
        if self.tp_group is not None and self.tp_group.torchrun and not self.tp_group.closed:
            from mii.parallel.group import EndCall

            self.tp_group.send(EndCall(results if self.all_rank_output else None))

    # --- prompts -------------------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Chat messages ({role, content} dicts) as the model's chat template writes them."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValidationError("messages", "this model has no chat template")
        flat = chat_messages(messages)
        try:
            return self.tokenizer.apply_chat_template(flat, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        except Exception as e:  # the template's own errors on these messages (jinja2's, a missing key, a type)
            raise ValidationError("messages", f"the chat template cannot render them: {type(e).__name__}: "
                                              f"{str(e)[:200]}") from None

    def _submit(self, prompts, kwargs) -> tuple[int, OutputProcessor, bool]:
        """Validate and admit one call's requests (all or none): (call id, its output processor, single prompt)."""
        engine = self._engine()
        requests, single = self._inputs.process(prompts, kwargs)
        outputs = OutputProcessor(requests)
        with self._arriving_count:
            self._arriving += 1
        with self._lock:
            try:
                uids = engine.add_requests(requests)
                outputs.bind(uids)
                call = next(self._calls)
                self._mailboxes[call] = collections.deque()
                self._owner.update((uid, call) for uid in uids)
            finally:
                with self._arriving_count:
                    self._arriving -= 1
                self._arrived.notify_all()
        return call, outputs, single

    def _steps(self, call: int, outputs: OutputProcessor) -> Iterator[list[RequestOutput]]:
        """This call's outputs, one list per engine step, until `outputs` has seen every sequence finish. Aborts
        what is left when closed early."""
        box = self._mailboxes[call]
        try:
            while not outputs.finished:
                if box:
                    group = box.popleft()
                    failed = next((o.error for o in group if o.error is not None), None)
                    if failed is not None:  # the engine dropped that sequence; the rest of the call is aborted
                        raise failed
                    yield group
                else:
                    with self._lock:
                        while self._arriving and not box:  # (the lock is let go while waiting: they admit theirs)
                            self._arrived.wait(0.05)
                        if not box:  # (another thread's step, while this one waited, may have filled it)
                            self._step()
        finally:
            with self._lock:
                self._mailboxes.pop(call, None)
                for uid in outputs.pending:
                    self._owner.pop(uid, None)
                    if self.engine is not None:
                        self.engine.abort(uid)

    def _step(self) -> None:
        engine = self._engine()
        outs = engine.step()
        if not outs and not engine.has_unfinished():
            raise RuntimeError("the engine stopped with requests outstanding")
        by_call: dict[int, list[RequestOutput]] = {}
        for o in outs:
            call = self._owner.get(o.uid)
            if call is not None:
                by_call.setdefault(call, []).append(o)
                if o.finished:
                    del self._owner[o.uid]
        for call, group in by_call.items():
            self._mailboxes[call].append(group)

    # --- public --------------------------------------------------------------------------------------------------

    def __call__(self, prompts, **kwargs) -> list[Response]:
        """Generate for one prompt or many; returns one Response per prompt (n per prompt when n > 1)."""
        if not self.is_rank_0:
            return self._follow()
        try:
            results = self._generate(prompts, kwargs)
        except BaseException:
            with contextlib.suppress(Exception):  # followers must not wait; the original error is the one to see
                self._end_call(None)
            raise
        self._end_call(results)
        return results

    def _generate(self, prompts, kwargs) -> list[Response]:
        call, outputs, _ = self._submit(prompts, kwargs)
        with contextlib.closing(self._steps(call, outputs)) as steps:
            for outs in steps:
                outputs.update(outs)
        return outputs.responses()

    def stream(self, prompts, **kwargs) -> Iterator[Union[Response, list[Response]]]:
        """Yield chunks as they are generated: a `Response` per chunk for a single prompt, or for a list of
        prompts a `list[Response]` (one per sequence, empty text when it had nothing new) per engine step."""
        call, outputs, single = self._submit(prompts, kwargs)
        # closed explicitly: a stream closed early (or an error here) aborts what is left at once, not whenever
        # the garbage collector gets to the inner generator
        with contextlib.closing(self._steps(call, outputs)) as steps:
            for outs in steps:
                chunk = outputs.chunk(outputs.update(outs))
                yield chunk[0] if single and len(chunk) == 1 else chunk


def pipeline(model_name_or_path: Optional[str] = None, model_config=None, all_rank_output: bool = False,
             **kwargs) -> MIIPipeline:
    """Load a model into this process: `mii.pipeline("path/or/hub-id" | "file.gguf" | None for the default)`."""
    (known,), rest = split_kwargs(kwargs, ModelConfig)
    if rest:
        raise UnknownArgument(f"unknown argument(s) for mii.pipeline: {', '.join(sorted(rest))}")
    if model_name_or_path is not None:
        known["model_name_or_path"] = str(model_name_or_path)
    cfg = build_config(ModelConfig, model_config, **known)
    if "tensor_parallel" not in cfg.model_fields_set:  # MII: under a launcher, every rank of WORLD_SIZE
        env = torchrun_env()
        if env is not None:
            cfg.tensor_parallel = env[1]
    if cfg.device_map != DEVICE_MAP_DEFAULT:  # MII's placement: the GPU(s) to run on, or a clear refusal
        cfg = cfg.model_copy(update={"device": pipeline_device(cfg, gpu_count()), "device_map": DEVICE_MAP_DEFAULT})
    return MIIPipeline(cfg, all_rank_output)
