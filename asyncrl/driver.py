"""The streaming driver of `asyncrl train`: start the system, watch it, stop after N steps.

The driver never waits on the actors' work: generators, assembler and learner run their own
loops; the driver only polls the run monitor (`asyncrl.monitor`, shared with the Serve app) every
0.5 s, and evaluates the policy on
held-out prompts before the first step, every `trainer.eval_every` steps, and after the last. It
writes a checkpoint at the end (the learner writes the periodic ones), and with `resume=true`
continues the run of `trainer.run_dir` from its newest valid checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import numpy as np
import ray
import torch

from asyncrl.config import Config, compose, to_dict
from asyncrl.evaluation import greedy_accuracy
from asyncrl.generation import build_engine
from asyncrl.monitor import REWARD_KEY, RunMonitor
from asyncrl.supervisor import Supervisor
from asyncrl.system import init_ray


def train(config: Config, progress: bool = True, eval_prompts: int | None = None) -> dict:
    """Run `trainer.total_steps` learner steps; returns a summary with held-out accuracy before/after."""
    from asyncrl import checkpoint

    run_dir = checkpoint.resolve_run_dir(config.trainer.run_dir, config.resume)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.resume.json" if config.resume else "config.json"), "w") as f:
        json.dump(to_dict(config), f, indent=2)
    init_ray(config)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    engine, tokenizer = build_engine(config.model)
    if config.resume:
        latest, _ = checkpoint.latest_valid(run_dir)
        if latest is not None:
            checkpoint.load_policy_weights(engine.model, os.path.join(latest, "policy"))
    before = greedy_accuracy(config, engine, tokenizer, eval_prompts, progress="eval before" if progress else "")
    print(f"held-out accuracy before training: {before['accuracy']:.3f} (n={before['n']})", flush=True)

    wandb_run = _init_wandb(config, run_dir)
    supervisor = Supervisor(config, run_dir, max_steps=config.trainer.total_steps)
    if supervisor.system.resumed:
        r = supervisor.system.resumed
        print(f"resumed from {r['checkpoint']} at step {r['step']} ({r['reissued_prompts']} prompts to regenerate, "
              f"{r['saved_batches']} saved batches)", flush=True)
    evals: list[dict] = []

    def evaluate_every(record: dict) -> None:
        every = config.trainer.eval_every
        if every and record["step"] % every == 0:
            version, weights = monitor.system.weights()
            engine.update_weights(weights.items(), version)
            result = greedy_accuracy(config, engine, tokenizer, eval_prompts)
            record.update({"eval_accuracy": result["accuracy"], "eval_n": result["n"]})
            evals.append({"step": record["step"], **result})

    monitor = RunMonitor(supervisor, run_dir, config.trainer.stall_timeout_s, annotate=evaluate_every,
                         wandb_run=wandb_run)
    bar = _progress(config.trainer.total_steps, progress)
    interrupted, last_checkpoint, weights, stop_reason = False, None, None, ""
    try:
        try:
            while monitor.step < config.trainer.total_steps and not _reached_target(monitor.records, config):
                time.sleep(0.5)
                polled = monitor.poll()
                _print_retirements(polled.retirements)
                if monitor.prompts_exhausted:
                    reasons = ", ".join(f"{n} {why}" for why, n in sorted(monitor.retired_by_reason.items()))
                    stop_reason = (f"every prompt is retired ({reasons}): no group has a learning signal left "
                                   f"(solved, or all wrong again when tried once more)")
                    print(f"stopping at step {monitor.step}: {stop_reason}; see retirements.jsonl", flush=True)
                    break
                if polled.restart is not None:
                    restart = polled.restart
                    print(f"restarted in {restart['restart_s']:.1f}s from step {restart['step']} after "
                          f"{restart['reason']}", flush=True)
                if bar is not None and polled.records:
                    bar.update(len(polled.records))
                    rate = polled.records[-1]["samples_per_s"]  # the number the plot and the status page show
                    bar.set_postfix(reward=f"{polled.records[-1][REWARD_KEY]:.3f}",
                                    samples_per_s="-" if rate is None else f"{rate:.1f}")
        except KeyboardInterrupt:
            interrupted = True
            if bar is not None:
                bar.close()
            print("\ninterrupted: finishing the step in flight, then saving and evaluating the last step "
                  "(Ctrl-C again to skip)", flush=True)
            monitor.system.stop_learning()
            monitor.poll(check_health=False)  # the steps done meanwhile
            print(f"stopped after step {monitor.step}", flush=True)
        if config.trainer.checkpoint_every and monitor.records:
            # The final step's checkpoint (waits for one the learner is writing, if any).
            last_checkpoint = monitor.system.checkpoint()
            print(f"checkpoint: {last_checkpoint}", flush=True)
        final_status = monitor.system.status()
        version, weights = monitor.system.weights()
    except KeyboardInterrupt:  # a second Ctrl-C: stop now; a checkpoint being written is never half there
        interrupted, final_status = True, {}
        print("\nstopping without the final checkpoint and evaluation", flush=True)
    finally:
        if bar is not None:
            bar.close()
        with _sigint_deferred():  # the actors must not be left running
            supervisor.stop()
    records = monitor.records
    wall = time.time() - monitor.started
    after = None
    if weights is not None:
        engine.update_weights(weights.items(), version)
        try:
            after = greedy_accuracy(config, engine, tokenizer, eval_prompts, progress="eval after" if progress else "")
            print(f"held-out accuracy after {len(records)} steps: {after['accuracy']:.3f} (n={after['n']}), "
                  f"{wall / 60:.1f} min of training", flush=True)
        except KeyboardInterrupt:
            print("\nfinal evaluation skipped", flush=True)
    monitor.write_plots()
    if interrupted:
        last_checkpoint = last_checkpoint or checkpoint.latest_valid(run_dir)[0]
        print(f"last checkpoint: {last_checkpoint or 'none'}"
              + (f" (continue with: asyncrl train trainer.run_dir={run_dir} resume=true)" if last_checkpoint else ""),
              flush=True)
    summary = {"run_dir": run_dir, "eval_before": before, "eval_after": after, "train_wall_s": wall,
               "reached_target": _reached_target(records, config), "evals": evals,
               "resumed": monitor.system.resumed, "restarts": supervisor.restarts,
               "steps": len(records), "final_status": final_status, "interrupted": interrupted,
               "stop_reason": stop_reason,
               "last_checkpoint": last_checkpoint, "records": records}
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump({k: v for k, v in summary.items() if k != "records"}, f, indent=2, default=str)
    if wandb_run is not None:
        wandb_run.summary.update({"eval_accuracy_before": before["accuracy"],
                                  "eval_accuracy_after": after["accuracy"] if after else None})
        wandb_run.finish()
    return summary


def _print_retirements(events: list[dict]) -> None:
    """One line per poll: which prompts were retired (or came back) and why."""
    if not events:
        return
    parts = [f"{e['prompt']} ({e['reason']} in its last {e['last_groups']} groups; back after prompt {e['until_issued']})"
             if e["event"] == "retired" else f"{e['prompt']} back (a group with signal)" for e in events]
    from tqdm import tqdm

    tqdm.write("prompts retired: " + "; ".join(parts))  # above the progress bar, not through it


@contextlib.contextmanager
def _sigint_deferred():
    """Hold a Ctrl-C until the block is done (stopping the actors), then raise it."""
    received = []
    try:
        previous = signal.signal(signal.SIGINT, lambda *_: received.append(True))
    except ValueError:  # not the main thread: nothing to defer
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt


def _reached_target(records: list[dict], config: Config) -> bool:
    target, window = config.trainer.target_reward, config.trainer.target_window
    if target is None or len(records) < window:
        return False
    return float(np.mean([r[REWARD_KEY] for r in records[-window:]])) >= target


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
    if config.mode != "train":  # the recording and offline modes have drivers of their own
        from asyncrl import offline

        summary = offline.record_only(config) if config.mode == "generate" else offline.learn(config)
        print(json.dumps({k: v for k, v in summary.items() if k in ("run_dir", "eval_before", "eval_after", "steps",
                                                                    "samples_recorded", "last_checkpoint")}, indent=2))
        return 0
    summary = train(config)
    print(json.dumps({k: summary[k] for k in ("run_dir", "eval_before", "eval_after", "train_wall_s", "steps",
                                              "last_checkpoint")}, indent=2))
    return 130 if summary["interrupted"] else 0  # 128 + SIGINT, as a shell reports Ctrl-C
