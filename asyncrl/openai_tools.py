"""OpenAI's tool calling on the policy endpoint (`tools`, `tool_choice`, assistant `tool_calls`,
role `tool`), written and read in the tool format the policy is trained in
(`environment.tool_format`, `asyncrl.environments.formats`): an outside agent framework drives the
live policy as its episodes do, and sees its calls as OpenAI `tool_calls`.

The conversation is rendered as training renders an episode: an assistant's call as the format
writes it, a tool's answer as the format's observation (ChatML: a user turn holding a
`<tool_response>`), the tools listed in a system message. A choice whose text holds a call is cut
just after it and answered with `tool_calls` and `finish_reason: "tool_calls"`; a call the format
cannot read is left as text.
"""

from __future__ import annotations

import json
import uuid
from typing import Literal

from pydantic import BaseModel, Field

from asyncrl.environments.formats import FORMATS, Malformed, ToolCall, ToolFormat

FunctionName = Field(..., pattern=r"^[A-Za-z0-9_-]{1,64}$")


class FunctionSpec(BaseModel):
    name: str = FunctionName
    description: str = Field("", max_length=4096)
    parameters: dict = Field(default_factory=dict)


class ToolSpec(BaseModel):
    type: Literal["function"]
    function: FunctionSpec


class FunctionCall(BaseModel):
    name: str = FunctionName
    arguments: str = Field(..., max_length=65_536)  # a JSON object, as a string (OpenAI's convention)


class AssistantToolCall(BaseModel):
    id: str = Field(..., max_length=128)
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolsError(ValueError):
    """A request whose tools or tool messages cannot be used: (message, param)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def tool_format(name: str) -> ToolFormat:
    return FORMATS[name]()


def uses_tools(body) -> bool:
    """The request lists tools (and does not forbid them), or its conversation holds tool turns."""
    listed = bool(body.tools) and body.tool_choice != "none"
    return listed or any(m.role == "tool" or m.tool_calls for m in body.messages)


def check_tools(body) -> None:
    if body.tool_choice not in (None, "auto", "none"):
        raise ToolsError(f"tool_choice={body.tool_choice!r} is not supported: use auto or none", "tool_choice")
    if body.tools and body.stream:
        raise ToolsError("stream with tools is not supported: ask without stream", "stream")
    for i, message in enumerate(body.messages):
        for call in message.tool_calls or []:
            try:
                arguments = json.loads(call.function.arguments)
            except json.JSONDecodeError as exc:
                raise ToolsError(f"messages[{i}].tool_calls: arguments are not JSON ({exc.msg})",
                                 f"messages[{i}].tool_calls") from exc
            if not isinstance(arguments, dict):
                raise ToolsError(f"messages[{i}].tool_calls: arguments must be a JSON object", f"messages[{i}].tool_calls")


def conversation(body, fmt: ToolFormat) -> list[dict]:
    """The request's messages as role/content turns a chat template renders: the tools listed in
    the system message; an assistant's calls written as the format writes them; a tool's answer
    as the user turn that carries it."""
    turns, tools = [], [t.function.model_dump() for t in body.tools or []] if body.tool_choice != "none" else []
    prompt = fmt.tools_prompt(tools) if tools else ""
    for message in body.messages:
        if message.role == "tool":
            turns.append({"role": "user", "content": fmt.response_message(message.content or "")})
        elif message.role == "assistant" and message.tool_calls:
            calls = "".join(fmt.call_text(ToolCall(c.function.name, json.loads(c.function.arguments)))
                            for c in message.tool_calls)
            turns.append({"role": "assistant", "content": (message.content or "") + calls})
        else:
            turns.append({"role": message.role, "content": message.content or ""})
    if prompt:
        if turns and turns[0]["role"] == "system":
            turns[0] = {"role": "system", "content": f"{turns[0]['content']}\n\n{prompt}"}
        else:
            turns.insert(0, {"role": "system", "content": prompt})
    return turns


def plain_conversation(body, fmt: ToolFormat) -> str:
    """The conversation as one text, for a model with no chat template (the tiny model): the
    prompt's turns joined by lines as a task's prompt is, then every later turn as an episode
    continues: the assistant's text and calls, each tool's answer as the format's observation."""
    messages, head = body.messages, []
    while messages and messages[0].role in ("system", "user"):
        head.append(messages[0].content or "")
        messages = messages[1:]
    text = "\n".join(head)
    for message in messages:
        if message.role == "tool":
            text += fmt.observation(message.content or "")
        else:
            text += (message.content or "") + "".join(
                fmt.call_text(ToolCall(c.function.name, json.loads(c.function.arguments))) for c in message.tool_calls or [])
    return text


def call_of(text: str, fmt: ToolFormat) -> tuple[int, dict | None]:
    """Where a choice's text ends when it holds a call (the characters kept), and the call as an
    OpenAI `tool_calls` entry (None when the format cannot read it: the text stays as it is)."""
    end = fmt.call_end(text)
    if end is None:
        return len(text), None
    call = fmt.parse(text[:end])
    if isinstance(call, Malformed):
        return len(text), None
    return end, {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}


def content_before_call(text: str, fmt: ToolFormat) -> str | None:
    """The assistant's words before its call (None when there are none, as OpenAI sends)."""
    opening = getattr(fmt, "opening", None)
    before = text[: text.rfind(opening)] if opening and opening in text else ""
    return before.strip() or None
