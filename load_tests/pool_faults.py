"""The generator pool under faults and scaling, measured as a rate: `load_tests/faults.py` runs these.

* kill_generator   one generator of three is killed mid-window; then, in the same run, the learner
                   is killed (a whole restart from the checkpoint, what any death cost before the
                   pool) so both recoveries are measured side by side
* node_loss        (two-node cluster) the worker node dies with its generator mid-window; then the
                   learner is killed in the same run for the comparison
* partition        (two-node cluster) the worker's link is down for 30 s
* scale            1 -> 4 -> 2 generators while training (`Run.scale`, what the admin route calls)

Each reports, per change: the rate of trained samples before, the dip (the slowest 5-second
window after it, as a share of the rate before), the time until a 5-second window runs at 90% of
the reference rate again, the learner's restarts (0 for anything the pool heals), the pool's
events, and the ledger (admitted = in flight + awaiting + trained + dropped; 0 duplicates).
"""

from __future__ import annotations

import threading
import time

import ray

from asyncrl.run import Run

WINDOW_S = 5.0  # a rate is read over this long
FULL_RATE = 0.9  # "full rate again": a window at this share of the reference rate


def learner_progress(run: Run) -> tuple[int, int] | None:
    """The learner's step and count of trained samples, or None while it cannot be reached."""
    try:
        stats = run.role_stats("learner", timeout_s=10)
    except (ray.exceptions.RayError, KeyError, AttributeError):
        return None
    return stats["step"], stats["samples_trained"]


class Timeline:
    """The learner's step and trained samples over time, read every `every_s` by a thread of its own
    (a poll can take seconds: a replacement joining, a restart), while the run is kept alive the way
    the driver keeps it (`Run.poll`: generators healed in place, a restart for any other death)."""

    def __init__(self, run: Run, every_s: float = 0.25):
        self.run = run
        self.points: list[tuple[float, int]] = []  # (time, samples trained)
        self.steps: list[int] = []
        self.restarts: list[dict] = []
        self._stop = threading.Event()

        def read():
            while not self._stop.is_set():
                progress = learner_progress(run)
                if progress is not None:
                    self.steps.append(progress[0])
                    self.points.append((time.time(), progress[1]))
                time.sleep(every_s)

        self._thread = threading.Thread(target=read, daemon=True)
        self._thread.start()

    def watch(self, seconds: float, until=None) -> None:
        end = time.time() + seconds
        while time.time() < end and not (until is not None and until()):
            try:
                polled = self.run.poll()
            except ray.exceptions.RayError:
                polled = None  # a role cut off for now: the next poll's check decides
            if polled is not None and polled.restart is not None:
                self.restarts.append(polled.restart)
            time.sleep(0.25)

    def steps_since(self, at: float) -> list[int]:
        first = next((i for i, (t, _) in enumerate(self.points) if t >= at), len(self.points))
        return self.steps[first:]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def rate(self, start: float, end: float) -> float:
        """Samples trained per second over [start, end]; 0 across a restart (the count went back)."""
        inside = [(t, n) for t, n in self.points if start <= t <= end]
        if len(inside) < 2 or inside[-1][0] - inside[0][0] < 0.5 * (end - start):
            return 0.0
        return max(0.0, (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0]))

    def recovery(self, at: float, reference: float, until: float | None = None) -> dict:
        """After a change at `at`: the slowest window (as a share of `reference`) and the seconds
        until a window ran at `FULL_RATE` of it again (None when none did before `until`)."""
        until = until or self.points[-1][0]
        rates, start, recovered = [], at, None
        while start + WINDOW_S <= until:
            rate = self.rate(start, start + WINDOW_S)
            rates.append(rate)
            if recovered is None and rate >= FULL_RATE * reference:
                recovered = start + WINDOW_S - at
            start += 0.5
        return {"rate_before": round(reference, 1),
                "dip": round(min(rates) / reference, 2) if rates and reference else None,
                "to_full_rate_s": None if recovered is None else round(recovered, 1)}


def ledger(run: Run) -> dict:
    found = run.ledger()
    counts = found["counts"]
    return {"admitted": counts["admitted"], "trained": counts["trained"], "dropped": counts["dropped"],
            "in_flight": counts["in_flight"], "awaiting": counts["awaiting_reward"] + counts["awaiting_training"],
            "duplicates": counts["duplicates"], "balanced": not found["problems"], "problems": found["problems"]}


def staleness(run: Run, since_step: int) -> dict:
    """The oldest weights any trained token came from (steps after `since_step`), against the bound."""
    records = [r for r in run.records if r["step"] > since_step]
    return {"staleness_max_trained": max((r.get("staleness_max", 0) for r in records), default=None),
            "staleness_bound": run.config.algorithm.max_staleness_versions,
            "stale_tokens_masked": sum(r.get("stale_tokens_masked", 0) for r in records)}


def monotone(steps: list[int]) -> dict:
    return {"learner_steps_monotone": steps == sorted(steps),
            "learner_steps_during": (steps[0], steps[-1]) if steps else None}


def wait_mid_window(run: Run, generator_id: str) -> int:
    """Wait until the generator holds sequences in a window; how many."""
    while (held := run.role_stats(generator_id)["inflight_sequences"]) == 0:
        time.sleep(0.05)
    return held


