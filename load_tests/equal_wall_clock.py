"""Algorithms side by side at the same training wall-clock: `asyncrl train` once per algorithm and
seed with `trainer.max_train_s` (the clock starts when the actors are up: model loading and the
first evaluation are outside it), one run after the other, and a table of what each did.

    .venv/bin/python load_tests/equal_wall_clock.py --algorithms dapo vapo --seeds 0 1 2 --seconds 300
    .venv/bin/python load_tests/equal_wall_clock.py --algorithms ppo tppo --seconds 900 \
        --extra model=tiny task=tiny_tail trainer.target_reward=0.9 trainer.total_steps=400

Run it on a quiet machine: the runs share its cores with nothing else, or their seconds mean
nothing. Each run's directory is kept under `--out`; `--table` prints the table of a finished
sweep's JSON again.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(algorithm: str, seed: int, seconds: int, out_dir: str, extra: list[str]) -> dict:
    """One run; what its summary and step records say."""
    run_dir = tempfile.mkdtemp(prefix=f"{algorithm}-s{seed}-", dir=out_dir)
    args = [os.path.join(ROOT, ".venv", "bin", "asyncrl"), "train", f"algorithm={algorithm}", f"trainer.seed={seed}",
            f"trainer.max_train_s={seconds}", f"trainer.run_dir={run_dir}", "trainer.wandb_mode=disabled", *extra]
    if not any(e.startswith("trainer.total_steps=") for e in extra):
        args.append("trainer.total_steps=1000")
    start = time.time()
    done = subprocess.run(args, capture_output=True, text=True, timeout=seconds + 1200)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    status = summary["final_status"]

    def mean(key, rows):
        values = [r[key] for r in rows if r.get(key) is not None]
        return round(statistics.fmean(values), 3) if values else None

    window = [r["value_explained_variance_window"] for r in records if r.get("value_explained_variance_window") is not None]
    return {"algorithm": algorithm, "seed": seed, "extra": extra, "run_dir": run_dir, "wall_s": round(time.time() - start),
            "held_out_before": summary["eval_before"]["accuracy"], "held_out_after": summary["eval_after"]["accuracy"],
            "steps": len(records), "train_wall_s": round(summary["train_wall_s"], 1),
            "reached_target": summary["reached_target"],
            "samples": [status["samples_generated"], status["samples_trained"], status["samples_dropped"]],
            "busy": [status.get("generator_busy_fraction"), status.get("learner_busy_fraction"),
                     status.get("value_learner", {}).get("value_busy_fraction")],
            "ev_first_last3": [mean("value_explained_variance", records[:1]), mean("value_explained_variance", records[-3:])],
            "ev_window_max": round(max(window), 3) if window else None,
            "value_steps": status.get("value_learner", {}).get("value_version"),
            "reward_first3_last3": [mean("reward_mean_generated", records[:3]), mean("reward_mean_generated", records[-3:])],
            "length_last3": mean("response_length_mean", records[-3:])}


def table(rows: list[dict]) -> str:
    lines = ["| run | held-out before → after | steps | value steps | samples generated / trained / dropped | "
             "busy: generator / policy / value | EV first / last 3 (window max) | generated reward first 3 → last 3 | "
             "length last 3 | training s (target reached) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        busy = " / ".join("-" if b is None else f"{b:.2f}" for b in r["busy"])
        ev = "-" if r["ev_first_last3"][0] is None else (f"{r['ev_first_last3'][0]:.2f} / {r['ev_first_last3'][1]:.2f}"
                                                         f" ({r['ev_window_max']})")
        name = " ".join([r["algorithm"], *r["extra"]])
        lines.append(f"| {name}, seed {r['seed']} | {r['held_out_before']:.3f} → **{r['held_out_after']:.3f}** | "
                     f"{r['steps']} | {r['value_steps'] if r['value_steps'] is not None else '-'} | "
                     f"{' / '.join(map(str, r['samples']))} | {busy} | {ev} | "
                     f"{r['reward_first3_last3'][0]} → {r['reward_first3_last3'][1]} | {r['length_last3']} | "
                     f"{r['train_wall_s']}{' (yes)' if r['reached_target'] else ''} |")
    by = {}
    for r in rows:
        by.setdefault(" ".join([r["algorithm"], *r["extra"]]), []).append(r["held_out_after"])
    lines.append("")
    lines += [f"median held-out {name}: {statistics.median(v):.3f} ({' / '.join(f'{x:.3f}' for x in v)})"
              for name, v in by.items()]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", nargs="+", default=["dapo", "vapo"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--seconds", type=int, default=300)
    parser.add_argument("--extra", nargs="*", default=[], help="overrides every run takes")
    parser.add_argument("--out", default=os.path.join(ROOT, "outputs", "equal_wall_clock"))
    parser.add_argument("--table", help="print the table of this sweep's JSON and stop")
    args = parser.parse_args()
    if args.table:
        print(table(json.load(open(args.table))))
        return 0
    os.makedirs(args.out, exist_ok=True)
    rows, path = [], os.path.join(args.out, f"sweep-{int(time.time())}.json")
    for seed in args.seeds:  # seed by seed, so that a sweep cut short still compares like with like
        for algorithm in args.algorithms:
            rows.append(run(algorithm, seed, args.seconds, args.out, args.extra))
            print(json.dumps(rows[-1]), flush=True)
            json.dump(rows, open(path, "w"), indent=1)
    print(table(rows))
    print(f"(JSON: {path})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
