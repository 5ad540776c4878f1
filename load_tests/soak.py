"""Soak: train for a long time with a fault every few minutes; sample every actor's resident memory
and report its slope; check the sample ledger at the end.

    python load_tests/soak.py --minutes 20 --fault-every 180     # the figures in docs/reliability.md
    python load_tests/soak.py --quick                            # 3 minutes, a fault a minute
    python load_tests/soak.py --minutes 25 --fault-every 0 --warmup-minutes 10   # memory only

The faults cycle: reward endpoint hangs (10 s, calls time out), reward endpoint killed (Ray
restarts it), a generator killed mid-window and the policy learner killed (the supervisor restarts
the system from its checkpoint). Memory slopes are fitted per process over its lifetime after a
warm-up (1 minute with --quick, 5 otherwise, while the bounded id windows fill; a restarted system has new processes), in MB per minute.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import numpy as np
import psutil
import ray

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncrl.config import compose  # noqa: E402
from asyncrl.run.placement import init_ray  # noqa: E402
from asyncrl.run import Run  # noqa: E402
from load_tests.faults import ledger_report  # noqa: E402

OVERRIDES = ["model=tiny", "task=tiny", "algorithm=grpo", "trainer.prompts_per_step=2", "trainer.checkpoint_every=20",
             "trainer.checkpoint_keep=2", "trainer.max_restarts=100", "trainer.wandb_mode=disabled",
             "reward.timeout_s=2.0", "reward.retries=1"]


def inject(sup: Run, kind: str) -> str:
    if kind == "hang_reward":
        sup.reconfigure_reward("verifier", {"fault_delay_s": 3600.0})
        time.sleep(10)
        sup.reconfigure_reward("verifier", {"fault_delay_s": 0.0})
        return "reward endpoint hung 10 s"
    if kind == "kill_reward":
        sup.kill("reward-verifier", restart=True)
        return "reward endpoint killed (restarted by Ray)"
    if kind == "kill_generator":
        sup.kill(sup.generator_ids[0])
        return "generator killed"
    sup.kill("learner")
    return "policy learner killed"


def slope_mb_per_min(samples: list[tuple[float, float]], warmup_s: float) -> float | None:
    if not samples:
        return None
    t0 = samples[0][0]
    kept = [(t - t0, m) for t, m in samples if t - t0 >= warmup_s]
    if len(kept) < 4:
        return None
    t, m = np.array(kept).T
    return float(np.polyfit(t / 60, m, 1)[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=20)
    parser.add_argument("--fault-every", type=float, default=180, help="seconds between faults (0: none, a memory soak)")
    parser.add_argument("--sample-every", type=float, default=10, help="seconds between memory samples")
    parser.add_argument("--quick", action="store_true", help="3 minutes, a fault a minute")
    parser.add_argument("--warmup-minutes", type=float, default=None,
                        help="memory slopes are fitted after this (1 with --quick, 5 otherwise)")
    parser.add_argument("--run-dir", default="outputs/soak")
    args = parser.parse_args()
    if args.quick:
        args.minutes, args.fault_every, args.sample_every = 3, 60, 5
    config = compose(OVERRIDES + [f"trainer.run_dir={args.run_dir}"])
    init_ray(config)
    import shutil

    shutil.rmtree(args.run_dir, ignore_errors=True)
    sup = Run(config, args.run_dir).start()
    cycle = ["hang_reward", "kill_reward", "kill_generator", "kill_learner"]
    memory: dict[int, list[tuple[float, float]]] = collections.defaultdict(list)
    role_of: dict[int, str] = {}
    faults, started = [], time.time()
    next_fault = started + args.fault_every if args.fault_every > 0 else float("inf")
    next_sample = started
    try:
        while time.time() - started < args.minutes * 60:
            event = sup.check()
            if event is not None:
                faults[-1]["restart_s"] = round(event["restart_s"], 1) if faults else None
            try:
                sup.pop_metrics()
            except ray.exceptions.RayError:
                continue  # the learner just died; the next check restarts the system
            now = time.time()
            if now >= next_sample:
                try:
                    pids = sup.pids()
                except ray.exceptions.RayError:  # an actor just died: the next check restarts the system
                    pids = {}
                for role, pid in pids.items():
                    try:
                        memory[pid].append((now, psutil.Process(pid).memory_info().rss / 2**20))
                        role_of[pid] = role
                    except psutil.NoSuchProcess:
                        pass
                next_sample = now + args.sample_every
            if now >= next_fault:
                kind = cycle[len(faults) % len(cycle)]
                step = sup.status().step
                faults.append({"at_s": round(now - started), "kind": kind, "what": inject(sup, kind), "step": step})
                print(json.dumps(faults[-1]), flush=True)
                next_fault = now + args.fault_every
            time.sleep(1.0)
        time.sleep(3.0)
        status, ledger = sup.status(), ledger_report(sup)
    finally:
        sup.stop()
    # The bounded id windows (ledger, dedup) fill in the first minutes of a fast tiny run; the slope
    # that matters is the one after.
    warmup_s = 60 * (args.warmup_minutes if args.warmup_minutes is not None else (1.0 if args.quick else 5.0))
    per_role: dict[str, list[dict]] = collections.defaultdict(list)
    for pid, samples in memory.items():
        per_role[role_of[pid]].append({"pid": pid, "minutes": round((samples[-1][0] - samples[0][0]) / 60, 1),
                                       "rss_mb_first": round(samples[0][1]), "rss_mb_last": round(samples[-1][1]),
                                       "slope_mb_per_min": slope_mb_per_min(samples, warmup_s),
                                       "series": [(round(t - started, 1), round(mb, 1)) for t, mb in samples]})
    result = {"minutes": args.minutes, "warmup_minutes": warmup_s / 60, "faults": faults, "supervisor_restarts": len(sup.restarts),
              "final_step": status.step, "samples_trained": status.samples_trained, "ledger": ledger,
              "memory": dict(per_role)}
    os.makedirs(args.run_dir, exist_ok=True)
    with open(os.path.join(args.run_dir, "soak.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "memory"}, indent=1))
    for role, lives in sorted(per_role.items()):
        longest = max(lives, key=lambda life: life["minutes"])
        slope = longest["slope_mb_per_min"]
        print(f"{role:28s} longest life {longest['minutes']:5.1f} min, RSS {longest['rss_mb_first']} -> "
              f"{longest['rss_mb_last']} MB, slope {'n/a' if slope is None else f'{slope:+.2f}'} MB/min")
    return 0 if ledger["balanced"] and not ledger["duplicates"] else 1


if __name__ == "__main__":
    sys.exit(main())
