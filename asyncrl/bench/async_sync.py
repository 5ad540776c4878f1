"""Asynchronous vs synchronous on a long-tailed task, same code: `tppo_sync` (whole batch generated,
then trained, then the next batch waits for the new weights) against `tppo` (truncated windows
streaming to the policy learner, the value learner training beside it). Same tiny model, samples
per step, generator and learner processes; paired rounds (sync, async, sync, async, ...).

Figures per run: samples/s (trained samples over training wall time), wall time to the target
reward (mean `reward_mean_generated` over `target_window` steps), and the share of wall time the
generator spent generating.
"""

from __future__ import annotations

import statistics
import tempfile

import numpy as np

from asyncrl.config import compose

# The long-tailed task: 5% of samples run to >= 240 tokens, the rest end after a few (tiny_tail).
WORKLOAD = ["model=tiny", "task=tiny_tail", "model.max_positions=300", "engine.max_response_tokens=256",
            "engine.long_tail_tokens=240", "engine.long_tail_fraction=0.05",
            "trainer.wandb_mode=disabled", "trainer.checkpoint_every=0", "trainer.stall_timeout_s=120"]
SYSTEMS = {"sync": ["algorithm=tppo_sync"], "async": ["algorithm=tppo", "engine.window_tokens=32"]}


def one_run(system: str, steps: int, target: float | None, window: int, overrides: list[str]) -> dict:
    from asyncrl.driver import train

    with tempfile.TemporaryDirectory() as run_dir:
        extra = [f"trainer.target_reward={target}", f"trainer.target_window={window}"] if target is not None else []
        config = compose([*WORKLOAD, *SYSTEMS[system], f"trainer.total_steps={steps}", f"trainer.run_dir={run_dir}",
                          *extra, *overrides])
        summary = train(config, progress=False, eval_prompts=10)
    records = summary["records"]
    wall = records[-1]["wall_time_s"]
    lengths = [r["response_length_mean"] for r in records]
    return {
        "steps": len(records), "wall_s": wall, "samples_trained": records[-1]["samples_trained"],
        "samples_per_s": records[-1]["samples_trained"] / wall,
        "reached_target": summary["reached_target"], "time_to_target_s": wall if summary["reached_target"] else None,
        "reward_last": float(np.mean([r["reward_mean_generated"] for r in records[-window:]])),
        "generator_busy_fraction": records[-1]["generator_busy_fraction"],
        "trained_row_length_mean": float(np.mean(lengths)),
        "eval_accuracy_after": summary["eval_after"]["accuracy"],
    }


def run(quick: bool = False, overrides: list[str] | None = None) -> dict:
    rounds = 1 if quick else 2
    steps = 15 if quick else 150
    target = None if quick else 0.3
    window = 5
    runs: dict[str, list[dict]] = {"sync": [], "async": []}
    for _ in range(rounds):
        for system in ("sync", "async"):
            result = one_run(system, steps, target, window, overrides or [])
            print(f"{system}: {result}", flush=True)
            runs[system].append(result)
    speed = [a["samples_per_s"] / s["samples_per_s"] for s, a in zip(runs["sync"], runs["async"])]
    to_target = [s["time_to_target_s"] / a["time_to_target_s"] for s, a in zip(runs["sync"], runs["async"])
                 if s["time_to_target_s"] and a["time_to_target_s"]]
    summary = {
        "workload": WORKLOAD, "systems": SYSTEMS, "rounds": rounds, "max_steps": steps, "target_reward": target,
        "target_window": window, "runs": runs,
        "samples_per_s_median": {k: statistics.median(r["samples_per_s"] for r in v) for k, v in runs.items()},
        "ratio_async_over_sync_samples_per_s_median": statistics.median(speed),
        "ratio_sync_over_async_time_to_target_median": statistics.median(to_target) if to_target else None,
        "target_reached": {k: sum(bool(r["reached_target"]) for r in v) for k, v in runs.items()},
    }
    return summary


def report(result: dict) -> str:
    def fmt(x, spec=".1f"):
        return "not reached" if x is None else format(x, spec)

    lines = ["| system | samples/s (median) | time to target (runs) | generator busy | reward at end |", "|---|---|---|---|---|"]
    for name, runs in result["runs"].items():
        times = ", ".join(fmt(r["time_to_target_s"]) for r in runs)
        lines.append(f"| {name} | {result['samples_per_s_median'][name]:.1f} | {times} s | "
                     f"{statistics.median(r['generator_busy_fraction'] for r in runs):.2f} | "
                     f"{statistics.median(r['reward_last'] for r in runs):.3f} |")
    lines.append(f"\nasync / sync samples/s (median of paired ratios): "
                 f"{result['ratio_async_over_sync_samples_per_s_median']:.2f}x")
    ratio = result["ratio_sync_over_async_time_to_target_median"]
    lines.append(f"sync / async wall time to reward {result['target_reward']}: {fmt(ratio, '.2f')}"
                 + ("x" if ratio is not None else ""))
    return "\n".join(lines)
