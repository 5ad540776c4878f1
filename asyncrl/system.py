"""Bringing a training run up as Ray actors, and taking it down.

`TrainingSystem(config).start()` creates the mailboxes, the reward endpoints, the policy learner, the
generators, the assembler and the prompt source, joins the learner and the generators in a weight
group, and starts every actor's loop. The same object serves `asyncrl train`, the Serve `train`
application and the tests. Each actor gets an explicit torch thread budget.

The Ray shells below only build the plain role objects of `actors/` from config and forward calls.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import ray
import torch

from asyncrl.assembly import AssemblySettings
from asyncrl.config import Config
from asyncrl.engines.base import SamplingParams
from asyncrl.engines.torch_engine import TorchEngine
from asyncrl.learning import PolicyLossSettings
from asyncrl.mailbox import RayMailbox
from asyncrl.models import ModelSpec, eos_token_ids, load_model, load_tokenizer
from asyncrl.schema import PromptRequest, ScoredTrajectory, Segment, TrainBatch
from asyncrl.tasks import encode_prompt, load_examples
from asyncrl.weight_sync import free_port, init_weight_group

NAMESPACE = "asyncrl"
LEARNER_NAME = "asyncrl-policy-learner"


def model_spec(config: Config) -> ModelSpec:
    return ModelSpec(**{k: getattr(config.model, k) for k in ModelSpec.__dataclass_fields__})


def sampling_params(config: Config) -> SamplingParams:
    e = config.engine
    return SamplingParams(temperature=e.temperature, top_p=e.top_p, top_k=e.top_k,
                          first_token_temperature=e.first_token_temperature, first_token_top_k=e.first_token_top_k)


def build_engine(config: Config, policy: tuple[Any, Any] | None = None) -> tuple[TorchEngine, Any]:
    """The CPU engine and tokenizer for `config.model`; `policy` = an already loaded `(model, tokenizer)`."""
    if policy is None:
        tokenizer = load_tokenizer(model_spec(config))
        model = load_model(model_spec(config), tokenizer)
    else:
        model, tokenizer = policy
    return TorchEngine(model, eos_token_ids(model, tokenizer), tokenizer.pad_token_id or 0), tokenizer


# --- Ray shells --------------------------------------------------------------------------------


class _LoopShell:
    """Forwards the loop controls of a role object held in `self.inner`."""

    inner: Any

    async def run(self) -> None:
        await self.inner.run()

    def stop(self) -> None:
        self.inner.stop()

    def stats(self) -> dict:
        return self.inner.stats()

    def pid(self) -> int:
        return os.getpid()



class GeneratorActor(_LoopShell):
    def __init__(self, config: Config, prompts: RayMailbox, segments: RayMailbox, generator_id: str):
        from actors.generator import Generator

        torch.set_num_threads(config.engine.threads)
        engine, _ = build_engine(config)
        e = config.engine
        max_windows = e.max_windows or math.ceil(e.max_response_tokens / e.window_tokens)
        self.inner = Generator(engine, prompts, segments, sampling_params(config), e.window_tokens,
                               e.max_response_tokens, max_windows, e.max_inflight_sequences, generator_id,
                               long_tail=(e.long_tail_fraction, e.long_tail_tokens))

    def init_weight_group(self, addr: str, port: int, world_size: int, rank: int) -> None:
        init_weight_group(addr, port, world_size, rank, "gloo")

    async def receive_weights(self, plan, version: int) -> float:
        return await self.inner.receive_weights(plan, version)


class LearnerActor(_LoopShell):
    def __init__(self, config: Config, batches: RayMailbox, run_dir: str = "", resume_from: str | None = None,
                 max_steps: int = 0):
        from actors.policy_learner import PolicyLearner

        torch.set_num_threads(config.trainer.learner_threads)
        torch.manual_seed(config.trainer.seed)
        tokenizer = load_tokenizer(model_spec(config))
        model = load_model(model_spec(config), tokenizer)
        a = config.algorithm
        settings = PolicyLossSettings(
            clip_low=a.clip_low, clip_high=a.clip_high, dual_clip=a.dual_clip, loss_agg=a.loss_agg,
            kl_coef=a.kl_coef, entropy_coef=a.entropy_coef, temperature=config.engine.temperature,
            grad_clip=a.grad_clip, micro_batch_tokens=a.micro_batch_tokens, nll_coef=a.nll_coef,
        )
        self.inner = PolicyLearner(model, settings, batches, a.lr, a.weight_decay, a.warmup_steps, a.kl_coef,
                                   tokenizer.pad_token_id or 0, config.trainer.broadcast_bucket_mb << 20,
                                   notify_after_broadcast=config.trainer.synchronous, tokenizer=tokenizer)
        self.inner.run_dir = run_dir
        self.inner.checkpoint_every = config.trainer.checkpoint_every if run_dir else 0
        self.inner.checkpoint_keep = config.trainer.checkpoint_keep
        self.inner.max_steps = max_steps
        if resume_from:
            self.inner.load_checkpoint(resume_from)

    def init_weight_group(self, addr: str, port: int, world_size: int, rank: int) -> None:
        init_weight_group(addr, port, world_size, rank, "gloo")

    def connect(self, generators: list, assembler, prompt_source, value_learner=None) -> None:
        self.inner.generators = generators
        self.inner.on_version = [lambda v: assembler.set_policy_version.remote(v),
                                 lambda v: prompt_source.set_learner_version.remote(v)]

        async def on_trained(ids):
            await prompt_source.record.remote(ids, "trained", "")

        self.inner.on_trained = on_trained
        parts = [prompt_source] + ([value_learner] if value_learner is not None else [])

        def writer(actor):
            async def write(directory):
                await actor.save_checkpoint_part.remote(directory)
            return write

        self.inner.checkpoint_parts = [writer(actor) for actor in parts]

    async def publish(self) -> None:
        await self.inner.publish()

    async def save_checkpoint(self) -> str:
        return await self.inner.save_checkpoint()

    def pop_metrics(self) -> list[dict]:
        return self.inner.pop_metrics()

    def weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        """(version, a snapshot of the parameters): for evaluation and the policy endpoint."""
        return self.inner.version, self.inner.snapshot()

    def version(self) -> int:
        return self.inner.version


class ValueLearnerActor(_LoopShell):
    def __init__(self, config: Config, trajectories: RayMailbox, resume_from: str | None = None):
        from actors.value_learner import ValueLearner
        from asyncrl.learning import ValueLossSettings
        from asyncrl.models import value_model_from_policy, value_model_from_reward_model

        c = config.critic
        torch.set_num_threads(c.threads)
        torch.manual_seed(config.trainer.seed + 1)
        tokenizer = load_tokenizer(model_spec(config))
        if c.init_path:
            value_model = value_model_from_reward_model(c.init_path, config.model.dtype)
        else:
            value_model = value_model_from_policy(load_model(model_spec(config), tokenizer))
        settings = ValueLossSettings(gamma=config.algorithm.gamma, lam=c.lam, clip_low=c.clip_low,
                                     clip_high=c.clip_high, grad_clip=c.grad_clip, micro_batch_tokens=c.micro_batch_tokens)
        self.inner = ValueLearner(value_model, trajectories, settings, c.lr, c.weight_decay, c.batch_trajectories,
                                  c.warmup_steps, tokenizer.pad_token_id or 0)
        if resume_from:
            self.inner.load_checkpoint(resume_from)

    async def save_checkpoint_part(self, directory: str) -> None:
        await self.inner.save_checkpoint_part(directory)

    def connect(self, assembler) -> None:
        self.inner.on_ready = [lambda: assembler.set_value_ready.remote()]

    async def values(self, rows):
        return await self.inner.values(rows)

    def pop_metrics(self) -> list[dict]:
        return self.inner.pop_metrics()


def reward_endpoint_actors(config: Config) -> dict[str, Any]:
    """Reward endpoints as plain Ray actors (`asyncrl train`); under `serve run` they are the Serve
    applications `reward-<name>` instead (reward.use_serve)."""
    from dataclasses import asdict

    from asyncrl.rewards.endpoint import RewardEndpoint

    return {
        # Stateless: Ray restarts a dead endpoint and retries the calls it was answering.
        name: ray.remote(RewardEndpoint).options(num_cpus=0, max_concurrency=64, max_restarts=-1,
                                                 max_task_retries=3).remote(
            name, asdict(endpoint), asdict(config.model), config.task.reward)
        for name, endpoint in config.reward.endpoints.items()
    }


class AssemblerActor(_LoopShell):
    def __init__(self, config: Config, segments: RayMailbox, batches: RayMailbox, endpoints: dict[str, Any],
                 prompt_source, value_learner=None, trajectories: RayMailbox | None = None,
                 batch_prefix: str = "batch"):
        from actors.assembler import Assembler, ValueMode
        from asyncrl.assembly import ValueAdvantageSettings

        torch.set_num_threads(1)
        tokenizer = load_tokenizer(model_spec(config))
        a = config.algorithm
        settings = AssemblySettings(
            dynamic_sampling=a.dynamic_sampling, scale_advantage_by_std=a.scale_advantage_by_std,
            max_staleness_versions=a.max_staleness_versions, overlong_buffer_tokens=a.overlong_buffer_tokens,
            overlong_penalty_factor=a.overlong_penalty_factor, max_response_tokens=config.engine.max_response_tokens,
        )

        from asyncrl.rewards.hybrid import RewardRouter, ServeRewardEndpoints

        r = config.reward

        if r.use_serve:
            serve_endpoints = ServeRewardEndpoints()
            call, compare = serve_endpoints.score, serve_endpoints.compare
        else:
            async def call(name, requests):
                return await endpoints[name].score.remote(requests)

            async def compare(name, pairs):
                return await endpoints[name].compare.remote(pairs)

        self.router = RewardRouter(list(r.routes), call, r.timeout_s, r.retries)
        self.endpoint_names = set(r.endpoints)
        score = self.router.score

        value_mode = None
        if a.estimator == "gae":
            async def values(rows):
                return await value_learner.values.remote(rows)

            value_mode = ValueMode(
                values=values, trajectories=trajectories, rows_per_batch=config.trainer.prompts_per_step * a.group_size,
                whiten=a.whiten_advantages, advantage_clamp=a.advantage_clamp,
                settings=ValueAdvantageSettings(
                    gamma=a.gamma, lam=a.lam, length_adaptive_alpha=a.length_adaptive_alpha,
                    lambda_floor=a.lambda_floor, edge_mask_tokens=a.edge_mask_tokens,
                    window_training=a.window_training, window_tokens=config.engine.window_tokens,
                    bootstrap=a.egae_bootstrap,
                    max_staleness_versions=a.max_staleness_versions, overlong_buffer_tokens=a.overlong_buffer_tokens,
                    overlong_penalty_factor=a.overlong_penalty_factor,
                    max_response_tokens=config.engine.max_response_tokens,
                ),
            )
        pairwise = None
        if a.estimator == "pairwise":
            from actors.assembler import PairwiseMode

            async def judge(pairs):
                return await compare(a.pairwise_endpoint, pairs)

            pairwise = PairwiseMode(judge=judge, anchor=a.pairwise_anchor)
        self.inner = Assembler(segments, batches, score, lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                               settings, config.trainer.prompts_per_step,
                               on_samples=lambda ids, state, reason: prompt_source.record.remote(ids, state, reason),
                               value_mode=value_mode, pairwise_mode=pairwise, batch_prefix=batch_prefix)

    def set_policy_version(self, version: int) -> None:
        self.inner.set_policy_version(version)

    def set_value_ready(self) -> None:
        self.inner.set_value_ready()

    def set_reward_routes(self, routes: list[dict]) -> list[dict]:
        """Admin: change the hybrid mix while training runs (validated like the config)."""
        from dataclasses import asdict

        from asyncrl.config import RouteConfig, route_checks

        parsed = [RouteConfig(**route) for route in routes]
        errors = [message for ok, message in route_checks(parsed, self.endpoint_names) if not ok]
        if errors:
            raise ValueError("; ".join(errors))
        self.router.set_routes(parsed)
        return [asdict(route) for route in parsed]

    def stats(self) -> dict:
        return {**self.inner.stats(), "reward_router": self.router.stats()}


class PromptSourceActor(_LoopShell):
    def __init__(self, config: Config, prompts: RayMailbox):
        from actors.prompt_source import PromptSource

        self.config = config
        self.tokenizer = tokenizer = load_tokenizer(model_spec(config))
        t = config.task
        examples = load_examples(t.name, "train", t.num_train_prompts, t.seed, t.path)
        tokens = [encode_prompt(ex, tokenizer, config.model.use_chat_template) for ex in examples]
        curriculum = [(stage.start_step, list(stage.data_sources)) for stage in t.curriculum]
        self.inner = PromptSource(examples, tokens, config.algorithm.group_size, prompts, config.trainer.seed,
                                  config.trainer.prompts_per_step, config.algorithm.max_staleness_versions,
                                  curriculum)
        self.pre_ppo: dict = {}

    async def prepare(self, endpoints: dict[str, Any]) -> dict:
        """Pre-PPO prompt selection (before the first prompt is issued); a no-op when off."""
        import asyncio

        import numpy as np

        from asyncrl.algo.selection import select_hardest
        from asyncrl.engines.base import SequenceInput
        from asyncrl.schema import RewardRequest
        from asyncrl.tasks import file_examples

        t = self.config.task
        if t.pre_ppo_fraction <= 0 or getattr(self, "restored", False):  # a resumed run keeps its selection
            return {}
        pool = file_examples(t.pre_ppo_pool_path) if t.pre_ppo_pool_path else list(self.inner.examples)
        pool_tokens = [encode_prompt(ex, self.tokenizer, self.config.model.use_chat_template) for ex in pool]
        engine, _ = build_engine(self.config)
        texts: list[str] = []
        batch = max(1, self.config.engine.max_inflight_sequences)
        for start in range(0, len(pool), batch):
            inputs = [SequenceInput(prompt_ids=np.asarray(ids, dtype=np.int32), response_ids=np.zeros(0, dtype=np.int32),
                                    seed=self.config.trainer.seed * 7919 + start + i,
                                    max_response_tokens=self.config.engine.max_response_tokens)
                      for i, ids in enumerate(pool_tokens[start : start + batch])]
            outputs = await asyncio.to_thread(engine.generate_window_sync, inputs, self.config.engine.max_response_tokens,
                                              sampling_params(self.config))
            texts += [self.tokenizer.decode(o.token_ids.tolist(), skip_special_tokens=True) for o in outputs]
        requests = [RewardRequest(prompt_id=ex.prompt_id, sample_idx=0, response_text=text, ground_truth=ex.ground_truth,
                                  data_source=ex.data_source, prompt_text=ex.text) for ex, text in zip(pool, texts)]
        endpoint = self.config.task.pre_ppo_endpoint
        if self.config.reward.use_serve:
            from ray import serve

            rewards = await serve.get_app_handle(f"reward-{endpoint}").score.remote(requests)
        else:
            rewards = await endpoints[endpoint].score.remote(requests)
        scores = np.array([r.score for r in rewards])
        keep = select_hardest(scores, [ex.data_source for ex in pool], t.pre_ppo_fraction)
        chosen, chosen_tokens = [pool[i] for i in keep], [pool_tokens[i] for i in keep]
        if t.pre_ppo_pool_path:  # new prompts join the original set
            chosen, chosen_tokens = list(self.inner.examples) + chosen, list(self.inner.prompt_token_ids) + chosen_tokens
        self.inner.set_examples(chosen, chosen_tokens)
        self.pre_ppo = {"candidates": len(pool), "selected": len(keep), "train_prompts": len(chosen),
                        "candidate_score_mean": float(scores.mean()), "selected_score_mean": float(scores[keep].mean()),
                        "failed_rewards": int(sum(r.failed for r in rewards))}
        return self.pre_ppo

    def set_learner_version(self, version: int) -> None:
        self.inner.set_learner_version(version)

    def record(self, sample_ids: list[str], state: str, reason: str = "") -> None:
        self.inner.record(sample_ids, state, reason)

    def save_checkpoint_part(self, directory: str) -> None:
        import os

        from actors.prompt_source import SNAPSHOT_CODEC

        with open(os.path.join(directory, "prompt_source.msgpack"), "wb") as f:
            f.write(SNAPSHOT_CODEC.encode(self.inner.snapshot()))

    def restore(self, directory: str, held_sample_ids: set[str], learner_version: int) -> int:
        """Continue from a checkpoint; returns how many prompts will be issued again."""
        import os

        from actors.prompt_source import SNAPSHOT_CODEC

        with open(os.path.join(directory, "prompt_source.msgpack"), "rb") as f:
            self.inner.restore(SNAPSHOT_CODEC.decode(f.read()), held_sample_ids, learner_version)
        self.restored = True
        return len(self.inner.reissue)

    def sample_states(self, sample_ids: list[str]) -> dict[str, str | None]:
        return {sid: self.inner.ledger.state(sid) for sid in sample_ids}

    def ledger(self) -> dict:
        return {"counts": self.inner.ledger.state_counts(), "problems": self.inner.ledger.check(),
                "trained_ids": self.inner.ledger.trained_ids()}


# --- the system ----------------------------------------------------------------------------------


class TrainingSystem:
    """`run_dir` enables checkpoints (every `trainer.checkpoint_every` steps); with `resume=true`
    the system continues from the newest valid checkpoint there."""

    def __init__(self, config: Config, name_actors: bool = True, run_dir: str = "", max_steps: int = 0):
        self.config = config
        self.max_steps = max_steps  # the learner stops there (0: trains until stopped, as under Serve)
        self.name_actors = name_actors
        self.run_dir = run_dir
        self.resumed: dict[str, Any] = {}
        self.actors: dict[str, Any] = {}
        self.generators: list[Any] = []
        self.run_refs: dict[str, Any] = {}
        self.mailboxes: dict[str, RayMailbox] = {}
        self.started_at = 0.0
        self._last_value: dict = {}
        self.pre_ppo: dict = {}

    def start(self) -> "TrainingSystem":
        from asyncrl import checkpoint

        cfg, tr = self.config, self.config.trainer
        resume_from, saved_batches, held, incarnation = None, [], set(), 0
        if cfg.resume:
            if not self.run_dir:
                raise ValueError("resume=true needs the run directory of the run to resume")
            resume_from, rejected = checkpoint.latest_valid(self.run_dir)
            if resume_from is None:
                raise FileNotFoundError(f"resume=true: no valid checkpoint in {checkpoint.checkpoints_dir(self.run_dir)}"
                                        + (f" (rejected: {'; '.join(rejected)})" if rejected else ""))
            saved_batches, held = checkpoint.resumable_batches(
                checkpoint.load_batches(os.path.join(resume_from, "batches.msgpack")))
            learner_meta = checkpoint.load_json(os.path.join(resume_from, "learner.json"))
            incarnation = int(learner_meta.get("incarnation", 0)) + 1
            self.resumed = {"checkpoint": resume_from, "rejected": rejected, "step": learner_meta["step"],
                            "weight_version": learner_meta["weight_version"], "saved_batches": len(saved_batches)}
        G = cfg.algorithm.group_size
        prompts_ahead = max(2, 2 * tr.num_generators * math.ceil(cfg.engine.max_inflight_sequences / G))
        # The capacity counts leased prompts too, and a prompt stays leased until its last sample
        # ends: with long-tailed lengths a few stragglers would hold every slot and starve the
        # generators. Room for every prompt the staleness budget allows to be open, plus a queue.
        prompts_open = min((cfg.algorithm.max_staleness_versions + 1) * tr.prompts_per_step, 4096)
        self.mailboxes = {
            "prompts": RayMailbox.create(PromptRequest, capacity=prompts_ahead + prompts_open, lease_s=tr.lease_s),
            "segments": RayMailbox.create(Segment, capacity=tr.mailbox_capacity, lease_s=tr.lease_s),
            "batches": RayMailbox.create(TrainBatch, capacity=2, lease_s=tr.lease_s),
        }
        value_based = cfg.algorithm.estimator == "gae"
        if value_based:
            self.mailboxes["trajectories"] = RayMailbox.create(
                ScoredTrajectory, capacity=max(4 * cfg.critic.batch_trajectories, 64), lease_s=tr.lease_s)
        opts = {"num_cpus": 0, "max_concurrency": 64}
        learner_opts = dict(opts, name=LEARNER_NAME, namespace=NAMESPACE) if self.name_actors else opts
        endpoints = {} if cfg.reward.use_serve else reward_endpoint_actors(cfg)
        learner = ray.remote(LearnerActor).options(**learner_opts).remote(cfg, self.mailboxes["batches"], self.run_dir,
                                                                          resume_from, self.max_steps)
        self.generators = [
            ray.remote(GeneratorActor).options(**opts).remote(cfg, self.mailboxes["prompts"], self.mailboxes["segments"], f"gen-{i}")
            for i in range(tr.num_generators)
        ]
        prompt_source = ray.remote(PromptSourceActor).options(**opts).remote(cfg, self.mailboxes["prompts"])
        value_learner = (ray.remote(ValueLearnerActor).options(**opts).remote(cfg, self.mailboxes["trajectories"],
                                                                             resume_from)
                         if value_based else None)
        assembler = ray.remote(AssemblerActor).options(**opts).remote(
            cfg, self.mailboxes["segments"], self.mailboxes["batches"], endpoints, prompt_source,
            value_learner, self.mailboxes.get("trajectories"), f"batch-r{incarnation}")
        self.actors = {"learner": learner, "assembler": assembler, "prompt_source": prompt_source,
                       **{f"reward-{name}": actor for name, actor in endpoints.items()}}
        if value_learner is not None:
            self.actors["value_learner"] = value_learner
            ray.get(value_learner.connect.remote(assembler))

        # Weight group: receivers first, then the sender, then wait (any other order deadlocks).
        port, world = free_port(), tr.num_generators + 1
        joins = [g.init_weight_group.remote("127.0.0.1", port, world, i + 1) for i, g in enumerate(self.generators)]
        joins.append(learner.init_weight_group.remote("127.0.0.1", port, world, 0))
        ray.get(joins)
        ray.get(learner.connect.remote(self.generators, assembler, prompt_source, value_learner))

        if resume_from:
            self.resumed["reissued_prompts"] = ray.get(prompt_source.restore.remote(
                resume_from, held, self.resumed["weight_version"]))
            if saved_batches:
                ray.get(self.mailboxes["batches"].actor.put.remote(
                    [(b.batch_id, self.mailboxes["batches"].codec.encode(b)) for b in saved_batches]))
        self.pre_ppo = ray.get(prompt_source.prepare.remote(endpoints))
        loops = [("assembler", assembler)] + ([("value_learner", value_learner)] if value_learner is not None else [])
        for name, actor in loops:
            self.run_refs[name] = actor.run.remote()
        for i, g in enumerate(self.generators):
            self.run_refs[f"generator-{i}"] = g.run.remote()
        if resume_from:
            # The generators hold the checkpoint's weights before the first prompt reaches them
            # (their loops apply a broadcast between windows, so they run already).
            ray.get(learner.publish.remote())
        self.run_refs["learner"] = learner.run.remote()
        self.run_refs["prompt_source"] = prompt_source.run.remote()
        self.started_at = time.time()
        return self

    def checkpoint(self) -> str:
        """Write a checkpoint now (between two learner steps); returns its path."""
        return ray.get(self.actors["learner"].save_checkpoint.remote())

    def ledger(self) -> dict:
        return ray.get(self.actors["prompt_source"].ledger.remote())

    def check_alive(self) -> None:
        """Raise the error of any actor loop that ended (a crash must not look like a slow run)."""
        done, _ = ray.wait(list(self.run_refs.values()), timeout=0, num_returns=len(self.run_refs))
        for ref in done:
            ray.get(ref)  # raises the actor's exception
            name = next(k for k, v in self.run_refs.items() if v == ref)
            raise RuntimeError(f"actor loop {name} stopped unexpectedly")

    def status(self) -> dict:
        learner = ray.get(self.actors["learner"].stats.remote())
        generators = ray.get([g.stats.remote() for g in self.generators])
        assembler = ray.get(self.actors["assembler"].stats.remote())
        mailboxes = {name: ray.get(box.actor.stats.remote()) for name, box in self.mailboxes.items()}
        status = summarize(learner, generators, assembler, mailboxes, time.time() - self.started_at)
        if "value_learner" in self.actors:
            status["value_learner"] = ray.get(self.actors["value_learner"].stats.remote())
        status["reward_endpoints"] = {name.removeprefix("reward-"): ray.get(actor.stats.remote())
                                      for name, actor in self.actors.items() if name.startswith("reward-")}
        status["prompt_source"] = ray.get(self.actors["prompt_source"].stats.remote())
        status["ledger"] = {**status["prompt_source"].pop("ledger"),
                            "problems": status["prompt_source"].pop("ledger_problems")}
        status["resumed"] = self.resumed
        status["pre_ppo"] = self.pre_ppo
        return status

    def pop_metrics(self) -> list[dict]:
        """Policy-step records; with a value learner, each carries its latest value-step metrics."""
        records = ray.get(self.actors["learner"].pop_metrics.remote())
        if "value_learner" in self.actors:
            value_records = ray.get(self.actors["value_learner"].pop_metrics.remote())
            if value_records:
                self._last_value = value_records[-1]
            for record in records:
                record.update(self._last_value)
        return records

    def weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        return ray.get(self.actors["learner"].weights.remote())

    def stop(self) -> None:
        stops = [a.stop.remote() for a in [*self.actors.values(), *self.generators] if hasattr(a, "stop")]
        ray.wait(stops, num_returns=len(stops), timeout=5)  # best effort: the actors are killed next
        for actor in [*self.actors.values(), *self.generators, *(b.actor for b in self.mailboxes.values())]:
            ray.kill(actor)
        # Return once the loops are gone (a learner must not write a checkpoint after this).
        if self.run_refs:
            ray.wait(list(self.run_refs.values()), num_returns=len(self.run_refs), timeout=15)


def summarize(learner: dict, generators: list[dict], assembler: dict, mailboxes: dict, wall_s: float) -> dict:
    generated = sum(g["samples_finished"] for g in generators)
    return {
        "step": learner["step"],
        "weight_version": learner["weight_version"],
        "samples_generated": generated,
        "samples_trained": learner["samples_trained"],
        "samples_dropped": assembler.get("samples_dropped", 0),
        "dropped_by_reason": {k.removeprefix("dropped_").removesuffix("_samples"): v for k, v in assembler.items()
                              if k.startswith("dropped_") and k.endswith("_samples")},
        "reward_mean": assembler.get("reward_mean_all", 0.0),
        "generator_busy_fraction": sum(g["busy_fraction"] for g in generators) / max(len(generators), 1),
        "generator_paused_for_weights_fraction": sum(g["paused_for_weights_fraction"] for g in generators) / max(len(generators), 1),
        "learner_busy_fraction": learner["busy_fraction"],
        "last_broadcast": learner["last_broadcast"],
        "last_checkpoint": learner.get("last_checkpoint", {}),
        "queue_depths": {name: {"queued": s.queued, "leased": s.leased, "capacity": s.capacity} for name, s in mailboxes.items()},
        "generators": generators,
        "assembler": assembler,
        "wall_time_s": wall_s,
    }
