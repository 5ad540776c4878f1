"""Ray Serve applications: `train` (the running system and its status), `policy`
(OpenAI-compatible completions from the latest weights) and `reward-<name>` (one per reward
endpoint, redeployable while training runs).

The deployments are a thin control plane: the training actors live outside Serve (a replica that
fails a health check is restarted and would lose their state), the controller owns them.

    serve run configs/serve.yaml            # both applications, trains until stopped
    serve run asyncrl.serve_app:build_train overrides="model=tiny task=tiny"

The policy endpoint pulls new weights from the learner (a named actor) when its version moves,
instead of joining the broadcast group: Serve replicas come and go independently, and a
fixed-size collective cannot lose a member.

No `from __future__ import annotations` here: Serve's ingress wrapper resolves route annotations
at runtime, and string annotations would turn request bodies into query parameters.
"""

import asyncio
import hmac
import json
import os
import time
import uuid
from dataclasses import asdict
from typing import Any

import msgspec

import ray
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel, Field
from ray import serve

from asyncrl.config import Config, ConfigError, compose
from asyncrl.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    chat_response,
    completion_response,
    describe_invalid_request,
    openai_error,
)
from asyncrl.rewards.endpoint import RewardEndpoint
from asyncrl.schema import RewardRequest
from asyncrl.generation import build_engine
from asyncrl.monitor import REWARD_KEY, RunMonitor
from asyncrl.supervisor import Supervisor
from asyncrl.system import LEARNER_NAME, NAMESPACE, TrainingSystem

VERSION_HEADER = "x-asyncrl-weight-version"
INITIAL_DATA_MARKER = '<script id="initial-data" type="application/json">null</script>'
STATUS_PAGE = open(os.path.join(os.path.dirname(__file__), "static", "status.html"), encoding="utf-8").read()


def _config_from_args(args: dict[str, Any]) -> Config:
    """Builder args (strings from `serve run` or the config file) -> a validated Config."""
    overrides = args.get("overrides", "")
    overrides = overrides.split() if isinstance(overrides, str) else list(overrides)
    overrides += [f"{k}={v}" for k, v in args.items() if k != "overrides"]
    return compose(overrides)


# --- train -------------------------------------------------------------------------------------------


class RouteBody(BaseModel):
    match: str = Field("*", min_length=1, max_length=256)
    endpoints: list[str] = Field(..., min_length=1, max_length=16)
    combine: str = Field("first", pattern="^(first|mix)$")
    weights: list[float] = Field(default_factory=list, max_length=16)
    dense: list[str] = Field(default_factory=list, max_length=16)
    dense_lambda_fail: float = 0.25
    dense_lambda_pass: float = 0.025


class RewardRoutesBody(BaseModel):
    routes: list[RouteBody] = Field(..., min_length=1, max_length=64)


train_api = FastAPI(title="asyncrl train")

# The admin token of this replica's controller (set in its __init__; one controller per process),
# and the reward endpoint's token (set in RewardService.__init__).
_ADMIN_TOKEN = {"value": ""}
_REWARD_TOKEN = {"value": ""}
MAX_ADMIN_BODY_BYTES = 1 << 20
MAX_SCORE_BODY_BYTES = 16 << 20


def _route_path(request: Request) -> str:
    """The path inside the application (Serve mounts it under its route prefix)."""
    path, root = request.scope.get("path", ""), request.scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def _bearer_matches(request: Request, token: str) -> bool:
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


def _from_loopback(request: Request) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(request.client.host if request.client else "").is_loopback
    except ValueError:
        return False


def _too_large(request: Request, limit: int) -> bool:
    try:
        return int(request.headers.get("content-length", "0")) > limit
    except ValueError:
        return True


def _refuse(status: int, message: str) -> JSONResponse:
    return JSONResponse({"detail": message}, status_code=status)


async def admin_guard(request: Request, call_next):
    """Middleware of the train app: /admin routes check the token from the headers alone, before
    the body is read (an unauthenticated caller makes the server parse nothing). Constant time."""
    if _route_path(request).startswith("/admin"):
        token = _ADMIN_TOKEN["value"]
        if not token:
            return _refuse(403, "admin routes are disabled: set serve.admin_token or ASYNCRL_ADMIN_TOKEN")
        if not _bearer_matches(request, token):
            return _refuse(401, "missing or wrong admin token")
        if _too_large(request, MAX_ADMIN_BODY_BYTES):
            return _refuse(413, f"admin request body over {MAX_ADMIN_BODY_BYTES} bytes")
    return await call_next(request)


