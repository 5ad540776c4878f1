"""OpenAI's tool calling on the policy endpoint (`tools`, `tool_choice`, assistant `tool_calls`,
role `tool`), written and read as the policy is trained: the conversation rendered in pieces by
the model's chat template (`asyncrl.environments.templates`, the same pieces a training episode
is made of), calls read in the tool format of the run (`environment.tool_format`).

* `tool_choice`: `auto` (the default with tools), `none` (no tools in the prompt, no call read),
  `required` and a named function. The last two are honoured by writing the start of the call
  for the model (the format's opening, and the function's name: `ToolFormat.call_start`); the
  rest of the call is the model's own, so a call it cannot finish comes back as text.
* A choice whose text holds a call of an offered function is cut just after it and answered with
  `tool_calls` and `finish_reason: "tool_calls"`. A function with `strict: true` gets only calls
  whose arguments validate against its parameters' JSON schema; any other call stays text.
"""

from __future__ import annotations

import json
import uuid
from typing import Literal

import jsonschema
from pydantic import BaseModel, ConfigDict, Field

from asyncrl.environments.formats import FORMATS, Malformed, ToolCall, ToolFormat
from asyncrl.environments.templates import encode

FunctionName = Field(..., pattern=r"^[A-Za-z0-9_-]{1,64}$")


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = FunctionName
    description: str = Field("", max_length=4096)
    parameters: dict = Field(default_factory=dict)
    strict: bool | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionSpec


class FunctionCall(BaseModel):
    name: str = FunctionName
    arguments: str = Field(..., max_length=65_536)  # a JSON object, as a string (OpenAI's convention)


class AssistantToolCall(BaseModel):
    id: str = Field(..., max_length=128)
    type: Literal["function"] = "function"
    function: FunctionCall


class NamedFunction(BaseModel):
    name: str = FunctionName


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["auto", "none", "required"] | NamedToolChoice


class ToolsError(ValueError):
    """A request whose tools or tool messages cannot be used: (message, param)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def tool_format(name: str) -> ToolFormat:
    return FORMATS[name]()


def offered(body) -> list[ToolSpec]:
    """The tools a request lets the model call (none with `tool_choice: "none"`)."""
    return [] if body.tool_choice == "none" else list(body.tools or [])


def check_tools(body) -> None:
    """Refuse what cannot be honoured: a tool choice naming no offered tool, a strict function
    whose parameters are not a JSON schema, an earlier call whose arguments are not a JSON object."""
    names = {t.function.name for t in body.tools or []}
    choice = body.tool_choice
    if choice == "required" and not names:
        raise ToolsError("tool_choice=required needs tools", "tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise ToolsError(f"tool_choice names {choice.function.name!r}, which is not in tools", "tool_choice")
    for i, tool in enumerate(body.tools or []):
        if tool.function.strict:
            try:
                jsonschema.validators.validator_for(tool.function.parameters).check_schema(tool.function.parameters)
            except jsonschema.SchemaError as exc:
                raise ToolsError(f"tools[{i}].function.parameters is not a JSON schema: {exc.message}",
                                 f"tools[{i}].function.parameters") from exc
    for i, message in enumerate(body.messages):
        for call in message.tool_calls or []:
            try:
                arguments = json.loads(call.function.arguments)
            except json.JSONDecodeError as exc:
                raise ToolsError(f"messages[{i}].tool_calls: arguments are not JSON ({exc.msg})",
                                 f"messages[{i}].tool_calls") from exc
            if not isinstance(arguments, dict):
                raise ToolsError(f"messages[{i}].tool_calls: arguments must be a JSON object", f"messages[{i}].tool_calls")


def _turn(message) -> dict:
    turn = {"role": message.template_role, "content": message.text}
    if message.tool_call_id is not None:
        turn["tool_call_id"] = message.tool_call_id
    return turn


def conversation_ids(body, render, tokenizer) -> list[int]:
    """The request's context as an episode's: the prompt (with the offered tools), then for each
    earlier assistant turn its text and the continuation that follows it, each piece encoded on
    its own (`asyncrl.environments.templates`). A conversation that ends with an assistant turn is
    continued from it."""
    messages = body.messages
    first = next((i for i, m in enumerate(messages) if m.role == "assistant"), len(messages))
    tools = [t.model_dump(exclude_none=True) for t in offered(body)]
    ids = encode(tokenizer, render.prompt([_turn(m) for m in messages[:first]], tools))
    i = first
    while i < len(messages):
        message = messages[i]
        calls = [ToolCall(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
        ids += encode(tokenizer, render.assistant(message.text, calls))
        end = next((j for j in range(i + 1, len(messages)) if messages[j].role == "assistant"), len(messages))
        if end > i + 1:
            ids += encode(tokenizer, render.continuation([_turn(m) for m in messages[i + 1:end]]))
        i = end
    return ids


def forced_start(body, fmt: ToolFormat) -> str:
    """The text written for the model before it samples: the start of a call when the request
    requires one (`required`, or a named function), else nothing."""
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        return fmt.call_start(choice.function.name)
    return fmt.call_start(None) if choice == "required" else ""


class CallReader:
    """Reads a choice's call in the tool format, for the functions a request offers."""

    def __init__(self, fmt: ToolFormat, tools: list[ToolSpec]):
        self.format = fmt
        self.functions = {t.function.name: t.function for t in tools}

    def end(self, text: str) -> int | None:
        return self.format.call_end(text)

    def pending_from(self, text: str) -> int:
        """Where text that may still turn into a call starts (held back from a stream)."""
        return self.format.pending_from(text)

    def read(self, text: str) -> dict | None:
        """The call that `text` (cut just after it) holds, as an OpenAI `tool_calls` entry; None when
        the format cannot read it, it names a function not offered, or a strict function's
        arguments do not validate."""
        call = self.format.parse(text)
        if isinstance(call, Malformed) or call.name not in self.functions:
            return None
        function = self.functions[call.name]
        if function.strict:
            try:
                jsonschema.validate(call.arguments, function.parameters)
            except Exception:  # noqa: BLE001 - invalid, or a schema no call can satisfy (an unresolvable $ref)
                return None
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}

    def content_before(self, text: str) -> str | None:
        """The assistant's words before its call (None when there are none, as OpenAI sends)."""
        return text[: self.format.pending_from(text)].strip() or None
