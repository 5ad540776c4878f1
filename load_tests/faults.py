"""Fault injection: kill or stall one part of a running system and report what happened to it and
to the sample ledger afterwards.

    python load_tests/faults.py --quick              # one scenario per kind of fault, small sizes (< 10 min)
    python load_tests/faults.py                      # every scenario but the cluster ones, full sizes
    python load_tests/faults.py kill_generator       # one scenario
    .venv-sglang/bin/python load_tests/faults.py kill_generator --engine sglang_cpu   # SGLang generators

Scenarios (tiny model, the real actors, mailboxes and gloo broadcast; checkpoints every 3 steps):

* kill_generator      one generator of three is killed mid-window: healed in place while the learner
                      trains; then the learner is killed in the same run (a whole restart) to compare
                      (not with --quick)
* scale               1 -> 4 -> 2 generators while training
* kill_learner        the policy learner is killed
* kill_value_learner  the value learner (T-PPO) is killed
* kill_reward         the reward endpoint actor is killed while it scores (Ray restarts it, the
                      calls are retried)
* hang_reward         the reward endpoint stops answering for a while (calls time out and are
                      recorded as failures; training continues)
* fill_mailbox        the reward endpoint slows down so that segments pile up: the mailbox stays
                      within its capacity and the generator waits (backpressure)
* node_loss           (a two-node cluster from `load_tests/cluster.py`, as root) the worker node
                      dies while its generator holds sequences mid-window: healed in place; then
                      the learner is killed in the same run to compare
* partition           (the same cluster) the worker's link goes down for 30 s
* hang_delivery, lease_outlived, scale_down_slow, restart_budget, serve_poll_errors: faults of
                      parts that stay alive (`load_tests/runtime_faults.py`, issue 44)
* full_disk           (root) the checkpoints' disk (a small tmpfs) fills up between two checkpoints:
                      one clear error, no restart, the last checkpoint intact; then room is made and
                      `resume=true` continues from it
* private_run_dir     (the two-node cluster) the learner on the worker node, whose run directory is
                      a private tmpfs: checkpoints reach the head's run directory; the learner is
                      killed and the restarted one (on that node again) resumes from the head's copy

The pool's scenarios (`load_tests/pool_faults.py`) also report the rate of trained samples before,
the dip after and the seconds until training runs at full rate again.
Each prints one JSON object: what was injected, the restart (if any), and the ledger after a
drain (`Run.drain`: nothing issued any more, the work in flight ended): admitted = in flight +
awaiting + trained + dropped, no duplicates, and nothing in flight that no generator holds
(`unaccounted`); and writes them all to `<run-dir>/faults.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import psutil
import ray

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncrl.config import compose  # noqa: E402
from asyncrl.run import Run  # noqa: E402
from asyncrl.run.placement import init_ray  # noqa: E402
from load_tests import pool_faults, runtime_faults  # noqa: E402

BASE = ["model=tiny", "task=tiny", "algorithm=grpo", "trainer.prompts_per_step=2", "trainer.checkpoint_every=3",
        "trainer.checkpoint_keep=2", "trainer.max_restarts=5", "trainer.wandb_mode=disabled"]
VALUE = ["model=tiny", "task=tiny_seq", "algorithm=tppo", "engine.window_tokens=2", "trainer.prompts_per_step=2",
         "trainer.checkpoint_every=3", "trainer.checkpoint_keep=2", "trainer.max_restarts=5",
         "trainer.wandb_mode=disabled"]


def learner_step(sup: Run) -> int | None:
    """The learner's step, or None while some part cannot be reached (a node cut off or dying:
    the supervisor's check restarts the run once an actor is known dead)."""
    try:
        return sup.role_stats("learner", timeout_s=10)["step"]
    except ray.exceptions.RayError:
        return None


