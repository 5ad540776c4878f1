"""The Ray shells of the roles, and the builders that make each role from its own config sections.

A builder (`build_*`) is a plain function: config sections and the role's edges (mailboxes and the
callables it talks through) in, a role object out; tests call the builders without Ray. A shell is
the Ray actor around one role: it sets the process's torch thread budget, turns actor handles into
those callables, and forwards calls. Which sections each role reads is visible in its builder's
signature, and `TrainingSystem.start` passes exactly those.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict
from typing import Any

import ray
import torch

from asyncrl.assembly import AssemblySettings, KLRewardSettings, ValueAdvantageSettings
from asyncrl.config import (AlgorithmConfig, CriticConfig, EngineConfig, ModelConfig, RewardConfig, RouteConfig,
                            TaskConfig, TrainerConfig, route_checks)
from asyncrl.generation import build_generator_engine, decode, sampling_params
from asyncrl.learning import PolicyLossSettings, ValueLossSettings
from asyncrl.mailbox import Mailbox
from asyncrl.models import load_model, load_tokenizer, value_model_from_checkpoint, value_model_from_policy
from asyncrl.rewards.hybrid import RewardRouter, ServeRewardEndpoints
from asyncrl.roles.assembler import Assembler
from asyncrl.roles.estimators import (ESTIMATORS, GroupEstimator, PairwiseEstimator, RecordOnlyEstimator, ValueEdges,
                                     ValueEstimator)
from asyncrl.roles.generator import Generator
from asyncrl.roles.policy_learner import PolicyLearner
from asyncrl.roles.policy_rank import PolicyRank
from asyncrl.roles.prompt_source import SNAPSHOT_CODEC, PromptSource
from asyncrl.roles.recorder import TrajectoryRecorder
from asyncrl.roles.value_learner import ValueLearner
from asyncrl.sharding import DataParallel, join as join_ranks
from asyncrl.store import BATCH_RECORD_ENCODER, RECORDS_ENCODER
from asyncrl.tasks import encode_prompt, load_examples
from asyncrl.weight_sync import WeightGroup, node_address


# --- builders ------------------------------------------------------------------------------------


def build_generator(model: ModelConfig, engine: EngineConfig, prompts: Mailbox, segments: Mailbox,
                    generator_id: str) -> Generator:
    embedded = build_generator_engine(model, engine)
    max_windows = engine.max_windows or math.ceil(engine.max_response_tokens / engine.window_tokens)
    return Generator(embedded, prompts, segments, sampling_params(engine), engine.window_tokens,
                     engine.max_response_tokens, max_windows, engine.max_inflight_sequences, generator_id,
                     long_tail=(engine.long_tail_fraction, engine.long_tail_tokens))


def policy_loss_settings(algorithm: AlgorithmConfig, trainer: TrainerConfig, engine: EngineConfig) -> PolicyLossSettings:
    """`engine`: its sampling settings, so the learner scores tokens under the distribution they
    were sampled from (and masks the positions whose distribution it cannot score)."""
    a, e = algorithm, engine
    return PolicyLossSettings(
        clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip, loss_agg=a.loss_agg,
        kl_coef=policy_kl_loss_coef(a), entropy_coef=a.entropy_coef, temperature=e.temperature,
        grad_clip=a.grad_clip, micro_batch_tokens=a.micro_batch_tokens, nll_coef=a.nll_coef,
        norm_constant=float(a.loss_norm_tokens or e.max_response_tokens), ppo_epochs=a.ppo_epochs,
        mini_batches=a.mini_batches, proximal_anchor=a.proximal_anchor, behaviour_weight_cap=a.behaviour_weight_cap,
        rollout_correction=a.rollout_correction, rollout_is_cap=a.rollout_is_cap, precision=trainer.learner_precision,
        kl_estimator=a.kl_estimator, top_k=e.top_k, top_p=e.top_p,
        mask_first_token=e.first_token_temperature is not None,
        long_tail=(e.long_tail_fraction, e.long_tail_tokens), logits_chunk_tokens=trainer.logits_chunk_tokens,
    )


def policy_kl_loss_coef(algorithm: AlgorithmConfig) -> float:
    """β of the KL loss term: 0 when the KL is in the reward (the value learner scores it)."""
    return 0.0 if algorithm.kl_in_reward else algorithm.kl_coef


def _policy_model(model: ModelConfig, trainer: TrainerConfig):
    torch.manual_seed(trainer.seed)
    tokenizer = load_tokenizer(model)
    policy = load_model(model, tokenizer)
    if trainer.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return policy.to(trainer.learner_device), tokenizer


def learner_backend(trainer: TrainerConfig) -> str:
    return "nccl" if trainer.learner_device == "cuda" else "gloo"


def build_policy_rank(model: ModelConfig, algorithm: AlgorithmConfig, trainer: TrainerConfig, engine: EngineConfig,
                      parallel: DataParallel) -> PolicyRank:
    """Rank 1.. of a sharded policy learner: the same model, loss and optimizer as rank 0."""
    policy, tokenizer = _policy_model(model, trainer)
    a = algorithm
    return PolicyRank(policy, policy_loss_settings(a, trainer, engine), a.lr, a.weight_decay, a.warmup_steps,
                      policy_kl_loss_coef(a), tokenizer.pad_token_id or 0, parallel)


def build_policy_learner(model: ModelConfig, algorithm: AlgorithmConfig, trainer: TrainerConfig,
                         engine: EngineConfig, batches: Mailbox, run_dir: str = "",
                         max_steps: int = 0, parallel: DataParallel | None = None, ranks=()) -> PolicyLearner:
    """`parallel`, `ranks`: rank 0 of a sharded learner and the calls to its other ranks."""
    policy, tokenizer = _policy_model(model, trainer)
    a = algorithm
    learner = PolicyLearner(policy, policy_loss_settings(a, trainer, engine), batches, a.lr, a.weight_decay,
                            a.warmup_steps, policy_kl_loss_coef(a), tokenizer.pad_token_id or 0,
                            trainer.broadcast_bucket_mb << 20, tokenizer=tokenizer,
                            max_staleness_versions=a.max_staleness_versions, parallel=parallel, ranks=ranks)
    learner.run_dir = run_dir
    learner.checkpoint_every = trainer.checkpoint_every if run_dir else 0
    learner.checkpoint_keep = trainer.checkpoint_keep
    learner.max_steps = max_steps
    return learner


def build_value_learner(model: ModelConfig, critic: CriticConfig, algorithm: AlgorithmConfig, engine: EngineConfig,
                        seed: int, trajectories: Mailbox, device: str = "cpu") -> ValueLearner:
    """`algorithm`: γ, and whether the KL to the reference is a reward (then this learner holds the
    reference policy and scores tokens under `engine`'s sampling settings)."""
    torch.manual_seed(seed + 1)
    tokenizer = load_tokenizer(model)
    if critic.init_path:
        value_model = value_model_from_checkpoint(critic.init_path, model, tokenizer)
    else:
        value_model = value_model_from_policy(load_model(model, tokenizer))
    settings = ValueLossSettings(gamma=algorithm.gamma, lam=critic.lam, clip_low=critic.clip_low,
                                 clip_high=critic.clip_high, grad_clip=critic.grad_clip,
                                 micro_batch_tokens=critic.micro_batch_tokens)
    reference = load_model(model, tokenizer).to(device) if algorithm.kl_in_reward else None
    return ValueLearner(value_model.to(device), trajectories, settings, critic.lr, critic.weight_decay,
                        critic.batch_trajectories, critic.warmup_steps, tokenizer.pad_token_id or 0,
                        reference=reference, sampling=sampling_params(engine))


def build_estimator(algorithm: AlgorithmConfig, engine: EngineConfig, prompts_per_step: int, router: RewardRouter,
                    value_edges: ValueEdges | None = None, trajectories: Mailbox | None = None,
                    mode: str = "train"):
    """The strategy `ESTIMATORS[algorithm.estimator]`, given what it talks to; `mode=generate`
    records only (no learner)."""
    a, kind = algorithm, ESTIMATORS[algorithm.estimator]
    if mode == "generate":
        return RecordOnlyEstimator()
    if kind is ValueEstimator:
        settings = ValueAdvantageSettings(
            gamma=a.gamma, lam=a.lam, length_adaptive_alpha=a.length_adaptive_alpha, lambda_floor=a.lambda_floor,
            edge_mask_tokens=a.edge_mask_tokens, window_training=a.window_training,
            window_tokens=engine.window_tokens, bootstrap=a.egae_bootstrap,
            max_staleness_versions=a.max_staleness_versions, overlong_buffer_tokens=a.overlong_buffer_tokens,
            overlong_penalty_factor=a.overlong_penalty_factor, max_response_tokens=engine.max_response_tokens)

        kl = (KLRewardSettings(a.kl_coef, a.kl_estimator, engine.first_token_temperature is not None)
              if a.kl_in_reward else None)
        return ValueEstimator(values=value_edges.values, value_ready=value_edges.ready, trajectories=trajectories,
                              settings=settings, rows_per_batch=prompts_per_step * a.group_size,
                              whiten=a.whiten_advantages, advantage_clamp=a.advantage_clamp,
                              nll_whole_response=a.nll_coef > 0,
                              reference_logprobs=value_edges.reference_logprobs if kl else None, kl=kl)
    settings = AssemblySettings(
        dynamic_sampling=a.dynamic_sampling, scale_advantage_by_std=a.scale_advantage_by_std,
        max_staleness_versions=a.max_staleness_versions, overlong_buffer_tokens=a.overlong_buffer_tokens,
        overlong_penalty_factor=a.overlong_penalty_factor, max_response_tokens=engine.max_response_tokens,
        filter_metric=a.filter_metric, max_refill_rounds=a.max_refill_rounds)
    if kind is PairwiseEstimator:
        async def judge(pairs):
            return await router.compare(a.pairwise_endpoint, pairs)

        return PairwiseEstimator(settings, prompts_per_step, judge=judge, anchor=a.pairwise_anchor)
    return GroupEstimator(settings, prompts_per_step)


def build_reward_router(reward: RewardConfig, endpoints: dict[str, Any],
                        routes: list[RouteConfig] | None = None) -> RewardRouter:
    """Calls reward endpoints with the run's timeout and retries: the actors of `endpoints`, or the
    Serve applications `reward-<name>` when `reward.use_serve`. `routes` default to the config's."""
    if reward.use_serve:
        serve_endpoints = ServeRewardEndpoints()
        call, compare = serve_endpoints.score, serve_endpoints.compare
    else:
        async def call(name, requests):
            return await endpoints[name].score.remote(requests)

        async def compare(name, pairs):
            return await endpoints[name].compare.remote(pairs)

    return RewardRouter(list(routes if routes is not None else reward.routes), call, reward.timeout_s,
                        reward.retries, compare=compare)


def build_prompt_source(model: ModelConfig, task: TaskConfig, algorithm: AlgorithmConfig, trainer: TrainerConfig,
                        prompts: Mailbox, max_prompts: int = 0) -> PromptSource:
    """`max_prompts` > 0: issue that many prompts and no more, with no staleness budget (there is no
    learner: `mode=generate`)."""
    tokenizer = load_tokenizer(model)
    examples = load_examples(task.name, "train", task.num_train_prompts, task.seed, task.path)
    tokens = [encode_prompt(ex, tokenizer, model.use_chat_template) for ex in examples]
    curriculum = [(stage.start_step, list(stage.data_sources)) for stage in task.curriculum]
    staleness = 1 << 30 if max_prompts else algorithm.max_staleness_versions
    a = algorithm
    return PromptSource(examples, tokens, a.group_size, prompts, trainer.seed, trainer.prompts_per_step,
                        staleness, curriculum, max_prompts=max_prompts, retire_after_groups=a.retire_after_groups,
                        retire_epochs=a.retire_epochs, retire_unsolved=a.retire_unsolved,
                        filter_metric=a.filter_metric, retest_every_s=a.retest_every_s)


# --- shells --------------------------------------------------------------------------------------


class _LoopShell:
    """Forwards the loop controls of a role object held in `self.inner`."""

    inner: Any

    async def run(self) -> None:
        await self.inner.run()

    def stop(self) -> None:
        self.inner.stop()

    def stats(self) -> dict:
        return {**self.inner.stats(), "node_ip": node_address()}  # where the role landed

    def pid(self) -> int:
        return os.getpid()


class _WeightGroupMember:
    """The learner (rank 0) and the generators on other hosts join the weight group."""

    def init_weight_group(self, host: str, port: int, world_size: int, rank: int, backend: str = "gloo") -> None:
        self.inner.weight_group = WeightGroup(host, port, world_size, rank, backend, local_address=node_address())

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


class PromptSourceActor(_LoopShell):
    def __init__(self, model: ModelConfig, task: TaskConfig, algorithm: AlgorithmConfig, trainer: TrainerConfig,
                 prompts: Mailbox, max_prompts: int = 0):
        torch.set_num_threads(1)
        self.inner = build_prompt_source(model, task, algorithm, trainer, prompts, max_prompts)
        self.restored = False
        self.pre_ppo: dict = {}

    async def prepare(self, model: ModelConfig, engine: EngineConfig, task: TaskConfig, reward: RewardConfig,
                      seed: int, endpoints: dict[str, Any]) -> dict:
        """Pre-PPO prompt selection before the first prompt is issued; a no-op when off or resumed
        (a resumed run keeps the selection its checkpoint holds)."""
        from asyncrl.pre_ppo import select_prompts

        if task.pre_ppo_fraction <= 0 or self.restored:
            return {}
        router = build_reward_router(reward, endpoints, [RouteConfig(match="*", endpoints=[task.pre_ppo_endpoint])])
        examples, tokens, self.pre_ppo = await select_prompts(
            self.inner.examples, self.inner.prompt_token_ids, model, engine, task, router, seed)
        self.inner.set_examples(examples, tokens)
        return self.pre_ppo

    def set_policy_version(self, version: int) -> None:
        self.inner.set_learner_version(version)

    def record(self, sample_ids: list[str], state: str, reason: str = "") -> None:
        self.inner.record(sample_ids, state, reason)

    def record_events(self, events, outcomes) -> None:
        self.inner.record_events(events, outcomes)

    def save_checkpoint_part(self, directory: str) -> None:
        with open(os.path.join(directory, "prompt_source.msgpack"), "wb") as f:
            f.write(SNAPSHOT_CODEC.encode(self.inner.snapshot()))

    def restore(self, directory: str, held_sample_ids: set[str], learner_version: int) -> int:
        """Continue from a checkpoint; returns how many prompts will be issued again."""
        with open(os.path.join(directory, "prompt_source.msgpack"), "rb") as f:
            self.inner.restore(SNAPSHOT_CODEC.decode(f.read()), held_sample_ids, learner_version)
        self.restored = True
        return len(self.inner.reissue)

    def sample_states(self, sample_ids: list[str]) -> dict[str, str | None]:
        return {sid: self.inner.ledger.state(sid) for sid in sample_ids}

    def ledger(self) -> dict:
        return {"counts": self.inner.ledger.state_counts(), "problems": self.inner.ledger.check(),
                "trained_ids": self.inner.ledger.trained_ids()}


class ValueLearnerActor(_LoopShell):
    def __init__(self, model: ModelConfig, critic: CriticConfig, algorithm: AlgorithmConfig, engine: EngineConfig,
                 seed: int, trajectories: Mailbox, resume_from: str | None = None, device: str = "cpu"):
        torch.set_num_threads(critic.threads)
        self.inner = build_value_learner(model, critic, algorithm, engine, seed, trajectories, device)
        if resume_from:
            self.inner.load_checkpoint(resume_from)

    async def save_checkpoint_part(self, directory: str) -> None:
        await self.inner.save_checkpoint_part(directory)

    async def values(self, rows):
        return await self.inner.values(rows)

    async def reference_logprobs(self, rows):
        return await self.inner.reference_logprobs(rows)

    def ready(self) -> bool:
        """The warm-up (value pretraining) is over: the assembler may train policy rows."""
        return self.inner.ready

    def pop_metrics(self) -> list[dict]:
        return self.inner.pop_metrics()


class AssemblerActor(_LoopShell):
    """Edges: `value_learner` (values, readiness, reference log-probs), the `ledger` (prompt
    source), the `recorder` (the trajectory store, when recording)."""

    def __init__(self, model: ModelConfig, algorithm: AlgorithmConfig, engine: EngineConfig, reward: RewardConfig,
                 prompts_per_step: int, segments: Mailbox, batches: Mailbox, endpoints: dict[str, Any],
                 ledger, value_learner=None, trajectories: Mailbox | None = None, batch_prefix: str = "batch",
                 recorder=None, mode: str = "train"):
        torch.set_num_threads(1)
        tokenizer = load_tokenizer(model)
        self.router = build_reward_router(reward, endpoints)
        self.endpoint_names = set(reward.endpoints)
        edges = None
        if value_learner is not None:
            async def values(rows):
                return await value_learner.values.remote(rows)

            async def ready() -> bool:
                return await value_learner.ready.remote()

            async def reference_logprobs(rows):
                return await value_learner.reference_logprobs.remote(rows)

            edges = ValueEdges(values=values, ready=ready, reference_logprobs=reference_logprobs)
        estimator = build_estimator(algorithm, engine, prompts_per_step, self.router, edges, trajectories, mode)
        record = None
        if recorder is not None:
            def record(records):  # nobody waits (but the last call at stop): the recorder writes at its own pace
                return recorder.add_trajectories.remote(RECORDS_ENCODER.encode(records))
        self.inner = Assembler(segments, batches, self.router.score, lambda ids: decode(tokenizer, ids), estimator,
                               events=lambda events, outcomes: ledger.record_events.remote(events, outcomes),
                               batch_prefix=batch_prefix, record=record)

    def set_policy_version(self, version: int) -> None:
        self.inner.set_policy_version(version)

    def set_reward_routes(self, routes: list[dict]) -> list[dict]:
        """Admin: change the hybrid mix while training runs (validated like the config)."""
        parsed = [RouteConfig(**route) for route in routes]
        errors = [message for ok, message in route_checks(parsed, self.endpoint_names) if not ok]
        if errors:
            raise ValueError("; ".join(errors))
        self.router.set_routes(parsed)
        return [asdict(route) for route in parsed]

    def stats(self) -> dict:
        return {**self.inner.stats(), "reward_router": self.router.stats()}


class GeneratorActor(_LoopShell, _WeightGroupMember):
    def __init__(self, model: ModelConfig, engine: EngineConfig, prompts: Mailbox, segments: Mailbox,
                 generator_id: str):
        torch.set_num_threads(engine.threads)
        self.inner = build_generator(model, engine, prompts, segments, generator_id)

    async def receive_weights(self, delivery, payload=None) -> float:
        return await self.inner.receive_weights(delivery, payload)


class RecorderActor(_LoopShell):
    def __init__(self, directory: str, trainer: TrainerConfig):
        self.inner = TrajectoryRecorder(directory, trainer.record_file_mb << 20, trainer.record_file_age_s)

    def add_trajectories(self, encoded: bytes) -> int:
        return self.inner.add_trajectories(encoded)

    def add_batch(self, encoded: bytes) -> None:
        self.inner.add_batch(encoded)

    async def close(self) -> None:
        await self.inner.close()


class PolicyLearnerActor(_LoopShell, _WeightGroupMember):
    """Edges: broadcasts to `generators`; tells `version_listeners` (the assembler) of each version
    and `delivered_listeners` (the prompt source's admission budget) of each version every generator
    holds; reports trained samples to the `ledger`; asks `checkpoint_parts` (prompt source,
    value learner) to write their parts of each checkpoint."""

    def __init__(self, model: ModelConfig, algorithm: AlgorithmConfig, trainer: TrainerConfig,
                 engine: EngineConfig, batches: Mailbox, generators: list, version_listeners: list[Any],
                 delivered_listeners: list[Any], ledger, checkpoint_parts: list[Any], run_dir: str = "",
                 max_steps: int = 0, recorder=None, ranks: list[Any] = (), rendezvous: tuple[str, int] | None = None):
        """`ranks`: the other ranks' actors (`PolicyRankActor`) of a sharded learner, which meet
        this one at `rendezvous` (a store the run's driver holds)."""
        torch.set_num_threads(trainer.learner_threads)
        parallel = (join_ranks(*rendezvous, len(ranks) + 1, 0, learner_backend(trainer), trainer.learner_timeout_s)
                    if ranks else None)
        self.inner = build_policy_learner(model, algorithm, trainer, engine, batches, run_dir, max_steps, parallel,
                                          [_rank_call(rank) for rank in ranks])
        self.inner.generators = generators
        self.inner.on_version = [_version_notice(listener) for listener in version_listeners]
        self.inner.on_version_delivered = [_version_notice(listener) for listener in delivered_listeners]

        async def on_trained(ids):
            await ledger.record.remote(ids, "trained", "")

        self.inner.on_trained = on_trained
        self.inner.checkpoint_parts = [_part_writer(actor) for actor in checkpoint_parts]
        if recorder is not None:
            self.inner.record_batch = lambda record: recorder.add_batch.remote(BATCH_RECORD_ENCODER.encode(record))

    async def resume(self, checkpoint_dir: str) -> None:
        await self.inner.load_checkpoint(checkpoint_dir)

    async def publish(self) -> None:
        await self.inner.publish()

    async def save_checkpoint(self) -> str:
        return await self.inner.save_checkpoint()

    def pop_metrics(self) -> list[dict]:
        return self.inner.pop_metrics()

    async def weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        """(version, a snapshot of the parameters): for evaluation and the policy endpoint."""
        version = self.inner.version
        return version, await self.inner.snapshot()

    def version(self) -> int:
        return self.inner.version

    def weight_group_address(self) -> tuple[str, int]:
        return self.inner.weight_group_address()

    def set_weight_paths(self, paths: list[str]) -> None:
        self.inner.weight_paths = list(paths)


class PolicyRankActor:
    """Rank 1.. of a sharded policy learner: builds its model, meets the other ranks, and runs what
    rank 0 asks, in order (a sync actor: one call at a time)."""

    METHODS = ("step", "snapshot", "state", "load")

    def __init__(self, model: ModelConfig, algorithm: AlgorithmConfig, trainer: TrainerConfig, engine: EngineConfig,
                 rendezvous: tuple[str, int], rank: int):
        torch.set_num_threads(trainer.learner_threads)
        self.rank = rank
        parallel = join_ranks(*rendezvous, trainer.learner_ranks, rank, learner_backend(trainer),
                              trainer.learner_timeout_s)
        self.inner = build_policy_rank(model, algorithm, trainer, engine, parallel)

    def call(self, method: str, *args):
        if method not in self.METHODS:
            raise ValueError(f"a policy rank has no method {method!r}")
        return getattr(self.inner, method)(*args)

    def stats(self) -> dict:
        return {"rank": self.rank, "optimizer_steps": self.inner.optimizer_steps(), "node_ip": node_address()}

    def pid(self) -> int:
        return os.getpid()


def _rank_call(actor):
    return lambda method, *args: actor.call.remote(method, *args)


def _version_notice(listener):
    """Fire-and-forget: the assembler and the prompt source take `max` of what they are told."""
    return lambda version: listener.set_policy_version.remote(version)


def _part_writer(actor):
    async def write(directory: str) -> None:
        await actor.save_checkpoint_part.remote(directory)
    return write


def reward_endpoint_actors(reward: RewardConfig, model: ModelConfig, default_style: str,
                           placement: dict | None = None) -> dict[str, Any]:
    """Reward endpoints as plain Ray actors (`asyncrl train`); under `serve run` they are the Serve
    applications `reward-<name>` instead (reward.use_serve)."""
    from asyncrl.rewards.endpoint import RewardEndpoint

    return {
        # Stateless: Ray restarts a dead endpoint and retries the calls it was answering.
        name: ray.remote(RewardEndpoint).options(num_cpus=0, max_concurrency=64, max_restarts=-1,
                                                 max_task_retries=3, **(placement or {})).remote(
            name, asdict(endpoint), asdict(model), default_style)
        for name, endpoint in reward.endpoints.items()
    }
