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
a mailbox's queue): its death brings the whole system back from the newest valid checkpoint
(`trainer.max_restarts` times at most), the one recovery that is exact for them
(docs/architecture.md, checkpoints and resume). The cost is the steps since that checkpoint.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec
from ray.exceptions import RayError, RayTaskError

from asyncrl import checkpoint
from asyncrl.config import Config
from asyncrl.run.pool import autoscale_step
from asyncrl.run.records import RunRecords
from asyncrl.run.wiring import RoleHung, System

RESTART_ATTEMPTS = 4
RESTART_WAIT_S = 10.0
EXHAUSTION_CHECK_S = 5.0  # how often a quiet run asks whether every prompt is retired


class StallError(RuntimeError):
    """No learner step for `trainer.stall_timeout_s`."""


@dataclass
class Poll:
    records: list[dict] = field(default_factory=list)  # new step records, as written
    restart: dict | None = None  # set when the system was restarted from a checkpoint
    retirements: list[dict] = field(default_factory=list)  # prompts retired (or back) since the last poll


class Run:
    def __init__(self, config: Config, run_dir: str, max_steps: int = 0, stall_timeout_s: float | None = None,
                 annotate: Callable[[dict], None] | None = None, wandb_run: Any = None, history_limit: int = 0):
        self.config = config
        self.run_dir = run_dir
        self.max_steps = max_steps  # the learner stops there (0: trains until stopped, as under Serve)
        self.stall_timeout_s = config.trainer.stall_timeout_s if stall_timeout_s is None else stall_timeout_s
        self.log = RunRecords(run_dir, annotate, wandb_run, history_limit, config.trainer.log_file_mb << 20,
                              config.trainer.log_files_kept)
        self.restarts: list[dict[str, Any]] = []
        self.system: System | None = None
        self.last_status: dict = {}  # the status read at the last poll with new steps
        self.last_step_at = time.time()
        self._exhaustion_checked_at = 0.0
        self._autoscale = {"at": time.monotonic(), "wait_batch_s": 0.0, "polls": 0, "batches_full": 0}

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
        """None while every role's loop runs; after a death, the run restarted from the newest
        checkpoint (the event, also in `restarts.jsonl`), or raise when it cannot recover."""
        try:
            dead = self.system.check_alive()
        except Exception as exc:  # a role's loop ended: its error, or ActorDiedError
            return self._recover(exc)
        self.system.pool.check(dead)  # generators: healed in place, replaced while there is room
        return None

    def _recover(self, exc: Exception) -> dict:
        """A role died or hung (`exc`): restart from the newest checkpoint; the event."""
        if isinstance(exc.__cause__, checkpoint.DiskRefused):
            # The disk would refuse the restarted run too (its checkpoints, its store): one error, no restarts.
            raise checkpoint.DiskRefused(_cause_message(exc.__cause__)) from exc
        restart = self.restart(f"{type(exc).__name__}: {exc}".splitlines()[0][:300], exc)
        self.log.after_restart(restart["step"])
        self.log.append("restarts.jsonl", [restart])
        self.last_step_at = time.time()
        return restart

    def poll(self, check_health: bool = True) -> Poll:
        """One look at the run; raises when it cannot recover, or `StallError` when it stalled.
        `check_health=False`: only record the steps done (after the learner was stopped on purpose)."""
        restart = self.check() if check_health else None
        if restart is not None:
            return Poll(restart=restart)
        try:
            return self._poll_records()
        except RoleHung as exc:  # alive but stuck: as good as dead
            return Poll(restart=self._recover(exc))

    def _poll_records(self) -> Poll:
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
                    f"prompts: {_prompt_state(status)}")
            return Poll()
        self.last_step_at = time.time()
        self.last_status = self.system.status()
        retirements = self.log.add(new, self.last_status, bool(self.system.resumed))
        if self.config.cluster.autoscale:
            self._autoscale_step(self.last_status)
        return Poll(records=new, retirements=retirements)

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
        """Bring the system back from the newest valid checkpoint; the event, or raise when it cannot."""
        start = time.perf_counter()
        # Stop first: a learner still alive could otherwise commit newer checkpoints and prune the
        # one chosen below.
        self.system.stop()
        latest, _ = checkpoint.latest_valid(self.run_dir) if self.run_dir else (None, [])
        if len(self.restarts) >= self.config.trainer.max_restarts or latest is None:
            why = "no checkpoint to restart from" if latest is None else \
                f"trainer.max_restarts={self.config.trainer.max_restarts} used up"
            raise RuntimeError(f"the run cannot recover ({why}) from: {reason}") from cause
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
                    raise RuntimeError(f"the run could not restart after {reason}: {exc}") from exc
                time.sleep(RESTART_WAIT_S)
        event = {"reason": reason, "restart_s": time.perf_counter() - start, "at": time.time(),
                 **{k: self.system.resumed[k] for k in ("checkpoint", "step", "reissued_prompts", "saved_batches")}}
        if cause is not None:  # where it failed, for whoever reads restarts.jsonl (the reason is one line)
            event["error"] = "".join(traceback.format_exception(cause))[-4000:]
        self.restarts.append(event)
        return event

    def stop_learning(self) -> None:
        self.system.stop_learning()

    def checkpoint(self) -> str:
        try:
            return self.system.checkpoint()
        except checkpoint.CheckpointWriteError as exc:  # the learner's message, not Ray's wrapping
            raise checkpoint.CheckpointWriteError(_cause_message(exc)) from None

    def weights(self):
        return self.system.weights()

    def stop(self) -> None:
        if self.system is not None:
            self.system.stop()

    def write_plots(self) -> None:
        self.log.write_plots()


def _cause_message(exc: BaseException) -> str:
    """The message of a role's own error (Ray wraps it with the role's traceback)."""
    return str(exc.cause if isinstance(exc, RayTaskError) else exc)


def _prompt_state(status: dict) -> dict:
    """What the prompt source says about why it issues nothing (a stall's first suspect)."""
    prompts = status.get("prompt_source", {})
    return {k: prompts.get(k) for k in ("issued", "budget", "delivered_version", "prompts_retired",
                                        "all_prompts_retired", "all_prompts_exhausted", "reissue_pending")}