def advance(sup: Run, steps: int, timeout_s: float = 300.0) -> list[dict]:
    """Run until the learner has taken `steps` more steps (restarting on a death); restarts seen."""
    events, deadline = [], time.time() + timeout_s
    while (start := learner_step(sup)) is None:
        events += [e for e in [sup.check()] if e is not None]
        time.sleep(0.5)
    target = start + steps
    while (step := learner_step(sup)) is None or step < target:
        if time.time() > deadline:
            raise TimeoutError(f"no progress to step {target} in {timeout_s:.0f}s: at {step}")
        event = sup.check()
        if event is not None:
            events.append(event)
            target = max(target, event["step"] + 1)
        try:
            sup.pop_metrics()
        except ray.exceptions.RayError:
            pass
        time.sleep(0.3)
    return events


def wait_restart(sup: Run, timeout_s: float = 120.0) -> dict:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        event = sup.check()
        if event is not None:
            return event
        time.sleep(0.2)
    raise TimeoutError("the supervisor saw no death")


def ledger_report(sup: Run) -> dict:
    """The books after a drain (the scenario's end): `runtime_faults.drained_ledger`."""
    return runtime_faults.drained_ledger(sup)


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


# Overrides every scenario's run gets (`--engine`).
EXTRA: list[str] = []


def _start(overrides: list[str], run_dir: str) -> Run:
    shutil.rmtree(run_dir, ignore_errors=True)
    config = compose(overrides + EXTRA + [f"trainer.run_dir={run_dir}"])
    return Run(config, run_dir).start()


def _kill(role: str, overrides: list[str], run_dir: str, quick: bool) -> dict:
    sup = _start(overrides, run_dir)
    try:
        advance(sup, 4 if quick else 8)
        step_at_kill = sup.status().step
        sup.kill(role)
        event = wait_restart(sup)
        advance(sup, 6 if quick else 12)
        status = sup.status()
        return {"injected": f"ray.kill({role}) at step {step_at_kill}",
                "restart_s": round(event["restart_s"], 2), "resumed_from_step": event["step"],
                "regenerated_prompts": event["reissued_prompts"], "saved_batches_trained": event["saved_batches"],
                "steps_redone": step_at_kill - event["step"], "step_after": status.step,
                "generator_versions_after": [g["delivered_version"] for g in status.generators],
                "ledger": ledger_report(sup)}
    finally:
        sup.stop()


def kill_learner(run_dir: str, quick: bool) -> dict:
    return _kill("learner", BASE, run_dir, quick)


def kill_value_learner(run_dir: str, quick: bool) -> dict:
    return _kill("value_learner", VALUE, run_dir, quick)


def kill_reward(run_dir: str, quick: bool) -> dict:
    # Slow calls (0.3 s) so that the kill lands mid-request.
    sup = _start(BASE + ["reward.endpoints.verifier.fault_delay_s=0.3"], run_dir)
    try:
        advance(sup, 3)
        before = sup.status().assembler
        kills = 2 if quick else 5
        for _ in range(kills):
            sup.kill("reward-verifier", restart=True)  # Ray restarts it; in-flight calls are retried
            advance(sup, 2)
        status = sup.status()
        router = status.assembler["reward_router"]
        return {"injected": f"{kills} kills of the reward endpoint actor mid-request",
                "supervisor_restarts": len(sup.restarts),
                "reward_failures": status.assembler.get("reward_failures", 0) - before.get("reward_failures", 0),
                "router": {k: router.get(k) for k in ("calls", "retries", "timeouts", "failures") if k in router},
                "step_after": status.step, "ledger": ledger_report(sup)}
    finally:
        sup.stop()


def hang_reward(run_dir: str, quick: bool) -> dict:
    sup = _start(BASE + ["reward.timeout_s=1.0", "reward.retries=1"], run_dir)
    try:
        advance(sup, 3)
        hang_s = 5 if quick else 20
        sup.reconfigure_reward("verifier", {"fault_delay_s": 3600.0})  # never answers in time
        time.sleep(hang_s)
        sup.reconfigure_reward("verifier", {"fault_delay_s": 0.0})
        during = sup.status().assembler
        advance(sup, 4)
        status = sup.status()
        return {"injected": f"reward endpoint hung for {hang_s}s (timeout 1 s, 1 retry)",
                "failed_rewards_recorded": during.get("reward_failures", 0),
                "router": status.assembler["reward_router"], "supervisor_restarts": len(sup.restarts),
                "step_after": status.step, "ledger": ledger_report(sup)}
    finally:
        sup.stop()


