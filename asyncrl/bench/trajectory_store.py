"""What the trajectory store costs (`asyncrl bench record`): the same run with and without it
(`trainer.store_trajectories`), paired rounds (off, on, off, on, ...). The tiny task is the hardest
case for the recorder: short responses and G=32 make hundreds of samples a second, each a record,
on two shared cores.

Figures per run: samples trained per second of training wall time, the generator's busy fraction,
and the recorder's rows and seconds spent writing.
"""

from __future__ import annotations

import statistics
import tempfile

from asyncrl.config import compose

WORKLOAD = ["model=tiny", "task=tiny", "algorithm=grpo", "trainer.wandb_mode=disabled", "trainer.checkpoint_every=0"]


def one_run(store_trajectories: bool, steps: int, overrides: list[str]) -> dict:
    from asyncrl.driver import train
    from asyncrl.storage.trajectory_store import read_trajectories

    with tempfile.TemporaryDirectory() as run_dir:
        config = compose([*WORKLOAD, f"trainer.total_steps={steps}",
                          f"trainer.store_trajectories={str(store_trajectories).lower()}",
                          f"trainer.run_dir={run_dir}", *overrides])
        summary = train(config, progress=False, eval_prompts=2)
        rows = len(read_trajectories(run_dir)) if store_trajectories else 0
    records = summary["records"]
    wall = records[-1]["wall_time_s"]
    return {"store_trajectories": store_trajectories, "steps": len(records), "wall_s": wall,
            "samples_per_s": records[-1]["samples_trained"] / wall,
            "samples_generated": summary["final_status"]["samples_generated"],
            "generated_per_s": summary["final_status"]["samples_generated"] / wall,
            "generator_busy_fraction": records[-1]["generator_busy_fraction"], "records_in_store": rows}


def run(quick: bool = False, overrides: list[str] | None = None) -> dict:
    rounds, steps = (1, 10) if quick else (3, 60)
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for _ in range(rounds):
        for name, store_trajectories in (("off", False), ("on", True)):
            result = one_run(store_trajectories, steps, overrides or [])
            print(f"trajectory store {name}: {result}", flush=True)
            runs[name].append(result)
    ratios = [on["generated_per_s"] / off["generated_per_s"] for off, on in zip(runs["off"], runs["on"])]
    return {"workload": WORKLOAD, "rounds": rounds, "steps": steps, "runs": runs,
            "generated_per_s_median": {k: statistics.median(r["generated_per_s"] for r in v) for k, v in runs.items()},
            "samples_per_s_median": {k: statistics.median(r["samples_per_s"] for r in v) for k, v in runs.items()},
            "ratio_on_over_off_generated_per_s_median": statistics.median(ratios)}


def report(result: dict) -> str:
    lines = ["| trajectory store | samples generated/s (median) | samples trained/s (median) | generator busy "
             "| records in store |", "|---|---|---|---|---|"]
    for name, runs in result["runs"].items():
        lines.append(f"| {name} | {result['generated_per_s_median'][name]:.1f} | {result['samples_per_s_median'][name]:.1f} | "
                     f"{statistics.median(r['generator_busy_fraction'] for r in runs):.3f} | "
                     f"{', '.join(str(r['records_in_store']) for r in runs)} |")
    lines.append(f"\nwith / without the trajectory store, samples generated per second (median of paired "
                 f"ratios): {result['ratio_on_over_off_generated_per_s_median']:.3f}x")
    return "\n".join(lines)
