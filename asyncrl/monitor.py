"""The one watch loop of a run, used by `asyncrl train` (the driver) and the Serve `train` app.

Each `poll()` checks the system's health (the supervisor restarts it from a checkpoint when an
actor died), drains the learners' step records (value-learner metrics merged into each policy
record), stamps them with the run's counters from one status read (`RUN_FIELDS`), lets the caller
annotate them (the driver's periodic evaluation), and appends them to `metrics.jsonl` (and wandb).
So both entry points write the same records, draw the same plots and show the same status.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from asyncrl.supervisor import Supervisor

# Fields every record gets from the system's status at the poll that drained it.
RUN_FIELDS = ("samples_trained", "samples_dropped", "samples_generated", "generator_busy_fraction",
              "generator_paused_for_weights_fraction", "broadcast_s", "wall_time_s", "samples_per_s",
              "prompts_retired_share")
# The curve a run is watched by: the reward of everything generated (before dynamic sampling).
REWARD_KEY = "reward_mean_generated"


def samples_per_s(previous_poll: tuple[float, int] | None, wall_s: float, samples_trained: int) -> float | None:
    """Throughput as every view shows it (progress bar, plot, status page): samples trained per
    second since the previous poll that had new steps (`(wall_s, samples_trained)` then; None at
    the first: the average since the start). None when the counter went back (a restart)."""
    base_s, base_n = previous_poll if previous_poll is not None else (0.0, 0)
    if samples_trained < base_n or wall_s <= base_s:
        return None
    return (samples_trained - base_n) / (wall_s - base_s)


class StallError(RuntimeError):
    """No learner step for `trainer.stall_timeout_s`."""


@dataclass
class Poll:
    records: list[dict] = field(default_factory=list)  # new step records, as written
    restart: dict | None = None  # set when the system was restarted from a checkpoint
    retirements: list[dict] = field(default_factory=list)  # prompts retired (or back) since the last poll


class RunMonitor:
    def __init__(self, supervisor: Supervisor, run_dir: str, stall_timeout_s: float,
                 annotate: Callable[[dict], None] | None = None, wandb_run: Any = None, history_limit: int = 0):
        self.supervisor = supervisor
        self.run_dir = run_dir
        self.stall_timeout_s = stall_timeout_s
        self.annotate = annotate  # called on each record before it is written (e.g. evaluation)
        self.wandb_run = wandb_run
        self.history_limit = history_limit  # 0 = keep every record (the driver's summary needs them)
        self.records: list[dict] = []
        self.status: dict = {}
        self.started = time.time()
        self.last_step_at = time.time()
        self._wandb_step = 0
        self._previous_poll: tuple[float, int] | None = None
        self.metrics_path = os.path.join(run_dir, "metrics.jsonl")
        # Prompt retirement: events already written to retirements.jsonl, and whether every prompt
        # is retired with nothing left to learn from (`asyncrl train` stops, Serve reports it).
        self._retirement_seq = -1
        self.prompts_exhausted = False
        self.retired_by_reason: dict[str, int] = {}

    @property
    def system(self):
        return self.supervisor.system

    @property
    def step(self) -> int:
        return self.records[-1]["step"] if self.records else self.system.resumed.get("step", 0)

    def poll(self, check_health: bool = True) -> Poll:
        """One look at the run; raises when it cannot recover, or `StallError` when it stalled.
        `check_health=False`: only record the steps done (after the learner was stopped on purpose)."""
        restart = self.supervisor.check() if check_health else None
        if restart is not None:  # an actor died: the system came back from a checkpoint
            self.records = [r for r in self.records if r["step"] <= restart["step"]]  # those steps are redone
            with open(os.path.join(self.run_dir, "restarts.jsonl"), "a") as f:
                f.write(json.dumps(restart) + "\n")
            self.last_step_at = time.time()
            self._previous_poll = (time.time() - self.started, 1 << 62)  # the next poll's rate is unknown
            return Poll(restart=restart)
        new = self.system.pop_metrics()
        if not new:
            if time.time() - self.last_step_at > self.stall_timeout_s:
                status = self.system.status()
                raise StallError(
                    f"no learner step for {self.stall_timeout_s:.0f}s at step {status['step']}; "
                    f"samples dropped by reason: {status['dropped_by_reason']}, queues: {status['queue_depths']}")
            return Poll()
        self.last_step_at = time.time()
        self.status = status = self.system.status()
        stamp = {"samples_trained": status["samples_trained"], "samples_dropped": status["samples_dropped"],
                 "samples_generated": status["samples_generated"],
                 "generator_busy_fraction": status["generator_busy_fraction"],
                 "generator_paused_for_weights_fraction": status["generator_paused_for_weights_fraction"],
                 "broadcast_s": status["last_broadcast"].get("total_s", 0.0),
                 "wall_time_s": time.time() - self.started}
        if self._previous_poll is None and self.system.resumed:  # counters restored: no rate until the next poll
            self._previous_poll = (0.0, 1 << 62)
        stamp["samples_per_s"] = samples_per_s(self._previous_poll, stamp["wall_time_s"], stamp["samples_trained"])
        prompts = status.get("prompt_source", {})
        stamp["prompts_retired_share"] = prompts.get("prompts_retired_share", 0.0)
        self.prompts_exhausted = bool(prompts.get("all_prompts_exhausted"))
        self.retired_by_reason = dict(prompts.get("retired_by_reason", {}))
        retirements = self._new_retirements(prompts.get("retirement_log", []))
        self._previous_poll = (stamp["wall_time_s"], stamp["samples_trained"])
        with open(self.metrics_path, "a") as metrics_file:
            for record in new:
                record.update(stamp)
                if self.annotate is not None:
                    self.annotate(record)
                metrics_file.write(json.dumps(record) + "\n")
                if self.wandb_run is not None and record["step"] > self._wandb_step:  # wandb steps only go up
                    self.wandb_run.log(record, step=record["step"])
                    self._wandb_step = record["step"]
        self.records += new
        if self.history_limit and len(self.records) > self.history_limit:
            self.records = self.records[-self.history_limit:]
        return Poll(records=new, retirements=retirements)

    def _new_retirements(self, log: list[dict]) -> list[dict]:
        """Retirement events not seen before, appended to `retirements.jsonl` (which prompt, why)."""
        new = [event for event in log if event["seq"] > self._retirement_seq]
        if new:
            self._retirement_seq = new[-1]["seq"]
            with open(os.path.join(self.run_dir, "retirements.jsonl"), "a") as f:
                for event in new:
                    f.write(json.dumps(event) + "\n")
        return new

    def write_plots(self) -> None:
        """The run's PNGs in its directory (the same for both entry points)."""
        from asyncrl.plots import plot_curve, write_plots

        plot_curve(self.records, os.path.join(self.run_dir, "reward_curve.png"), key=REWARD_KEY,
                   title="reward of generated samples (all groups, before dynamic sampling)")
        write_plots(self.records, self.run_dir)
