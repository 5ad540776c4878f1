"""One incarnation of a run as Ray actors: `System(config).start()` brings it up, `stop()` takes it
down. `_start` is the map of a run, read top to bottom: the mailboxes, the roles (each given its
config sections and its edges by keyword), the weight paths between the learner and the
generators, then the loops, consumers first. The roles are `actors/`; their placement is
`asyncrl.run.placement`; the status views are `asyncrl.run.status`. `asyncrl.run.Run` keeps a
run alive across incarnations, and is the door to it: `System` is private to `asyncrl.run`.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from actors.assembler import AssemblerActor
from actors.environment import environment_actor
from actors.policy_learner import CheckpointPolicy, PolicyLearnerActor
from actors.policy_rank import PolicyRankActor
from actors.prompt_source import PromptSourceActor
from actors.recorder import RecorderActor
from actors.reward_endpoint import reward_endpoint_actors
from actors.value_learner import ValueLearnerActor
from asyncrl.config import Config
from asyncrl.data.files import check_prompts
from asyncrl.messages.mailbox import MailboxStats
from asyncrl.messages.ray_mailbox import RayMailbox, ShardedMailbox, sum_stats
from asyncrl.messages.structs import PromptRequest, ScoredTrajectory, Segment, TrainBatch
from asyncrl.run.deadlines import PREPARE_TIMEOUT_S, WORK_TIMEOUT_S, RoleDied, answer
from asyncrl.run.placement import LEARNER_NAME, ask, role_placement, spawn
from asyncrl.run.pool import GeneratorPool
from asyncrl.run.resume_point import ResumePoint, resume_point
from asyncrl.run.status import RunStatus, mailbox_actors, system_status
from asyncrl.staleness import open_prompts_bound
from asyncrl.storage.checkpoint_transfer import WriterClient
from asyncrl.storage.trajectory_store import STORE_DIRNAME
from asyncrl.weights.sharding import rendezvous_store
from asyncrl.weights.sync import free_port, node_address


class System:
    """`run_dir` enables checkpoints; with `resume=true` the system continues from the newest valid
    checkpoint there. `max_steps`: the learner stops there (0: trains until stopped, as under Serve)."""

    def __init__(self, config: Config, run_dir: str = "", max_steps: int = 0, name_actors: bool = True,
                 num_generators: int | None = None, on_pool_event=lambda event: None):
        """`num_generators`: the pool's size (default `cluster.num_generators`; a restarted run keeps
        the size it was scaled to); `on_pool_event`: told of every join, leave and heal."""
        self.config = config
        self.run_dir = run_dir
        self.max_steps = max_steps
        self.name_actors = name_actors
        self.resumed: dict[str, Any] = {}
        self.actors: dict[str, Any] = {}
        self.pool = GeneratorPool(self, config.cluster.num_generators if num_generators is None else num_generators,
                                  on_pool_event)
        self.mailboxes: dict[str, Any] = {}
        self.run_refs: dict[str, Any] = {}  # role -> its loop's reference (the generators' are the pool's)
        self.pre_ppo: dict = {}
        self.started_at = 0.0
        self.placement_group = None  # cluster.placement colocated/spread: removed at stop
        self._rank_store = None  # where a sharded learner's ranks meet (held for the run's life)
        self._created: list[Any] = []  # every role actor made by start()
        self._endpoints: dict[str, Any] = {}  # reward endpoint actors (none under Serve)
        self.environment: Any = None  # the environment endpoint actor (a task with an environment)
        self.checkpoint_writer: WriterClient | None = None  # the checkpoints' writer, on the run directory's node
        self._last_value: dict = {}
        self.draining = False  # `drain` stopped the prompt source

    @property
    def generators(self) -> dict[str, Any]:
        """Generator id -> actor: the pool's (`asyncrl.run.pool`), read here, written there alone."""
        return self.pool.generators

    def start(self) -> "System":
        try:
            return self._start()
        except BaseException:
            self.stop()  # no half-started run left behind (a node dying while it started, say)
            raise

    def _start(self) -> "System":
        cfg = self.config
        check_prompts(cfg)  # the task's data: refused here, naming the rows, before any role starts
        resume, self.resumed = resume_point(self.config, self.run_dir)  # None for a fresh run
        learning = cfg.mode == "train"  # mode=generate: generators, rewards and the store only
        value_based = learning and cfg.algorithm.value_based
        if cfg.trainer.store_trajectories and not self.run_dir:
            raise ValueError("trainer.store_trajectories=true needs a run directory (trainer.run_dir)")
        # The control plane (mailboxes, prompt source, assembler, reward endpoints, recorder) sits on
        # this node, the run's own: on a cluster it does not share the fate of a generator's node.
        # Hard affinity: a soft one let a busy head's raylet spill a mailbox to a worker node (seen on
        # the namespace cluster), and losing that node then cost a restart instead of a heal.
        here = {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                                      soft=False)}
        self._mailboxes(value_based, here)
        self._roles(resume, learning, value_based, here)
        self._resume(resume)
        if "learner" in self.actors:  # the generators join: each gets the learner's version first
            self.pool.join(list(self.generators))
            answer(self.actors["learner"].announce.remote(), "the learner", "announce")
        # Pre-PPO selection (before the first prompt; a no-op when off or resumed).
        self.pre_ppo = answer(self.actors["prompt_source"].prepare.remote(
            cfg.model, cfg.engine, cfg.sampling, cfg.task, cfg.reward, cfg.trainer.seed, self._endpoints),
            "the prompt source", "prepare (Pre-PPO selection)", PREPARE_TIMEOUT_S)
        self._loops(resume)
        self.started_at = time.time()
        return self

    def _mailboxes(self, value_based: bool, here: dict) -> None:
        """Each owned by its consumer. Prompts: room for every prompt the staleness budget allows to
        be open (stragglers hold leases), plus a queue ahead of the generators."""
        cfg, cl = self.config, self.config.cluster
        most = max(self.pool.target, cl.max_generators)  # room for the largest pool the run may scale to
        prompts_ahead = max(2, 2 * most * math.ceil(cfg.engine.max_inflight_sequences / cfg.algorithm.group_size))
        prompts_open = min(open_prompts_bound(cfg.algorithm.max_staleness_versions, cfg.trainer.prompts_per_step), 4096)
        held = {"lease_s": cl.lease_s, "placement": here, "capacity_bytes": cl.mailbox_bytes}
        self.mailboxes = {
            "prompts": RayMailbox.create(PromptRequest, capacity=prompts_ahead + prompts_open, **held),
            # Generators -> assembler; several shards when many generators would saturate one actor.
            "segments": (ShardedMailbox.create(Segment, cl.segment_shards, cl.mailbox_capacity, key_attr="sample_id",
                                               **held) if cl.segment_shards > 1 else
                         RayMailbox.create(Segment, capacity=cl.mailbox_capacity, **held)),
            "batches": RayMailbox.create(TrainBatch, capacity=2, **held),
        }
        if value_based:  # assembler -> value learner
            self.mailboxes["trajectories"] = RayMailbox.create(
                ScoredTrajectory, capacity=max(4 * cfg.critic.batch_trajectories, 64), **held)

    def _roles(self, resume: "ResumePoint | None", learning: bool, value_based: bool, here: dict) -> None:
        cfg, tr, boxes = self.config, self.config.trainer, self.mailboxes
        # Reward endpoints: actors here, or the Serve applications `reward-<name>` (reward.use_serve).
        self._endpoints = {} if cfg.reward.use_serve else reward_endpoint_actors(cfg.reward, cfg.model, cfg.task.reward, here)
        # The environment a task's episodes act in: an endpoint of its own, here with the control plane.
        self.environment = environment_actor(cfg.environment, here) if cfg.environment.enabled else None
        self._created += [self.environment] if self.environment is not None else []
        # Every checkpoint is begun and committed on this node, the run directory's (roles elsewhere
        # ship their parts to it: `asyncrl.storage.checkpoint_transfer`).
        self.checkpoint_writer = (WriterClient.spawn(self.run_dir, lambda shell, **kw: self._spawn(shell, placement=here, **kw))
                      if self.run_dir and learning else None)
        recorder = (self._spawn(RecorderActor, directory=os.path.join(self.run_dir, STORE_DIRNAME),
                                max_file_mb=tr.store_file_mb, max_file_age_s=tr.store_file_age_s,
                                keep_mb=tr.store_keep_mb, placement=here)
                    if tr.store_trajectories else None)
        prompt_source = self._spawn(
            PromptSourceActor, model=cfg.model, task=cfg.task, algorithm=cfg.algorithm,
            prompts_per_step=tr.prompts_per_step, seed=tr.seed, prompts=boxes["prompts"],
            max_prompts=0 if learning else tr.total_steps * tr.prompts_per_step, environment=cfg.environment,
            placement=here)
        ranks = cfg.policy.compute.ranks if learning else 0
        learners = [ask(cfg.policy.compute.gpus, cfg.policy.compute.resources)] * ranks
        learners += [ask(cfg.critic.compute.gpus, cfg.critic.compute.resources)] if value_based else []
        generator_options, learner_options, self.placement_group = role_placement(
            cfg.cluster.placement, ask(cfg.engine.gpus, cfg.engine.resources), self.pool.target, learners)
        # A learner that asks for nothing (no GPU, no resource) stays with the control plane: it holds
        # the run's state, and on a cluster it must not share a generator's node's fate.
        learner_options = [options or dict(here) for options in learner_options]
        value_learner = (self._spawn(
            ValueLearnerActor, model=cfg.model, critic=cfg.critic, algorithm=cfg.algorithm, sampling=cfg.sampling,
            seed=tr.seed, trajectories=boxes["trajectories"], resume_from=resume and resume.checkpoint,
            checkpoint_writer=self.checkpoint_writer, placement=learner_options[ranks]) if value_based else None)
        assembler = self._spawn(
            AssemblerActor, model=cfg.model, algorithm=cfg.algorithm, engine=cfg.engine, reward=cfg.reward,
            prompts_per_step=tr.prompts_per_step, segments=boxes["segments"], batches=boxes["batches"],
            endpoints=self._endpoints, ledger=prompt_source, value_learner=value_learner,
            trajectories=boxes.get("trajectories"), batch_prefix=f"batch-r{resume.incarnation if resume else 0}",
            recorder=recorder, mode=cfg.mode, synchronous=tr.synchronous, placement=here)
        for options in generator_options:
            self._created.append(self.pool.spawn(self.pool.next_id(), options))
        rank_actors, learner = self._learner(learning, prompt_source, assembler, value_learner, recorder,
                                             learner_options[:ranks], ranks)
        self.actors = {**({"learner": learner} if learner is not None else {}), "assembler": assembler,
                       "prompt_source": prompt_source,
                       **({"value_learner": value_learner} if value_learner is not None else {}),
                       **({"recorder": recorder} if recorder is not None else {}),
                       **{f"learner-rank-{i}": actor for i, actor in enumerate(rank_actors, 1)},
                       **{f"reward-{name}": endpoint for name, endpoint in self._endpoints.items()},
                       **({"environment": self.environment} if self.environment is not None else {})}

    def _learner(self, learning: bool, prompt_source, assembler, value_learner, recorder, options: list[dict],
                 ranks: int) -> tuple[list, Any]:
        """The policy learner (and the other ranks of a sharded one, which meet rank 0 at a store this
        process holds): `batches` -> optimizer step -> weights to the generators; both versions told
        to the assembler (staleness) and the prompt source (admission); trained samples to the
        ledger; checkpoints with the prompt source's and value learner's parts; batches to the store."""
        if not learning:
            return [], None
        cfg, tr = self.config, self.config.trainer
        rank_actors, rendezvous = [], None
        if ranks > 1:
            rendezvous = (node_address(), free_port(node_address()))
            self._rank_store = rendezvous_store(*rendezvous)
            rank_actors = [self._spawn(PolicyRankActor, model=cfg.model, algorithm=cfg.algorithm, policy=cfg.policy,
                                       engine=cfg.engine, sampling=cfg.sampling, seed=tr.seed, rendezvous=rendezvous, rank=rank,
                                       placement=options[rank]) for rank in range(1, ranks)]
        learner = self._spawn(
            PolicyLearnerActor, model=cfg.model, algorithm=cfg.algorithm, policy=cfg.policy, engine=cfg.engine,
            sampling=cfg.sampling, seed=tr.seed, batches=self.mailboxes["batches"], listeners=[assembler, prompt_source], ledger=prompt_source,
            checkpoint_parts=[prompt_source] + ([value_learner] if value_learner is not None else []),
            checkpoints=CheckpointPolicy(self.run_dir, tr.checkpoint_every if self.run_dir else 0,
                                         tr.checkpoint_every_s if self.run_dir else 0.0, tr.checkpoint_keep,
                                         self.checkpoint_writer),
            max_steps=self.max_steps, recorder=recorder, ranks=rank_actors, rendezvous=rendezvous,
            delivery_timeout_s=self.config.cluster.generator_timeout_s,
            placement=options[0], actor_name=LEARNER_NAME if self.name_actors else None)  # found by name
        return rank_actors, learner

    def _resume(self, resume: "ResumePoint | None") -> None:
        """The learner's weights and optimizer (on every rank); the ledger says which prompts to
        issue again; unsent batches go back in the mailbox."""
        if resume is None:
            return
        if "learner" in self.actors:
            answer(self.actors["learner"].resume.remote(resume.checkpoint), "the learner", "resume", WORK_TIMEOUT_S)
        self.resumed["reissued_prompts"] = answer(self.actors["prompt_source"].restore.remote(
            resume.checkpoint, resume.held_sample_ids, resume.weight_version, self.checkpoint_writer), "the prompt source",
            "restore", WORK_TIMEOUT_S)
        if resume.saved_batches:
            batches = self.mailboxes["batches"]
            answer(batches.actor.put.remote([(b.batch_id, batches.codec.encode(b)) for b in resume.saved_batches]),
                   "the batches mailbox", "put")

    def _loops(self, resume: "ResumePoint | None") -> None:
        """Consumers first; the generators hold the learner's version already (they joined)."""
        for name in ("recorder", "assembler", "value_learner"):
            if name in self.actors:
                self.run_refs[name] = self.actors[name].run.remote()
        for gid in self.generators:
            self.pool.start(gid)
        if "learner" in self.actors:
            self.run_refs["learner"] = self.actors["learner"].run.remote()
        self.run_refs["prompt_source"] = self.actors["prompt_source"].run.remote()

    def _spawn(self, shell: type, placement: dict | None = None, actor_name: str | None = None, **kwargs):
        """`spawn`, remembering the actor: a start that fails midway kills what it made."""
        actor = spawn(shell, placement=placement, actor_name=actor_name, **kwargs)
        self._created.append(actor)
        return actor

    # --- while it runs ---------------------------------------------------------------------------------

    def stop_learning(self, timeout_s: float = 120.0) -> None:
        """End the policy learner's loop (a step in flight finishes first), so that a checkpoint and
        the weights read afterwards are those of the last step the run reports."""
        answer(self.actors["learner"].stop.remote(), "the learner", "stop")
        ray.wait([self.run_refs["learner"]], timeout=timeout_s)

    def actor(self, role: str) -> Any:
        """The actor behind a role's name (`learner`, `reward-<name>`, ...), a generator's id, or
        `mailbox-<name>` (a mailbox of one shard); KeyError for none of them."""
        if role.startswith("mailbox-"):
            return self.mailboxes[role.removeprefix("mailbox-")].actor
        return self.actors[role] if role in self.actors else self.generators[role]

    def kill(self, role: str, restart: bool = False, wait_s: float = 0.0) -> None:
        """`ray.kill` of a role or a generator (a fault); then up to `wait_s` for its loop to end."""
        ray.kill(self.actor(role), no_restart=not restart)
        loops = self._loops_running()
        loop = loops.get(role, loops.get(f"generator:{role}"))
        if wait_s and loop is not None:
            ray.wait([loop], timeout=wait_s)

    def mailbox_stats(self, name: str) -> MailboxStats:
        """A mailbox's counters, its shards summed; each call bounded."""
        box = self.mailboxes[name]
        return sum_stats(answer([a.stats.remote() for a in mailbox_actors(box)], f"the {name} mailbox", "stats"))

    def checkpoint(self) -> str:
        """Write a checkpoint now (between two learner steps); returns its path."""
        return answer(self.actors["learner"].save_checkpoint.remote(), "the learner", "save_checkpoint",
                      WORK_TIMEOUT_S)

    def ledger(self) -> dict:
        return answer(self.actors["prompt_source"].ledger.remote(), "the prompt source", "ledger")

    def drain(self, timeout_s: float = 120.0, settle_s: float = 3.0) -> dict:
        """Stop issuing prompts and let the work in flight end (the learner trains on), then prove it
        with the ledger: every sample still in flight must be one a live generator holds (a hung
        one holds its own), and none may wait for a reward that never comes. The run issues
        nothing more after this (`check_alive` accepts the prompt source's end)."""
        self.draining = True
        start = time.monotonic()
        ray.get(self.actors["prompt_source"].stop.remote(), timeout=60)
        quiet_since = None  # unaccounted samples pass through states (a segment on its way): wait for none
        while True:
            open_ids = ray.get(self.actors["prompt_source"].open_samples.remote(), timeout=60)
            in_flight, awaiting = set(open_ids["in_flight"]), set(open_ids["awaiting_reward"])
            held = self._held_samples()
            unaccounted = (in_flight - held) | awaiting
            now = time.monotonic()
            quiet_since = None if unaccounted else (quiet_since or now)
            if (quiet_since is not None and now - quiet_since >= settle_s) or now - start > timeout_s:
                break
            time.sleep(0.5)
        counts = ray.get(self.actors["prompt_source"].ledger.remote(), timeout=60)["counts"]
        return {"drain_s": round(time.monotonic() - start, 1), "in_flight_after_drain": len(in_flight),
                "held_by_generators": len(in_flight & held), "awaiting_reward_after_drain": len(awaiting),
                "unaccounted": len(unaccounted), "unaccounted_ids": sorted(unaccounted)[:10],
                "awaiting_training_after_drain": counts["awaiting_training"]}

    def _held_samples(self) -> set[str]:
        """The samples the live generators hold (one that does not answer within 5 s holds nothing)."""
        calls = {gid: g.held_samples.remote() for gid, g in self.generators.items()}
        ready, _ = ray.wait(list(calls.values()), num_returns=len(calls), timeout=5.0)
        held = set()
        for ref in ready:
            try:
                held.update(ray.get(ref))
            except ray.exceptions.RayError:
                pass  # it died: it holds nothing
        return held

    def check_alive(self) -> list[str]:
        """Raise the error of any role's loop that ended (a crash must not look like a slow run),
        but a generator's: the generators whose loops ended are returned, for the pool to heal."""
        loops = self._loops_running()
        done, _ = ray.wait(list(loops.values()), timeout=0, num_returns=len(loops))
        dead = []
        for ref in done:
            name = next(k for k, v in loops.items() if v == ref)
            if name.startswith("generator:"):
                dead.append(name.removeprefix("generator:"))
                continue
            if name == "prompt_source" and self.draining:
                continue  # stopped on purpose (`drain`)
            try:
                ray.get(ref)
            except Exception as exc:  # the loop's own error, named by its role
                raise RoleDied(f"{name}'s loop ended: {type(exc).__name__}: {exc}") from exc
            raise RoleDied(f"{name}'s loop stopped unexpectedly")
        return dead

    def status(self) -> RunStatus:
        """Every role's stats and the run's figures as one view (`asyncrl.run.status.system_status`)."""
        return system_status(self)

    def reward_health(self) -> dict:
        """The assembler's count of scored samples and failed rewards, with each endpoint's first failure."""
        return answer(self.actors["assembler"].reward_health.remote(), "the assembler", "reward_health")

    def pop_metrics(self) -> list[dict]:
        """Policy-step records; with a value learner, each carries its latest value-step metrics."""
        records = answer(self.actors["learner"].pop_metrics.remote(), "the learner", "pop_metrics")
        if "value_learner" in self.actors:
            value_records = answer(self.actors["value_learner"].pop_metrics.remote(), "the value learner",
                                   "pop_metrics")
            if value_records:
                self._last_value = value_records[-1]
            for record in records:
                record.update(self._last_value)
        return records

    def weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        return answer(self.actors["learner"].weights.remote(), "the learner", "weights", WORK_TIMEOUT_S)

    def stop(self, learner_grace_s: float = 60.0) -> None:
        """Stop every loop and kill every actor. Once this returns, no checkpoint is committed any
        more: the caller (a restart, a resume) may pick the newest one."""
        stops = [a.stop.remote() for a in [*self.actors.values(), *self.generators.values()] if hasattr(a, "stop")]
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
        for actor in [*self.actors.values(), *self.generators.values(), *self._created,
                      *(a for b in self.mailboxes.values() for a in mailbox_actors(b))]:
            ray.kill(actor)
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
            self.placement_group = None
        loops = self._loops_running()
        if loops:
            ray.wait(list(loops.values()), num_returns=len(loops), timeout=15)

    def _loops_running(self) -> dict[str, Any]:
        """Every loop's reference: the roles' and the pool's generators' (as `generator:<id>`)."""
        return {**self.run_refs, **{f"generator:{gid}": ref for gid, ref in self.pool.loops.items()}}
