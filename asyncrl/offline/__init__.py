"""The modes beside streaming training, each a short driver (`asyncrl train mode=...`):

* `generate` (`generate_and_store`): generators, reward endpoints and the trajectory store, no learner:
  `trainer.total_steps × trainer.prompts_per_step` prompts are generated, scored and recorded.
* `learn` (`learn`): training from recorded data, no generator and no reward endpoint:
  - `algorithm=dqo`: DQO on the recorded (or labelled) responses (`asyncrl.learning.dqo`);
  - `offline.train=value`: value pretraining (VC-PPO's, without a generator): the critic learns the
    recorded responses' Monte-Carlo returns; its checkpoint initialises an online critic;
  - otherwise the algorithm's own learners, fed the recorded windows through the real assembler
    and strategy (in this process, with in-process mailboxes) with the recorded rewards.

Each writes `metrics.jsonl`, `summary.json` and a checkpoint in the usual layout, so `asyncrl eval
--checkpoint` and an online run (`model.source=hf model.path=<ckpt>/policy`, `critic.init_path=
<ckpt>/value`) start from it.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time

import msgspec
import torch

from actors.assembler import Assembler
from actors.policy_learner import CheckpointPolicy, LearnerEdges, build_policy_learner
from actors.value_learner import build_value_learner
from asyncrl.assembly.strategies import build_strategy
from asyncrl.assembly.values import ValueEdges
from asyncrl.config import NO_BOUND, Config, PairwiseAdvantage, to_record
from asyncrl.evaluation import greedy_accuracy, progress_bar
from asyncrl.learning.dqo import dqo_step
from asyncrl.learning.tensors import build_optimizer
from asyncrl.messages.mailbox import InProcessMailbox
from asyncrl.messages.structs import Reward, RewardRequest, ScoredTrajectory, Segment
from asyncrl.models.loading import load_model, load_tokenizer
from asyncrl.offline.records import offline_records, reference_logprobs, scored_trajectory, with_behaviour
from asyncrl.storage import checkpoint, checkpoint_parts
from asyncrl.storage.trajectory_store import BatchRecord, TrajectoryRecord, reward_of, segments_of
from asyncrl.weights import lora


# --- mode=generate -----------------------------------------------------------------------------------


def generate_and_store(config: Config, progress: bool = True) -> dict:
    """Generate, score and store `total_steps × prompts_per_step` prompts; no learner."""
    from asyncrl.run import Run
    from asyncrl.run.placement import init_ray

    run_dir = _start_run(config)
    init_ray(config)
    tr = config.trainer
    expected = tr.total_steps * tr.prompts_per_step * config.algorithm.group_size
    run = Run(config, run_dir, name_learner=False).start()
    started, ended = time.time(), 0
    try:
        with progress_bar(expected, "generate", progress) as bar:
            while ended < expected:
                time.sleep(0.5)
                run.check_alive()
                counts = run.ledger()["counts"]
                now = counts["recorded"] + counts["dropped"]
                bar.update(now - ended)
                ended = now
        wall = time.time() - started
        generators = [run.role_stats(gid) for gid in run.generator_ids]
        assembler = run.role_stats("assembler")
        ledger = run.ledger()
    finally:
        run.stop()  # closes the store's files
    summary = {"run_dir": run_dir, "mode": "generate", "samples_recorded": ledger["counts"]["recorded"],
               "samples_dropped": ledger["counts"]["dropped"], "ledger_problems": ledger["problems"],
               "wall_s": wall, "samples_per_s": ledger["counts"]["recorded"] / wall,
               "tokens_generated": sum(g["tokens"] for g in generators),
               "reward_mean": assembler.get("reward_mean_all", 0.0),
               "store": os.path.join(run_dir, "trajectories")}
    _write_summary(run_dir, summary)
    print(f"recorded {summary['samples_recorded']} samples in {wall:.1f}s ({summary['samples_per_s']:.1f} samples/s), "
          f"reward mean {summary['reward_mean']:.3f}; store: {summary['store']}", flush=True)
    return summary


# --- mode=learn ------------------------------------------------------------------------------------------


def learn(config: Config, progress: bool = True) -> dict:
    run_dir = _start_run(config)
    torch.manual_seed(config.trainer.seed)
    torch.set_num_threads(max(1, config.policy.compute.threads))
    records = offline_records(config)
    if config.algorithm.name == "dqo":
        summary = learn_dqo(config, records, run_dir, progress)
    elif config.offline.train == "value":
        summary = asyncio.run(pretrain_value(config, with_behaviour(records, None, config), run_dir))
    else:
        summary = asyncio.run(replay(config, with_behaviour(records, None, config), run_dir, progress))
    _write_summary(run_dir, summary)
    return summary


def learn_dqo(config: Config, records: list[TrajectoryRecord], run_dir: str, progress: bool) -> dict:
    """DQO from recorded responses: evaluate, train `trainer.total_steps` updates (or the epochs),
    evaluate, checkpoint."""
    from asyncrl.engines.torch_engine import TorchEngine
    from asyncrl.models.loading import eos_token_ids

    tr = config.trainer
    tokenizer = load_tokenizer(config.model)
    policy, reference = load_model(config.model, tokenizer), load_model(config.model, tokenizer).requires_grad_(False)
    peft_model = lora.wrap(policy, config.model) if config.model.lora_rank else None  # the adapter trains alone
    value_model = _value_model(config, tokenizer)
    engine = TorchEngine(policy, eos_token_ids(policy, tokenizer), tokenizer.pad_token_id or 0)
    before = greedy_accuracy(config, engine, tokenizer, progress="eval before" if progress else "")
    print(f"held-out accuracy before (the behaviour policy's start): {before['accuracy']:.3f}", flush=True)
    reference_logp = reference_logprobs(records, config, reference)
    records = with_behaviour(records, reference_logp, config)
    trajectories = [scored_trajectory(r, config) for r in records]
    sections = (config.policy, config.critic, config.sampling)
    policy_opt, policy_schedule = build_optimizer([p for p in policy.parameters() if p.requires_grad],
                                                  config.policy.optimizer)
    value_opt, value_schedule = build_optimizer(value_model.parameters(), config.critic.optimizer)
    batch, order, step = config.offline.batch_trajectories, list(range(len(trajectories))), 0
    rng = random.Random(tr.seed)
    started = time.time()
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as metrics_file, \
            progress_bar(tr.total_steps, "dqo", progress) as bar:
        for _ in range(config.offline.epochs):
            rng.shuffle(order)
            for start in range(0, len(order), batch):
                if step >= tr.total_steps:
                    break
                chosen = order[start:start + batch]
                metrics = dqo_step(policy, value_model, policy_opt, value_opt, [trajectories[i] for i in chosen],
                                   [reference_logp[i] for i in chosen], config.offline.dqo, sections,
                                   tokenizer.pad_token_id or 0)
                step += 1
                metrics_file.write(json.dumps({"step": step, **metrics, "lr": policy_opt.param_groups[0]["lr"],
                                               "wall_time_s": time.time() - started}) + "\n")
                policy_schedule.step(), value_schedule.step()  # each optimizer stepped once in `dqo_step`
                bar.update(1)
    after = greedy_accuracy(config, engine, tokenizer, progress="eval after" if progress else "")
    print(f"held-out accuracy after {step} DQO updates: {after['accuracy']:.3f}", flush=True)
    path = _save(run_dir, step, policy, tokenizer, value_model, value_opt, {"algorithm": "dqo"},
                 (peft_model, config.model) if peft_model is not None else None)
    return {"run_dir": run_dir, "mode": "learn", "algorithm": "dqo", "trajectories": len(trajectories),
            "steps": step, "eval_before": before, "eval_after": after, "train_wall_s": time.time() - started,
            "last_checkpoint": path}


async def pretrain_value(config: Config, records: list[TrajectoryRecord], run_dir: str) -> dict:
    """The critic alone on the recorded responses (Monte-Carlo returns with critic.loss.lam = 1)."""
    trajectories_box = InProcessMailbox(max(4 * config.offline.batch_trajectories, 64))
    # Shuffled below, so each batch already mixes prompts: one batch a step (`mix_batches=1`).
    critic = msgspec.structs.replace(config.critic, batch_trajectories=config.offline.batch_trajectories, mix_batches=1,
                                     warmup=msgspec.structs.replace(config.critic.warmup, steps=0))
    learner = build_value_learner(config.model, critic, config.algorithm, config.sampling, config.trainer.seed,
                                  trajectories_box)
    trajectories = [scored_trajectory(r, config) for r in records]
    started, metrics, rng = time.time(), [], random.Random(config.trainer.seed)
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as metrics_file:
        for epoch in range(config.offline.epochs):
            rng.shuffle(trajectories)  # a store is in the order groups finished: batches of one prompt otherwise
            for i in range(0, len(trajectories), critic.batch_trajectories):
                if learner.version >= config.trainer.total_steps:
                    break
                part = [_renamed(t, epoch) for t in trajectories[i:i + critic.batch_trajectories]]
                await trajectories_box.put(part)
                record = await learner.step_once(timeout=0.0)
                if record is not None:
                    metrics.append(record)
                    metrics_file.write(json.dumps({"step": learner.version, **record}) + "\n")
    tmp = checkpoint.begin(run_dir, learner.version)
    await learner.save_checkpoint_part(tmp)
    checkpoint_parts.save_json({"step": learner.version, "mode": "learn", "offline_train": "value"},
                         os.path.join(tmp, "learner.json"))
    path = checkpoint.commit(tmp, learner.version, config.trainer.checkpoint_keep)
    print(f"value model pretrained for {learner.version} steps; critic.init_path={path}/value", flush=True)
    return {"run_dir": run_dir, "mode": "learn", "offline_train": "value", "trajectories": len(trajectories),
            "steps": learner.version, "train_wall_s": time.time() - started, "last_checkpoint": path,
            "value_init_path": os.path.join(path, "value"),
            "value_explained_variance_last": metrics[-1]["value_explained_variance"] if metrics else None}


async def replay(config: Config, records: list[TrajectoryRecord], run_dir: str, progress: bool) -> dict:
    """The algorithm's learners on recorded windows, through the real assembler and strategy with
    the recorded rewards. Offline data is off-policy by construction: there is no staleness bound
    (the recorded behaviour log-probs importance-correct the loss, as online)."""
    algorithm = msgspec.structs.replace(config.algorithm, max_staleness_versions=NO_BOUND)
    if isinstance(algorithm.advantage, PairwiseAdvantage):
        raise ValueError("algorithm=pairwise_ppo needs its judge online; mode=learn replays recorded rewards only")
    tr, engine = config.trainer, config.engine
    segments, batches = InProcessMailbox(1 << 16), InProcessMailbox(2)
    value_learner = trajectories = None
    if algorithm.value_based:
        trajectories = InProcessMailbox(max(4 * config.critic.batch_trajectories, 64))
        value_learner = build_value_learner(config.model, config.critic, algorithm, config.sampling, tr.seed,
                                            trajectories)
    recorded = RecordedRewards(records, config.offline.epochs)
    tokenizer = load_tokenizer(config.model)

    def decode(ids):
        return tokenizer.decode(ids)

    strategy = build_strategy(algorithm, engine, tr.prompts_per_step, None, decode,
                              ValueEdges.of(value_learner) if value_learner else None)
    assembler = Assembler(segments, batches, recorded.score, decode, strategy, algorithm.overlong,
                          engine.max_response_tokens, trajectories=trajectories)
    edges = LearnerEdges(listeners=[assembler.set_versions],
                         checkpoint_parts=[value_learner.save_checkpoint_part] if value_learner else [])
    learner = build_policy_learner(config.model, algorithm, config.policy, engine, config.sampling, tr.seed, batches,
                                   edges,
                                   CheckpointPolicy(run_dir, keep=tr.checkpoint_keep), max_steps=tr.total_steps)
    from asyncrl.engines.torch_engine import TorchEngine
    from asyncrl.models.loading import eos_token_ids

    engine_eval = TorchEngine(learner.model, eos_token_ids(learner.model, tokenizer), tokenizer.pad_token_id or 0)
    before = greedy_accuracy(config, engine_eval, tokenizer, progress="eval before" if progress else "")
    loops = [asyncio.create_task(role.run()) for role in (assembler, learner, value_learner) if role is not None]
    started = time.time()
    try:
        for epoch in range(config.offline.epochs):
            for record in records:
                await segments.put([_epoch_segment(s, epoch) for s in segments_of(record)])
                if learner.step >= tr.total_steps:
                    break
                await asyncio.sleep(0)
        while learner.step < tr.total_steps and not await _drained(segments, batches, assembler, learner):
            await asyncio.sleep(0.2)
    finally:
        for role in (assembler, learner, value_learner):
            if role is not None:
                role.stop()
        await asyncio.gather(*loops, return_exceptions=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as metrics_file:
        for record in learner.pop_metrics():
            metrics_file.write(json.dumps(record) + "\n")
    path = await learner.save_checkpoint() if learner.step else None
    after = greedy_accuracy(config, engine_eval, tokenizer, progress="eval after" if progress else "")
    print(f"replayed {len(records)} recorded samples: {learner.step} steps, held-out accuracy "
          f"{before['accuracy']:.3f} -> {after['accuracy']:.3f}", flush=True)
    return {"run_dir": run_dir, "mode": "learn", "algorithm": algorithm.name, "trajectories": len(records),
            "steps": learner.step, "eval_before": before, "eval_after": after, "train_wall_s": time.time() - started,
            "last_checkpoint": path, "assembler": assembler.stats()}


def replay_batch(config: Config, record: BatchRecord, checkpoint_dir: str | None = None) -> dict[str, float]:
    """Learner-only replay of one recorded batch: the run's learner, built from its config at the
    weights and optimizer state the batch was trained from (the initial ones for the run's first
    batch, else the checkpoint of that step), trains it once; returns the step's metrics, to set
    against the recorded loss and gradient norm (the golden-batch test)."""
    from asyncrl.storage.trajectory_store import BATCH_CODEC

    learner = build_policy_learner(config.model, config.algorithm, config.policy, config.engine, config.sampling,
                                   config.trainer.seed, InProcessMailbox(2))
    if checkpoint_dir is not None:
        asyncio.run(learner.load_checkpoint(checkpoint_dir))
    if learner.weight_version != record.trained_from_version:
        raise ValueError(f"batch {record.batch_id} was trained from version {record.trained_from_version}; the "
                         f"learner is at {learner.weight_version} (pass the checkpoint of step "
                         f"{record.trained_from_version})")
    batch = BATCH_CODEC.decode(record.batch)  # recorded as trained (stale tokens already masked)
    return learner.policy.step(batch.rows)


class RecordedRewards:
    """The reward endpoints of `mode=learn`: each sample's recorded reward (a replay scores nothing)."""

    def __init__(self, records: list[TrajectoryRecord], epochs: int):
        self._by_id = {(f"{r.prompt_id}~e{e}", r.sample_idx): r for r in records for e in range(epochs)}

    async def score(self, requests: list[RewardRequest]) -> list[Reward]:
        out = []
        for request in requests:
            record = self._by_id[(request.prompt_id, request.sample_idx)]
            out.append(msgspec.structs.replace(reward_of(record), prompt_id=request.prompt_id))
        return out


