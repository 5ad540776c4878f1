"""The `train` application: the running system (a `Run`), its status (JSON, a page, Prometheus) and
its admin routes. A thin control plane: the training actors live outside Serve (a replica that
fails a health check is restarted and would lose their state); the controller owns them.

    serve run configs/serve.yaml            # every application, trains until stopped
    serve run asyncrl.serve.train:build_train overrides="model=tiny task=tiny"

One run per app, whatever happens to the controller: its run directory is the same at every start
(`trainer.run_dir`, or `outputs/serve-<app name>`) and a start continues the run there from its
newest checkpoint (`serve.resume_run`), so a controller Serve replaces, a redeploy or a restarted
cluster goes on with the run instead of training the base model again. Inside one controller every
error of a poll restarts the run from its checkpoint (`asyncrl.run.Run`); when the restart budget
of the window is spent the controller waits for the window to allow the next restart (its health
check passes: replacing it would not help, `/healthz` says what it waits for); a run that cannot
restart at all fails the health check, and the controller that replaces it resumes the run.

No `from __future__ import annotations` here: Serve's ingress wrapper resolves route annotations
at runtime, and string annotations would turn request bodies into query parameters.
"""

import asyncio
import logging
import os
import threading
import time
from typing import Any

import msgspec
from fastapi import FastAPI, HTTPException
from fastapi.responses import HTMLResponse
from pydantic import BaseModel, Field
import ray
from ray import serve

from asyncrl.config import Config, ConfigError
from asyncrl.run import RestartBudgetSpent, Run
from asyncrl.run.loggers import open_loggers
from asyncrl.run.records import REWARD_KEY
from asyncrl.run.deadlines import CONTROL_TIMEOUT_S, WORK_TIMEOUT_S, RoleHung
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


def serve_run(config: Config, app_name: str) -> tuple[str, Config]:
    """The train app's run directory, and its config (`resume` set when it continues the run there)."""
    from asyncrl.storage.checkpoint import latest_valid, resolve_run_dir

    if not config.serve.resume_run:
        return resolve_run_dir(config.trainer.run_dir, config.resume, prefix="serve-"), config
    run_dir = config.trainer.run_dir or os.path.join("outputs", f"serve-{app_name}")
    resume = config.resume or latest_valid(run_dir)[0] is not None
    return run_dir, msgspec.structs.replace(config, resume=resume)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100, health_check_period_s=10)