def learner_restart(run: Run, timeline: Timeline, settle_s: float) -> dict:
    """Kill the learner (the whole run comes back from its checkpoint) and measure it like the rest."""
    reference = timeline.rate(time.time() - 2 * WINDOW_S, time.time())
    step, at = run.status().step, time.time()
    run.kill("learner")
    before = len(timeline.restarts)
    timeline.watch(120, until=lambda: len(timeline.restarts) > before)
    timeline.watch(settle_s)
    event = timeline.restarts[-1] if len(timeline.restarts) > before else {}
    return {"injected": f"ray.kill(learner) at step {step}", **timeline.recovery(at, reference),
            "restart_s": round(event.get("restart_s", 0.0), 1), "resumed_from_step": event.get("step"),
            "steps_redone": step - event["step"] if event else None}


def _pool_events(run: Run, since: float) -> list[dict]:
    return [{k: e[k] for k in ("event", "generator", "reason", "generators")} | {"after_s": round(e["at"] - since, 1)}
            for e in run.log.pool_events if e["at"] >= since]


def _healed(run: Run, timeline: Timeline, at: float, reference: float, step: int, injected: str) -> dict:
    return {"injected": injected, **timeline.recovery(at, reference), "learner_restarts": len(timeline.restarts),
            **monotone(timeline.steps_since(at)), "pool_events": _pool_events(run, at), **staleness(run, step),
            "generator_nodes_after": sorted(g.get("node_ip", "") for g in run.status().generators),
            "ledger": ledger(run)}


def _inject(run: Run, timeline: Timeline, settle_s: float, injected: str, inject, compare: bool = True) -> dict:
    """Run `inject()` now, keep the run for `settle_s`, then (`compare`) kill the learner for the
    whole-restart comparison in the same run."""
    reference, at, step = timeline.rate(time.time() - 2 * WINDOW_S, time.time()), time.time(), run.step
    inject()
    timeline.watch(settle_s)
    healed = _healed(run, timeline, at, reference, step, injected)
    if not compare:
        return {"healed_in_place": healed, "ledger": ledger(run)}
    whole = learner_restart(run, timeline, settle_s)
    return {"healed_in_place": healed, "whole_restart_same_run": whole, "ledger": ledger(run)}


def kill_generator(run: Run, quick: bool) -> dict:
    settle = 20 if quick else 40
    timeline = Timeline(run)
    try:
        timeline.watch(settle)
        victim = run.generator_ids[0]
        held = wait_mid_window(run, victim)
        return _inject(run, timeline, settle,
                       f"ray.kill({victim}) of {len(run.generator_ids)} holding {held} sequences",
                       lambda: run.kill(victim),
                       compare=not quick)  # --quick: the learner's restart is kill_learner's
    finally:
        timeline.close()


def node_loss(run: Run, quick: bool) -> dict:
    from load_tests import cluster

    settle = 30 if quick else 60
    timeline = Timeline(run)
    try:
        timeline.watch(settle / 2)
        victim = worker_generator(run)
        held = wait_mid_window(run, victim)
        return _inject(run, timeline, settle, f"worker node {cluster.WORKER_IP} killed, its generator {victim} "
                                              f"holding {held} sequences", cluster.kill_worker)
    finally:
        timeline.close()


def partition(run: Run, quick: bool, down_s: float = 30.0) -> dict:
    from load_tests import cluster

    settle = 30 if quick else 60
    timeline = Timeline(run)
    try:
        timeline.watch(settle / 2)
        victim = worker_generator(run)
        reference, at, step = timeline.rate(time.time() - 2 * WINDOW_S, time.time()), time.time(), run.step
        cut = threading.Thread(target=cluster.partition, args=(down_s,))
        cut.start()
        timeline.watch(down_s + settle)
        cut.join()
        return _healed(run, timeline, at, reference, step,
                       f"worker link down {down_s:.0f}s (generator {victim} there)")
    finally:
        timeline.close()


def scale(run: Run, quick: bool) -> dict:
    settle = 20 if quick else 45
    timeline = Timeline(run)
    try:
        timeline.watch(settle)
        phases = [{"generators": 1, "rate": round(timeline.rate(time.time() - settle / 2, time.time()), 1)}]
        for count in (4, 2):
            at, step = time.time(), run.step
            run.scale(count, reason=f"load test: scale to {count}")
            took = time.time() - at
            timeline.watch(settle)
            steady = timeline.rate(time.time() - settle / 2, time.time())
            phases.append({"generators": count, "scale_call_s": round(took, 1), "rate": round(steady, 1),
                           **{k: v for k, v in timeline.recovery(at, steady).items() if k != "rate_before"},
                           "learner_restarts": len(timeline.restarts), **monotone(timeline.steps_since(at)),
                           "pool_events": _pool_events(run, at), **staleness(run, step)})
        return {"phases": phases, "ledger": ledger(run)}
    finally:
        timeline.close()


def worker_generator(run: Run) -> str:
    from load_tests.cluster import WORKER_IP

    for gid in run.generator_ids:
        if run.role_stats(gid)["node_ip"] == WORKER_IP:
            return gid
    raise RuntimeError("no generator landed on the worker node (cluster.placement=spread should put one there)")