def fill_mailbox(run_dir: str, quick: bool) -> dict:
    capacity = 8
    sup = _start(BASE + [f"cluster.mailbox_capacity={capacity}"], run_dir)
    try:
        advance(sup, 2)
        pids = {"segments_mailbox": sup.pid("mailbox-segments"), "assembler": sup.pid("assembler")}
        rss_before = {name: rss_mb(pid) for name, pid in pids.items()}
        sup.reconfigure_reward("verifier", {"fault_delay_s": 2.0})  # the consumer falls behind
        generator = sup.generator_ids[0]
        depths, wait_before = [], sup.role_stats(generator)["wait_mailbox_s"]
        end = time.time() + (15 if quick else 60)
        while time.time() < end:
            s = sup.mailbox_stats("segments")
            depths.append(s.queued + s.leased)
            time.sleep(0.2)
        wait_after = sup.role_stats(generator)["wait_mailbox_s"]
        rss_after = {name: rss_mb(pid) for name, pid in pids.items()}
        sup.reconfigure_reward("verifier", {"fault_delay_s": 0.0})
        advance(sup, 3)
        return {"injected": "reward endpoint slowed to 2 s per call for "
                            f"{15 if quick else 60}s; segments mailbox capacity {capacity}",
                "max_mailbox_depth": max(depths), "capacity": capacity,
                "generator_waited_for_mailbox_s": round(wait_after - wait_before, 1),
                "rss_mb_before": {k: round(v) for k, v in rss_before.items()},
                "rss_mb_after": {k: round(v) for k, v in rss_after.items()},
                "step_after": sup.status().step, "ledger": ledger_report(sup)}
    finally:
        sup.stop()


# --- the generator pool (`load_tests/pool_faults.py`); node cases on a real two-node cluster ----------

POOL = [*BASE, "cluster.num_generators=3", "cluster.max_generators=4"]
SCALE = [*BASE, "cluster.num_generators=1", "cluster.max_generators=4"]
# One generator per node; a cut-off generator is healed after 15 s without an answer.
CLUSTER = [*BASE, "cluster.num_generators=2", "cluster.placement=spread", "cluster.generator_timeout_s=15"]


def _pool(scenario, overrides: list[str]):
    def run(run_dir: str, quick: bool) -> dict:
        sup = _start(overrides, run_dir)
        try:
            advance(sup, 3)
            return {**scenario(sup, quick), "ledger": ledger_report(sup)}
        finally:
            sup.stop()

    run.__name__ = scenario.__name__
    return run


kill_generator = _pool(pool_faults.kill_generator, POOL)
scale = _pool(pool_faults.scale, SCALE)
node_loss = _pool(pool_faults.node_loss, CLUSTER)
partition = _pool(pool_faults.partition, CLUSTER)


# --- storage: a full disk, a learner whose node does not see the run directory -----------------------


def _fill(directory: str) -> str:
    """Take every free byte of the filesystem of `directory`; the filler's path."""
    path = os.path.join(directory, "filler")
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass
    return path