def _epoch_segment(segment: Segment, epoch: int) -> Segment:
    """A recorded window under a per-epoch prompt id (the assembler counts each id once)."""
    return msgspec.structs.replace(segment, prompt_id=f"{segment.prompt_id}~e{epoch}",
                                   group_id=f"{segment.group_id}~e{epoch}")


def _renamed(trajectory: ScoredTrajectory, epoch: int) -> ScoredTrajectory:
    return msgspec.structs.replace(trajectory, segment=_epoch_segment(trajectory.segment, epoch))


async def _drained(segments, batches, assembler, learner) -> bool:
    """Nothing left to assemble or train (the strategies' partial batches stay unbatched)."""
    seg, bat = await segments.stats(), await batches.stats()
    return not (seg.queued or seg.leased or bat.queued or bat.leased or assembler.stats()["scoring_tasks"])


# --- helpers -------------------------------------------------------------------------------------------


def _start_run(config: Config) -> str:
    run_dir = checkpoint.resolve_run_dir(config.trainer.run_dir, False)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(to_record(config), f, indent=2)
    return run_dir


def _value_model(config: Config, tokenizer):
    from asyncrl.models.loading import value_model_from_checkpoint, value_model_from_policy

    if config.critic.init_path:
        return value_model_from_checkpoint(config.critic.init_path, config.model, tokenizer)
    return value_model_from_policy(load_model(config.model, tokenizer))


def _save(run_dir: str, step: int, policy, tokenizer, value_model, value_optimizer, meta: dict,
          adapter: tuple | None = None) -> str:
    """A checkpoint in the online layout: `policy/` (Hugging Face; with `adapter`, LoRA's peft model
    and settings, the adapter alone in peft's format) and `value/` (the value model)."""
    tmp = checkpoint.begin(run_dir, step)
    if adapter is None:
        checkpoint_parts.save_policy(policy, tokenizer, os.path.join(tmp, "policy"))
    else:
        lora.save_adapter(os.path.join(tmp, "policy"), adapter[0], {n: p.detach() for n, p in policy.named_parameters()
                                                                    if lora.is_adapter(n)}, adapter[1], tokenizer)
    checkpoint_parts.save_value_part(tmp, value_model, value_optimizer, step, {})
    checkpoint_parts.save_json({"step": step, "weight_version": step, "mode": "learn", **meta}, os.path.join(tmp, "learner.json"))
    return checkpoint.commit(tmp, step, 1)


def _write_summary(run_dir: str, summary: dict) -> None:
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
