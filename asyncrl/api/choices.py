"""One choice's text as its tokens are sampled: incremental detokenisation, stop strings, a tool
call, and the part of the text that is safe to stream (pure: the endpoint runs it off the event
loop, a batch of tokens at a time).

A stream and a plain answer are the same `ChoiceText` read two ways, so they agree token for
token: the text ends before the first stop string to complete (the tokens up to the one that
completes it are counted, no further), or just after a call the tool format can read (then the
choice has `tool_calls`, and the words before the call are its content). Text that may still turn
into a stop string or a call (a prefix of one at the end of the text, or a call's opening) is
held back from the stream until it is decided, so a stream never shows what the answer cuts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from asyncrl.messages.structs import FinishReason


@dataclass
class Delta:
    """What one choice gained from a batch of its tokens: `content` safe to show now; its tokens,
    their log-probs and alternatives (`(token text, log-prob)`, most likely first); a `tool_call`
    (an OpenAI `tool_calls` entry) once read; `finish` on its last delta."""

    index: int
    content: str = ""
    tokens: list[int] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    alternatives: list[list[tuple[str, float]]] = field(default_factory=list)
    tool_call: dict | None = None
    finish: str | None = None
    version: int | None = None


class ChoiceText:
    """`stops`: the request's stop strings; `calls`: a `CallReader` (a chat request with tools) or
    None; `start`: text written for the model before it samples (the start of a required call),
    `start_tokens` its length in tokens (counted as the choice's own)."""

    def __init__(self, index: int, tokenizer, stops: list[str], calls=None, start: str = "", start_tokens: int = 0,
                 alternatives: bool = False):
        self.index, self.tokenizer, self.stops, self.calls = index, tokenizer, stops, calls
        self.longest_stop = max((len(s) for s in stops), default=0)
        self.want_alternatives = alternatives
        self.ids: list[int] = []
        self.text = start  # everything decided so far (the choice's whole text at the end)
        self.shown = 0  # characters of `text` released as content
        self._prefix, self._read = 0, 0  # incremental detokenisation offsets into `ids`
        self.start_tokens = start_tokens
        self.tool_call: dict | None = None
        self.finish: str | None = None
        self.versions: set[int] = set()
        if calls is not None and start:  # a forced start that is a whole call (the tiny format's "?")
            end = calls.end(start)
            call = calls.read(start[:end]) if end is not None else None
            if call is not None:
                self.text, self.tool_call, self.finish = start[:end], call, "tool_calls"

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def completion_tokens(self) -> int:
        return self.start_tokens + len(self.ids)

    def feed(self, steps) -> Delta:
        """Take this choice's tokens (`StepToken`s, in order); a delta of what they add."""
        delta = Delta(self.index)
        for step in steps:
            if self.done:
                break
            self._take(step, delta)
        delta.content = self._release()
        delta.finish = self.finish
        delta.tool_call = self.tool_call if self.finish == "tool_calls" else None
        return delta

    def _take(self, step, delta: Delta) -> None:
        self.ids.append(step.token)
        self.versions.add(step.version)
        delta.version = step.version
        delta.tokens.append(step.token)
        delta.token_texts.append(self.tokenizer.decode([step.token]))
        delta.logprobs.append(step.logprob)
        if self.want_alternatives:
            delta.alternatives.append([] if step.top is None else [
                (self.tokenizer.decode([int(i)]), float(lp)) for i, lp in zip(*step.top) if math.isfinite(lp)])
        before = self.tokenizer.decode(self.ids[self._prefix:self._read], skip_special_tokens=True)
        after = self.tokenizer.decode(self.ids[self._prefix:], skip_special_tokens=True)
        new = after[len(before):] if after.startswith(before) else after
        if new.endswith("\ufffd") and step.finish is None:
            new = ""  # an incomplete multi-byte character: wait for the rest
        else:
            self._prefix, self._read = self._read, len(self.ids)
        searched_from = max(0, len(self.text) - self.longest_stop + 1)
        self.text += new
        cuts = [self.text.find(s, searched_from) for s in self.stops if s in self.text[searched_from:]]
        if cuts:
            self.text, self.finish = self.text[: min(cuts)], "stop"
        if self.calls is not None:
            end = self.calls.end(self.text)
            call = self.calls.read(self.text[:end]) if end is not None else None
            if call is not None:  # the tokens past the call were sampled, not answered
                self.text, self.tool_call, self.finish = self.text[:end], call, "tool_calls"
        if self.finish is None and step.finish is not None:
            self.finish = "stop" if step.finish is FinishReason.EOS else "length"

    def end(self, finish: str) -> Delta:
        """End the choice here (its rows gave no more tokens): what is left of its text, and `finish`."""
        self.finish = self.finish or finish
        return Delta(self.index, self._release(), finish=self.finish)

    def _release(self) -> str:
        """Content safe to show: all of it once the choice ended (the call's text aside), else up
        to where a stop string or a call might still begin."""
        if self.finish == "tool_calls":
            safe = self.calls.pending_from(self.text)
        elif self.finish is not None:
            safe = len(self.text)
        else:
            safe = len(self.text) - _partial_stop(self.text, self.stops)
            if self.calls is not None:
                safe = min(safe, self.calls.pending_from(self.text))
        if safe <= self.shown:
            return ""
        piece, self.shown = self.text[self.shown:safe], safe
        return piece

    @property
    def content(self) -> str | None:
        """The final message content: the words before a call (None when there are none), else the text."""
        if self.finish == "tool_calls":
            return self.calls.content_before(self.text)
        return self.text


def _partial_stop(text: str, stops: list[str]) -> int:
    """How many characters at the end of `text` are a proper prefix of some stop string."""
    return max((k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])),
               default=0)