def full_disk(run_dir: str, quick: bool) -> dict:
    import subprocess

    from asyncrl.storage import checkpoint

    if os.geteuid() != 0:
        raise RuntimeError("full_disk mounts a tmpfs: run as root")
    shutil.rmtree(run_dir, ignore_errors=True)
    disk = checkpoint.checkpoints_dir(run_dir)
    os.makedirs(disk)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", disk], check=True)
    overrides = BASE + EXTRA + [f"trainer.run_dir={run_dir}"]
    try:
        sup = Run(compose(overrides), run_dir).start()
        try:
            advance(sup, 4)  # the step-3 checkpoint
            kept = checkpoint.latest_valid(run_dir)[0]
            filler = _fill(disk)
            filled_at_step, start = sup.status().step, time.time()
            error = None
            while error is None and time.time() - start < 300:
                try:
                    sup.poll()
                except checkpoint.DiskRefused as exc:
                    error = str(exc)
                time.sleep(0.3)
            if error is None:
                raise TimeoutError("no checkpoint was refused in 300 s")
            stopped_s, ledger_at_error = time.time() - start, ledger_report(sup)
            restarts = len(sup.restarts)
        finally:
            sup.stop()
        latest = checkpoint.latest_valid(run_dir)[0]
        leftovers = [n for n in os.listdir(disk) if n.endswith(".tmp")]
        os.remove(filler)  # room again: the run continues from the checkpoint it kept
        sup = Run(compose(overrides + ["resume=true"]), run_dir).start()
        try:
            advance(sup, 4 if quick else 8)
            status = sup.status()
            return {"injected": f"the checkpoints' tmpfs (16 MiB) filled at step {filled_at_step}, after the "
                                f"checkpoint {os.path.basename(kept)}",
                    "error": error, "seconds_to_the_error": round(stopped_s, 1), "restarts_before_the_error": restarts,
                    "checkpoint_after_the_error": os.path.basename(latest or "none"),
                    "partial_checkpoints_left": leftovers, "ledger_at_the_error": ledger_at_error,
                    "resumed_from": sup.resumed.get("step"), "step_after": status.step, "ledger": ledger_report(sup)}
        finally:
            sup.stop()
    finally:
        subprocess.run(["umount", "-l", disk], check=False)


@ray.remote(num_cpus=0, resources={"node_private": 0.01})
def _listing_on_the_private_node(path: str) -> list[str]:
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


def private_run_dir(run_dir: str, quick: bool) -> dict:
    """(Inside the head's namespace, the worker's run directory a private tmpfs: `cluster.up`.)"""
    from asyncrl.storage import checkpoint

    # The learner on the worker node, the generators and the control plane on the head. (Not
    # `_start`: removing the directory would detach the worker's private mount on it.)
    overrides = BASE + EXTRA + ["policy.compute.resources={node_private: 1}", "engine.resources={node_learner: 1}"]
    sup = Run(compose(overrides + [f"trainer.run_dir={run_dir}"]), run_dir).start()
    try:
        advance(sup, 4)
        learner_node = sup.status().learner_node
        committed = [os.path.basename(p) for _, p in checkpoint.committed(checkpoint.checkpoints_dir(run_dir))]
        on_the_worker = ray.get(_listing_on_the_private_node.remote(run_dir), timeout=60)
        step_at_kill = sup.status().step
        sup.kill("learner")
        event = wait_restart(sup)
        advance(sup, 6 if quick else 12)
        status = sup.status()
        return {"injected": f"the learner on {learner_node} (its run directory a private tmpfs), killed at step "
                            f"{step_at_kill}",
                "checkpoints_on_the_head": committed, "run_directory_as_the_learner_node_sees_it": on_the_worker,
                "restart_s": round(event["restart_s"], 2), "resumed_from_step": event["step"],
                "learner_node_after": status.learner_node, "step_after": status.step,
                "ledger": ledger_report(sup)}
    finally:
        sup.stop()



def _runtime(scenario):
    def run(run_dir: str, quick: bool) -> dict:
        return scenario(run_dir, quick, EXTRA)

    run.__name__ = scenario.__name__
    return run


SCENARIOS = {f.__name__: f for f in (kill_generator, scale, kill_learner, kill_value_learner, kill_reward,
                                     hang_reward, fill_mailbox, node_loss, partition, full_disk, private_run_dir,
                                     *map(_runtime, runtime_faults.SCENARIOS.values()))}
