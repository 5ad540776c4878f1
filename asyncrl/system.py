"""A training run as Ray actors: `TrainingSystem(config).start()` brings it up, `stop()` takes it down.

`start()` is the map of a run: it creates every mailbox and every role process and wires every
edge between them, in start order. The roles' Ray shells and their builders are in
`asyncrl/roles/shells.py`; each shell gets only the config sections its role reads. The same object
serves `asyncrl train`, the Serve `train` application and the tests.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from asyncrl.config import Config
from asyncrl.mailbox import RayMailbox, ShardedMailbox, sum_stats
from asyncrl.roles.estimators import ESTIMATORS
from asyncrl.roles.shells import (AssemblerActor, GeneratorActor, PolicyLearnerActor, PolicyRankActor, PromptSourceActor,
                                  RecorderActor, ValueLearnerActor, reward_endpoint_actors)
from asyncrl.schema import PromptRequest, ScoredTrajectory, Segment, TrainBatch
from asyncrl.staleness import open_prompts_bound
from asyncrl.store import STORE_DIRNAME
from asyncrl.sharding import rendezvous_store
from asyncrl.weight_sync import choose_paths, free_port, node_address

NAMESPACE = "asyncrl"
LEARNER_NAME = "asyncrl-policy-learner"


@dataclass
class ResumePoint:
    checkpoint: str
    weight_version: int
    incarnation: int  # how many times the run was resumed (batch ids stay unique across them)
    saved_batches: list = field(default_factory=list)  # assembled, not yet trained
    held_sample_ids: set = field(default_factory=set)  # samples inside those batches


def init_ray(config: Config) -> None:
    """Ray for a run: the cluster at `trainer.ray_address` (or RAY_ADDRESS), else a local instance."""
    if ray.is_initialized():
        return
    # Few malloc arenas: torch's threads otherwise keep freed activation memory per arena.
    runtime_env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"}}
    address = config.trainer.ray_address or os.environ.get("RAY_ADDRESS", "")
    if address:
        ray.init(address=address, namespace="asyncrl", log_to_driver=False, runtime_env=runtime_env)
        return
    # The object store is the shared memory the weights reach same-node generators through
    # (trainer.object_store_mb: room for a few versions of the policy).
    ray.init(num_cpus=16, include_dashboard=False, object_store_memory=config.trainer.object_store_mb * 2**20,
             log_to_driver=False, namespace="asyncrl", runtime_env=runtime_env)


def _spawn(role_shell: type, *args, actor_name: str | None = None, placement: dict | None = None, **kwargs):
    """A role's Ray actor. No CPU reserved (each role budgets its torch threads itself), and async
    methods run concurrently (a learner answers `weights` while it trains). `placement`: what the
    role asks Ray for (`num_gpus`, custom `resources`, a `scheduling_strategy`)."""
    options: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 64, **(placement or {})}
    if actor_name:
        options.update(name=actor_name, namespace=NAMESPACE)
    return ray.remote(role_shell).options(**options).remote(*args, **kwargs)


def role_placement(trainer, num_generators: int, num_learners: int = 1) -> tuple[list[dict], list[dict], Any]:
    """What each generator and the learners ask Ray for: GPUs, custom resources (pinning roles to
    nodes that offer them), and for `trainer.placement` colocated/spread a placement group whose
    bundles hold them (STRICT_PACK: one node; SPREAD: generators over the nodes). Returns the
    generators' options, the learners' options (policy, then value) and the placement group (or None)."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    def ask(gpus: float, resources: dict) -> dict:
        return {**({"num_gpus": gpus} if gpus else {}), **({"resources": dict(resources)} if resources else {})}

    generator, learner = ask(trainer.generator_gpus, trainer.generator_resources), ask(trainer.learner_gpus,
                                                                                      trainer.learner_resources)
    if trainer.placement == "any":
        return [dict(generator) for _ in range(num_generators)], [dict(learner) for _ in range(num_learners)], None

    def bundle(options: dict) -> dict:
        # A bundle reserves something: a sliver of CPU when the role asks for nothing else.
        return {"CPU": 0.01, **({"GPU": options["num_gpus"]} if "num_gpus" in options else {}),
                **options.get("resources", {})}

    bundles = [bundle(generator) for _ in range(num_generators)]
    if trainer.placement == "colocated":
        bundles += [bundle(learner) for _ in range(num_learners)]
    group = placement_group(bundles, strategy="STRICT_PACK" if trainer.placement == "colocated" else "SPREAD")
    ray.get(group.ready(), timeout=300)

    def in_bundle(options: dict, index: int) -> dict:
        return {**options, "scheduling_strategy": PlacementGroupSchedulingStrategy(group, index)}

    generators = [in_bundle(generator, i) for i in range(num_generators)]
    learners = ([in_bundle(learner, num_generators + i) for i in range(num_learners)] if trainer.placement == "colocated"
                else [dict(learner) for _ in range(num_learners)])
    return generators, learners, group


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
        self._rank_store = None  # where a sharded learner's ranks meet (held for the run's life)
        self._last_value: dict = {}
        self.pre_ppo: dict = {}
        self.weight_paths: list[str] = []  # each generator's weight path (shm / cuda_ipc / group)
        self.placement_group = None  # trainer.placement colocated/spread: removed at stop
        self._created: list[Any] = []  # every role actor made by start()

    def start(self) -> "TrainingSystem":
        """Bring the run up. Reading top to bottom: every mailbox, every role process and every edge
        between them, in the order they start."""
        try:
            return self._start()
        except BaseException:
            self.stop()  # no half-started run left behind (a node dying while it started, say)
            raise

    def _start(self) -> "TrainingSystem":
        cfg, tr = self.config, self.config.trainer
        resume = self._resume_point()  # None for a fresh run
        # The control plane (mailboxes, prompt source, assembler, reward endpoints, recorder) sits on
        # this node, the run's own: on a cluster it does not share the fate of a generator's node.
        here = {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)}
        # mode=generate: generators, rewards and the store only; no learner, so no staleness budget.
        learning = cfg.mode == "train"
        value_based = learning and ESTIMATORS[cfg.algorithm.estimator].needs_value_learner
        if tr.record and not self.run_dir:
            raise ValueError("trainer.record=true needs a run directory (trainer.run_dir)")

        # 1. Mailboxes (each owned by its consumer). Prompts: room for every prompt the staleness
        #    budget allows to be open (stragglers hold leases), plus a queue ahead of the generators.
        prompts_ahead = max(2, 2 * tr.num_generators * math.ceil(cfg.engine.max_inflight_sequences / cfg.algorithm.group_size))
        prompts_open = min(open_prompts_bound(cfg.algorithm.max_staleness_versions, tr.prompts_per_step), 4096)
        prompts = RayMailbox.create(PromptRequest, capacity=prompts_ahead + prompts_open, lease_s=tr.lease_s,
                                    placement=here)
        # Generators -> assembler; several shards when many generators would saturate one mailbox actor.
        segments = (ShardedMailbox.create(Segment, tr.segment_shards, tr.mailbox_capacity, tr.lease_s, key_attr="sample_id",
                                          placement=here)
                    if tr.segment_shards > 1 else RayMailbox.create(Segment, capacity=tr.mailbox_capacity, lease_s=tr.lease_s,
                                                                    placement=here))
        batches = RayMailbox.create(TrainBatch, capacity=2, lease_s=tr.lease_s, placement=here)  # assembler -> policy learner
        trajectories = (RayMailbox.create(ScoredTrajectory, capacity=max(4 * cfg.critic.batch_trajectories, 64),
                                          lease_s=tr.lease_s, placement=here) if value_based else None)  # assembler -> value learner
        self.mailboxes = {"prompts": prompts, "segments": segments, "batches": batches}
        if trajectories is not None:
            self.mailboxes["trajectories"] = trajectories

        # 2. Reward endpoints: actors here, or the Serve applications `reward-<name>` (reward.use_serve).
        endpoints = {} if cfg.reward.use_serve else reward_endpoint_actors(cfg.reward, cfg.model, cfg.task.reward, here)
        # The trajectory store (trainer.record): written by its own process, fed without waiting.
        recorder = self._spawn(RecorderActor, os.path.join(self.run_dir, STORE_DIRNAME), tr, placement=here) if tr.record else None

        # 3. Roles. Prompt source: dataset cursor, admission budget, ledger of every sample
        #    (mode=generate: trainer.total_steps batches of prompts, then none).
        prompt_source = self._spawn(PromptSourceActor, cfg.model, cfg.task, cfg.algorithm, tr, prompts,
                               0 if learning else tr.total_steps * tr.prompts_per_step, placement=here)
        # Value learner (value-based estimators): trains on `trajectories`, answers value requests.
        # Placement: what each role asks Ray for (GPUs, node resources, a placement group).
        # The learners' options: the policy learner's ranks, then the value learner.
        ranks = tr.learner_ranks if learning else 0
        generator_options, learner_options, self.placement_group = role_placement(
            tr, tr.num_generators, ranks + (1 if value_based else 0))
        value_learner = (self._spawn(ValueLearnerActor, cfg.model, cfg.critic, cfg.algorithm, cfg.engine, tr.seed,
                                trajectories, resume and resume.checkpoint, tr.learner_device,
                                placement=learner_options[ranks]) if value_based else None)
        # Assembler: `segments` -> rewards (router) -> estimator -> `batches` (and `trajectories`);
        # reports every sample's fate to the ledger (prompt source) and its record to the store;
        # asks the value learner for values.
        assembler = self._spawn(AssemblerActor, cfg.model, cfg.algorithm, cfg.engine, cfg.reward, tr.prompts_per_step,
                           segments, batches, endpoints, prompt_source, value_learner, trajectories,
                           f"batch-r{resume.incarnation if resume else 0}", recorder, cfg.mode, placement=here)
        # Generators: `prompts` -> engine windows -> `segments`.
        self.generators = [self._spawn(GeneratorActor, cfg.model, cfg.engine, prompts, segments, f"gen-{i}",
                                  placement=generator_options[i]) for i in range(tr.num_generators)]
        # A sharded policy learner's ranks 1.. (trainer.learner_ranks, FSDP2): they and rank 0 meet
        # at a store this process holds, and rank 0 runs each step on all of them.
        rank_actors, rendezvous = [], None
        if ranks > 1:
            rendezvous = (node_address(), free_port(node_address()))
            self._rank_store = rendezvous_store(*rendezvous)
            rank_actors = [self._spawn(PolicyRankActor, cfg.model, cfg.algorithm, tr, cfg.engine, rendezvous, rank,
                                       placement=learner_options[rank]) for rank in range(1, ranks)]
        # Policy learner: `batches` -> optimizer step -> weights broadcast to the generators; each new
        # version told to the assembler at once (staleness) and to the prompt source once every
        # generator holds it (admission; synchronous mode: the assembler too); trained samples
        # to the ledger; checkpoints written with the prompt source's and value learner's parts;
        # trained batches to the store.
        learner = self._spawn(
            PolicyLearnerActor, cfg.model, cfg.algorithm, tr, cfg.engine, batches,
            generators=self.generators, version_listeners=[] if tr.synchronous else [assembler],
            delivered_listeners=[assembler, prompt_source] if tr.synchronous else [prompt_source],
            ledger=prompt_source,
            checkpoint_parts=[prompt_source] + ([value_learner] if value_learner is not None else []),
            run_dir=self.run_dir, max_steps=self.max_steps, recorder=recorder, ranks=rank_actors,
            rendezvous=rendezvous, placement=learner_options[0],
            actor_name=LEARNER_NAME if self.name_actors else None) if learning else None  # found by name
        self.actors = {**({"learner": learner} if learner is not None else {}), "assembler": assembler,
                       "prompt_source": prompt_source,
                       **({"value_learner": value_learner} if value_learner is not None else {}),
                       **({"recorder": recorder} if recorder is not None else {}),
                       **{f"learner-rank-{i}": actor for i, actor in enumerate(rank_actors, 1)},
                       **{f"reward-{name}": endpoint for name, endpoint in endpoints.items()}}

        # 4. Weights from the learner to each generator, by a path chosen from where they landed:
        #    shared memory on the learner's node, a distributed group of its own for other nodes
        #    (rendezvous at the learner's node IP; receivers join first, then the sender).
        if learner is not None:
            learner_node = ray.get(learner.node_id.remote())
            paths = choose_paths(learner_node, ray.get([g.node_id.remote() for g in self.generators]), tr.learner_device,
                                 tr.weight_transport)
            remote = [g for g, path in zip(self.generators, paths) if path == "group"]
            if remote:
                host, port = ray.get(learner.weight_group_address.remote())
                backend = "nccl" if tr.learner_device == "cuda" else "gloo"
                joins = [g.init_weight_group.remote(host, port, len(remote) + 1, rank, backend)
                         for rank, g in enumerate(remote, 1)]
                ray.get(joins + [learner.init_weight_group.remote(host, port, len(remote) + 1, 0, backend)])
            ray.get(learner.set_weight_paths.remote(paths))
            self.weight_paths = paths

        # 5. Resume: the learner's weights and optimizer (on every rank); the ledger says which
        #    prompts to issue again; unsent batches go back in the mailbox.
        if resume is not None and learner is not None:
            ray.get(learner.resume.remote(resume.checkpoint))
        if resume is not None:
            self.resumed["reissued_prompts"] = ray.get(prompt_source.restore.remote(
                resume.checkpoint, resume.held_sample_ids, resume.weight_version))
            if resume.saved_batches:
                ray.get(batches.actor.put.remote([(b.batch_id, batches.codec.encode(b)) for b in resume.saved_batches]))
        # 6. Pre-PPO selection (before the first prompt; a no-op when off or resumed).
        self.pre_ppo = ray.get(prompt_source.prepare.remote(cfg.model, cfg.engine, cfg.task, cfg.reward, tr.seed,
                                                            endpoints))

        # 7. Loops, consumers first. A resumed run's generators get the checkpoint's weights before
        #    any prompt (their loops apply a broadcast between windows, so they run already).
        if recorder is not None:
            self.run_refs["recorder"] = recorder.run.remote()
        self.run_refs["assembler"] = assembler.run.remote()
        if value_learner is not None:
            self.run_refs["value_learner"] = value_learner.run.remote()
        for i, g in enumerate(self.generators):
            self.run_refs[f"generator-{i}"] = g.run.remote()
        if learner is not None:
            if resume is not None:
                ray.get(learner.publish.remote())
            self.run_refs["learner"] = learner.run.remote()
        self.run_refs["prompt_source"] = prompt_source.run.remote()
        self.started_at = time.time()
        return self

    def _spawn(self, *args, **kwargs):
        """`_spawn`, remembering the actor: a start that fails midway kills what it made."""
        actor = _spawn(*args, **kwargs)
        self._created.append(actor)
        return actor

    def _resume_point(self) -> "ResumePoint | None":
        """With `resume=true`: the newest valid checkpoint of the run directory and what it holds."""
        from asyncrl import checkpoint

        if not self.config.resume:
            return None
        if not self.run_dir:
            raise ValueError("resume=true needs the run directory of the run to resume")
        path, rejected = checkpoint.latest_valid(self.run_dir)
        if path is None:
            raise FileNotFoundError(f"resume=true: no valid checkpoint in {checkpoint.checkpoints_dir(self.run_dir)}"
                                    + (f" (rejected: {'; '.join(rejected)})" if rejected else ""))
        saved_batches, held = checkpoint.resumable_batches(checkpoint.load_batches(os.path.join(path, "batches.msgpack")))
        learner_meta = checkpoint.load_json(os.path.join(path, "learner.json"))
        point = ResumePoint(checkpoint=path, saved_batches=saved_batches, held_sample_ids=held,
                            weight_version=learner_meta["weight_version"],
                            incarnation=int(learner_meta.get("incarnation", 0)) + 1)
        self.resumed = {"checkpoint": path, "rejected": rejected, "step": learner_meta["step"],
                        "weight_version": point.weight_version, "saved_batches": len(saved_batches)}
        return point

    def stop_learning(self, timeout_s: float = 120.0) -> None:
        """End the policy learner's loop (a step in flight finishes first), so that a checkpoint and
        the weights read afterwards are those of the last step the run reports."""
        ray.get(self.actors["learner"].stop.remote())
        ray.wait([self.run_refs["learner"]], timeout=timeout_s)

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
        mailboxes = {name: sum_stats(ray.get([a.stats.remote() for a in mailbox_actors(box)]))
                     for name, box in self.mailboxes.items()}
        status = summarize(learner, generators, assembler, mailboxes, time.time() - self.started_at)
        if "value_learner" in self.actors:
            status["value_learner"] = ray.get(self.actors["value_learner"].stats.remote())
        status["reward_endpoints"] = reward_endpoint_table(
            self.config.reward, assembler.get("reward_router", {}).get("endpoints", {}),
            {name.removeprefix("reward-"): ray.get(actor.stats.remote())
             for name, actor in self.actors.items() if name.startswith("reward-")})
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

    def stop(self, learner_grace_s: float = 60.0) -> None:
        """Stop every loop and kill every actor. Once this returns, no checkpoint is committed any
        more: the caller (the supervisor, a resume) may pick the newest one."""
        stops = [a.stop.remote() for a in [*self.actors.values(), *self.generators] if hasattr(a, "stop")]
        ray.wait(stops, num_returns=len(stops), timeout=5)  # best effort: the actors are killed next
        # The learner is the one writer of checkpoints: let its loop end first, so a checkpoint it is
        # writing is committed or never started, never committed after a kill that landed late.
        if "learner" in self.run_refs:
            ray.wait([self.run_refs["learner"]], timeout=learner_grace_s)
        # The store: the assembler sends its last records as its loop ends, then the recorder
        # closes its files, so every record sent is in a whole file.
        if "recorder" in self.actors:
            ray.wait([self.run_refs["assembler"]], timeout=15)
            ray.wait([self.actors["recorder"].close.remote()], timeout=60)
        for actor in [*self.actors.values(), *self.generators, *self._created,
                      *(a for b in self.mailboxes.values() for a in mailbox_actors(b))]:
            ray.kill(actor)
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
            self.placement_group = None
        if self.run_refs:
            ray.wait(list(self.run_refs.values()), num_returns=len(self.run_refs), timeout=15)


