"""The streaming driver of `asyncrl train`: evaluate, start the run, watch it, stop, evaluate.

The driver never waits on the actors' work: generators, assembler and learner run their own
loops; the driver polls the run (`asyncrl.run.Run`, shared with the Serve app) every 0.5 s, and
evaluates the policy on held-out prompts before the first step and after the last, and every
`trainer.eval_every` steps beside training, on a thread (`asyncrl.evaluation.EvaluationBeside`: the
weights of one version pinned, the version named in the result) while the run and its polls go
on. It writes a checkpoint at the end (the learner writes the periodic ones), and with
`resume=true` continues the run of `trainer.run_dir` from its newest valid checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass

import numpy as np
import torch

from asyncrl.config import Config, to_record
from asyncrl.data.files import check_prompts, fit_notices
from asyncrl.engines.generation import build_engine
from asyncrl.errors import RewardsFailing
from asyncrl.evaluation import EvaluationBeside, accuracy_line, greedy_accuracy
from asyncrl.run import Run
from asyncrl.run.loggers import StepLoggers, open_loggers
from asyncrl.run.placement import init_ray
from asyncrl.run.records import REWARD_KEY


# Step records held in memory for the plots and the summary: a run of days keeps its newest half
# whole and thins the older ones (`asyncrl.run.records`); every record is in metrics.jsonl.
HISTORY_RECORDS = 100_000


@dataclass
class Ending:
    interrupted: bool = False
    stop_reason: str = ""
    last_checkpoint: str | None = None
    final_status: dict | None = None
    weights: tuple | None = None  # (version, weights) of the last step
    rewards_failing: str = ""  # the run stopped at once: every reward of its first samples failed


def train(config: Config, progress: bool = True, eval_prompts: int | None = None) -> dict:
    """Run `trainer.total_steps` learner steps; returns a summary with held-out accuracy before/after."""
    from asyncrl.storage import checkpoint

    run_dir = checkpoint.resolve_run_dir(config.trainer.run_dir, config.resume)
    progress = progress and "console" in config.trainer.loggers
    write_config(config, run_dir)
    init_ray(config)
    engine, tokenizer = _evaluation_engine(config, run_dir)
    before = _evaluate_before(config, engine, tokenizer, eval_prompts, progress)
    loggers = open_loggers(config, run_dir)  # wandb, TensorBoard, Ray: the run's own, resumed with it
    ctrl_c = _CtrlC()
    evaluator = EvaluationBeside(config, engine, tokenizer, lambda: run.weights(), lambda: time.time() - run.log.started,
                                 run_dir, eval_prompts)

    def evaluate_every(record: dict) -> None:
        evaluator.annotate(record)  # a result that came since the last record
        # None once the run is stopping (the final evaluation follows), nor of the last step (it is the final one's).
        every = config.trainer.eval_every
        if every and record["step"] % every == 0 and record["step"] < config.trainer.total_steps and not (
                ctrl_c.noted or ctrl_c.loop_over):
            evaluator.due(record["step"])

    if progress:
        print("starting the run's actors (each loads the model: about a minute on a quiet machine)", flush=True)
    run = Run(config, run_dir, max_steps=config.trainer.total_steps, annotate=evaluate_every, loggers=loggers,
              history_limit=HISTORY_RECORDS)
    try:
        run.start()
        if run.resumed:
            r = run.resumed
            print(f"resumed from {r['checkpoint']} at step {r['step']} ({r['reissued_prompts']} prompts to regenerate, "
                  f"{r['saved_batches']} saved batches)", flush=True)
        ending = _watch(run, config, progress, ctrl_c, evaluator)
    finally:
        evaluator.stop(wait=False)  # an error or a second Ctrl-C: the engine free for the final evaluation
        with _sigint_deferred():  # the actors must not be left running
            run.stop()
    wall = time.time() - run.log.started
    after = None if ending.rewards_failing else _evaluate_after(config, engine, tokenizer, eval_prompts, ending,
                                                                 run.log.steps_recorded, wall, progress)
    run.write_plots()
    if ending.interrupted:
        last = ending.last_checkpoint or checkpoint.latest_valid(run_dir)[0]
        print(f"last checkpoint: {last or 'none'}"
              + (f" (continue with: asyncrl train trainer.run_dir={run_dir} resume=true)" if last else ""), flush=True)
    summary = {"run_dir": run_dir, "eval_before": before, "eval_after": after, "train_wall_s": wall,
               "reached_target": _reached_target(run.records, config), "evals": evaluator.results, "resumed": run.resumed,
               "restarts": run.restarts, "steps": run.log.steps_recorded, "final_status": ending.final_status or {},
               "interrupted": ending.interrupted, "stop_reason": ending.stop_reason or ending.rewards_failing,
               "last_checkpoint": ending.last_checkpoint, "records": run.records}
    _write_summary(summary, run_dir, loggers)
    if ending.rewards_failing:
        raise RewardsFailing(ending.rewards_failing)
    return summary


def _evaluation_engine(config: Config, run_dir: str):
    """The driver's own engine for the held-out evaluations (the resumed run's weights when it
    resumes), and the notices of defaults that do not fit the data."""
    from asyncrl.storage import checkpoint, checkpoint_parts

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    engine, tokenizer = build_engine(config.model)
    for line in fit_notices(config, tokenizer, engine.max_positions):
        print(f"notice: {line}", flush=True)
    if config.resume and (latest := checkpoint.latest_valid(run_dir)[0]) is not None:
        from asyncrl.weights import lora

        part = os.path.join(latest, "policy")
        if lora.is_adapter_dir(part):  # LoRA: the adapter merged into the base
            engine.update_weights(lora.merged_model(part, config.model.trust_remote_code)[0].named_parameters(), 0)
        else:
            checkpoint_parts.load_policy_weights(engine.model, part)
    return engine, tokenizer


def _evaluate_before(config: Config, engine, tokenizer, eval_prompts: int | None, progress: bool) -> dict:
    """The held-out accuracy before training; a run whose every evaluation reward failed stops here."""
    before = greedy_accuracy(config, engine, tokenizer, eval_prompts, progress="eval before" if progress else "")
    print(accuracy_line("before training", before), flush=True)
    if config.reward.fail_fast_samples and before["n"] and before["rewards_failed"] == before["n"]:
        raise RewardsFailing(f"every reward of the held-out evaluation failed ({before['n']} of {before['n']}): "
                             f"{before['reward_failure']}. Fix the reward and start again "
                             f"(reward.fail_fast_samples=0 trains on regardless)")
    return before


def _write_summary(summary: dict, run_dir: str, loggers: StepLoggers) -> None:
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump({k: v for k, v in summary.items() if k != "records"}, f, indent=2, default=str)
    after = summary["eval_after"]
    loggers.finish({"eval_accuracy_before": summary["eval_before"]["accuracy"],
                    "eval_accuracy_after": after["accuracy"] if after else None})


def write_config(config: Config, run_dir: str) -> str:
    """The run's config as `config.json` (`config.resume.json` when resumed), its secrets redacted."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "config.resume.json" if config.resume else "config.json")
    with open(path, "w") as f:
        json.dump(to_record(config), f, indent=2)
    return path


