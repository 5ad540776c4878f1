"""asyncrl against TRL's GRPOTrainer: same model, task, reward function, group size, samples per
step, max length, learning rate, clip range and optimizer (AdamW, constant LR), both on this CPU.
Paired rounds (asyncrl, TRL, asyncrl, TRL, ...).

TRL runs in the benchmark's environment (`make bench-venv`: `.venv-bench`, asyncrl's packages
plus TRL), as a subprocess (`load_tests/trl_grpo.py`); TRL is never a dependency of asyncrl.

Figures: wall time per 1,000 trained samples (training loop only: model loading and actor start
excluded on both sides) and the reward of generated samples against samples trained.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

from asyncrl.config import compose

ROOT = Path(__file__).resolve().parents[2]
BENCH_PYTHON = ROOT / ".venv-bench" / "bin" / "python"

WORKLOADS = {
    # The tiny random model on the successor-digit task: G=32, 2 prompts per step, lr 3e-3 (as in
    # docs/benchmarks.md; the task itself now defaults to 2e-3).
    "tiny": ["model=tiny", "task=tiny", "algorithm=grpo", "policy.optimizer.lr=3e-3"],
    # The embedded SmolLM2-135M-Instruct on arithmetic word problems: G=4, 4 prompts, 64 tokens.
    # The learner in fp32 as TRL's (load_tests/trl_grpo.py: bf16=False), not policy.compute.precision=auto.
    "embedded": ["algorithm=grpo", "sampling.temperature=1.0", "policy.compute.precision=fp32"],
}
COMMON = ["trainer.wandb_mode=disabled", "trainer.checkpoint_every=0"]


def run_asyncrl(overrides: list[str], steps: int) -> dict:
    from asyncrl.driver import train

    with tempfile.TemporaryDirectory() as run_dir:
        config = compose([*overrides, *COMMON, f"trainer.total_steps={steps}", f"trainer.run_dir={run_dir}"])
        summary = train(config, progress=False, eval_prompts=10)
    return {"records": [{k: r[k] for k in ("step", "wall_time_s", "samples_trained", "reward_mean_generated")}
                        for r in summary["records"]]}


def run_trl(overrides: list[str], steps: int) -> dict:
    if not BENCH_PYTHON.exists():
        raise SystemExit(f"{BENCH_PYTHON} is missing: run `make bench-venv` first (installs TRL beside asyncrl)")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "trl.json")
        cmd = [str(BENCH_PYTHON), str(ROOT / "load_tests" / "trl_grpo.py"), "--overrides", json.dumps(overrides),
               "--steps", str(steps), "--out", out]
        subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
        with open(out) as f:
            return json.load(f)


def per_1000(run: dict) -> float:
    """Wall seconds per 1,000 trained samples, from the start of training (pipeline fill included)."""
    last = run["records"][-1]
    return last["wall_time_s"] / last["samples_trained"] * 1000


def steady_per_1000(run: dict) -> float:
    """The same after the first step: the streaming pipeline's fill (the first batch waits for
    generation, assembly and scoring of a whole step) is paid once per run, not per sample."""
    first, last = run["records"][0], run["records"][-1]
    return (last["wall_time_s"] - first["wall_time_s"]) / (last["samples_trained"] - first["samples_trained"]) * 1000


def summarize(runs: dict) -> dict:
    out = {}
    for name, fn in (("", per_1000), ("steady_", steady_per_1000)):
        out[f"asyncrl_{name}s_per_1000_samples_median"] = statistics.median(fn(r) for r in runs["asyncrl"])
        out[f"trl_{name}s_per_1000_samples_median"] = statistics.median(fn(r) for r in runs["trl"])
        out[f"ratio_trl_over_asyncrl_{name}time_median"] = statistics.median(
            fn(t) / fn(a) for a, t in zip(runs["asyncrl"], runs["trl"]))
    return out


def run(quick: bool = False, overrides: list[str] | None = None) -> dict:
    plan = {"tiny": (1, 10)} if quick else {"tiny": (3, 60), "embedded": (1, 4)}  # (rounds, steps)
    out = {}
    for name, (rounds, steps) in plan.items():
        workload = [*WORKLOADS[name], *(overrides or [])]
        runs = {"asyncrl": [], "trl": []}
        for _ in range(rounds):
            runs["asyncrl"].append(run_asyncrl(workload, steps))
            runs["trl"].append(run_trl([*workload, *COMMON], steps))
            print(name, {k: round(per_1000(v[-1]), 1) for k, v in runs.items()}, flush=True)
        config = compose(workload)
        out[name] = {
            "overrides": workload, "rounds": rounds, "steps": steps, "trl_version": runs["trl"][0].get("trl_version"),
            "group_size": config.algorithm.group_size, "samples_per_step": config.algorithm.group_size * config.trainer.prompts_per_step,
            "max_response_tokens": config.engine.max_response_tokens, "lr": config.policy.optimizer.lr,
            **summarize(runs), "runs": runs,
        }
    return out


def write_extras(result: dict, run_dir: str) -> None:
    plot(result, os.path.join(run_dir, "bench_trl_reward.png"))


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(result), figsize=(6 * len(result), 3.5), squeeze=False)
    for ax, (name, r) in zip(axes[0], result.items()):
        for system, color in (("asyncrl", "tab:blue"), ("trl", "tab:orange")):
            for i, run in enumerate(r["runs"][system]):
                # GRPO trains exactly samples_per_step per step on both sides (no dynamic sampling);
                # asyncrl's `samples_trained` is a status snapshot taken when the driver polls.
                xs = [x["step"] * r["samples_per_step"] for x in run["records"]]
                ys = [x["reward_mean_generated"] for x in run["records"]]
                ax.plot(xs, ys, color=color, alpha=0.8, label=system if i == 0 else None)
        ax.set_title(f"{name}: reward of generated samples")
        ax.set_xlabel("samples trained")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(result: dict) -> str:
    lines = ["| workload | asyncrl s / 1000 samples | TRL s / 1000 samples | TRL / asyncrl time | after the first step: asyncrl / TRL s, TRL / asyncrl | reward at end: asyncrl / TRL |",
             "|---|---|---|---|---|---|"]
    for name, r in result.items():
        end = {k: statistics.median(run["records"][-1]["reward_mean_generated"] for run in r["runs"][k]) for k in r["runs"]}
        lines.append(f"| {name} | {r['asyncrl_s_per_1000_samples_median']:.1f} | {r['trl_s_per_1000_samples_median']:.1f} | "
                     f"{r['ratio_trl_over_asyncrl_time_median']:.2f}x | {r['asyncrl_steady_s_per_1000_samples_median']:.1f} / "
                     f"{r['trl_steady_s_per_1000_samples_median']:.1f}, {r['ratio_trl_over_asyncrl_steady_time_median']:.2f}x | "
                     f"{end['asyncrl']:.3f} / {end['trl']:.3f} |")
    return "\n".join(lines)
