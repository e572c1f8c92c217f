"""`mii.pipeline`: a non-persistent deployment living in this process (MII's API), with streaming."""
from __future__ import annotations

import dataclasses
import contextlib
import logging
import weakref
from typing import Iterator, Optional, Union

import torch

from mii.config import ModelConfig, build_config, split_kwargs
from mii.engine.engine import Engine, RequestOutput, finish_plan_and_build_runner
from mii.engine.params import GenerationParams
from mii.engine.plan import plan_device
from mii.errors import UnknownArgument, ValidationError
from mii.loading import gguf_file, load_model, resolve_source
from mii.response import Response

log = logging.getLogger("mii")

Prompt = Union[str, list[int]]
_LIST_VALUED = {"stop", "stop_token_ids"}


def normalize_prompts(prompts) -> tuple[list[Prompt], bool]:
    """(prompts as a list, whether a single prompt was given). A flat list of ints is one token-id prompt."""
    if isinstance(prompts, str):
        if not prompts:
            raise ValidationError("prompts", "the prompt is empty")
        return [prompts], True
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [list(prompts)], True
    if not isinstance(prompts, (list, tuple)):
        raise ValidationError("prompts", f"must be a string, a list of strings or token-id lists, got {type(prompts).__name__}")
    if not prompts:
        raise ValidationError("prompts", "the prompt list is empty")
    for i, p in enumerate(prompts):
        ok = isinstance(p, str) or (isinstance(p, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in p))
        if not ok:
            raise ValidationError(f"prompts[{i}]", f"must be a string or a list of token ids, got {p!r:.60}")
        if len(p) == 0:
            raise ValidationError(f"prompts[{i}]", "the prompt is empty")
    return [p if isinstance(p, str) else list(p) for p in prompts], False


def per_prompt_params(kwargs: dict, n: int, defaults: Optional[dict] = None) -> list[GenerationParams]:
    """One `GenerationParams` per prompt; a list value gives one value per prompt (vLLM-style)."""
    unknown = set(kwargs) - GenerationParams.names()
    if unknown:
        raise UnknownArgument(f"unknown generation argument(s): {', '.join(sorted(unknown))}")
    split = {}
    for k, v in kwargs.items():
        per_prompt = isinstance(v, (list, tuple)) and (
            k not in _LIST_VALUED or (v and all(isinstance(x, (list, tuple)) or x is None for x in v)))
        if per_prompt:
            if len(v) != n:
                raise ValidationError(k, f"has {len(v)} values for {n} prompts")
            split[k] = list(v)
    return [GenerationParams.from_kwargs({k: (split[k][i] if k in split else v) for k, v in kwargs.items()}, defaults)
            for i in range(n)]


