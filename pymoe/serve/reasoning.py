"""A chat answer's reasoning split out of its content, as llama.cpp's `--reasoning-format deepseek` does.

    stream = ThinkStream(open_=prompt_ends_in_think)
    reasoning, content = stream.feed(piece)      # as the answer grows (streamed: delta.reasoning_content / content)
    reasoning, content = stream.close()          # the rest, once it is complete

What this is: a `<think>...</think>` block at the start of an answer (Qwen3, Qwen3.5, DeepSeek-R1, GLM-4.5) becomes
`reasoning_content`, the text after it `content` (its leading blanks dropped). A prompt that ends inside an open
`<think>` (the template wrote it: DeepSeek-R1's) starts the answer in the reasoning, as llama.cpp's "thinking forced
open". An unclosed block is all reasoning. A `<think>` later in the answer is content, as llama.cpp leaves it.
gpt-oss' reasoning is its analysis channel (serve/tools.py `Harmony.reasoning`), not tags.
What this is not: tool-call parsing (the content goes on to serve/tools.py), or /v1/completions and /v1/messages,
which keep the text as the model wrote it.
"""
from __future__ import annotations

from typing import Optional

OPEN, CLOSE = "<think>", "</think>"
FORMATS = ("none", "deepseek")  # --reasoning-format: none keeps the tags in the content


def think_markers(tokenizer) -> frozenset:
    """The ids of <think> and </think> where the vocabulary makes them control tokens (whose text a generation would
    leave out): shown in the answer, so that the block can be found (the scheduler's `preserved`)."""
    from gguf import TokenType

    ids = (p for m in (OPEN, CLOSE) for p in tokenizer.split_special(m) if isinstance(p, int))
    return frozenset(i for i in ids if tokenizer.types[i] != TokenType.USER_DEFINED)


def opens_thinking(prompt: str) -> bool:
    """The chat prompt ends inside an open <think> (the template wrote it for the model to continue)."""
    text = prompt.rstrip()
    return text.endswith(OPEN)


def _held(text: str, marker: str) -> int:
    """Where the longest suffix of text that is a proper prefix of marker starts (len(text): none)."""
    for start in range(max(0, len(text) - len(marker) + 1), len(text)):
        if marker.startswith(text[start:]):
            return start
    return len(text)


class ThinkStream:
    """The answer read as it grows: a leading <think> block's text out as reasoning, the rest as content. Text that
    may still turn into a tag is held back until the next piece (or close) decides it."""

    def __init__(self, open_: bool = False):
        self.state = "think" if open_ else "start"  # start -> think -> after -> content, or start -> content
        self.lead = True  # the reasoning's leading blanks are dropped
        self.buf = ""

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        self.buf += piece
        reasoning = content = ""
        while True:
            if self.state == "start":
                text = self.buf.lstrip()
                if text.startswith(OPEN):
                    self.state, self.buf = "think", text[len(OPEN):]
                elif not final and OPEN.startswith(text):  # blank, or the start of a tag: wait
                    return reasoning, content
                else:
                    self.state = "content"
            elif self.state == "think":
                if self.lead:
                    self.buf = self.buf.lstrip()
                    if not self.buf and not final:
                        return reasoning, content
                    self.lead = False
                end = self.buf.find(CLOSE)
                if end >= 0:
                    reasoning += self.buf[:end].rstrip()
                    self.state, self.buf = "after", self.buf[end + len(CLOSE):]
                    continue
                # held: a suffix that may become </think>, and trailing blanks (dropped if </think> comes next)
                cut = len(self.buf) if final else len(self.buf[:_held(self.buf, CLOSE)].rstrip())
                reasoning += self.buf[:cut].rstrip() if final else self.buf[:cut]
                self.buf = self.buf[cut:]
                return reasoning, content
            elif self.state == "after":
                self.buf = self.buf.lstrip()
                if not self.buf and not final:
                    return reasoning, content
                self.state = "content"
            else:
                content, self.buf = content + self.buf, ""
                return reasoning, content

    def close(self) -> tuple[str, str]:
        return self.feed("", final=True)


def split(text: str, open_: bool = False) -> tuple[Optional[str], str]:
    """A whole answer -> (its reasoning, None when there is none; its content): the stream's split, so a streamed
    and a whole answer agree."""
    stream = ThinkStream(open_)
    r1, c1 = stream.feed(text)
    r2, c2 = stream.close()
    return (r1 + r2) or None, c1 + c2