ON_CLUSTER = ("node_loss", "partition", "private_run_dir")
# `--quick` with no names: a kill of a generator, of the learner and of a reward endpoint, a reward that
# hangs, backpressure, and the three faults of parts that stay alive that cost the least, in under
# 10 minutes on 2 cores. The full suite (every scenario, full sizes) is the one docs/reliability.md shows.
QUICK = ("kill_generator", "kill_learner", "kill_reward", "hang_reward", "fill_mailbox", "hang_delivery",
         "lease_outlived", "scale_down_slow")
NEEDS_ROOT = ("full_disk",)
# How a cluster scenario's two nodes are brought up (`cluster.up`), from its run directory.
CLUSTER_OPTIONS = {"private_run_dir": lambda run_dir: {"private_dir": run_dir}}


def on_cluster(name: str, run_dir: str, quick: bool) -> dict:
    """A cluster scenario: bring the two nodes up, run it in the head's namespace, take them down."""
    from load_tests import cluster

    shutil.rmtree(run_dir, ignore_errors=True)  # before a node mounts anything on it
    cluster.up(**CLUSTER_OPTIONS.get(name, lambda _: {})(run_dir))
    try:
        out = cluster.run_in_head([sys.executable, os.path.abspath(__file__), name, "--run-dir", run_dir,
                                   *(["--quick"] if quick else [])], timeout_s=1500)
        if out.returncode != 0:
            raise RuntimeError(f"{name} failed in the cluster:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
        with open(os.path.join(run_dir, "faults.json")) as f:
            return json.load(f)[name]
    finally:
        cluster.down()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", nargs="*",
                        help=f"any of {list(SCENARIOS)} (default: all but the cluster ones, {list(ON_CLUSTER)}; "
                             f"with --quick, {list(QUICK)})")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--run-dir", default="outputs/faults")
    parser.add_argument("--engine", default="torch", choices=["torch", "sglang_cpu"],
                        help="the generators' engine (sglang_cpu: run with .venv-sglang/bin/python)")
    args = parser.parse_args()
    args.scenarios = args.scenarios or list(QUICK if args.quick else (n for n in SCENARIOS if n not in ON_CLUSTER))
    EXTRA[:] = [f"engine={args.engine}"]
    inside = bool(os.environ.get("RAY_ADDRESS"))  # re-run in the head's namespace, joined to the cluster
    if not inside and any(name not in ON_CLUSTER for name in args.scenarios):
        init_ray(compose(BASE))
    results = {}
    for name in args.scenarios:
        start = time.time()
        if name in NEEDS_ROOT and os.geteuid() != 0:
            print(f"{name}: skipped (needs root for a tmpfs)", flush=True)
            continue
        if name in ON_CLUSTER and not inside:
            if os.geteuid() != 0:
                print(f"{name}: skipped (needs root for the network namespaces)", flush=True)
                continue
            result = on_cluster(name, os.path.abspath(os.path.join(args.run_dir, name)), args.quick)
        else:
            if inside:
                init_ray(compose(BASE))
            run_dir = args.run_dir if inside else os.path.join(args.run_dir, name)
            result = SCENARIOS[name](run_dir, args.quick)
        # The machine's load (other jobs share its cores): every time here is read against it.
        results[name] = {**result, "scenario_s": round(time.time() - start, 1),
                         "load_avg_1m": round(os.getloadavg()[0], 1), "cpus": os.cpu_count()}
        print(json.dumps({name: results[name]}), flush=True)
    os.makedirs(args.run_dir, exist_ok=True)
    with open(os.path.join(args.run_dir, "faults.json"), "w") as f:
        json.dump(results, f, indent=2)
    bad = [n for n, r in results.items()
           if not r["ledger"]["balanced"] or r["ledger"]["duplicates"] or r["ledger"].get("unaccounted", 1)]
    print(f"{len(results)} scenarios; ledger unbalanced, duplicates or samples in flight that no generator "
          f"holds after the drain in: {bad or 'none'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
