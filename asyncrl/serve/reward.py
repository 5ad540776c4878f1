"""The `reward-<name>` applications: one per reward endpoint, redeployable while training runs
(settings in place through `user_config`; code or model by a rolling update of two replicas).

No `from __future__ import annotations` here (see `asyncrl.serve.train`).
"""

import os
import time
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from ray import serve

from asyncrl.api.requests import describe_invalid_request
from asyncrl.config import ConfigError
from asyncrl.messages.structs import RewardRequest
from asyncrl.rewards.endpoint import RewardEndpoint
from asyncrl.serve.guards import config_from_args, reward_guard


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
                 token: str = "", local_without_token: bool = False):
        from asyncrl.serve import guards  # the module's dict, not a pickled copy (see `guards`)

        guards.REWARD_TOKEN["value"] = token or os.environ.get("ASYNCRL_REWARD_TOKEN", "")
        guards.REWARD_LOCAL_WITHOUT_TOKEN["value"] = local_without_token
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
    config = config_from_args(args)
    if name not in config.reward.endpoints:
        raise ConfigError(f"reward endpoint {name!r} is not in reward.endpoints ({sorted(config.reward.endpoints)})")
    return RewardService.bind(name, msgspec.to_builtins(config.reward.endpoints[name]), msgspec.to_builtins(config.model),
                              config.task.reward, config.serve.reward_token,
                              config.serve.reward_local_without_token)


def reward_app_config(name: str, overrides: str, user_config: dict | None = None) -> dict:
    """The `reward-<name>` application as an entry of a Serve config file (`configs/serve.yaml`)."""
    app = {"name": f"reward-{name}", "route_prefix": f"/reward/{name}", "import_path": "asyncrl.serve.reward:build_reward",
           "args": {"name": name, "overrides": overrides}}
    if user_config is not None:
        app["deployments"] = [{"name": "RewardService", "user_config": user_config}]
    return app


def missing_reward_apps(reward, deployed: set[str]) -> list[str]:
    """The endpoints the routes call (`reward.use_serve`: each is the application `reward-<name>`)
    that no application of `deployed` serves."""
    used = {name for route in reward.routes for name in (*route.endpoints, *route.dense)}
    return sorted(name for name in used if f"reward-{name}" not in deployed)


def refuse_missing_reward_apps(reward, deployed: set[str], overrides: str) -> None:
    """At the train application's start: a reward endpoint with no application of its own would
    fail every reward it is asked for. Refused, with the entries to add to the config file."""
    import yaml

    missing = missing_reward_apps(reward, deployed)
    if missing:
        entries = yaml.safe_dump([reward_app_config(name, overrides) for name in missing], sort_keys=False)
        raise ConfigError(f"reward.use_serve=true calls each reward endpoint as the Serve application reward-<name>, "
                          f"and {', '.join(f'reward-{name}' for name in missing)} is not deployed: add to the "
                          f"config file's applications (the same overrides as the train application):\n{entries}")


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
