"""What evaluation beside training costs the run: training samples/s of `asyncrl train` with
`trainer.eval_every` against none, runs interleaved (`docs/benchmarks.md` §16).

    .venv/bin/python load_tests/eval_beside.py                    # the tiny task, 2 pairs of 40 s of training
    .venv/bin/python load_tests/eval_beside.py --model embedded --train-s 90 --pairs 1

tiny: `model=tiny task=tiny algorithm=grpo` with a held-out file of 3000 rows (the ten prompts 300
times), evaluated every 5 steps, so that an evaluation lasts longer than the steps between two.
embedded: the demo's defaults (SmolLM2-135M-Instruct, DAPO on arithmetic), 16 held-out prompts
every 4 steps. samples/s = `final_status.samples_trained / train_wall_s` of `summary.json`. Prints
one JSON line per run; run directories under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_files(directory: str) -> list[str]:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from test_eval_beside import write_tiny_files

    train_path, eval_path = write_tiny_files(directory)
    return ["model=tiny", "task=tiny", "task.name=file", f"task.path={train_path}", f"task.eval_path={eval_path}",
            "algorithm=grpo", "trainer.eval_samples=3000"]


def one_run(settings: list[str], every: int, train_s: float, run_dir: str) -> dict:
    subprocess.run(["rm", "-rf", run_dir], check=True)
    command = [os.path.join(os.path.dirname(sys.executable), "asyncrl"), "train", *settings,
               "trainer.total_steps=100000", f"trainer.max_train_s={train_s}", f"trainer.eval_every={every}",
               "trainer.loggers=[console]", "trainer.checkpoint_every=0", f"trainer.run_dir={run_dir}"]
    done = subprocess.run(command, capture_output=True, text=True)
    summary = json.load(open(os.path.join(run_dir, "summary.json")))
    path = os.path.join(run_dir, "evals.jsonl")
    evals = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    return {"eval_every": every, "returncode": done.returncode, "steps": summary["steps"],
            "train_wall_s": round(summary["train_wall_s"], 1),
            "samples_trained": summary["final_status"]["samples_trained"],
            "samples_per_s": round(summary["final_status"]["samples_trained"] / summary["train_wall_s"], 3),
            "evaluations": len(evals),
            "eval_s_mean": round(sum(e["finished_s"] - e["started_s"] for e in evals) / max(len(evals), 1), 2),
            "evaluated": [(e["step"], e["weight_version"], e["accuracy"]) for e in evals],
            "load_average": round(os.getloadavg()[0], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["tiny", "embedded"], default="tiny")
    parser.add_argument("--train-s", type=float, default=40.0)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--out", default="outputs/eval_beside")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.model == "tiny":
        settings, every = tiny_files(os.path.abspath(args.out)), 5
    else:
        settings, every = ["trainer.eval_samples=16"], 4
    for pair in range(args.pairs):
        for interval in (0, every):
            result = one_run(settings, interval, args.train_s, os.path.join(args.out, f"{args.model}-{pair}-{interval}"))
            print(json.dumps({"model": args.model, "pair": pair, **result}), flush=True)


if __name__ == "__main__":
    main()