async def reward_guard(request: Request, call_next):
    """Middleware of a reward app: POST /score runs untrusted code and models for its caller. With
    a token set (serve.reward_token / ASYNCRL_REWARD_TOKEN) every call must carry it; with none,
    only this machine may call. Checked from the headers, before the body is read."""
    if request.method == "POST":
        token = _REWARD_TOKEN["value"]
        if token and not _bearer_matches(request, token):
            return _refuse(401, "missing or wrong reward token")
        if not token and not _from_loopback(request):
            return _refuse(403, "the reward endpoint runs submitted code: from other hosts it needs a token "
                                "(set serve.reward_token or ASYNCRL_REWARD_TOKEN and send it as a bearer token)")
        if _too_large(request, MAX_SCORE_BODY_BYTES):
            return _refuse(413, f"score request body over {MAX_SCORE_BODY_BYTES} bytes")
    return await call_next(request)


train_api.middleware("http")(admin_guard)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100, health_check_period_s=10)
@serve.ingress(train_api)
class TrainController:
    def __init__(self, config: Config):
        from asyncrl.checkpoint import resolve_run_dir

        self.config = config
        # Through the imported module: Serve pickles this class by value, so a bare global here
        # would be a copy, not the dict `admin_guard` reads.
        from asyncrl import serve_app

        serve_app._ADMIN_TOKEN["value"] = config.serve.admin_token or os.environ.get("ASYNCRL_ADMIN_TOKEN", "")
        # A restarted app with resume=true (and the same trainer.run_dir) continues that run.
        self.run_dir = resolve_run_dir(config.trainer.run_dir, config.resume, prefix="serve-")
        os.makedirs(self.run_dir, exist_ok=True)
        self.supervisor = Supervisor(config, self.run_dir)  # restarts the system from a checkpoint if an actor dies
        # The same watch loop as `asyncrl train`. A service runs until stopped: no stall deadline.
        self.monitor = RunMonitor(self.supervisor, self.run_dir, stall_timeout_s=float("inf"), history_limit=5000)
        self.failure: str | None = None
        self.started_at = time.time()
        self._task = asyncio.get_event_loop().create_task(self._watch())

    @property
    def system(self) -> TrainingSystem:
        return self.supervisor.system

    @property
    def history(self) -> list[dict]:
        return self.monitor.records

    async def _watch(self, plot_every_s: float = 60.0) -> None:
        plotted_at = time.monotonic()
        while True:
            await asyncio.sleep(1.0)
            try:
                await asyncio.to_thread(self.monitor.poll)
                if time.monotonic() - plotted_at > plot_every_s and self.monitor.records:
                    await asyncio.to_thread(self.monitor.write_plots)
                    plotted_at = time.monotonic()
            except Exception as exc:  # could not recover: the health check reports it
                self.failure = str(exc)
                return

    @train_api.get("/status")
    def status(self) -> dict:
        status = self.system.status()
        # Where each generator runs and the weights it holds (its full counters stay internal).
        status["generators"] = [{key: g.get(key) for key in ("generator_id", "node_ip", "version", "busy_fraction")}
                                for g in status["generators"]]
        status["run_dir"] = self.run_dir
        status["started_at"] = self.started_at
        status["reward_curve"] = [(r["step"], r[REWARD_KEY]) for r in self.history[-200:]]
        return status

    @train_api.get("/")
    def page(self) -> HTMLResponse:
        """The status page: facts, curves and queues, drawn in the browser from /status and /metrics.
        The data of the moment is in the page itself, so it is drawn at first paint (a screenshot
        or a slow link never shows an empty page)."""
        try:
            initial = json.dumps({"status": self.status(), "metrics": self.metrics()}, default=str, allow_nan=False)
        except ValueError:  # a NaN somewhere: the page fetches the data itself
            initial = "null"
        # Inside <script>, "</" would end the element: escape it as JSON allows.
        element = INITIAL_DATA_MARKER.replace(">null<", ">" + initial.replace("</", "<\\/") + "<")
        return HTMLResponse(STATUS_PAGE.replace(INITIAL_DATA_MARKER, element, 1))

    @train_api.get("/metrics")
    def metrics(self, last: int = 500) -> list[dict]:
        return self.history[-max(1, min(last, 5000)):]

    @train_api.post("/admin/reward_routes")
    async def set_reward_routes(self, body: RewardRoutesBody) -> dict:
        """Change the hybrid reward mix while training runs (validated; takes effect on the next scores)."""
        try:
            routes = await self.system.actors["assembler"].set_reward_routes.remote(
                [route.model_dump() for route in body.routes])
        except Exception as exc:  # a route the config schema rejects
            raise HTTPException(400, f"invalid reward routes: {getattr(exc, 'cause', exc)}") from None
        return {"routes": routes}

    @train_api.post("/admin/checkpoint")
    async def save_checkpoint(self) -> dict:
        """Write a checkpoint now (between two learner steps)."""
        path = await self.system.actors["learner"].save_checkpoint.remote()
        return {"path": path}

    @train_api.get("/metrics/prometheus")
    def prometheus(self):
        """The run's counters and gauges in the Prometheus text format (for a scrape job)."""
        from fastapi.responses import Response

        from asyncrl.metrics import prometheus_text

        return Response(prometheus_text(self.system.status()), media_type="text/plain; version=0.0.4")

    @train_api.get("/healthz")
    def healthz(self) -> dict:
        if self.failure:
            raise HTTPException(503, f"training stopped: {self.failure}")
        return {"ok": True, "restarts": len(self.supervisor.restarts)}

    def check_health(self) -> None:
        if self.failure:  # the supervisor gave up: let Serve restart this replica
            raise RuntimeError(self.failure)

    def __del__(self):
        self._task.cancel()
        self.supervisor.stop()


