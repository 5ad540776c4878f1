"""The streaming driver of `asyncrl train`: start the system, watch it, stop after N steps.

The driver never waits on the actors' work: generators, assembler and learner run their own
loops; the driver only polls metrics (every `poll_s`) to log them, and evaluates the policy on
held-out prompts before the first step, every `trainer.eval_every` steps, and after the last. It
writes a checkpoint at the end (the learner writes the periodic ones), and with `resume=true`
continues the run of `trainer.run_dir` from its newest valid checkpoint.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import ray
import torch

from asyncrl.config import Config, compose, to_dict
from asyncrl.engines.base import SamplingParams, SequenceInput
from asyncrl.supervisor import Supervisor
from asyncrl.system import build_engine
from asyncrl.tasks import encode_prompt, load_examples, score_response


def evaluate(config: Config, engine, tokenizer, max_prompts: int | None = None) -> dict:
    """Greedy pass@1 on the held-out prompts of the task."""
    t = config.task
    examples = load_examples(t.name, "eval", t.num_eval_prompts, t.seed, t.eval_path or t.path)
    examples = examples[: max_prompts or config.trainer.eval_samples]
    sequences = [
        SequenceInput(prompt_ids=np.asarray(encode_prompt(ex, tokenizer, config.model.use_chat_template), dtype=np.int32),
                      response_ids=np.zeros(0, dtype=np.int32), seed=i, max_response_tokens=config.engine.max_response_tokens)
        for i, ex in enumerate(examples)
    ]
    correct, lengths = 0, []
    batch = 16
    for start in range(0, len(sequences), batch):
        outs = engine.generate_window_sync(sequences[start:start + batch], config.engine.max_response_tokens, SamplingParams(greedy=True))
        for ex, out in zip(examples[start:start + batch], outs):
            text = tokenizer.decode(out.token_ids.tolist(), skip_special_tokens=True)
            correct += score_response(ex.data_source, text, ex.ground_truth, "zero_one")[1]
            lengths.append(len(out.token_ids))
    return {"accuracy": correct / max(len(examples), 1), "n": len(examples), "response_length_mean": float(np.mean(lengths))}


def plot_curve(records: list[dict], path: str, key: str = "reward_mean", title: str = "reward") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records if key in r]
    values = [r[key] for r in records if key in r]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, values, marker=".", label=key)
    if len(values) >= 5:
        window = max(3, len(values) // 10)
        smooth = np.convolve(values, np.ones(window) / window, mode="valid")
        ax.plot(steps[window - 1:], smooth, label=f"{key} (mean of {window})")
    ax.set_xlabel("learner step")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def init_ray(config: Config) -> None:
    if not ray.is_initialized():
        ray.init(num_cpus=16, include_dashboard=False, object_store_memory=512 * 2**20, log_to_driver=False,
                 namespace="asyncrl",
                 # Few malloc arenas: torch's threads otherwise keep freed activation memory per arena.
                 runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
                                           "MALLOC_ARENA_MAX": "2"}})


def train(config: Config, progress: bool = True, eval_prompts: int | None = None) -> dict:
    """Run `trainer.total_steps` learner steps; returns a summary with held-out accuracy before/after."""
    from asyncrl import checkpoint

    run_dir = checkpoint.resolve_run_dir(config.trainer.run_dir, config.resume)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.resume.json" if config.resume else "config.json"), "w") as f:
        json.dump(to_dict(config), f, indent=2)
    init_ray(config)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    engine, tokenizer = build_engine(config)
    if config.resume:
        latest, _ = checkpoint.latest_valid(run_dir)
        if latest is not None:
            checkpoint.load_policy_weights(engine.model, os.path.join(latest, "policy"))
    before = evaluate(config, engine, tokenizer, eval_prompts)
    print(f"held-out accuracy before training: {before['accuracy']:.3f} (n={before['n']})", flush=True)

    wandb_run = _init_wandb(config, run_dir)
    supervisor = Supervisor(config, run_dir, max_steps=config.trainer.total_steps)
    system = supervisor.system
    if system.resumed:
        print(f"resumed from {system.resumed['checkpoint']} at step {system.resumed['step']} "
              f"({system.resumed['reissued_prompts']} prompts to regenerate, "
              f"{system.resumed['saved_batches']} saved batches)", flush=True)
    records: list[dict] = []
    evals: list[dict] = []
    started = time.time()
    bar = _progress(config.trainer.total_steps, progress)
    last_step_at = time.time()
    wandb_step = 0
    try:
        with open(os.path.join(run_dir, "metrics.jsonl"), "a") as metrics_file:
            start_step = system.resumed.get("step", 0)
            while (records[-1]["step"] if records else start_step) < config.trainer.total_steps:
                if _reached_target(records, config):
                    break
                time.sleep(0.5)
                restart = supervisor.check()
                if restart is not None:  # an actor died: the system came back from a checkpoint
                    system = supervisor.system
                    records = [r for r in records if r["step"] <= restart["step"]]  # those steps are redone
                    print(f"restarted in {restart['restart_s']:.1f}s from step {restart['step']} after "
                          f"{restart['reason']}", flush=True)
                    with open(os.path.join(run_dir, "restarts.jsonl"), "a") as f:
                        f.write(json.dumps(restart) + "\n")
                    last_step_at = time.time()
                    continue
                new = system.pop_metrics()
                if not new:
                    if time.time() - last_step_at > config.trainer.stall_timeout_s:
                        status = system.status()
                        raise RuntimeError(
                            f"no learner step for {config.trainer.stall_timeout_s:.0f}s at step {status['step']}; "
                            f"samples dropped by reason: {status['dropped_by_reason']}, queues: {status['queue_depths']}")
                    continue
                last_step_at = time.time()
                status = system.status()
                for record in new:
                    record.update({
                        "samples_trained": status["samples_trained"], "samples_dropped": status["samples_dropped"],
                        "samples_generated": status["samples_generated"],
                        "generator_busy_fraction": status["generator_busy_fraction"],
                        "generator_paused_for_weights_fraction": status["generator_paused_for_weights_fraction"],
                        "broadcast_s": status["last_broadcast"].get("total_s", 0.0),
                        "wall_time_s": time.time() - started,
                    })
                    every = config.trainer.eval_every
                    if every and record["step"] % every == 0:
                        version, weights = system.weights()
                        engine.update_weights(weights.items(), version)
                        result = evaluate(config, engine, tokenizer, eval_prompts)
                        record.update({"eval_accuracy": result["accuracy"], "eval_n": result["n"]})
                        evals.append({"step": record["step"], **result})
                    metrics_file.write(json.dumps(record) + "\n")
                    records.append(record)
                    if wandb_run is not None and record["step"] > wandb_step:  # wandb steps only go up
                        wandb_run.log(record, step=record["step"])
                        wandb_step = record["step"]
                metrics_file.flush()
                if bar is not None:
                    bar.update(len(new))
                    bar.set_postfix(reward=f"{records[-1]['reward_mean_generated']:.3f}",
                                    samples_s=f"{status['samples_trained'] / max(time.time() - started, 1e-9):.2f}")
        if config.trainer.checkpoint_every and records:
            # The final step's checkpoint (waits for one the learner is writing, if any).
            path = system.checkpoint()
            print(f"checkpoint: {path}", flush=True)
        final_status = system.status()
        version, weights = system.weights()
    finally:
        if bar is not None:
            bar.close()
        supervisor.stop()
    wall = time.time() - started
    engine.update_weights(weights.items(), version)
    after = evaluate(config, engine, tokenizer, eval_prompts)
    print(f"held-out accuracy after {len(records)} steps: {after['accuracy']:.3f} (n={after['n']}), "
          f"{wall / 60:.1f} min of training", flush=True)
    plot_curve(records, os.path.join(run_dir, "reward_curve.png"), key="reward_mean_generated",
               title="reward of generated samples (all groups, before dynamic sampling)")
    from asyncrl.plots import write_plots

    write_plots(records, run_dir)
    summary = {"run_dir": run_dir, "eval_before": before, "eval_after": after, "train_wall_s": wall,
               "reached_target": _reached_target(records, config), "evals": evals,
               "resumed": system.resumed, "restarts": supervisor.restarts,
               "steps": len(records), "final_status": final_status,
               "records": records}
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump({k: v for k, v in summary.items() if k != "records"}, f, indent=2, default=str)
    if wandb_run is not None:
        wandb_run.summary.update({"eval_accuracy_before": before["accuracy"], "eval_accuracy_after": after["accuracy"]})
        wandb_run.finish()
    return summary


def _reached_target(records: list[dict], config: Config) -> bool:
    target, window = config.trainer.target_reward, config.trainer.target_window
    if target is None or len(records) < window:
        return False
    return float(np.mean([r["reward_mean_generated"] for r in records[-window:]])) >= target


def _init_wandb(config: Config, run_dir: str):
    mode = os.environ.get("WANDB_MODE", config.trainer.wandb_mode)
    if mode == "disabled":
        return None
    import wandb

    return wandb.init(project=config.trainer.wandb_project, dir=run_dir, mode=mode, config=to_dict(config))


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="train", unit="step")


def train_cli(overrides: list[str]) -> int:
    config = compose(overrides)
    summary = train(config)
    print(json.dumps({k: summary[k] for k in ("run_dir", "eval_before", "eval_after", "train_wall_s")}, indent=2))
    return 0