class MIIPipeline:
    """With `tensor_parallel=N` this process is rank 0 of N (the others are spawned workers, or torchrun's
    processes): it schedules, samples and returns results. Under torchrun the other ranks' pipelines follow rank
    0's calls and return `[]`, or rank 0's results with `all_rank_output=True` (MII's behaviour)."""

    def __init__(self, model_config: ModelConfig, all_rank_output: bool = False):
        self.model_config = model_config
        self.all_rank_output = all_rank_output or model_config.all_rank_output
        from mii.parallel.group import active_group

        if active_group() is not None:  # the layers' rank and size are process-wide
            raise ValidationError("tensor_parallel", "a tensor-parallel pipeline is running in this process; "
                                                     "destroy() it before creating another pipeline")
        plan = plan_device(model_config)
        torch.set_num_threads(plan.num_threads)
        source = resolve_source(model_config.model_name_or_path)
        self.tp = None
        self._follower_runner = None
        self._destroyed = False
        self.engine: Optional[Engine] = None
        if model_config.tensor_parallel > 1:
            from mii.parallel.group import start

            if source.kind == "gguf":  # convert once here, before the other ranks read it
                gguf_file.cached_folder(source.path, source.name)
            self.tp = start(model_config.model_copy(update={"num_threads": plan.num_threads}), plan.device)
        try:
            loaded = load_model(source, plan.torch_dtype, torch.device(plan.device), model_config.tokenizer)
            if self.tp is None or self.tp.rank == 0:
                self.engine = Engine(loaded, model_config, plan, self.tp)
                self._plan = self.engine.plan
            else:
                self._plan, self._follower_runner = finish_plan_and_build_runner(loaded, model_config, plan, self.tp)
        except BaseException:
            if self.tp is not None:  # the other ranks may be anywhere in loading: stop them hard
                self.tp.close(graceful=False)
            raise
        self.tokenizer = loaded.tokenizer
        if self.tp is not None:  # a pipeline dropped without destroy() still stops its ranks
            weakref.finalize(self, self.tp.close)

    @property
    def engine_plan(self):
        self._engine()
        return self._plan

    @property
    def is_rank_0(self) -> bool:
        return self.tp is None or self.tp.rank == 0

    def _engine(self) -> Engine:
        if self._destroyed:
            raise RuntimeError("this pipeline was destroyed; create a new one with mii.pipeline(...)")
        return self.engine

    def destroy(self) -> None:
        """Free the model and KV cache (and stop the other tensor-parallel ranks); later calls raise RuntimeError."""
        self.engine = self._follower_runner = None
        self._destroyed = True
        if self.tp is not None:
            self.tp.close()
            self.tp = None

    def _follow(self):
        """A torchrun rank other than 0: run rank 0's steps for the length of its call."""
        self._engine()
        with torch.inference_mode():
            payload = self.tp.follow(self._follower_runner.execute)
        return payload if payload is not None and self.all_rank_output else []

    def _end_call(self, results) -> None:
        if self.tp is not None and self.tp.torchrun and not self.tp.closed:
            from mii.parallel.group import EndCall

            self.tp.send(EndCall(results if self.all_rank_output else None))

    # --- prompts -------------------------------------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValidationError("messages", "this model has no chat template")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def _submit(self, prompts, kwargs) -> tuple[list[int], list, list, bool]:
        engine = self._engine()
        plist, single = normalize_prompts(prompts)
        params = per_prompt_params(kwargs, len(plist))
        ids = [self.encode(p) for p in plist]
        for i, (tokens, p) in enumerate(zip(ids, params)):  # validate everything before queueing anything
            if not tokens:
                raise ValidationError(f"prompts[{i}]", "the prompt encodes to no tokens")
            engine.max_total(len(tokens), p)
        uids, expanded_prompts, expanded_params = [], [], []
        try:
            for prompt, tokens, p in zip(plist, ids, params):
                for j in range(p.n):
                    pj = p if p.n == 1 or p.seed is None else dataclasses.replace(p, seed=p.seed + j)
                    uids.append(engine.add_request(tokens, pj))
                    expanded_prompts.append(prompt)
                    expanded_params.append(pj)
        except Exception:
            for uid in uids:
                engine.abort(uid)
            raise
        return uids, expanded_prompts, expanded_params, single

    def _prefix(self, prompt: Prompt, p: GenerationParams) -> str:
        if not p.return_full_text:
            return ""
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt, skip_special_tokens=True)

    def _run(self, uids: list[int]) -> Iterator[list[RequestOutput]]:
        """Step the engine until every uid finishes; yield each step's outputs. Aborts leftovers on exit."""
        engine = self._engine()
        pending, mine = set(uids), set(uids)
        try:
            while pending:
                outs = engine.step()
                if not outs and not engine.has_unfinished():
                    raise RuntimeError("the engine stopped with requests outstanding")
                for o in outs:
                    if o.finished:
                        pending.discard(o.uid)
                yield [o for o in outs if o.uid in mine]
        finally:
            for uid in pending:
                engine.abort(uid)

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
        uids, plist, params, _ = self._submit(prompts, kwargs)
        index = {uid: i for i, uid in enumerate(uids)}
        texts = [[] for _ in uids]
        tokens = [[] for _ in uids]
        logprobs = [[] for _ in uids]
        results: list[Optional[Response]] = [None] * len(uids)
        for outs in self._run(uids):
            for o in outs:
                i = index[o.uid]
                texts[i].append(o.text)
                tokens[i].extend(o.token_ids)
                logprobs[i].extend(o.logprobs)
                if o.finished:
                    results[i] = Response(
                        self._prefix(plist[i], params[i]) + "".join(texts[i]), o.prompt_length, o.generated_length,
                        o.finish_reason, tokens[i],
                        [_lp_dict(x) for x in logprobs[i]] if params[i].logprobs is not None else None)
        return results

    def stream(self, prompts, **kwargs) -> Iterator[Union[Response, list[Response]]]:
        """Yield chunks as they are generated: a `Response` per chunk for a single prompt, or for a list of
        prompts a `list[Response]` (one per prompt, empty text when it had nothing new) per engine step."""
        uids, plist, params, single = self._submit(prompts, kwargs)
        index = {uid: i for i, uid in enumerate(uids)}
        started = [False] * len(uids)
        state = [Response("", 0, 0, "none") for _ in uids]
        for outs in self._run(uids):
            if not outs:
                continue
            # prompts without news this step repeat their counts and last finish_reason with empty text
            chunk = [Response("", s.prompt_length, s.generated_length, s.finish_reason) for s in state]
            for o in outs:
                i = index[o.uid]
                text = o.text if started[i] else self._prefix(plist[i], params[i]) + o.text
                started[i] = True
                chunk[i] = state[i] = Response(text, o.prompt_length, o.generated_length, o.finish_reason, o.token_ids,
                                               [_lp_dict(x) for x in o.logprobs] if params[i].logprobs is not None else None)
            if single and len(uids) == 1:
                yield chunk[0]
            else:
                yield chunk


def _lp_dict(x) -> dict:
    token, lp, top = x
    return {"token_id": token, "logprob": lp, "top_logprobs": top}


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
        from mii.envs import torchrun_env

        env = torchrun_env()
        if env is not None:
            cfg.tensor_parallel = env[1]
    return MIIPipeline(cfg, all_rank_output)
