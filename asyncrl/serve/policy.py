"""The `policy` application: OpenAI-compatible completions from the latest weights, tagged with
the weight version that answered (`weight_version` field, `x-asyncrl-weight-version` header).

It generates on the run's own engine (`asyncrl.serve.policy_engine`: the embedded engine batched
across requests, or SGLang), and pulls new weights from the learner (a named actor) when its
version moves, instead of joining the weight delivery: Serve replicas come and go independently of
the run, and a query must never hold a generator's delivery.

Abuse is bounded before it costs: with `serve.api_key` (or ASYNCRL_API_KEY) set, a caller without
that bearer key is a 401 on every route but /health, before anything else (`guards.BearerKey`); a
body over `serve.max_body_mb` is a 413 before it is read (`guards.BodyLimit`); tokenising,
detokenising and building answers run off the event loop; a request whose client goes away is
cancelled and its sequences leave the engine at the next window; a request's KV cache is checked
against the bound before it is admitted. `GET /health` answers from the loop alone, with the
engine's load.

A version is read with the learner's incarnation id (`weight_tag`): a run restarted from its
checkpoint, or a new run, starts another line of versions whose numbers may be lower than the one
served, and the endpoint takes it (`follows`), where comparing numbers alone would serve the dead
line's weights until the new counter overtook them.

No `from __future__ import annotations` here (see `asyncrl.serve.train`).
"""

import asyncio
import json
import os
import time
import uuid
from typing import Any

import ray
import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from asyncrl.api.requests import (ChatCompletionRequest, CompletionRequest, OpenAIError, describe_invalid_request,
                                  openai_error)
from asyncrl.config import Config
from asyncrl.run.placement import LEARNER_NAME, NAMESPACE
from asyncrl.serve import guards
from asyncrl.serve.guards import BodyLimit, BodyTooLarge, config_from_args
from asyncrl.serve.policy_requests import Prepared, answer, chat_prompt, events

VERSION_HEADER = "x-asyncrl-weight-version"

policy_api = FastAPI(title="asyncrl policy")
policy_api.add_middleware(BodyLimit, refuse=lambda exc: openai_error(413, str(exc.detail), None, "request_too_large"))


def _unauthorized() -> JSONResponse:
    response = openai_error(401, "missing or wrong API key: send it as `Authorization: Bearer <key>`", None,
                            "invalid_api_key")
    response.headers["www-authenticate"] = "Bearer"
    return response


# Added last, so outermost: a caller without the key gets its 401 before any body is read.
policy_api.add_middleware(guards.BearerKey, refuse=_unauthorized)


@policy_api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return openai_error(400, *describe_invalid_request(exc.errors()))


@policy_api.exception_handler(OpenAIError)
async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
    return openai_error(exc.status, exc.message, exc.param, exc.code)


@policy_api.exception_handler(BodyTooLarge)
async def _body_too_large(request: Request, exc: BodyTooLarge) -> JSONResponse:
    return openai_error(413, str(exc.detail), None, "request_too_large")


async def until_disconnected(request: Request | None) -> None:
    """Returns once the client of `request` has gone (never without a request: a direct call)."""
    if request is None:
        await asyncio.Event().wait()
    while (await request.receive())["type"] != "http.disconnect":
        pass


