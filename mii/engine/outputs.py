"""The output side of the one request path: the engine's per-step `RequestOutput`s → stream chunks and final
`Response`s (text, token ids, logprobs, `FinishReason`).

`OutputProcessor` is used by `mii.pipeline` and by the replica for every gRPC call; `ResponseJoiner` is the one
place where streamed pieces become whole responses (the pipeline's and the replica's final answers, the load
balancer's merge for the HTTP routes, and `mii.client`'s streaming calls).
"""
from __future__ import annotations

from typing import Iterable, Optional

from mii.engine.requests import EngineRequest
from mii.response import FinishReason, Response


def logprob_entries(logprobs: Iterable[tuple]) -> list[dict]:
    """The `Response.logprobs` form of the engine's (token id, logprob, {top id: logprob}) triples."""
    return [{"token_id": token, "logprob": lp, "top_logprobs": top} for token, lp, top in logprobs]


class ResponseJoiner:
    """Folds stream chunks (one `Response` per sequence, text deltas) into whole responses: texts, token ids and
    logprobs appended; counts (cached tokens too) and finish reason from the latest piece."""

    def __init__(self, n: int = 0):
        self._texts: list[list[str]] = []
        self._tokens: list[list[int]] = []
        self._logprobs: list[Optional[list[dict]]] = []
        self._last: list[Optional[Response]] = []
        self._prompt_logprobs: list[Optional[list]] = []
        self._grow(n)

    def _grow(self, n: int) -> None:
        for _ in range(n - len(self._last)):
            self._texts.append([])
            self._tokens.append([])
            self._logprobs.append(None)
            self._last.append(None)
            self._prompt_logprobs.append(None)

    def add(self, chunk: list[Response]) -> None:
        self._grow(len(chunk))
        for i, r in enumerate(chunk):
            self.add_piece(i, r)

    def add_piece(self, i: int, r: Response) -> None:
        self._texts[i].append(r.generated_text)
        self._tokens[i].extend(r.token_ids or ())
        if r.logprobs is not None:
            if self._logprobs[i] is None:
                self._logprobs[i] = []
            self._logprobs[i].extend(r.logprobs)
        self._last[i] = r
        if r.prompt_logprobs is not None:
            self._prompt_logprobs[i] = r.prompt_logprobs

    def responses(self) -> list[Response]:
        return [Response("".join(text), r.prompt_length, r.generated_length, r.finish_reason, tokens, lps, plp,
                         r.cached_tokens)
                for text, tokens, lps, r, plp in zip(self._texts, self._tokens, self._logprobs, self._last,
                                                     self._prompt_logprobs)]


class OutputProcessor:
    """One call's sequences (its `EngineRequest`s, in order): each step's outputs become per-sequence pieces (the
    `return_full_text` prefix before the first), stream chunks, and at the end the final responses."""

    def __init__(self, requests: list[EngineRequest]):
        self.requests = requests
        self.joined = ResponseJoiner(len(requests))
        self._index: dict[int, int] = {}
        self.pending: set[int] = set()
        self._started = [False] * len(requests)
        self._latest = [self._idle(i, len(r.prompt_ids), 0, FinishReason.NONE, 0) for i, r in enumerate(requests)]

    def bind(self, uids: list[int]) -> None:
        """The engine's uids of the requests, in order."""
        self._index = {uid: i for i, uid in enumerate(uids)}
        self.pending = set(uids)

    @property
    def uids(self) -> list[int]:
        """The engine's uids of the requests, in order (as bound)."""
        return list(self._index)

    @property
    def finished(self) -> bool:
        return not self.pending

    def _idle(self, i: int, prompt_length: int, generated_length: int, reason: FinishReason,
              cached_tokens: int) -> Response:
        """A sequence's part of a chunk in which it had no news."""
        lp = [] if self.requests[i].params.logprobs is not None else None
        return Response("", prompt_length, generated_length, reason, [], lp, cached_tokens=cached_tokens)

    def update(self, outputs) -> dict[int, Response]:
        """Fold outputs in step order (one step's, or several steps' that a replica's sink held); each sequence that
        had news: its new piece (several steps' pieces joined into one)."""
        news: dict[int, Response] = {}
        for o in outputs:
            i = self._index[o.uid]
            req = self.requests[i]
            text = o.text
            if not self._started[i]:
                text, self._started[i] = req.prefix + text, True
            lp = logprob_entries(o.logprobs) if req.params.logprobs is not None else None
            piece = Response(text, o.prompt_length, o.generated_length, o.finish_reason, list(o.token_ids), lp,
                             cached_tokens=o.cached_tokens)
            if o.prompt_logprobs is not None:
                piece.prompt_logprobs = logprob_entries(o.prompt_logprobs)
            self.joined.add_piece(i, piece)
            if i in news:  # several steps' pieces of one sequence (a replica's sink held them): one piece
                both = ResponseJoiner(1)
                both.add_piece(0, news[i])
                both.add_piece(0, piece)
                piece = both.responses()[0]
            news[i] = self._latest[i] = piece
            if o.finished:
                self.pending.discard(o.uid)
        return news

    def chunk(self, news: dict[int, Response]) -> list[Response]:
        """A stream chunk: one `Response` per sequence; those without news repeat their counts with empty text."""
        return [news[i] if i in news else self._idle(i, s.prompt_length, s.generated_length, s.finish_reason,
                                                     s.cached_tokens)
                for i, s in enumerate(self._latest)]

    def responses(self) -> list[Response]:
        """The final responses, in request order (prompts × n)."""
        return self.joined.responses()
