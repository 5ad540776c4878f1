"""What a run writes as it goes, the same for `asyncrl train` and the Serve `train` app: each learner
step's record stamped with the run's counters (`metrics.jsonl`, and the loggers of
`asyncrl.run.loggers`: wandb, TensorBoard), prompt retirements
(`retirements.jsonl`), the generator pool's events (`generators.jsonl`), restarts
(`restarts.jsonl`), and the plots.

Nothing here grows without end in a run of days: each jsonl log rolls to `<name>.1`, `<name>.2`, ...
past `trainer.log_file_mb` and keeps `trainer.log_files_kept` rolled files; the records held in
memory (the plots, the Serve app's /metrics) are at most `history_limit`: the newest half of them
whole, the older ones thinned (every other one each time the limit is reached), so a plot still
spans the whole run."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable

# Fields every record gets from the system's status at the poll that drained it.
RUN_FIELDS = ("samples_trained", "samples_dropped", "samples_generated", "tool_calls", "generator_busy_fraction",
              "generator_paused_for_weights_fraction", "broadcast_s", "broadcast_bytes", "wall_time_s", "samples_per_s",
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


def append_jsonl(path: str, records: list[dict], max_bytes: int = 0, keep: int = 0) -> None:
    """Append one JSON line per record; past `max_bytes` (0: never) the file rolls (`roll`)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)  # the first line of a run's directory
    with open(path, "a") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    if max_bytes and os.path.getsize(path) >= max_bytes:
        roll(path, keep)


def roll(path: str, keep: int) -> None:
    """`path` becomes `path.1` (`.1` becomes `.2`, ...); the rolled file past `keep` is deleted."""
    if keep == 0:
        os.remove(path)
        return
    if os.path.exists(f"{path}.{keep}"):
        os.remove(f"{path}.{keep}")
    for i in range(keep - 1, 0, -1):
        if os.path.exists(f"{path}.{i}"):
            os.replace(f"{path}.{i}", f"{path}.{i + 1}")
    os.replace(path, f"{path}.1")


def thin_history(records: list[dict], limit: int) -> list[dict]:
    """At most `limit` records: the newest half whole, every other one of the older part (whose
    density thus halves each time the limit is reached again), the first kept."""
    if len(records) <= limit:
        return records
    recent = limit // 2
    older = records[:-recent]
    return older[::2][: limit - recent] + records[-recent:]


