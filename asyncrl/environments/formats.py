"""Tool-call formats: where a policy's turn ends (the stop string), how its call is read, and how
the environment's answer is written where the model's chat template has no say (pure functions).
With a chat template, the context around a call comes from the template
(`asyncrl.environments.templates`); a format supplies the call syntax and, for a template that
ignores tools, the documented fallback (its tools prompt, its tool-answer message).

The observation's tokens are appended to the episode exactly as the tokenizer encodes the rendered
text, once; the policy's own tokens are never decoded and encoded again: the tokens trained are
the tokens sampled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Malformed:
    """A turn that ended like a tool call but cannot be read as one: what is wrong (the policy
    reads it as its observation)."""

    reason: str


class ToolFormat(Protocol):
    def call_end(self, turn_text: str) -> int | None:
        """Where a call ends in a policy turn's text (the characters it keeps), or None: no call."""

    def parse(self, turn_text: str) -> ToolCall | Malformed: ...

    def observation(self, text: str) -> str:
        """A model without a chat template: what follows the call in the context, up to the next turn."""

    def call_start(self, name: str | None) -> str:
        """The text that starts a call (of function `name`, or of any): what the policy endpoint
        writes for the model when a request requires a call."""

    def pending_from(self, text: str) -> int:
        """Where text that may still become a call starts (its opening, or a prefix of the opening
        at the end); `len(text)` when none can."""

    def call_text(self, call: ToolCall) -> str:
        """How the policy writes `call` (an outside agent's earlier calls, rendered back)."""

    def response_message(self, text: str) -> str:
        """A tool's answer as the content of a chat message (for models with a chat template)."""

    def tools_prompt(self, tools: list[dict]) -> str:
        """What tells the model which tools it has (OpenAI `tools`: `{"name", "description",
        "parameters"}` each), in a system message; "" where the format has no such text."""


class ChatMLTools:
    """The Hermes / Qwen2.5 tool format for ChatML models (SmolLM2, Qwen2): a call is
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; its result comes back as a
    `<tool_response>` in a user turn, and the assistant's turn starts again."""

    stop = "</tool_call>"
    opening = "<tool_call>"

    def call_end(self, turn_text: str) -> int | None:
        at = turn_text.find(self.stop)
        return None if at < 0 else at + len(self.stop)

    def parse(self, turn_text: str) -> ToolCall | Malformed:
        start = turn_text.rfind(self.opening)
        if start < 0:
            return Malformed(f"the call must begin with {self.opening}")
        body = turn_text[start + len(self.opening): len(turn_text) - len(self.stop)].strip()
        try:
            call = json.loads(body)
        except json.JSONDecodeError as exc:
            return Malformed(f"the call is not JSON ({exc.msg} at character {exc.pos})")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return Malformed('the call must be a JSON object with a "name"')
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return Malformed('"arguments" must be a JSON object')
        if not isinstance(arguments, dict):
            return Malformed('"arguments" must be a JSON object')
        return ToolCall(call["name"], arguments)

    def observation(self, text: str) -> str:
        return f"\n{self.response_message(text)}\n"

    def call_start(self, name: str | None) -> str:
        return self.opening + (f'\n{{"name": {json.dumps(name)}, "arguments": ' if name is not None else "\n")

    def pending_from(self, text: str) -> int:
        at = text.find(self.opening)
        if at >= 0:
            return at
        partial = next((k for k in range(min(len(self.opening) - 1, len(text)), 0, -1)
                        if text.endswith(self.opening[:k])), 0)
        return len(text) - partial

    def response_message(self, text: str) -> str:
        """A tool's answer as the content of the user turn that carries it."""
        return f"<tool_response>\n{text}\n</tool_response>"

    def call_text(self, call: ToolCall) -> str:
        return f"{self.opening}{json.dumps({'name': call.name, 'arguments': call.arguments})}{self.stop}"

    def tools_prompt(self, tools: list[dict]) -> str:
        listed = "\n".join(json.dumps({"type": "function", "function": tool}) for tool in tools)
        return ("You can call functions to help with the request. Their signatures, one JSON object "
                f"per line:\n<tools>\n{listed}\n</tools>\nTo call one, write "
                '<tool_call>{"name": <function name>, "arguments": <a JSON object of arguments>}</tool_call>; '
                "its result comes back in <tool_response></tool_response>.")


class TinyTools:
    """The tiny model's format (its character vocabulary): a turn answers with a digit, or asks the
    lookup tool by starting with any other character (one character, the call); the answer comes
    back as `=<value>`, and the next turn answers. Any non-digit asks, so that a random policy asks
    often enough to learn what an answer is for (with a single call character it asked one time
    in 30, and the guesses it was rewarded for taught it never to ask)."""

    def call_end(self, turn_text: str) -> int | None:
        return 1 if turn_text and not turn_text[0].isdigit() else None

    def parse(self, turn_text: str) -> ToolCall | Malformed:
        return ToolCall("lookup")

    def observation(self, text: str) -> str:
        return f"={text}"

    def call_text(self, call: ToolCall) -> str:
        return "?"

    def response_message(self, text: str) -> str:
        return self.observation(text)

    def call_start(self, name: str | None) -> str:
        return "?"

    def pending_from(self, text: str) -> int:
        return 0 if text and not text[0].isdigit() else len(text)  # the first character decides

    def tools_prompt(self, tools: list[dict]) -> str:
        return ""


FORMATS: dict[str, type] = {"chatml": ChatMLTools, "tiny": TinyTools}
