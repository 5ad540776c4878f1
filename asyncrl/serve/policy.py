"""The `policy` application: OpenAI-compatible completions from the latest weights, tagged with
the weight version that answered (`weight_version` field, `x-asyncrl-weight-version` header).

The endpoint pulls new weights from the learner (a named actor) when its version moves, instead of
joining the weight delivery: Serve replicas come and go independently of the run. A version is
read with the learner's incarnation id (`weight_tag`): a run restarted from its checkpoint, or a
new run, starts another line of versions whose numbers may be lower than the one served, and the
endpoint takes it (`follows`), where comparing numbers alone would serve the dead line's weights
until the new counter overtook them.

No `from __future__ import annotations` here (see `asyncrl.serve.train`).
"""

import asyncio
import time
import uuid
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from asyncrl.config import Config
from asyncrl.generation import build_engine
from asyncrl.openai_api import (ChatCompletionRequest, CompletionRequest, OpenAIError, chat_response,
                                completion_response, describe_invalid_request, openai_error)
from asyncrl.run.placement import LEARNER_NAME, NAMESPACE
from asyncrl.serve.guards import config_from_args

VERSION_HEADER = "x-asyncrl-weight-version"

policy_api = FastAPI(title="asyncrl policy")


@policy_api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return openai_error(400, *describe_invalid_request(exc.errors()))


@policy_api.exception_handler(OpenAIError)
async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
    return openai_error(exc.status, exc.message, exc.param, exc.code)


def follows(served: tuple[str, int], learner: tuple[str, int]) -> bool:
    """Whether the endpoint takes the learner's weights: `(incarnation id, version)` served and the
    learner's. The same incarnation: a newer version. Another one: any version (a restart from a
    checkpoint rolls back, a new run starts again at 0), once the endpoint follows a learner at
    all; the model's own weights ("") give way to any version above them."""
    (served_line, served_version), (line, version) = served, learner
    if line == served_line or not served_line:
        return version > served_version
    return True


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=64)
@serve.ingress(policy_api)
class PolicyServer:
    def __init__(self, config: Config, poll_s: float = 1.0):
        self.config = config
        self.engine, self.tokenizer = build_engine(config.model)
        self.poll_s = poll_s
        self.incarnation = ""  # the learner incarnation whose weights are served ("": the model's own)
        self.started_at = time.time()
        self._task = None
        if config.serve.follow_learner:
            self._task = asyncio.get_event_loop().create_task(self._follow_weights())

    async def _follow_weights(self) -> None:
        while True:
            try:
                learner = ray.get_actor(LEARNER_NAME, namespace=NAMESPACE)
                incarnation, version = await learner.weight_tag.remote()
                if follows((self.incarnation, self.engine.weight_version), (incarnation, version)):
                    version, weights = await learner.weights.remote()
                    await asyncio.to_thread(self.engine.update_weights, weights.items(), version)
                    self.incarnation = incarnation
                    del weights  # not held while waiting for the next version: a second copy of the model
            except ValueError:
                pass  # no learner running (yet): serve the weights we have
            except ray.exceptions.RayError:
                pass  # the learner went away meanwhile (a restart): the next look finds the new one
            await asyncio.sleep(self.poll_s)

    @policy_api.get("/models")
    def models(self) -> dict:
        t = self.config.task
        # `task` and `max_response_tokens` let `asyncrl eval --endpoint` score the task this policy learns.
        return {"object": "list", "data": [{"id": self.config.model.name, "object": "model", "owned_by": "asyncrl",
                                            "weight_version": self.engine.weight_version,
                                            "weight_incarnation": self.incarnation, "started_at": self.started_at,
                                            "task": {"name": t.name, "seed": t.seed, "num_eval_prompts": t.num_eval_prompts,
                                                     "eval_path": t.eval_path or t.path},
                                            "max_response_tokens": self.config.engine.max_response_tokens}]}

    @policy_api.post("/completions")
    async def completions(self, body: CompletionRequest) -> JSONResponse:
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        # Tokenising a long prompt takes a while: off the event loop, which serves everyone.
        ids = await asyncio.to_thread(lambda: [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts])
        return await self._respond(body, ids, chat=False)

    @policy_api.post("/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest) -> JSONResponse:
        from asyncrl.openai_tools import (ToolsError, check_tools, conversation, plain_conversation, tool_format,
                                          uses_tools)

        fmt = None
        if uses_tools(body):  # in the tool format the policy is trained in
            try:
                check_tools(body)
            except ToolsError as exc:
                raise OpenAIError(400, str(exc), exc.param) from exc
            fmt = tool_format(self.config.environment.tool_format)
        if self.config.model.use_chat_template:
            messages = (conversation(body, fmt) if fmt is not None else
                        [{"role": m.role, "content": m.content} for m in body.messages])
            ids = await asyncio.to_thread(self.tokenizer.apply_chat_template, messages, add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
        else:
            text = (plain_conversation(body, fmt) if fmt is not None else
                    "\n".join(m.content for m in body.messages))
            ids = await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=False)
        calls = fmt if fmt is not None and body.tools and body.tool_choice != "none" else None
        return await self._respond(body, [list(ids)], chat=True, tool_format=calls)

    async def _respond(self, body, prompt_ids: list[list[int]], chat: bool, tool_format=None) -> JSONResponse:
        from asyncrl.openai_api import (check_model_name, check_request_size, generate_choices, logprobs_asked,
                                        stream_events)

        check_model_name(body.model, self.config.model.name)
        check_request_size(prompt_ids, body.n, body.max_tokens)
        asked = logprobs_asked(body, chat)  # alternatives per token, or None: no log-probs
        limit = self.engine.max_positions
        for ids in prompt_ids:
            if not ids:
                raise OpenAIError(400, "the prompt is empty", "prompt")
            if len(ids) + body.max_tokens > limit:
                raise OpenAIError(400, f"prompt ({len(ids)} tokens) + max_tokens ({body.max_tokens}) exceeds the "
                                       f"model's context of {limit} tokens", "max_tokens")
        version = self.engine.weight_version
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if body.stream:
            events = stream_events(self.engine, self.tokenizer, prompt_ids, body, chat, request_id,
                                   self.config.model.name, version, asked)
            return StreamingResponse(events, media_type="text/event-stream", headers={VERSION_HEADER: str(version)})
        choices = await generate_choices(self.engine, self.tokenizer, prompt_ids, body, asked or 0, tool_format)
        build = chat_response if chat else completion_response
        payload = build(request_id, self.config.model.name, choices, version, asked)
        return JSONResponse(payload, headers={VERSION_HEADER: str(version)})


def build_policy(args: dict[str, Any]) -> serve.Application:
    return PolicyServer.bind(config_from_args(args))