class RunRecords:
    def __init__(self, run_dir: str, annotate: Callable[[dict], None] | None = None, loggers: Any = None,
                 history_limit: int = 0, log_file_bytes: int = 0, log_files_kept: int = 0):
        self.run_dir = run_dir
        self.annotate = annotate  # called on each record before it is written (e.g. evaluation)
        self.loggers = loggers  # `asyncrl.run.loggers.StepLoggers`: wandb, TensorBoard (None: metrics.jsonl alone)
        self.history_limit = history_limit  # 0 = keep every record in memory
        self.log_file_bytes, self.log_files_kept = log_file_bytes, log_files_kept  # 0 bytes: never roll
        self.records: list[dict] = []
        self.steps_recorded = 0  # records added, less those a restart redoes (`records` may be thinned)
        self.started = time.time()
        self.metrics_path = os.path.join(run_dir, "metrics.jsonl")
        self._previous_poll: tuple[float, int] | None = None
        # Prompt retirement: events already written, and whether every prompt is retired with nothing
        # left to learn from (`asyncrl train` stops, Serve reports it).
        self._retirement_seq = -1
        self.prompts_exhausted = False
        self.retired_by_reason: dict[str, int] = {}
        self.retired_share = 0.0
        self.pool_events: list[dict] = []  # the newest generator joins, leaves and heals (status page)

    def append(self, name: str, records: list[dict]) -> None:
        """Lines of the jsonl log `name` in the run directory (rolled past its size); none without one."""
        if self.run_dir:
            append_jsonl(os.path.join(self.run_dir, name), records, self.log_file_bytes, self.log_files_kept)

    def after_restart(self, step: int) -> None:
        """The steps after the checkpoint a restart came back from are redone."""
        if self.records:
            self.steps_recorded -= max(0, self.records[-1]["step"] - step)
        self.records = [r for r in self.records if r["step"] <= step]
        self._previous_poll = (time.time() - self.started, 1 << 62)  # the next poll's rate is unknown
        self._retirement_seq = -1  # a new prompt source numbers its retirement events from 0

    def note_prompts(self, status: dict) -> None:
        """The prompt source's retirement figures (also read between steps: the last prompt may
        retire after the last step a run will ever take)."""
        prompts = status.get("prompt_source", {})
        self.retired_share = prompts.get("prompts_retired_share", 0.0)
        self.prompts_exhausted = bool(prompts.get("all_prompts_exhausted"))
        self.retired_by_reason = dict(prompts.get("retired_by_reason", {}))
        self._new_retirements(prompts.get("retirement_log", []))  # the last ones come after the last step

    def add(self, new: list[dict], status: dict, resumed: bool) -> list[dict]:
        """Stamp, annotate and write new step records; returns the new retirement events."""
        stamp = {"samples_trained": status["samples_trained"], "samples_dropped": status["samples_dropped"],
                 "samples_generated": status["samples_generated"], "tool_calls": status["tool_calls"],
                 "generator_busy_fraction": status["generator_busy_fraction"],
                 "generator_paused_for_weights_fraction": status["generator_paused_for_weights_fraction"],
                 "broadcast_s": status["last_broadcast"].get("total_s", 0.0),
                 "broadcast_bytes": status["last_broadcast"].get("bytes", 0.0),
                 "reward_failed": status.get("assembler", {}).get("reward_failures", 0),
                 "wall_time_s": time.time() - self.started}
        if "delta_elements" in status["last_broadcast"]:  # policy.weight_delta: the share of values that changed
            stamp["delta_changed_fraction"] = (status["last_broadcast"]["delta_elements_changed"]
                                               / max(status["last_broadcast"]["delta_elements"], 1.0))
        if self._previous_poll is None and resumed:  # counters restored: no rate until the next poll
            self._previous_poll = (0.0, 1 << 62)
        stamp["samples_per_s"] = samples_per_s(self._previous_poll, stamp["wall_time_s"], stamp["samples_trained"])
        retirements = self._new_retirements(status.get("prompt_source", {}).get("retirement_log", []))
        self.note_prompts(status)
        stamp["prompts_retired_share"] = self.retired_share
        self._previous_poll = (stamp["wall_time_s"], stamp["samples_trained"])
        for record in new:
            record.update(stamp)
            if self.annotate is not None:
                self.annotate(record)
        self.append("metrics.jsonl", new)
        if self.loggers is not None:  # after metrics.jsonl, which has every record whatever a logger does
            self.loggers.log(new, status)
        self.records += new
        self.steps_recorded += len(new)
        if self.history_limit:
            self.records = thin_history(self.records, self.history_limit)
        return retirements

    def _new_retirements(self, log: list[dict]) -> list[dict]:
        """Retirement events not seen before, appended to `retirements.jsonl` (which prompt, why)."""
        new = [event for event in log if event["seq"] > self._retirement_seq]
        if new:
            self._retirement_seq = new[-1]["seq"]
            self.append("retirements.jsonl", new)
        return new

    def pool_event(self, event: dict) -> None:
        """A generator joined, left or was healed: a line of `generators.jsonl`, and on the status."""
        self.append("generators.jsonl", [event])
        self.pool_events = (self.pool_events + [event])[-50:]

    def write_plots(self) -> None:
        """The run's PNGs in its directory (the same for both entry points); none before a first step."""
        from asyncrl.plots import plot_curve, write_plots

        if not self.records:
            return

        plot_curve(self.records, os.path.join(self.run_dir, "reward_curve.png"), key=REWARD_KEY,
                   title="reward of generated samples (before dynamic sampling)")
        write_plots(self.records, self.run_dir)