def mailbox_actors(box) -> list:
    """The actors behind a mailbox client (one, or one per shard)."""
    return box.actors if isinstance(box, ShardedMailbox) else [box.actor]


def reward_endpoint_table(reward, seen: dict[str, dict], own: dict[str, dict]) -> dict[str, dict]:
    """One row per configured reward endpoint: its kind, where it runs, and, as the run's reward
    router saw them, the version it last answered with, its rewards (by version) and failures. The
    same under Serve (where the endpoints are applications, not actors of the run) as with actors,
    whose own counters (e.g. a judge's pairs) come first."""
    table = {}
    for name, endpoint in reward.endpoints.items():
        mine = own.get(name, {})
        table[name] = {**mine, "kind": endpoint.kind,
                       "where": f"serve app reward-{name}" if reward.use_serve else "actor",
                       "version": str(mine.get("version", "")), "rewards": 0, "failed": 0, "versions": {},
                       "last_error": "", "last_answer_at": 0.0, **seen.get(name, {})}
    return table


def summarize(learner: dict, generators: list[dict], assembler: dict, mailboxes: dict, wall_s: float) -> dict:
    generated = sum(g["samples_finished"] for g in generators)
    return {
        "step": learner["step"],
        "weight_version": learner["weight_version"],
        "samples_generated": generated,
        "samples_trained": learner["samples_trained"],
        "stale_tokens_masked": learner.get("stale_tokens_masked", 0),
        "steps_skipped": learner.get("steps_skipped", 0),
        "samples_dropped": assembler.get("samples_dropped", 0),
        "dropped_by_reason": {k.removeprefix("dropped_").removesuffix("_samples"): v for k, v in assembler.items()
                              if k.startswith("dropped_") and k.endswith("_samples")},
        "reward_mean": assembler.get("reward_mean_all", 0.0),
        "generator_busy_fraction": sum(g["busy_fraction"] for g in generators) / max(len(generators), 1),
        "generator_paused_for_weights_fraction": sum(g["paused_for_weights_fraction"] for g in generators) / max(len(generators), 1),
        "learner_busy_fraction": learner["busy_fraction"],
        "learner_node": learner.get("node_ip", ""),
        "last_broadcast": learner["last_broadcast"],
        "last_checkpoint": learner.get("last_checkpoint", {}),
        "queue_depths": {name: {"queued": s.queued, "leased": s.leased, "capacity": s.capacity} for name, s in mailboxes.items()},
        "generators": generators,
        "assembler": assembler,
        "wall_time_s": wall_s,
    }