def build_train(args: dict[str, Any]) -> serve.Application:
    return TrainController.bind(_config_from_args(args))


# --- policy ------------------------------------------------------------------------------------------

policy_api = FastAPI(title="asyncrl policy")


@policy_api.exception_handler(RequestValidationError)
async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return openai_error(400, *describe_invalid_request(exc.errors()))


@policy_api.exception_handler(OpenAIError)
async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
    return openai_error(exc.status, exc.message, exc.param, exc.code)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=64)
@serve.ingress(policy_api)
class PolicyServer:
    def __init__(self, config: Config, poll_s: float = 1.0):
        self.config = config
        self.engine, self.tokenizer = build_engine(config.model)
        self.poll_s = poll_s
        self.started_at = time.time()
        self._task = asyncio.get_event_loop().create_task(self._follow_weights())

    async def _follow_weights(self) -> None:
        while True:
            try:
                learner = ray.get_actor(LEARNER_NAME, namespace=NAMESPACE)
                version = await learner.version.remote()
                if version > self.engine.version:
                    version, weights = await learner.weights.remote()
                    # `weights` reads the version before it waits out a step in progress, so the copy
                    # can be the next version's: adopt it only if no step ended meanwhile.
                    if await learner.version.remote() == version:
                        await asyncio.to_thread(self.engine.update_weights, weights.items(), version)
                    del weights  # not held while waiting for the next version: a second copy of the model
            except ValueError:
                pass  # no learner running (yet): serve the weights we have
            await asyncio.sleep(self.poll_s)

    @policy_api.get("/models")
    def models(self) -> dict:
        t = self.config.task
        # `task` and `max_response_tokens` let `asyncrl eval --endpoint` score the task this policy learns.
        return {"object": "list", "data": [{"id": self.config.model.name, "object": "model", "owned_by": "asyncrl",
                                            "weight_version": self.engine.version, "started_at": self.started_at,
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
        messages = [{"role": m.role, "content": m.content} for m in body.messages]
        if self.config.model.use_chat_template:
            ids = await asyncio.to_thread(self.tokenizer.apply_chat_template, messages, add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
        else:
            ids = await asyncio.to_thread(self.tokenizer.encode, "\n".join(m["content"] for m in messages),
                                          add_special_tokens=False)
        return await self._respond(body, [list(ids)], chat=True)

    async def _respond(self, body, prompt_ids: list[list[int]], chat: bool) -> JSONResponse:
        from asyncrl.openai_api import check_model_name, check_request_size, generate_choices, logprobs_asked, stream_events

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
        version = self.engine.version
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        if body.stream:
            events = stream_events(self.engine, self.tokenizer, prompt_ids, body, chat, request_id, self.config.model.name,
                                   version, asked)
            return StreamingResponse(events, media_type="text/event-stream", headers={VERSION_HEADER: str(version)})
        choices = await generate_choices(self.engine, self.tokenizer, prompt_ids, body, asked or 0)
        build = chat_response if chat else completion_response
        payload = build(request_id, self.config.model.name, choices, version, asked)
        return JSONResponse(payload, headers={VERSION_HEADER: str(version)})


def build_policy(args: dict[str, Any]) -> serve.Application:
    return PolicyServer.bind(_config_from_args(args))


# --- reward endpoints ------------------------------------------------------------------------------

reward_api = FastAPI(title="asyncrl reward endpoint")
reward_api.middleware("http")(reward_guard)


class ScoreItem(BaseModel):
    prompt_id: str = Field(min_length=1, max_length=512)
    sample_idx: int = Field(ge=0)
    response_text: str = Field(max_length=4 << 20)
    ground_truth: str = Field(default="", max_length=1 << 20)
    data_source: str = Field(min_length=1, max_length=256)
    prompt_text: str = Field(default="", max_length=1 << 20)


class ScoreBody(BaseModel):
    requests: list[ScoreItem] = Field(min_length=1, max_length=64)


@reward_api.exception_handler(RequestValidationError)
async def _reward_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = describe_invalid_request(exc.errors())
    return JSONResponse({"error": {"message": message, "param": param}}, status_code=400)


# max_surge_percent=100: a rolling update starts both replacements while the old replicas serve and
# stops those once the new ones are ready (Serve's default stops one first and goes one at a time).
# The surge needs room for twice the replicas; where there is none (a GPU judge), lower it under
# the deployment in the Serve config file.
# No access log: the trainer calls `score` once per batch, which was one INFO line each (500 KB in
# 7 minutes); failures are still logged, and /stats counts the calls.
@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=32, num_replicas=2,
                  graceful_shutdown_wait_loop_s=0.5, graceful_shutdown_timeout_s=30,
                  max_surge_percent=100, rolling_update_percentage=1.0,
                  logging_config={"enable_access_log": False})
@serve.ingress(reward_api)
class RewardService(RewardEndpoint):
    """A reward endpoint as its own Serve application (`reward-<name>`). The trainer calls
    `score`/`compare` through a handle; people and load tests use POST /score. Two replicas by
    default, so a code or model swap (a rolling update) always leaves one serving; a settings swap
    goes through `user_config` -> `reconfigure` with no restart at all."""

    def __init__(self, name: str, config: dict, model: dict | None = None, default_style: str = "zero_one",
                 token: str = ""):
        from asyncrl import serve_app  # the module's dict, not a pickled copy (see TrainController)

        serve_app._REWARD_TOKEN["value"] = token or os.environ.get("ASYNCRL_REWARD_TOKEN", "")
        super().__init__(name, config, model, default_style)

    @reward_api.post("/score")
    async def score_http(self, body: ScoreBody) -> dict:
        requests = [RewardRequest(**item.model_dump()) for item in body.requests]
        rewards = await self.score(requests)
        # token_rewards (numpy) become lists in JSON.
        return {"version": self.version, "rewards": [msgspec.to_builtins(r, enc_hook=lambda a: a.tolist()) for r in rewards]}

    @reward_api.get("/stats")
    def stats_http(self) -> dict:
        return self.stats()


def build_reward(args: dict[str, Any]) -> serve.Application:
    """args: `name` (an entry of reward.endpoints) and the same `overrides` as the train app."""
    args = dict(args)
    name = args.pop("name", "verifier")
    config = _config_from_args(args)
    if name not in config.reward.endpoints:
        raise ConfigError(f"reward endpoint {name!r} is not in reward.endpoints ({sorted(config.reward.endpoints)})")
    return RewardService.bind(name, asdict(config.reward.endpoints[name]), asdict(config.model), config.task.reward,
                              config.serve.reward_token)


def reward_app_config(name: str, overrides: str, user_config: dict | None = None) -> dict:
    """The `reward-<name>` application as an entry of a Serve config file (`configs/serve.yaml`)."""
    app = {"name": f"reward-{name}", "route_prefix": f"/reward/{name}", "import_path": "asyncrl.serve_app:build_reward",
           "args": {"name": name, "overrides": overrides}}
    if user_config is not None:
        app["deployments"] = [{"name": "RewardService", "user_config": user_config}]
    return app


def deploy_declaratively(applications: list[dict], timeout_s: float = 300.0) -> None:
    """Deploy applications from config-file entries, as `serve deploy` and `serve run <file>` do,
    and wait until they run. Use this, not `serve.run`, to swap a reward endpoint: an imperative
    `serve.run` gives the deployment a new code version every time, so even a `user_config`-only
    change replaces the replicas (seen on Ray 2.60). Declaratively, a change under `user_config`
    reconfigures the running replicas in place, and a change of `args` rolls them.

    Like a config file, the list is the whole declarative state: applications deployed this way
    before and missing from it are deleted (those from `serve.run` are left alone).
    """
    from ray.serve.context import _get_global_client  # what `serve run <file>` calls; no dashboard needed
    from ray.serve.schema import ApplicationStatus, ServeDeploySchema

    client = _get_global_client()
    client.deploy_apps(ServeDeploySchema(applications=applications))
    names, deadline = {app["name"] for app in applications}, time.monotonic() + timeout_s
    while True:
        statuses = {name: app.status for name, app in serve.status().applications.items() if name in names}
        # apply_config has already set the app to DEPLOYING; RUNNING means the new target is reached.
        if len(statuses) == len(names) and set(statuses.values()) == {ApplicationStatus.RUNNING}:
            break
        if ApplicationStatus.DEPLOY_FAILED in statuses.values() or time.monotonic() > deadline:
            raise RuntimeError(f"Serve deploy did not reach RUNNING: {serve.status().applications}")
        time.sleep(0.2)


__all__ = ["build_train", "build_policy", "build_reward", "TrainController", "PolicyServer", "RewardService",
           "ConfigError", "reward_app_config", "deploy_declaratively"]