def _watch(run: Run, config: Config, progress: bool, ctrl_c: "_CtrlC", evaluator: EvaluationBeside) -> Ending:
    """Poll until the last step, the target reward, the time or sample budget, nothing left to learn, or
    Ctrl-C; then the final checkpoint, status and weights (a second Ctrl-C skips them)."""
    ending = Ending()
    bar = _progress(config.trainer.total_steps, progress, run.resumed)
    try:
        with _sigint_noted(ctrl_c):
            while run.step < config.trainer.total_steps and not _reached_target(run.records, config):
                time.sleep(0.5)
                if ctrl_c.noted:
                    _say(bar, "interrupted: finishing the step in flight, then saving and evaluating the last "
                              "step (Ctrl-C again to skip)")
                    break
                polled = run.poll()
                if polled.restart is not None:
                    _say(bar, f"restarted in {polled.restart['restart_s']:.1f}s from step {polled.restart['step']} "
                              f"after {polled.restart['reason']}")
                for line in polled.reward_notices:
                    _say(bar, line)
                _show(bar, polled.records, run)
                ending.stop_reason = _stop_reason(run, config)
                ending.rewards_failing = polled.rewards_failing
                if ending.stop_reason or ending.rewards_failing:
                    break
            ctrl_c.loop_over = True  # from here a Ctrl-C skips what is left, as a second one does
            ending.interrupted = ctrl_c.noted
            _finish(run, config, ending, bar, evaluator)
    except KeyboardInterrupt:  # a second Ctrl-C: stop now; a checkpoint being written is never half there
        ending.interrupted = True
        print("\nstopping without the final checkpoint and evaluation", flush=True)
    finally:
        if bar is not None:
            bar.close()
    return ending


def _finish(run: Run, config: Config, ending: Ending, bar, evaluator: EvaluationBeside) -> None:
    """After the watch loop: the learner stopped, the evaluation running finished (its result on
    the steps done meanwhile, if any), the final checkpoint, status and weights. A run whose
    rewards all fail stops at once: nothing it trained is worth keeping or evaluating."""
    if ending.rewards_failing:
        if bar is not None:
            bar.close()
        ending.final_status = run.status().json_dict()
        return
    if ending.interrupted or ending.stop_reason:
        run.stop_learning()
        evaluator.stop(wait=True)
        run.poll(check_health=False)  # the steps done meanwhile
        _say(bar, f"stopped after step {run.step}" + (f": {ending.stop_reason}" if ending.stop_reason else ""))
    evaluator.stop(wait=True)
    if bar is not None:
        bar.close()
    if config.trainer.checkpoint_every and run.records:
        # The final step's checkpoint (waits for one the learner is writing, if any).
        ending.last_checkpoint = run.checkpoint()
        print(f"checkpoint: {ending.last_checkpoint}", flush=True)
    ending.final_status = run.status().json_dict()
    ending.weights = run.weights()


