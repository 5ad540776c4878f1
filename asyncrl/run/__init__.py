"""A training run as the CLI (`asyncrl train`) and Serve (`train` app) both use it: `Run`.

    run = Run(config, run_dir, max_steps=...).start()   # the roles up (`asyncrl.run.wiring`)
    polled = run.poll()       # health (a restart from the checkpoint when a role died), new steps
    run.weights(); run.checkpoint(); run.status()
    run.stop()

Keeping a run alive. The generators are an elastic pool (`asyncrl.run.pool`): one that dies or
hangs is healed in place, its work re-issued through the ledger, while the learner keeps training
on what the others produce; the pool grows and shrinks by hand (`scale`) or by policy
(`cluster.autoscale`). Any other role holds state no other process has (the learner's weights and
optimizer, the prompt source's cursor and ledger, the assembler's open groups, the value learner,
a mailbox's queue): its death brings the whole system back from the newest valid checkpoint, the
one recovery that is exact for them (docs/architecture.md, checkpoints and resume). The cost is
the steps since that checkpoint.

Every error of a poll takes that path, not only a death `check_alive` sees: an error healing the
pool, reading the metrics or the status is a part of the run that failed, and a run of days must
not end on one. Restarts are budgeted per window (`trainer.max_restarts` within any
`trainer.restart_window_s`, an hour by default), counted from `restarts.jsonl`, so a run that
restarted three times in a week is not one restart from its end, and a controller that replaces
another (Serve) counts the restarts before it. A spent budget raises `RestartBudgetSpent`, which
says when the next restart is allowed (Serve waits for it); a run that cannot restart at all (no
checkpoint, a start that failed) raises `RunFailed`.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec
from ray.exceptions import RayError, RayTaskError

from asyncrl.config import Config
from asyncrl.run.pool import autoscale_step
from asyncrl.run.records import RunRecords
from asyncrl.run.status import reward_failure_lines
from asyncrl.run.wiring import System
from asyncrl.storage import checkpoint

RESTART_ATTEMPTS = 4
RESTART_WAIT_S = 10.0
EXHAUSTION_CHECK_S = 5.0  # how often a quiet run asks whether every prompt is retired


class StallError(RuntimeError):
    """No learner step for `trainer.stall_timeout_s`."""


class RunFailed(RuntimeError):
    """The run cannot come back: no checkpoint to restart from, or it could not start again
    (`attempted`: a restart was tried, and spent the budget)."""

    def __init__(self, message: str, attempted: bool = False):
        super().__init__(message)
        self.attempted = attempted


class RestartBudgetSpent(RunFailed):
    """`trainer.max_restarts` restarts within the last `trainer.restart_window_s`: the next one is
    allowed at `retry_at` (a wall-clock time)."""

    def __init__(self, message: str, retry_at: float, reason: str = ""):
        super().__init__(message)
        self.retry_at = retry_at
        self.reason = reason  # what the refused restart was for


class InjectedFault(RuntimeError):
    """An error a load test injected into the poll (`Run.inject_poll_errors`)."""


def restart_allowed_at(restart_times: list[float], now: float, max_restarts: int, window_s: float) -> float | None:
    """None when a restart is allowed now (fewer than `max_restarts` in the last `window_s`), else
    the time the oldest of them leaves the window. `max_restarts=0`: never (inf)."""
    if max_restarts <= 0:
        return float("inf")
    recent = sorted(t for t in restart_times if t > now - window_s)
    if len(recent) < max_restarts:
        return None
    return recent[-max_restarts] + window_s


@dataclass
class Poll:
    records: list[dict] = field(default_factory=list)  # new step records, as written
    restart: dict | None = None  # set when the system was restarted from a checkpoint
    retirements: list[dict] = field(default_factory=list)  # prompts retired (or back) since the last poll
    reward_notices: list[str] = field(default_factory=list)  # an endpoint's first failed reward, said once
    rewards_failing: str = ""  # every reward of the first samples failed: why (`reward.fail_fast_samples`)


class Run:
    def __init__(self, config: Config, run_dir: str, max_steps: int = 0, stall_timeout_s: float | None = None,
                 annotate: Callable[[dict], None] | None = None, loggers: Any = None, history_limit: int = 0):
        self.config = config
        self.run_dir = run_dir
        self.max_steps = max_steps  # the learner stops there (0: trains until stopped, as under Serve)
        self.stall_timeout_s = config.trainer.stall_timeout_s if stall_timeout_s is None else stall_timeout_s
        self.log = RunRecords(run_dir, annotate, loggers, history_limit, config.trainer.log_file_mb << 20,
                              config.trainer.log_files_kept)
        self.restarts: list[dict[str, Any]] = []  # this process's restarts
        # When restarts were tried (this process's and, from restarts.jsonl, earlier ones): the budget.
        self.restart_times: list[float] = _earlier_restarts(run_dir, config.trainer.restart_window_s)
        self.inject_poll_errors = 0  # load tests: the next N polls raise `InjectedFault`
        self.system: System | None = None
        self.last_status: dict = {}  # the status read at the last poll with new steps
        self.last_step_at = time.time()
        self._exhaustion_checked_at = 0.0
        self._autoscale = {"at": time.monotonic(), "wait_batch_s": 0.0, "polls": 0, "batches_full": 0}
        self._rewards_announced: set[str] = set()  # endpoints whose first failure was said
        self.rewards_failing = ""  # the status says it under Serve, where the run goes on

    def start(self) -> "Run":
        self.system = System(self.config, self.run_dir, self.max_steps, on_pool_event=self.log.pool_event).start()
        self.log.started = self.last_step_at = time.time()
        return self

    @property
    def records(self) -> list[dict]:
        return self.log.records

    @property
    def resumed(self) -> dict:
        return self.system.resumed

    @property
    def step(self) -> int:
        return self.records[-1]["step"] if self.records else self.system.resumed.get("step", 0)

    def check(self) -> dict | None:
        """None while every role's loop runs (generators that died or hung are healed in place);
        after any other failure, the run restarted from the newest checkpoint (the event, also in
        `restarts.jsonl`), or raise when it cannot recover (`RunFailed`)."""
        try:
            dead = self.system.check_alive()
            self.system.pool.check(dead)  # generators: healed in place, replaced while there is room
        except Exception as exc:  # a role's loop ended (its error, ActorDiedError), or the healing failed
            return self.restart_after(exc)
        return None

    def poll(self, check_health: bool = True) -> Poll:
        """One look at the run; raises when it cannot recover (`RunFailed`), or `StallError` when it
        stalled. Any other error restarts the run. `check_health=False`: only record the steps done
        (after the learner was stopped on purpose); errors then propagate."""
        if check_health:
            restart = self.check()
            if restart is not None:
                return Poll(restart=restart)
        try:
            return self._observe()
        except StallError:
            raise
        except Exception as exc:
            if not check_health:
                raise
            return Poll(restart=self.restart_after(exc))

    def _observe(self) -> Poll:
        """The new step records, stamped with the status; the prompts' state when the run is quiet."""
        if self.inject_poll_errors > 0:
            self.inject_poll_errors -= 1
            raise InjectedFault("an error injected into the run's poll (load test)")
        notices, self.rewards_failing = reward_failure_lines(
            self.system.reward_health(), self._rewards_announced, self.config.reward.fail_fast_samples)
        new = self.system.pop_metrics()
        if not new:
            quiet_s = time.time() - self.last_step_at
            if quiet_s > EXHAUSTION_CHECK_S and time.time() - self._exhaustion_checked_at > EXHAUSTION_CHECK_S:
                # With every prompt retired no step comes: that is the run's end, not a stall.
                self._exhaustion_checked_at = time.time()
                self.log.note_prompts(self.system.status())
            if quiet_s > self.stall_timeout_s and not self.log.prompts_exhausted:
                status = self.system.status()
                raise StallError(
                    f"no learner step for {self.stall_timeout_s:.0f}s at step {status['step']}; "
                    f"samples dropped by reason: {status['dropped_by_reason']}, queues: {status['queue_depths']}, "
                    f"prompts: {_prompt_state(status)}"
                    + (f"; the last reward failure: {failure}" if (failure := status["assembler"].get(
                        "last_reward_failure")) else ""))
            return Poll(reward_notices=notices, rewards_failing=self.rewards_failing)
        self.last_step_at = time.time()
        self.last_status = self.system.status()
        retirements = self.log.add(new, self.last_status, bool(self.system.resumed))
        if self.config.cluster.autoscale:
            self._autoscale_step(self.last_status)
        return Poll(records=new, retirements=retirements, reward_notices=notices, rewards_failing=self.rewards_failing)

    def restart_after(self, exc: BaseException, reason: str = "") -> dict:
        """`exc` ended this incarnation: restart from the checkpoint, record it (`restarts.jsonl`);
        raise `RunFailed` if it cannot. `reason`: the restart's (default: `exc` in one line)."""
        refused = exc if isinstance(exc, checkpoint.DiskRefused) else exc.__cause__
        if isinstance(refused, checkpoint.DiskRefused):
            # The disk would refuse the restarted run too (its checkpoints, its store): one error, no restarts.
            raise checkpoint.DiskRefused(_cause_message(refused)) from exc
        reason = reason or f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        try:
            restart = self.restart(reason, exc)
        except RunFailed as failed:
            # A refused restart (no checkpoint, the budget spent) spends no budget; a failed start does.
            self._write_restart({"reason": reason, "at": time.time(), "failed": str(failed)[:500],
                                 "attempted": failed.attempted})
            raise
        self.log.after_restart(restart["step"])
        self._write_restart(restart)
        self.last_step_at = time.time()
        return restart

    def _write_restart(self, event: dict) -> None:
        if self.run_dir:
            self.log.append("restarts.jsonl", [event])  # rolled past trainer.log_file_mb, as every log

    def scale(self, count: int, reason: str = "admin") -> list[dict]:
        """Grow or shrink the generator pool to `count` (within `cluster.max_generators`)."""
        limit = self.config.cluster.max_generators
        if not 1 <= count <= limit:
            raise ValueError(f"the pool's size must be between 1 and cluster.max_generators={limit}, got {count}")
        return self.system.pool.scale(count, reason)

    def _autoscale_step(self, status: dict) -> None:
        """Every `cluster.autoscale_every_s`: one generator more when the learner waited for batches,
        one fewer when batches waited for the learner (`autoscale_step`)."""
        window = self._autoscale
        window["polls"] += 1
        batches = status["queue_depths"].get("batches", {})
        window["batches_full"] += int(batches.get("queued", 0) >= batches.get("capacity", 1))
        elapsed = time.monotonic() - window["at"]
        if elapsed < self.config.cluster.autoscale_every_s:
            return
        waited = status["learner_wait_batch_s"] - window["wait_batch_s"]
        cl = self.config.cluster
        target = autoscale_step(len(self.system.generators), cl.min_generators, cl.max_generators,
                                waited / elapsed, window["batches_full"] / window["polls"])
        self._autoscale = {"at": time.monotonic(), "wait_batch_s": status["learner_wait_batch_s"], "polls": 0,
                           "batches_full": 0}
        if target != len(self.system.generators):
            self.system.pool.scale(target, f"autoscale: learner waited {waited / elapsed:.0%} of the last "
                                           f"{elapsed:.0f}s for batches")

    def restart(self, reason: str, cause: BaseException | None = None) -> dict:
        """Bring the system back from the newest valid checkpoint; the event. Raises
        `RestartBudgetSpent` when the window's budget is spent (retry at its `retry_at`), `RunFailed`
        when there is no checkpoint or the system could not start."""
        start = time.perf_counter()
        # Stop first: a learner still alive could otherwise commit newer checkpoints and prune the
        # one chosen below.
        self.system.stop()
        latest, _ = checkpoint.latest_valid(self.run_dir) if self.run_dir else (None, [])
        if latest is None:
            raise RunFailed(f"the run cannot recover (no checkpoint to restart from) from: {reason}") from cause
        trainer, now = self.config.trainer, time.time()
        retry_at = restart_allowed_at(self.restart_times, now, trainer.max_restarts, trainer.restart_window_s)
        if retry_at is not None:
            budget = f"trainer.max_restarts={trainer.max_restarts} within {trainer.restart_window_s:g}s used up"
            if retry_at == float("inf"):
                raise RunFailed(f"the run cannot recover ({budget}) from: {reason}") from cause
            raise RestartBudgetSpent(f"the run cannot restart before {time.strftime('%H:%M:%S', time.localtime(retry_at))} "
                                     f"({budget}) after: {reason}", retry_at, reason) from cause
        self.restart_times.append(now)  # an attempt spends the budget, whether or not it starts
        resumed = msgspec.structs.replace(self.config, resume=True)
        for attempt in range(RESTART_ATTEMPTS):
            try:
                self.system = System(resumed, self.run_dir, self.max_steps, num_generators=self.system.pool.target,
                                     on_pool_event=self.log.pool_event).start()
                break
            except RayError as exc:
                # A node that is dying may still take actors until Ray has marked it dead (its
                # heartbeats time out): they die with it. Try again once that has happened.
                if attempt == RESTART_ATTEMPTS - 1:
                    raise RunFailed(f"the run could not restart after {reason}: {exc}", attempted=True) from exc
                time.sleep(RESTART_WAIT_S)
            except Exception as exc:  # a checkpoint it could not load, a bad setting: not one to retry
                raise RunFailed(f"the run could not restart after {reason}: {type(exc).__name__}: {exc}",
                                attempted=True) from exc
        event = {"reason": reason, "restart_s": time.perf_counter() - start, "at": now,  # when it was tried
                 **{k: self.system.resumed[k] for k in ("checkpoint", "step", "reissued_prompts", "saved_batches")}}
        if cause is not None:  # where it failed, for whoever reads restarts.jsonl (the reason is one line)
            event["error"] = "".join(traceback.format_exception(cause))[-4000:]
        self.restarts.append(event)
        return event

    def stop_learning(self) -> None:
        self.system.stop_learning()

    def drain(self, timeout_s: float = 120.0) -> dict:
        """Issue nothing more, let the work in flight end, and say what the ledger shows then
        (`System.drain`): a drained run has nothing in flight that no generator holds."""
        return self.system.drain(timeout_s)

    def checkpoint(self) -> str:
        try:
            return self.system.checkpoint()
        except checkpoint.CheckpointWriteError as exc:  # the learner's message, not Ray's wrapping
            raise checkpoint.CheckpointWriteError(_cause_message(exc)) from None

    def checkpoint_ref(self):
        """A checkpoint now, as an awaitable reference (the Serve app awaits it on its event loop)."""
        return self.system.actors["learner"].save_checkpoint.remote()

    def status(self) -> dict:
        """Every role's status, the ledger's and the pool's (`System.status`)."""
        return self.system.status()

    @property
    def generator_ids(self) -> list[str]:
        return list(self.system.generators)

    def set_reward_routes(self, routes: list[dict]):
        """New reward routes for the assembler (validated there; the next scores use them), as an
        awaitable reference."""
        return self.system.actors["assembler"].set_reward_routes.remote(routes)

    def weights(self):
        return self.system.weights()

    def stop(self) -> None:
        if self.system is not None:
            self.system.stop()

    def write_plots(self) -> None:
        self.log.write_plots()


def _earlier_restarts(run_dir: str, window_s: float) -> list[float]:
    """When the restarts in `restarts.jsonl` within the last `window_s` were tried (a resumed run,
    a Serve controller replacing another, keeps counting them)."""
    path = os.path.join(run_dir, "restarts.jsonl") if run_dir else ""
    if not path or not os.path.exists(path):
        return []
    since = time.time() - window_s
    times = []
    with open(path) as f:
        for line in f:
            try:
                event = json.loads(line)
                at = float(event.get("at", 0.0))
            except (ValueError, AttributeError):
                continue  # a line cut by a crash
            if at > since and event.get("attempted", True):  # refused restarts spent nothing
                times.append(at)
    return times


def _cause_message(exc: BaseException) -> str:
    """The message of a role's own error (Ray wraps it with the role's traceback)."""
    return str(exc.cause if isinstance(exc, RayTaskError) else exc)


def _prompt_state(status: dict) -> dict:
    """What the prompt source says about why it issues nothing (a stall's first suspect)."""
    prompts = status.get("prompt_source", {})
    return {k: prompts.get(k) for k in ("issued", "budget", "delivered_version", "prompts_retired",
                                        "all_prompts_retired", "all_prompts_exhausted", "reissue_pending")}
