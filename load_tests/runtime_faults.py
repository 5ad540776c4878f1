"""Faults of a run that stays alive (issue 44, items 1-4): parts that answer but make no progress,
work slower than its lease, a pool shrinking while rewards are slow, errors in the run's own
monitor, and restarts spread over time. `load_tests/faults.py` runs these beside its kills.

* hang_delivery      a generator's weight load hangs while it answers its stats: healed (the
                     learner reports the failed delivery), replaced, no version announced that no
                     generator holds
* lease_outlived     a prompt's work outlives its lease (`cluster.lease_s`): first a window longer
                     than the lease (renewed: never handed to another generator), then a generator
                     stopped for two leases (its prompts go to the other one, both copies reach the
                     assembler, which keeps one)
* scale_down_slow    3 -> 1 generators while every reward takes a second: the drained generators'
                     finished samples, still queued, count (before, they were ignored and stayed in
                     flight for ever, with their share of the admission budget)
* restart_budget     learner deaths spread over more than the restart window are all recovered,
                     a burst inside one window spends the budget (`trainer.max_restarts` within
                     `trainer.restart_window_s`, scaled down from an hour)
* serve_poll_errors  the `train` and `policy` Serve apps as `serve run` deploys them: errors
                     injected into the controller's poll restart the run from its checkpoint (the
                     same run directory, steps never below the checkpoint), the policy endpoint
                     follows the restarted learner's weights (a lower version of a new
                     incarnation), then the controller replica is killed and its replacement
                     resumes the run

Each ends with the ledger after a drain (`Run.drain`: nothing issued any more, the work in flight
ended): every sample still in flight must be one a live generator holds.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from typing import Callable

from asyncrl.config import compose
from asyncrl.run import RestartBudgetSpent, Run
from load_tests.pool_faults import WINDOW_S, Timeline, _pool_events, monotone, staleness

BASE = ["model=tiny", "task=tiny", "algorithm=grpo", "trainer.prompts_per_step=2", "trainer.checkpoint_every=3",
        "trainer.checkpoint_keep=2", "trainer.max_restarts=5", "trainer.wandb_mode=disabled"]


def drained_ledger(run: Run, timeout_s: float = 120.0) -> dict:
    """The books after a drain: balanced, nothing trained twice, and nothing in flight that no
    generator holds (`unaccounted`, with up to ten of their ids)."""
    drained = run.drain(timeout_s)
    found = run.ledger()
    counts = found["counts"]
    return {"admitted": counts["admitted"], "in_flight": counts["in_flight"],
            "awaiting": counts["awaiting_reward"] + counts["awaiting_training"], "trained": counts["trained"],
            "dropped": counts["dropped"], "dropped_by_reason": counts["dropped_by_reason"],
            "duplicates": counts["duplicates"], "balanced": not found["problems"], "problems": found["problems"],
            **drained}


def _start(overrides: list[str], run_dir: str, extra: list[str]) -> Run:
    shutil.rmtree(run_dir, ignore_errors=True)
    return Run(compose(overrides + extra + [f"trainer.run_dir={run_dir}"]), run_dir).start()


def _learner_step(run: Run) -> int:
    return run.role_stats("learner", timeout_s=30)["step"]


def hang_delivery(run_dir: str, quick: bool, extra: list[str]) -> dict:
    run = _start([*BASE, "cluster.num_generators=2", "cluster.generator_timeout_s=10"], run_dir, extra)
    timeline = Timeline(run)
    announced_beyond = []  # (learner's delivered version, the versions the generators held)

    def watch_versions():
        while not stop.is_set():
            try:
                status = run.status()
            except Exception:  # noqa: BLE001 - a status read across a heal: the next one
                continue
            held = [g["delivered_version"] for g in status.generators if not g.get("unresponsive")]
            if held and status.delivered_version > min(held):
                announced_beyond.append((status.delivered_version, held))
            time.sleep(0.5)

    stop = threading.Event()
    try:
        timeline.watch(15 if quick else 30)
        victim = run.generator_ids[0]
        reference, at, step = timeline.rate(time.time() - 2 * WINDOW_S, time.time()), time.time(), run.step
        watcher = threading.Thread(target=watch_versions, daemon=True)
        watcher.start()
        run.inject_generator_fault(victim, load_hang_s=3600)
        timeline.watch(40 if quick else 80)
        stop.set()
        watcher.join()
        return {"injected": f"{victim}'s weight loads hang (it answers its stats); cluster.generator_timeout_s=10",
                **timeline.recovery(at, reference), "learner_restarts": len(timeline.restarts),
                **monotone(timeline.steps_since(at)), "pool_events": _pool_events(run, at), **staleness(run, step),
                "versions_announced_beyond_what_generators_held": announced_beyond[:5],
                "ledger": drained_ledger(run)}
    finally:
        stop.set()
        timeline.close()
        run.stop()


def lease_outlived(run_dir: str, quick: bool, extra: list[str]) -> dict:
    lease_s = 4.0
    run = _start([*BASE, "cluster.num_generators=2", f"cluster.lease_s={lease_s}", "cluster.generator_timeout_s=120"],
                 run_dir, extra)
    timeline = Timeline(run)
    try:
        timeline.watch(10)
        victim = run.generator_ids[0]
        before = run.mailbox_stats("prompts")
        # A window three leases long: the lease is renewed beside it, nothing is handed over.
        run.inject_generator_fault(victim, window_hang_s=3 * lease_s)
        timeline.watch(3 * lease_s + 2)
        run.inject_generator_fault(victim, window_hang_s=0.0)
        renewed = run.mailbox_stats("prompts")
        long_window = {"redelivered": renewed.redelivered_total - before.redelivered_total,
                       "renewed": renewed.renewed_total - before.renewed_total,
                       "generator": {k: run.role_stats(victim)[k] for k in ("leases_renewed", "leases_lost")}}
        # The generator stopped for two leases (no renewal): its prompts go to the other generator.
        pid = run.pid(victim)
        assembler_before = run.role_stats("assembler")
        os.kill(pid, signal.SIGSTOP)
        timeline.watch(2 * lease_s + 2)
        os.kill(pid, signal.SIGCONT)
        timeline.watch(15 if quick else 30)
        after = run.mailbox_stats("prompts")
        assembler = run.role_stats("assembler")
        delta = {k: assembler.get(k, 0) - assembler_before.get(k, 0)
                 for k in ("copies_discarded", "segments_ignored", "segments_out_of_order")}
        return {"injected": f"cluster.lease_s={lease_s:g}: a window of {3 * lease_s:g} s on {victim}, then "
                            f"{victim} stopped (SIGSTOP) for {2 * lease_s + 2:g} s",
                "long_window": long_window,
                "stopped": {"prompts_redelivered": after.redelivered_total - renewed.redelivered_total,
                            "assembler": delta, "held_again": run.role_stats(victim)["prompts_held_again"]},
                "learner_restarts": len(timeline.restarts), **monotone(timeline.steps),
                "assembler_alive": True, "step_after": _learner_step(run), "ledger": drained_ledger(run)}
    finally:
        timeline.close()
        run.stop()


def scale_down_slow(run_dir: str, quick: bool, extra: list[str]) -> dict:
    run = _start([*BASE, "cluster.num_generators=3", "cluster.max_generators=3"], run_dir, extra)
    timeline = Timeline(run)
    try:
        timeline.watch(10)
        run.reconfigure_reward("verifier", {"fault_delay_s": 1.0})  # every reward call takes a second
        timeline.watch(8)
        queued = run.mailbox_stats("segments")
        at, step = time.time(), run.step
        events = run.scale(1, reason="load test: scale down while rewards are slow")
        timeline.watch(5)
        run.reconfigure_reward("verifier", {"fault_delay_s": 0.0})
        timeline.watch(20 if quick else 40)
        prompt_source = run.role_stats("prompt_source")
        return {"injected": "reward calls slowed to 1 s, then the pool scaled 3 -> 1 (two generators drained)",
                "segments_queued_at_scale": queued.queued + queued.leased,
                "pool_events": [{k: e[k] for k in ("event", "generator", "handed_back")} for e in events if "handed_back" in e],
                "learner_restarts": len(timeline.restarts), **monotone(timeline.steps_since(at)),
                "steps_after_scale": run.step - step,
                "admission": {k: prompt_source[k] for k in ("issued", "budget", "delivered_version")},
                "ledger": drained_ledger(run)}
    finally:
        timeline.close()
        run.stop()


def restart_budget(run_dir: str, quick: bool, extra: list[str]) -> dict:
    """The hour scaled to `window` seconds: deaths spaced wider than window / max_restarts are all
    recovered, however many; a burst spends the budget and is refused with the time it may restart
    again; at that time it does (as the Serve controller does), and trains on."""
    window, budget = (40.0, 2) if quick else (90.0, 2)
    spread = 3 if quick else 5
    run = _start([*BASE, f"trainer.max_restarts={budget}", f"trainer.restart_window_s={window:g}"], run_dir, extra)
    timeline = Timeline(run)
    recovered, refused = [], None
    try:
        timeline.watch(8)
        start = time.time()
        for i in range(spread):  # one death every window / budget (+ a margin): never over the budget
            while time.time() < start + i * (window / budget + 3):
                timeline.watch(1)
            recovered.append(_kill_learner(run, timeline))
        for _ in range(budget + 3):  # a burst: one finds the budget spent (the window slides meanwhile)
            try:
                recovered.append(_kill_learner(run, timeline))
            except RestartBudgetSpent as spent:
                refused = {"message": str(spent), "retry_in_s": round(spent.retry_at - time.time(), 1)}
                time.sleep(max(0.0, spent.retry_at - time.time()) + 1.0)
                restart = run.restart_after(spent, spent.reason)  # allowed again: the window moved on
                refused["restarted_after_wait"] = {"resumed_from_step": restart["step"],
                                                   "restart_s": round(restart["restart_s"], 1)}
                timeline.watch(10)
                break
        return {"injected": f"{spread} learner deaths {window / budget + 3:g} s apart, then a burst "
                            f"(trainer.max_restarts={budget} within trainer.restart_window_s={window:g})",
                "restarts": recovered, "spread_over_s": round(recovered[spread - 1]["at"] - recovered[0]["at"], 1),
                "refused": refused, "step_after": run.step, "ledger": drained_ledger(run)}
    finally:
        timeline.close()
        run.stop()


def _kill_learner(run: Run, timeline: Timeline) -> dict:
    """Kill the learner; the poll that sees it restarts the run (or raises: the budget is spent)."""
    step, at = run.status().step, time.time()
    run.kill("learner")
    while (restart := run.poll().restart) is None:
        time.sleep(0.25)
    timeline.watch(5)
    return {"killed_at_step": step, "resumed_from_step": restart["step"], "restart_s": round(restart["restart_s"], 1),
            "at": at, "training_again_s": round(time.time() - at, 1)}


# --- under Serve --------------------------------------------------------------------------------------

SERVE_OVERRIDES = ("model=tiny task=tiny algorithm=grpo trainer.wandb_mode=disabled trainer.checkpoint_every=4 "
                   "trainer.checkpoint_keep=2 trainer.max_restarts=10")


def serve_poll_errors(run_dir: str, quick: bool, extra: list[str]) -> dict:
    from ray import serve

    from asyncrl.serve.reward import deploy_declaratively
    from asyncrl.weights.sync import free_port

    shutil.rmtree(run_dir, ignore_errors=True)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    overrides = " ".join([SERVE_OVERRIDES, *extra])
    apps = [{"name": "train", "route_prefix": "/train", "import_path": "asyncrl.serve.train:build_train",
             "args": {"overrides": overrides, "trainer.run_dir": run_dir}},
            {"name": "policy", "route_prefix": "/v1", "import_path": "asyncrl.serve.policy:build_policy",
             "args": {"overrides": overrides}}]
    try:
        deploy_declaratively(apps, timeout_s=600)
        controller = serve.get_deployment_handle("TrainController", "train")
        _wait(lambda: _status(base).get("step", 0) >= 6, 300, "the first steps")
        errors = []
        for i in range(2 if quick else 5):
            errors.append(_inject_poll_error(base, controller, len(errors)))
        replaced = _kill_controller(base, controller, run_dir)
        drained = controller.drain.remote(120).result(timeout_s=300)
        status = _status(base)
        ledger = status["ledger"]
        return {"injected": f"{len(errors)} errors injected into the controller's poll, then the controller "
                            f"replica killed", "poll_errors": errors, "controller_replaced": replaced,
                "same_run_dir": all(e["run_dir"] == run_dir for e in errors) and replaced["run_dir"] == run_dir,
                "steps_below_checkpoint": [e for e in [*errors, replaced] if e["min_step_after"] < e["checkpoint_step"]],
                "ledger": {"admitted": ledger["admitted"], "in_flight": ledger["in_flight"],
                           "trained": ledger["trained"], "dropped": ledger["dropped"],
                           "duplicates": ledger["duplicates"], "balanced": not ledger["problems"],
                           "problems": ledger["problems"], **drained}}
    finally:
        for app in ("train", "policy"):
            serve.delete(app)
        serve.shutdown()


def _status(base: str) -> dict:
    import httpx

    try:
        answer = httpx.get(f"{base}/train/status", timeout=30)
        return answer.json() if answer.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}


def _models(base: str) -> dict:
    import httpx

    return httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]


def _wait(done: Callable[[], bool], timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not done():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"waited {timeout_s:.0f}s for {what}")
        time.sleep(0.5)
    return time.monotonic() - start


def _restarts(base: str) -> int:
    import httpx

    try:
        answer = httpx.get(f"{base}/train/healthz", timeout=30)
    except httpx.HTTPError:
        return -1
    return answer.json().get("restarts", 0) if answer.status_code == 200 else -1


def _inject_poll_error(base: str, controller, restarts_before: int) -> dict:
    before = _status(base)
    checkpoint_step = before.get("last_checkpoint", {}).get("step", 0)
    served_before = _models(base)
    at = time.monotonic()
    controller.inject_poll_errors.remote(1).result(timeout_s=60)
    _wait(lambda: _restarts(base) > restarts_before, 180, "the restart")
    restart_s = time.monotonic() - at
    steps = []
    _wait(lambda: steps.append(_status(base).get("step", -1)) or steps[-1] >= checkpoint_step + 3, 180,
          "training after the restart")
    # The policy endpoint takes the restarted learner's weights (another incarnation, perhaps a lower version).
    _wait(lambda: _models(base)["weight_incarnation"] != served_before["weight_incarnation"], 60,
          "the policy endpoint to follow the new learner")
    served = _models(base)
    return {"step_at_error": before.get("step"), "checkpoint_step": checkpoint_step,
            "min_step_after": min(s for s in steps if s >= 0), "restart_s": round(restart_s, 1),
            "training_again_s": round(time.monotonic() - at, 1), "run_dir": before.get("run_dir"),
            "policy_before": {k: served_before[k] for k in ("weight_incarnation", "weight_version")},
            "policy_after": {k: served[k] for k in ("weight_incarnation", "weight_version")}}


def _kill_controller(base: str, controller, run_dir: str) -> dict:
    """Kill the train controller's replica process: Serve starts another, which resumes the run.
    The bound its steps are held to is the newest checkpoint committed in the run directory (the
    learner's own `last_checkpoint` is empty until the incarnation running writes one)."""
    import httpx

    from asyncrl.storage import checkpoint

    before = _status(base)
    checkpoint_step = max((step for step, _ in checkpoint.committed(checkpoint.checkpoints_dir(run_dir))), default=0)
    pid = controller.pid.remote().result(timeout_s=60)
    at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    _wait(lambda: _healthy_resumed(base, before.get("started_at")), 600, "a new controller")
    health = httpx.get(f"{base}/train/healthz", timeout=30).json()
    steps = []
    _wait(lambda: steps.append(_status(base).get("step", -1)) or steps[-1] >= checkpoint_step + 3, 300,
          "training in the new controller")
    return {"step_at_kill": before.get("step"), "checkpoint_step": checkpoint_step,
            "resumed_from_step": health.get("resumed_from_step"), "run_dir": health.get("run_dir"),
            "min_step_after": min(s for s in steps if s >= 0),
            "training_again_s": round(time.monotonic() - at, 1)}


def _healthy_resumed(base: str, started_before: float | None) -> bool:
    status = _status(base)
    return bool(status) and status.get("started_at") != started_before and status.get("step", 0) > 0


SCENARIOS = {f.__name__: f for f in (hang_delivery, lease_outlived, scale_down_slow, restart_budget,
                                     serve_poll_errors)}
