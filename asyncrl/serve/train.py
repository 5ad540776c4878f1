"""The `train` application: the running system (a `Run`), its status (JSON, a page, Prometheus) and
its admin routes. A thin control plane: the training actors live outside Serve (a replica that
fails a health check is restarted and would lose their state); the controller owns them.

    serve run configs/serve.yaml            # every application, trains until stopped
    serve run asyncrl.serve.train:build_train overrides="model=tiny task=tiny"

No `from __future__ import annotations` here: Serve's ingress wrapper resolves route annotations
at runtime, and string annotations would turn request bodies into query parameters.
"""

import asyncio
import logging
import os
import time
from typing import Any

import msgspec
from fastapi import FastAPI, HTTPException
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, Field
from ray import serve

from asyncrl.config import Config
from asyncrl.run import Run
from asyncrl.run.records import REWARD_KEY
from asyncrl.run.wiring import CONTROL_TIMEOUT_S, WORK_TIMEOUT_S, RoleHung
from asyncrl.serve.guards import FiniteJSONResponse, admin_guard, config_from_args

INITIAL_DATA_MARKER = '<script id="initial-data" type="application/json">null</script>'
STATUS_PAGE = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "static", "status.html"),
                   encoding="utf-8").read()
# The status page carries at most this many step records of the whole run (thinned evenly), so its
# size stays put however long the service runs; the page fetches more from /metrics itself.
PAGE_RECORDS = 200


def status_page(status: dict, history: list[dict]) -> str:
    """The status page: facts, curves and queues, drawn in the browser from /status and /metrics.
    The data of the moment is in the page itself, so it is drawn at first paint (a screenshot or a
    slow link never shows an empty page): the status and at most `PAGE_RECORDS` step records spread
    over the whole run, so the page stays the same size however long it runs."""
    try:
        initial = FiniteJSONResponse.encode({"status": status, "metrics": thinned(history, PAGE_RECORDS)}).decode()
    except (TypeError, msgspec.EncodeError):  # something JSON cannot hold: the page fetches the data itself
        initial = "null"
    # Inside <script>, "</" would end the element: escape it as JSON allows.
    element = INITIAL_DATA_MARKER.replace(">null<", ">" + initial.replace("</", "<\\/") + "<")
    return STATUS_PAGE.replace(INITIAL_DATA_MARKER, element, 1)


def thinned(records: list[dict], limit: int) -> list[dict]:
    """At most `limit` records spread evenly over `records`, the first and the last kept."""
    if len(records) <= limit:
        return list(records)
    step = (len(records) - 1) / (limit - 1)
    return [records[round(i * step)] for i in range(limit)]


class RouteBody(BaseModel):
    match: str = Field("*", min_length=1, max_length=256)
    endpoints: list[str] = Field(..., min_length=1, max_length=16)
    combine: str = Field("first", pattern="^(first|mix)$")
    weights: list[float] = Field(default_factory=list, max_length=16)
    dense: list[str] = Field(default_factory=list, max_length=16)
    dense_lambda_fail: float = 0.25
    dense_lambda_pass: float = 0.025


class GeneratorsBody(BaseModel):
    count: int = Field(..., ge=1, le=1024)


class RewardRoutesBody(BaseModel):
    routes: list[RouteBody] = Field(..., min_length=1, max_length=64)