@serve.ingress(train_api)
class TrainController:
    def __init__(self, config: Config):
        # Through the imported module: Serve pickles this class by value, so a bare global here
        # would be a copy, not the dict `admin_guard` reads.
        from asyncrl.serve import guards

        guards.ADMIN_TOKEN["value"] = config.serve.admin_token or os.environ.get("ASYNCRL_ADMIN_TOKEN", "")
        self.run_dir, self.config = serve_run(config, serve.get_replica_context().app_name)
        os.makedirs(self.run_dir, exist_ok=True)
        # The same run as `asyncrl train` (restarted from a checkpoint when a part of it fails), its
        # step records logged from this process as the driver logs them (wandb, TensorBoard: the
        # run's own, which a replacing controller opens again). A service runs until stopped: no stall deadline.
        self.loggers = open_loggers(self.config, self.run_dir)
        self.run = Run(self.config, self.run_dir, stall_timeout_s=float("inf"), history_limit=5000,
                       loggers=self.loggers).start()
        # The line `serve run` shows when the service is up (Serve logs the replica's logger).
        logging.getLogger("ray.serve").info(
            "asyncrl: training runs (run directory %s%s); status at /train/status and /train/, the policy at /v1",
            self.run_dir, ", resumed from step %d" % self.run.resumed["step"] if self.run.resumed else "")
        self._said_failing = False  # the log said that every reward fails
        self.failure: str | None = None  # why the run does not train now
        self.fatal = False  # the run cannot come back in this controller: the health check fails
        self.started_at = time.time()
        self._scale_lock = threading.Lock()
        self._scale_to: int | None = None  # the pool size `serve deploy` asked for, not applied yet
        self._scaling = False
        self._task = asyncio.get_event_loop().create_task(self._watch())

    @property
    def history(self) -> list[dict]:
        return self.run.records

    async def _watch(self, plot_every_s: float = 60.0) -> None:
        plotted_at = time.monotonic()
        while True:
            await asyncio.sleep(1.0)
            try:
                polled = await asyncio.to_thread(self.run.poll)  # any error of the run restarts it
            except RestartBudgetSpent as spent:
                await self._restart_when_allowed(spent)
                continue
            except Exception as exc:  # no restart possible here: the health check fails, Serve
                self.failure, self.fatal = str(exc), True  # replaces this controller, which resumes the run
                logging.getLogger("ray.serve").error("asyncrl: the run cannot recover here: %s", exc)
                return
            self._say_reward_failures(polled)
            if time.monotonic() - plotted_at > plot_every_s and self.run.records:
                plotted_at = time.monotonic()
                try:
                    await asyncio.to_thread(self.run.write_plots)
                except Exception as exc:  # noqa: BLE001 - a plot is not worth the run
                    logging.getLogger("ray.serve").warning("asyncrl: plots not written: %s", exc)

    def _say_reward_failures(self, polled) -> None:
        """An endpoint's first failed reward, and rewards that all fail, in Serve's log (the status
        says the latter too). Training goes on: a fixed reward application can be deployed."""
        log = logging.getLogger("ray.serve")
        for line in polled.reward_notices:
            log.warning("asyncrl: %s", line)
        if polled.rewards_failing and not self._said_failing:
            log.error("asyncrl: %s", polled.rewards_failing)
        self._said_failing = bool(polled.rewards_failing)

    async def _restart_when_allowed(self, spent: RestartBudgetSpent) -> None:
        """The window's restarts are spent: wait until it allows the next, then restart (again, while
        the budget says no). The run is stopped meanwhile; `/healthz` says so."""
        while True:
            self.failure = f"waiting to restart: {spent}"
            await asyncio.sleep(max(0.0, spent.retry_at - time.time()) + 1.0)
            try:
                await asyncio.to_thread(self.run.restart_after, spent, spent.reason)
            except RestartBudgetSpent as again:
                spent = again
                continue
            self.failure = None
            return

    def drain(self, timeout_s: float = 120.0) -> dict:
        """Through a deployment handle (no route): issue nothing more, let the work in flight end,
        and return what the ledger shows (`Run.drain`; the run trains no more after it)."""
        return self.run.drain(timeout_s)

    def pid(self) -> int:
        """Through a deployment handle: this replica's process (a load test kills it)."""
        return os.getpid()

    def inject_poll_errors(self, count: int) -> int:
        """Load tests, through a deployment handle (no route): the run's next `count` polls raise."""
        self.run.inject_poll_errors = int(count)
        return self.run.inject_poll_errors

    def _system_status(self) -> dict:
        """The run's status as JSON (`RunStatus.json_dict`)."""
        try:
            return self.run.status().json_dict()
        except RoleHung as exc:  # the watch loop restarts the run; meanwhile say why there is no status
            raise HTTPException(503, str(exc)) from None

    @train_api.get("/status")
    def status(self) -> dict:
        if self.failure:  # the run is stopped (waiting to restart, or failed): nothing to read
            raise HTTPException(503, f"training stopped: {self.failure}")
        status = self._system_status()
        # Where each generator runs and the weights it holds (its full counters stay internal).
        status["generators"] = [{key: g.get(key) for key in ("generator_id", "node_ip", "delivered_version",
                                                             "busy_fraction", "unresponsive") if key in g}
                                for g in status["generators"]]
        status["pool"]["events"] = self.run.log.pool_events[-20:]
        status["run_dir"] = self.run_dir
        status["rewards_failing"] = self.run.rewards_failing  # "" while any reward succeeds
        status["started_at"] = self.started_at
        status["restarts"] = len(self.run.restarts)
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
            routes = await asyncio.wait_for(self.run.set_reward_routes(
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
        return {"generators": self.run.generator_ids, "events": events}

    def reconfigure(self, user_config: dict) -> None:
        """`serve deploy` with `user_config: {num_generators: N}` scales the pool in place, in the
        background: a scale loads models and drains generators, longer than Serve waits for a
        reconfigure or a health check. The size is checked here (a bad one fails the deploy with
        its reason); the pool's events say when it is done."""
        unknown = sorted(set(user_config) - {"num_generators"})
        if unknown:  # a setting that would do nothing is refused (the deploy fails with this reason)
            raise ValueError(f"unknown user_config key(s) {unknown} for the train application; it takes num_generators")
        count = user_config.get("num_generators")
        if count is None:
            return
        limit = self.config.cluster.max_generators
        if not 1 <= int(count) <= limit:
            raise ValueError(f"num_generators must be between 1 and cluster.max_generators={limit}, got {count}")
        with self._scale_lock:
            self._scale_to = int(count)
            if not self._scaling:
                self._scaling = True
                threading.Thread(target=self._scale_in_background, daemon=True).start()

    def _scale_in_background(self) -> None:
        """Apply the newest size `reconfigure` asked for, until no newer one is waiting."""
        while True:
            with self._scale_lock:
                count, self._scale_to = self._scale_to, None
                if count is None:
                    self._scaling = False
                    return
            try:
                self.run.scale(count, "serve deploy (user_config)")
            except Exception as exc:  # noqa: BLE001 - said in the log; the run's own errors restart it
                logging.getLogger("ray.serve").error("asyncrl: scaling to %d generators failed: %s", count, exc)

    @train_api.post("/admin/checkpoint")
    async def save_checkpoint(self) -> dict:
        """Write a checkpoint now (between two learner steps)."""
        try:
            path = await asyncio.wait_for(self.run.checkpoint_ref(), WORK_TIMEOUT_S)
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
        return {"ok": True, "restarts": len(self.run.restarts), "run_dir": self.run_dir,
                "resumed_from_step": self.run.resumed.get("step")}

    def check_health(self) -> None:
        if self.fatal:  # no restart possible here: Serve replaces this replica, which resumes the run
            raise RuntimeError(self.failure)

    def __del__(self):
        self._task.cancel()
        self.loggers.finish()  # first: stopping the actors can outlast Serve's graceful shutdown
        self.run.stop()


def build_train(args: dict[str, Any]) -> serve.Application:
    config = config_from_args(args)
    optimizer = config.policy.optimizer
    if optimizer.schedule != "constant" and not optimizer.decay_steps:
        # `asyncrl train` decays over trainer.total_steps; a service trains until stopped.
        raise ConfigError(f"policy.optimizer.schedule={optimizer.schedule} decays over policy.optimizer.decay_steps, "
                          f"and the train app runs until stopped (trainer.total_steps does not end it): set "
                          f"policy.optimizer.decay_steps, or policy.optimizer.schedule=constant")
    if config.reward.use_serve and ray.is_initialized():  # built by Serve (not imported to look at)
        # Refused here, as the config's applications are built (Serve knows them all by now), not by
        # a replica, which Serve would start again and again before giving up.
        from ray.serve.exceptions import RayServeException

        from asyncrl.serve.reward import refuse_missing_reward_apps

        try:
            deployed = set(serve.status().applications)
        except RayServeException:  # `serve run` of this builder alone: no Serve yet, nothing else deployed
            deployed = set()
        overrides = args.get("overrides", "")
        refuse_missing_reward_apps(config.reward, deployed, overrides if isinstance(overrides, str) else " ".join(overrides))
    return TrainController.bind(config)
