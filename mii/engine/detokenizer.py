"""Incremental, UTF-8 safe detokenization and stop-string matching, one object per request.

Text is released only once its bytes are complete (no U+FFFD mid-stream), and, when the request has stop
strings, only once no stop string can still start inside it; so streamed chunks concatenate to exactly the
final text, and a stop string that spans several tokens is cut out of the output.
"""
from __future__ import annotations

_CONTEXT = 5  # prompt tokens decoded along with the first new ones, so leading spaces come out right


class Detokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...] = (), include_stop: bool = False,
                 skip_special: bool = True):
        self.tokenizer = tokenizer
        self.include_stop = include_stop  # the stop string found stays at the end of the text
        self.skip_special = skip_special
        self.ids = list(prompt_ids[-_CONTEXT:])
        self.prefix = 0
        self.read = len(self.ids)
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""      # everything decoded so far (cut at a stop string once one is found)
        self.emitted = 0    # characters of self.text already handed out
        self.stopped = False

    def _decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, token_id: int, final: bool = False, check_stop: bool = True) -> str:
        """Append one token; return the text that became safe to emit (all of it when `final`)."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix: self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            start = len(self.text)
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
            if self.stop and check_stop:
                self._find_stop(max(0, start - self.hold))
        return self.flush() if final or self.stopped else self._release()

    def _find_stop(self, since: int) -> None:
        hits = [(i, -len(s)) for i, s in ((self.text.find(s, since), s) for s in self.stop) if i >= 0]
        if hits:
            at, minus_len = min(hits)  # the first stop string in the text (of two starting there, the longer)
            self.text = self.text[: at - minus_len if self.include_stop else at]
            self.stopped = True

    def _release(self) -> str:
        end = len(self.text) - self.hold if self.stop else len(self.text)
        if end <= self.emitted:
            return ""
        out, self.emitted = self.text[self.emitted: end], end
        return out

    def flush(self) -> str:
        out, self.emitted = self.text[self.emitted:], len(self.text)
        return out