def follows(served: tuple[str, int], learner: tuple[str, int]) -> bool:
    """Whether the endpoint takes the learner's weights: `(incarnation id, version)` served and the
    learner's. The same incarnation: a newer version. Another one: any version (a restart from a
    checkpoint rolls back, a new run starts again at 0), once the endpoint follows a learner at
    all; the model's own weights ("") give way to any version above them."""
    (served_line, served_version), (line, version) = served, learner
    if line == served_line or not served_line:
        return version > served_version
    return True


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=256)
@serve.ingress(policy_api)
class PolicyServer:
    def __init__(self, config: Config, poll_s: float = 1.0, policy=None):
        """`policy`: an engine already built (`asyncrl.serve.policy_engine`), else one of the run's kind."""
        from asyncrl.environments.templates import renderer
        from asyncrl.models.loading import load_tokenizer
        from asyncrl.api.images import RequestImages
        from asyncrl.api.tools import tool_format
        from asyncrl.models.vision import image_prep
        from asyncrl.serve.policy_engine import build_policy_engine

        guards.BODY_LIMIT["value"] = config.serve.max_body_mb << 20  # through the module: one per process
        guards.API_KEY["value"] = config.serve.api_key or os.environ.get("ASYNCRL_API_KEY", "")
        torch.set_num_threads(config.engine.threads)  # an engine beside the run's: its thread budget
        self.config = config
        self.policy = policy if policy is not None else build_policy_engine(config)
        self.tokenizer = load_tokenizer(config.model)
        self.format = tool_format(config.environment.tool_format)
        # A vision-language model's image processor (None: a text-only model) and the limits of
        # image_url parts; the images themselves only on the embedded engine for now.
        self.images = RequestImages.of(config, image_prep(config.model, self.tokenizer),
                                       getattr(self.policy, "takes_images", True))
        # The conversation's pieces as training renders an episode's, with the run's template options
        # (`task.chat_template_kwargs`) and the model's template (`model.chat_template`, through
        # load_tokenizer); a model without a tool template: the documented fallback
        # (`asyncrl.environments.templates`).
        self.render = renderer(self.tokenizer, self.format, config.model.use_chat_template,
                               config.task.chat_template_kwargs)
        self.poll_s = poll_s
        self.incarnation = ""  # the learner incarnation whose weights are served ("": the model's own)
        self.started_at = time.time()
        self.weight_errors = 0
        self._task = None
        if config.serve.follow_learner:
            self._task = asyncio.get_event_loop().create_task(self._follow_weights())

    async def _follow_weights(self) -> None:
        while True:
            try:
                learner = ray.get_actor(LEARNER_NAME, namespace=NAMESPACE)
                incarnation, version = await learner.weight_tag.remote()
                if follows((self.incarnation, self.policy.weight_version), (incarnation, version)):
                    version, weights = await learner.weights.remote()
                    await self.policy.load(weights.items(), version)
                    self.incarnation = incarnation
                    del weights  # not held while waiting for the next version: a second copy of the model
            except ValueError:
                pass  # no learner running (yet): serve the weights we have
            except ray.exceptions.RayError:
                self.weight_errors += 1  # a learner restarting: the next poll finds the new one
            await asyncio.sleep(self.poll_s)

    @policy_api.get("/models")
    def models(self) -> dict:
        t = self.config.task
        # `task` and `max_response_tokens` let `asyncrl eval --endpoint` score the task this policy learns.
        return {"object": "list", "data": [{"id": self.config.model.name, "object": "model", "owned_by": "asyncrl",
                                            "weight_version": self.policy.weight_version,
                                            "weight_incarnation": self.incarnation, "started_at": self.started_at,
                                            "task": {"name": t.name, "seed": t.seed, "num_eval_prompts": t.num_eval_prompts,
                                                     "eval_path": t.eval_path or t.path},
                                            "max_response_tokens": self.config.engine.max_response_tokens}]}

    @policy_api.get("/health")
    async def health(self) -> dict:
        """Liveness, the weight version and the engine's load (requests, sequences, KV block)."""
        return {"ok": True, "engine": self.config.engine.name, "weight_version": self.policy.weight_version,
                "weight_errors": self.weight_errors, **self.policy.stats()}

    @policy_api.post("/completions")
    async def completions(self, body: CompletionRequest, request: Request = None):
        body.refuse_unhonoured()
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        # Tokenising long prompts takes a while: off the event loop, which serves everyone.
        ids = await asyncio.to_thread(lambda: [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts])
        return await self._respond(Prepared.of(self, body, ids, chat=False), request)

    @policy_api.post("/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request = None):
        body.refuse_unhonoured()
        # Images are decoded, stored and processed there too (`asyncrl.api.images`).
        ids, start, images = await asyncio.to_thread(chat_prompt, self, body)
        return await self._respond(Prepared.of(self, body, [ids], chat=True, start=start, images=[images]), request)

    async def _await_version(self, body) -> None:
        """Hold a request until the weights it asks for are served (`min_weight_version`, or an
        exact `weight_version` above the one served), up to `serve.version_wait_s`; else 409."""
        exact, least = body.weight_version, body.min_weight_version
        wanted = max(v for v in (exact, least, 0) if v is not None)
        deadline = time.monotonic() + self.config.serve.version_wait_s
        while self.policy.weight_version < wanted and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        held = self.policy.weight_version
        if exact is not None and held != exact:
            raise OpenAIError(409, f"weight_version {exact} is not held: this endpoint serves version {held}"
                                   + (" (a newer one replaced it)" if held > exact else
                                      f" (waited {self.config.serve.version_wait_s:g}s, serve.version_wait_s)"),
                              "weight_version", "weight_version_not_held")
        if least is not None and held < least:
            raise OpenAIError(409, f"min_weight_version {least} is not held within {self.config.serve.version_wait_s:g}s "
                                   f"(serve.version_wait_s): this endpoint serves version {held}",
                              "min_weight_version", "weight_version_not_held")

    async def _respond(self, prepared: Prepared, request: Request | None):
        request_id = f"{'chatcmpl' if prepared.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if prepared.body.weight_version is not None or prepared.body.min_weight_version is not None:
            await self._await_version(prepared.body)
        steps = prepared.start(self.policy)  # a request that cannot fit is refused here
        if prepared.body.stream:
            version = self.policy.weight_version
            return StreamingResponse(events(prepared, steps, request_id, self.config.model.name, version),
                                     media_type="text/event-stream", headers={VERSION_HEADER: str(version)})
        work = asyncio.ensure_future(answer(prepared, steps, request_id, self.config.model.name,
                                            self.policy.weight_version))
        # A client gone before its answer: the answer is cancelled and its sequences freed (a stream
        # is cancelled by Starlette itself when its client goes).
        gone = asyncio.ensure_future(until_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
        if not work.done() or work.cancelled():
            return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
        payload = work.result()
        exact = prepared.body.weight_version
        if exact is not None and set(payload.get("weight_versions", [payload["weight_version"]])) != {exact}:
            raise OpenAIError(409, f"weight_version {exact} was replaced while the answer was generated (its tokens "
                                   f"came from versions {payload.get('weight_versions')})", "weight_version",
                              "weight_version_not_held")
        encoded = await asyncio.to_thread(json.dumps, payload)  # megabytes for many choices with log-probs
        return Response(encoded, media_type="application/json", headers={VERSION_HEADER: str(payload["weight_version"])})


def build_policy(args: dict[str, Any]) -> serve.Application:
    """The application; its replica asks Ray for what a generator asks (its engine is of that kind)."""
    config = config_from_args(args)
    options = {"num_cpus": 0, "num_gpus": config.engine.gpus, "resources": dict(config.engine.resources)}
    return PolicyServer.options(ray_actor_options=options).bind(config)