# A diverged loss is a NaN in the records: answered as null (JSON has no NaN), never a 500.
train_api = FastAPI(title="asyncrl train", default_response_class=FiniteJSONResponse)
train_api.middleware("http")(admin_guard)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100, health_check_period_s=10)
@serve.ingress(train_api)
class TrainController:
    def __init__(self, config: Config):
        from asyncrl.checkpoint import resolve_run_dir

        self.config = config
        # Through the imported module: Serve pickles this class by value, so a bare global here
        # would be a copy, not the dict `admin_guard` reads.
        from asyncrl.serve import guards

        guards.ADMIN_TOKEN["value"] = config.serve.admin_token or os.environ.get("ASYNCRL_ADMIN_TOKEN", "")
        # A restarted app with resume=true (and the same trainer.run_dir) continues that run.
        self.run_dir = resolve_run_dir(config.trainer.run_dir, config.resume, prefix="serve-")
        os.makedirs(self.run_dir, exist_ok=True)
        # The same run as `asyncrl train` (restarted from a checkpoint if a role dies). A service runs
        # until stopped: no stall deadline.
        self.run = Run(config, self.run_dir, stall_timeout_s=float("inf"), history_limit=5000).start()
        # The line `serve run` shows when the service is up (Serve logs the replica's logger).
        logging.getLogger("ray.serve").info(
            "asyncrl: training runs (run directory %s); status at /train/status and /train/, the policy at /v1",
            self.run_dir)
        self.failure: str | None = None
        self.started_at = time.time()
        self._task = asyncio.get_event_loop().create_task(self._watch())

    @property
    def system(self):
        return self.run.system

    @property
    def history(self) -> list[dict]:
        return self.run.records

    async def _watch(self, plot_every_s: float = 60.0) -> None:
        plotted_at = time.monotonic()
        while True:
            await asyncio.sleep(1.0)
            try:
                await asyncio.to_thread(self.run.poll)
                if time.monotonic() - plotted_at > plot_every_s and self.run.records:
                    await asyncio.to_thread(self.run.write_plots)
                    plotted_at = time.monotonic()
            except Exception as exc:  # could not recover: the health check reports it
                self.failure = str(exc)
                return

    def _system_status(self) -> dict:
        try:
            return self.system.status()
        except RoleHung as exc:  # the watch loop restarts the run; meanwhile say why there is no status
            raise HTTPException(503, str(exc)) from None

    @train_api.get("/status")
    def status(self) -> dict:
        status = self._system_status()
        # Where each generator runs and the weights it holds (its full counters stay internal).
        status["generators"] = [{key: g.get(key) for key in ("generator_id", "node_ip", "delivered_version",
                                                             "busy_fraction", "unresponsive") if key in g}
                                for g in status["generators"]]
        status["pool"]["events"] = self.run.log.pool_events[-20:]
        status["run_dir"] = self.run_dir
        status["started_at"] = self.started_at
        status["reward_curve"] = [(r["step"], r[REWARD_KEY]) for r in self.history[-200:]]
        return status

    @train_api.get("/")
    def page(self) -> HTMLResponse:
        return HTMLResponse(status_page(self.status(), self.history))

    @train_api.get("/metrics")
    def metrics(self, last: int = 500) -> list[dict]:
        return self.history[-max(1, min(last, 5000)):]

    @train_api.post("/admin/reward_routes")
    async def set_reward_routes(self, body: RewardRoutesBody) -> dict:
        """Change the hybrid reward mix while training runs (validated; takes effect on the next scores)."""
        try:
            routes = await asyncio.wait_for(self.system.actors["assembler"].set_reward_routes.remote(
                [route.model_dump() for route in body.routes]), CONTROL_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise HTTPException(503, f"the assembler did not answer within {CONTROL_TIMEOUT_S:g}s") from None
        except Exception as exc:  # a route the config schema rejects
            raise HTTPException(400, f"invalid reward routes: {getattr(exc, 'cause', exc)}") from None
        return {"routes": routes}

    @train_api.post("/admin/generators")
    async def set_generators(self, body: GeneratorsBody) -> dict:
        """Grow or shrink the generator pool while training runs (the learner never stops)."""
        return await asyncio.to_thread(self._scale, body.count, "admin route")

    def _scale(self, count: int, reason: str) -> dict:
        try:
            events = self.run.scale(count, reason)
        except ValueError as exc:  # out of the configured bounds
            raise HTTPException(400, str(exc)) from None
        return {"generators": list(self.system.generators), "events": events}

    def reconfigure(self, user_config: dict) -> None:
        """`serve deploy` with `user_config: {num_generators: N}` scales the pool in place."""
        unknown = sorted(set(user_config) - {"num_generators"})
        if unknown:  # a setting that would do nothing is refused (the deploy fails with this reason)
            raise ValueError(f"unknown user_config key(s) {unknown} for the train application; it takes num_generators")
        count = user_config.get("num_generators")
        if count is not None and hasattr(self, "run"):
            self._scale(int(count), "serve deploy (user_config)")

    @train_api.post("/admin/checkpoint")
    async def save_checkpoint(self) -> dict:
        """Write a checkpoint now (between two learner steps)."""
        try:
            path = await asyncio.wait_for(self.system.actors["learner"].save_checkpoint.remote(), WORK_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise HTTPException(503, f"the learner did not write the checkpoint within {WORK_TIMEOUT_S:g}s") from None
        return {"path": path}

    @train_api.get("/metrics/prometheus")
    def prometheus(self):
        """The run's counters and gauges in the Prometheus text format (for a scrape job)."""
        from fastapi.responses import Response

        from asyncrl.metrics import prometheus_text

        return Response(prometheus_text(self._system_status()), media_type="text/plain; version=0.0.4")

    @train_api.get("/healthz")
    def healthz(self) -> dict:
        if self.failure:
            raise HTTPException(503, f"training stopped: {self.failure}")
        return {"ok": True, "restarts": len(self.run.restarts)}

    def check_health(self) -> None:
        if self.failure:  # the supervisor gave up: let Serve restart this replica
            raise RuntimeError(self.failure)

    def __del__(self):
        self._task.cancel()
        self.run.stop()


def build_train(args: dict[str, Any]) -> serve.Application:
    return TrainController.bind(config_from_args(args))
