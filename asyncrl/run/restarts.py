"""The restart budget of a run (`asyncrl.run.Run`): restarts are counted per window
(`trainer.max_restarts` within any `trainer.restart_window_s`), from `restarts.jsonl`, so a run that
restarted three times in a week is not one restart from its end, and a controller that replaces
another (Serve) counts the restarts before it; and the errors a run that cannot come back ends on."""

from __future__ import annotations

import json
import os
import time


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


def restart_allowed_at(restart_times: list[float], now: float, max_restarts: int, window_s: float) -> float | None:
    """None when a restart is allowed now (fewer than `max_restarts` in the last `window_s`), else
    the time the oldest of them leaves the window. `max_restarts=0`: never (inf)."""
    if max_restarts <= 0:
        return float("inf")
    recent = sorted(t for t in restart_times if t > now - window_s)
    if len(recent) < max_restarts:
        return None
    return recent[-max_restarts] + window_s


def earlier_restarts(run_dir: str, window_s: float) -> list[float]:
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
