"""Reasoning in a chat model's output: models that think in `<think>…</think>` before they answer (Qwen3, QwQ,
DeepSeek-R1 and its distills). The thinking becomes `reasoning_content`, the rest `content`.

Whether the answer starts inside the thinking is read from the rendered prompt, not guessed per model: DeepSeek-R1's
templates end the prompt with an open `<think>`, Qwen3's with `enable_thinking=False` with an empty closed block,
and otherwise the model opens the block itself. Like the tool-call parsers, one incremental machine (`feed` pieces,
then `finish`) serves the streamed and the whole answer, so they agree however the text was cut. Events:
`("reasoning", text)` and `("content", text)`.
"""
from __future__ import annotations

from typing import Optional

from mii.serving.tool_parsers import partial_suffix

OPEN, CLOSE = "<think>", "</think>"

PARSERS = ("think",)
"""The reasoning formats by the names `--reasoning-parser` takes (deepseek_r1 and qwen3 are the same format)."""
ALIASES = {"deepseek_r1": "think", "qwen3": "think"}


def starts_thinking(prompt: str) -> bool:
    """Whether the prompt leaves a `<think>` block open, so that the answer begins inside it."""
    return prompt.rfind(OPEN) > prompt.rfind(CLOSE)


class ThinkParser:
    """`<think>reasoning</think> content`. The answer may open the block itself (after whitespace) or begin inside
    it (`in_think`); whitespace after `</think>` is dropped; an answer that ends while thinking is all reasoning,
    and one that does not begin with `<think>` is all content."""

    def __init__(self, in_think: bool = False):
        self.state = "think" if in_think else "start"  # start → think → after → content
        self.buf = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        out: list[tuple[str, str]] = []
        self._advance(out, final=False)
        return out

    def finish(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self._advance(out, final=True)
        return out

    def _advance(self, out, final: bool) -> None:
        if self.state == "start":
            head = self.buf.lstrip()
            if head.startswith(OPEN):
                self.buf, self.state = head[len(OPEN):], "think"
            elif OPEN.startswith(head) and not final:
                return  # whitespace, or the beginning of <think>
            else:
                self.state = "content"
        if self.state == "think":
            i = self.buf.find(CLOSE)
            if i < 0:
                keep = 0 if final else partial_suffix(self.buf, CLOSE)
                _emit(out, "reasoning", self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                return
            _emit(out, "reasoning", self.buf[:i])
            self.buf, self.state = self.buf[i + len(CLOSE):], "after"
        if self.state == "after":
            self.buf = self.buf.lstrip()
            if not self.buf:
                return
            self.state = "content"
        _emit(out, "content", self.buf)
        self.buf = ""


def _emit(out: list, kind: str, text: str) -> None:
    if text:
        out.append((kind, text))


def detect(chat_template) -> Optional[str]:
    """The reasoning format of a chat template: "think" when it handles `</think>` blocks, else None."""
    text = chat_template if isinstance(chat_template, str) else " ".join((chat_template or {}).values()) \
        if isinstance(chat_template, dict) else ""
    return "think" if CLOSE in text else None


def resolve(option: str, chat_template) -> Optional[str]:
    """The parser a deployment uses: `option` ("auto": from the template; "none": never)."""
    if option == "none":
        return None
    if option == "auto":
        return detect(chat_template)
    name = ALIASES.get(option, option)
    if name not in PARSERS:
        raise ValueError(f"reasoning_parser={option!r}: expected auto, none, think, deepseek_r1 or qwen3")
    return name
