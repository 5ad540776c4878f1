"""Conversations with tools as the model's own chat template writes them, in pieces: the one
rendering that training episodes (`asyncrl.environments.episodes`) and the policy endpoint
(`asyncrl.api.tools`) share.

A conversation's context is the concatenation of each piece encoded on its own:

* the **prompt**: the messages before the first assistant turn, with the tools, up to the
  assistant's generation prompt (`apply_chat_template(..., tools=..., add_generation_prompt=True)`);
* each **assistant turn**: in an episode, the tokens the policy sampled (never decoded and encoded
  again); at the endpoint, an earlier turn's text as the template writes it, its calls included;
* each **continuation**: what follows an assistant turn up to the next generation prompt: the
  turn's end, the tool answers (an episode's observation) or user turns, the next assistant header.

A continuation is cut from the template's rendering of a conversation whose assistant turn is a
sentinel: the text after the sentinel. Pieces meet at the template's special tokens (`<|im_end|>`,
`<|im_start|>`), which encode alike whole or apart, so for ChatML templates the pieces' tokens are
those of the whole conversation rendered at once (tests/test_templates.py, Qwen2.5's template and
SmolLM2's).

A template that ignores `tools` (SmolLM2's own) gets the documented fallback, through the same
template: the tool format's own instructions (`ToolFormat.tools_prompt`) in the system message,
and each tool answer as the user turn that carries it (`ToolFormat.response_message`, Hermes style).
A model with no chat template (`model.use_chat_template=false`, the tiny one) has plain text pieces:
the prompt's turns joined by lines, the format's own call and observation text.
"""

from __future__ import annotations

import json

from asyncrl.environments.formats import ToolCall, ToolFormat

_SENTINEL = "\u2063asyncrl-turn\u2063"  # text no conversation holds: where the assistant's turn is
_PROBE_TOOL = {"type": "function", "function": {"name": "asyncrl_probe", "description": "probe",
                                                "parameters": {"type": "object", "properties": {}}}}


class TemplateError(ValueError):
    """A chat template this rendering cannot cut into pieces (named at start-up)."""


def function_tools(tools: list[dict] | None) -> list[dict]:
    """OpenAI's `tools` entries (`{"type": "function", "function": {...}}`), as templates read them."""
    return [t if "function" in t else {"type": "function", "function": t} for t in tools or []]


class ChatTemplate:
    """The pieces of conversations in `tokenizer`'s chat template, for tools in `fmt`; every
    rendering passes `template_kwargs` (`task.chat_template_kwargs`, e.g. Qwen3's `enable_thinking`)."""

    def __init__(self, tokenizer, fmt: ToolFormat, template_kwargs: dict | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError("model.use_chat_template=true but the tokenizer has no chat template")
        self.tokenizer, self.format = tokenizer, fmt
        self.template_kwargs = dict(template_kwargs or {})
        user = [{"role": "user", "content": "x"}]
        # A template that writes tools renders a prompt with them differently from one without.
        self.knows_tools = self._render(user, [_PROBE_TOOL], True) != self._render(user, None, True)
        ended = self._render([*user, {"role": "assistant", "content": _SENTINEL}], None, False)
        if _SENTINEL not in ended:
            raise TemplateError("the chat template does not write an assistant turn's content as it is")
        self.turn_end = ended[ended.index(_SENTINEL) + len(_SENTINEL):]
        self.header = self._render(user, None, True)  # a conversation up to the assistant's turn

    def _render(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=generation_prompt,
                                                  tokenize=False, **self.template_kwargs)

    def _turns(self, messages: list[dict]) -> list[dict]:
        """Messages as this template takes them: the fallback writes tool answers as user turns."""
        if self.knows_tools:
            return messages
        return [{"role": "user", "content": self.format.response_message(m.get("content") or "")}
                if m["role"] == "tool" else m for m in messages]

    def prompt(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The text of a conversation's first messages up to the assistant's generation prompt."""
        tools = function_tools(tools)
        if tools and not self.knows_tools:
            listed = self.format.tools_prompt([t["function"] for t in tools])
            if messages and messages[0]["role"] == "system":
                messages = [{"role": "system", "content": f"{messages[0]['content']}\n\n{listed}"}, *messages[1:]]
            else:
                messages = [{"role": "system", "content": listed}, *messages]
            tools = []
        return self._render(self._turns(messages), tools, True)

    def continuation(self, messages: list[dict]) -> str:
        """What follows an assistant turn when `messages` (tool answers, user turns) come next: the
        turn's end, their turns, and the next generation prompt."""
        rendered = self._render([{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL},
                                 *self._turns(messages)], None, True)
        return rendered[rendered.index(_SENTINEL) + len(_SENTINEL):]

    def observation(self, text: str) -> str:
        """An episode's observation: a tool's answer and the next generation prompt."""
        return self.continuation([{"role": "tool", "content": text}])

    def assistant(self, content: str, calls: list[ToolCall]) -> str:
        """An earlier assistant turn's text as the template writes it (its calls in the template's own
        call syntax where it has one, else the format's), without the turn's end."""
        message = {"role": "assistant", "content": content}
        if calls and self.knows_tools:
            message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in calls]
            rendered = self._render([{"role": "user", "content": "x"}, message], None, False)
            if rendered.startswith(self.header) and rendered.endswith(self.turn_end):
                return rendered[len(self.header): len(rendered) - len(self.turn_end)]
        return content + "".join(self.format.call_text(c) for c in calls)


class PlainText:
    """A model without a chat template: the pieces as plain text in the tool format."""

    def __init__(self, fmt: ToolFormat):
        self.format = fmt
        self.knows_tools = False

    def prompt(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        return "\n".join(m.get("content") or "" for m in messages)

    def continuation(self, messages: list[dict]) -> str:
        return "".join(self.format.observation(m.get("content") or "") if m["role"] == "tool"
                       else "\n" + (m.get("content") or "") for m in messages)

    def observation(self, text: str) -> str:
        return self.format.observation(text)

    def assistant(self, content: str, calls: list[ToolCall]) -> str:
        return content + "".join(self.format.call_text(c) for c in calls)


def renderer(tokenizer, fmt: ToolFormat, use_chat_template: bool,
             template_kwargs: dict | None = None) -> ChatTemplate | PlainText:
    return ChatTemplate(tokenizer, fmt, template_kwargs) if use_chat_template else PlainText(fmt)


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def tool_call_of(message_call: dict) -> ToolCall:
    """An OpenAI `tool_calls` entry as a `ToolCall` (its arguments a JSON object string)."""
    return ToolCall(message_call["function"]["name"], json.loads(message_call["function"]["arguments"]))