def _stop_reason(run: Run, config: Config) -> str:
    """Why the run stops before its last step ("" while it goes on)."""
    if run.log.prompts_exhausted:
        reasons = ", ".join(f"{n} {why}" for why, n in sorted(run.log.retired_by_reason.items()))
        return (f"every prompt is retired ({reasons}): no group has a learning signal left (solved, or given up: "
                f"all wrong through task.unsolved_max_retries={config.task.unsolved_max_retries} retries as the "
                f"policy moved); see retirements.jsonl")
    if config.trainer.max_train_s > 0 and time.time() - run.log.started >= config.trainer.max_train_s:
        return f"the training time budget (trainer.max_train_s={config.trainer.max_train_s:g}) is spent"
    budget = config.trainer.max_generated_samples
    if budget and run.records and run.records[-1]["samples_generated"] >= budget:
        return f"the sample budget (trainer.max_generated_samples={budget}) is spent"
    return ""


@dataclass
class _CtrlC:
    noted: bool = False  # a first Ctrl-C came while the loop ran
    loop_over: bool = False  # the loop ended: a Ctrl-C now raises KeyboardInterrupt


@contextlib.contextmanager
def _sigint_noted(state: "_CtrlC"):
    """While the watch loop runs, a first Ctrl-C is only noted (the loop stops at its next turn),
    so no KeyboardInterrupt lands inside a call to the actors, half sent or half read; the
    periodic evaluations still due are skipped from then on (`evaluate_every`). A second one, or
    one after the loop, raises it. A SIGINT the process was started ignoring (`cmd &` in a script) stays ignored."""

    def handler(signum, frame):
        if state.noted or state.loop_over:
            raise KeyboardInterrupt
        state.noted = True  # only a flag: printing here could re-enter a write in progress

    previous = signal.getsignal(signal.SIGINT)
    installed = False
    if previous is not signal.SIG_IGN:
        try:
            signal.signal(signal.SIGINT, handler)
            installed = True
        except ValueError:  # not the main thread: Ctrl-C is not ours to handle
            pass
    try:
        yield state
    finally:
        if installed:
            signal.signal(signal.SIGINT, previous)


def _evaluate_after(config, engine, tokenizer, eval_prompts, ending: Ending, steps: int, wall: float,
                    progress: bool) -> dict | None:
    if ending.weights is None:
        return None
    version, weights = ending.weights
    engine.update_weights(weights.items(), version)
    try:
        after = greedy_accuracy(config, engine, tokenizer, eval_prompts, progress="eval after" if progress else "")
    except KeyboardInterrupt:
        print("\nfinal evaluation skipped", flush=True)
        return None
    print(f"{accuracy_line(f'after {steps} steps', after)}, {wall / 60:.1f} min of training", flush=True)
    return after


def _progress(total: int, enabled: bool, resumed: dict):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=resumed.get("step", 0), desc="train", unit="step")


def _show(bar, records: list[dict], run: Run) -> None:
    """The one progress line: steps, the reward of what is generated, samples/s, prompts retired."""
    if bar is None or not records:
        return
    bar.update(records[-1]["step"] - bar.n)
    rate = records[-1]["samples_per_s"]  # the number the plot and the status page show
    retired = run.log.retired_share
    failed = records[-1].get("reward_failed", 0)
    bar.set_postfix(reward=f"{records[-1][REWARD_KEY]:.3f}", samples_per_s="-" if rate is None else f"{rate:.1f}",
                    **({"retired": f"{retired:.0%}"} if retired else {}),
                    **({"reward_failed": failed} if failed else {}))


def _say(bar, line: str) -> None:
    """A line above the progress bar, not through it."""
    if bar is None:
        print(line, flush=True)
    else:
        from tqdm import tqdm

        tqdm.write(line)


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


def train_cli(config: Config) -> int:
    """`asyncrl train` of a composed config: the user's files checked before Ray or a model starts,
    then the run of its mode."""
    check_prompts(config)  # the reward file imports, its function is there, the data reads
    if config.model.lora_rank:  # against the model itself: a module it lacks is refused here, in one line
        from asyncrl.weights import lora

        lora.check_targets(config.model, config.engine.name)
    if config.mode != "train":  # the generate and learn modes have drivers of their own
        from asyncrl import offline

        summary = offline.generate_and_store(config) if config.mode == "generate" else offline.learn(config)
        print(json.dumps({k: v for k, v in summary.items() if k in ("run_dir", "eval_before", "eval_after", "steps",
                                                                    "samples_recorded", "last_checkpoint")}, indent=2))
        return 0
    summary = train(config)
    print(json.dumps({k: summary[k] for k in ("run_dir", "eval_before", "eval_after", "train_wall_s", "steps",
                                              "last_checkpoint")}, indent=2))
    return 130 if summary["interrupted"] else 0  # 128 + SIGINT, as a shell reports Ctrl-C
