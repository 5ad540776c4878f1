"""Policy learner: owns the policy weights, the optimizer and the weight version (the role, its
builder, its Ray shell; the other ranks of a sharded learner are `actors.policy_rank`).

Consumes `TrainBatch`es (deduplicated by batch id: a redelivered batch is never trained twice),
masks the tokens that are too stale for the weights it is about to train (the staleness bound is
enforced here), trains on the batch (`ppo_epochs` x `mini_batches` optimizer updates), bumps
`weight_version`, and delivers the new weights to every generator in the background
(`asyncrl.weights.transport`): training continues while a delivery is in flight, and when several versions
pile up only the newest is sent. Its listeners (the assembler, the prompt source) are told both
versions through one conduit, `set_versions(weight_version, delivered_version)`: the version
trained, and the version every generator holds.

It also coordinates checkpoints, between two steps (`asyncrl.storage.policy_checkpoints`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import msgspec
import torch

from actors.base import RoleShell, TrainingLoop
from asyncrl.config import NO_BOUND, AlgorithmConfig, EngineConfig, ModelConfig, PolicyConfig, SamplingConfig
from asyncrl.learning.rank import PolicyRank, build_policy_rank, learner_backend
from asyncrl.learning.routing import misfit_reason, route_shape
from asyncrl.messages.mailbox import Mailbox, RecentIds
from asyncrl.messages.structs import DropReason, SampleState, TrainBatch
from asyncrl.staleness import mask_stale_tokens, mean_staleness, trained_versions
from asyncrl.storage.checkpoint_transfer import WriterClient
from asyncrl.storage.policy_checkpoints import CheckpointPolicy, LearnerCheckpoints
from asyncrl.storage.trajectory_store import BATCH_CODEC, BATCH_RECORD_ENCODER, BatchRecord
from asyncrl.weights.delta import DeltaTracker, held_dtype
from asyncrl.weights.sharding import join as join_ranks
from asyncrl.weights.sync import free_port, node_address, plan_buckets
from asyncrl.weights.transport import WeightReceivers, WeightSender

# Calls a rank of a sharded learner: `call(method name, *args)` -> awaitable (its Ray actor).
RankCall = Callable[..., Awaitable[Any]]
VersionListener = Callable[[int, int], Any]  # (weight_version, delivered_version)


@dataclass
class LearnerEdges:
    """Whom the learner talks to (actor handles or in-process callables)."""

    generators: dict[str, Any] = field(default_factory=dict)  # generator id -> handle (`receive_weights`)
    listeners: list[VersionListener] = field(default_factory=list)  # told both versions
    trained: Callable[[list[str]], Awaitable[Any]] | None = None  # the ledger: sample ids trained
    dropped: Callable[[list[str], DropReason], Awaitable[Any]] | None = None  # the ledger: ids ended untrained
    # Write a part into the checkpoint being written (its path on the run's node; the writer to ship it to).
    checkpoint_parts: list[Callable[[str, WriterClient], Awaitable[Any]]] = field(default_factory=list)
    record_batch: Callable[[BatchRecord], Any] | None = None  # the store: each batch as trained


class PolicyLearner(LearnerCheckpoints, TrainingLoop):
    def __init__(self, policy: PolicyRank, batches: Mailbox, edges: LearnerEdges | None = None,
                 checkpoints: CheckpointPolicy = CheckpointPolicy(), bucket_bytes: int = 64 << 20, tokenizer=None,
                 max_staleness_versions: int = NO_BOUND, max_steps: int = 0, ranks: list[RankCall] = (),
                 weight_delta: torch.dtype | None = None, delivery_timeout_s: float = 300.0):
        # Rank 0's model, optimizer and schedule; `ranks` call the other ranks of a sharded learner,
        # which run every weight-touching call with it (`_on_every_rank`).
        self.policy = policy
        self.ranks = list(ranks)
        self.batches = batches
        self.edges = edges or LearnerEdges()
        self.checkpoints = checkpoints
        self.writer = checkpoints.writer or (WriterClient.local(checkpoints.run_dir) if checkpoints.run_dir else None)
        self.tokenizer = tokenizer
        self.route_shape = route_shape(self.policy.lm)  # a mixture-of-experts model's (None: dense)
        # The staleness bound holds here, at the step, against the version being trained.
        self.max_staleness_versions = max_staleness_versions
        self.max_steps = max_steps  # stop training at this step (0 = never; `asyncrl train` sets total_steps)
        self.weight_version = 0  # the version of the weights this learner holds
        self.delivered_version = 0  # the newest version every generator holds
        self.step = 0
        # What a version is for the generators: every weight, a LoRA adapter (`policy.adapter`), or
        # with `weight_delta` (the engine's dtype) what changed since the version they hold.
        self.sender = WeightSender(plan_buckets(self.policy.delivered_parameters(), bucket_bytes), self.policy.adapter,
                                   DeltaTracker(weight_delta) if weight_delta is not None else None, bucket_bytes)
        # The generators this learner delivers to (they join and leave while it trains).
        self.receivers = WeightReceivers(self.sender, self._stage, self._delivered_all, self.edges.generators, delivery_timeout_s)
        self._weights_lock = asyncio.Lock()  # held while the weights change: a copy taken under it is whole
        self._trained_ids = RecentIds(10_000)
        self.incarnation = 0  # how many times this run was resumed
        # Names this learner's line of versions: a restart from a checkpoint, or another run, starts
        # another line, whose version numbers may repeat or fall (the policy endpoint follows it).
        self.incarnation_id = uuid.uuid4().hex[:12]
        self._adam_steps = 0  # Adam's step count as of the last finished step (see `train_on`)
        self._step_lock = asyncio.Lock()
        self.last_checkpoint: dict[str, Any] = {}
        self._last_checkpoint_at = time.monotonic()
        self._metrics: list[dict] = []
        self._running = False
        self._started = time.monotonic()
        self.timing = {"train_s": 0.0, "wait_batch_s": 0.0, "broadcast_s": 0.0, "checkpoint_s": 0.0}
        # A row is a whole response, or one window of it (T-PPO); a sample counts when its last row trains.
        self.counters = {"broadcasts": 0, "duplicate_batches": 0, "samples_trained": 0, "rows_trained": 0,
                         "checkpoints": 0, "stale_tokens_masked": 0, "optimizer_updates": 0, "steps_skipped": 0}
        self.last_broadcast: dict[str, float] = {}

    @property
    def model(self):
        """The policy (a Hugging Face causal LM; its parameters are shards when sharded)."""
        return self.policy.lm

    async def _on_every_rank(self, method: str, *args, rank0_args: tuple | None = None):
        """Run a `PolicyRank` method on every rank at once (a collective when sharded); rank 0's
        result. `rank0_args`: what rank 0 passes instead of `args` (what it alone has read)."""
        local = asyncio.to_thread(getattr(self.policy, method), *(args if rank0_args is None else rank0_args))
        results = await asyncio.gather(local, *(call(method, *args) for call in self.ranks))
        return results[0]

    async def snapshot(self) -> tuple[int, dict[str, torch.Tensor]]:
        """(weight version, a copy of the parameters by name, whole), both read between two steps."""
        async with self._weights_lock:
            return self.weight_version, await self._on_every_rank("snapshot")

    def weight_group_address(self) -> tuple[str, int]:
        """Where the weight group meets: this learner's node IP and a port free there."""
        host = node_address()
        return host, free_port(host)

    # --- versions and deliveries ---------------------------------------------------------------------

    def _tell_listeners(self) -> None:
        for listener in self.edges.listeners:
            listener(self.weight_version, self.delivered_version)

    def _delivered(self, version: int) -> None:
        """Every receiver holds `version` (or there is none): tell the listeners."""
        self.delivered_version = max(self.delivered_version, version)
        self._tell_listeners()

    async def _stage(self, paths: set[str]):
        """A consistent copy of the current version for `paths`, taken between two optimizer steps."""
        async with self._weights_lock:
            version = self.weight_version
            whole = (await self._on_every_rank("delivered") if self.ranks or self.sender.needs_whole_copy(paths)
                     else None)
            return await asyncio.to_thread(self.sender.stage, version, self.policy.delivered_parameters(), whole, paths)

    def _delivered_all(self, version: int, timing: dict | None) -> None:
        """The receivers' news: `version` is held by every generator (`timing`: of a delivery; None: a join)."""
        if timing is not None:
            self.timing["broadcast_s"] += timing["total_s"]
            self.counters["broadcasts"] += 1
            self.last_broadcast = timing
        self._delivered(version)

    def _request_delivery(self) -> None:
        if self.sender.slots.closed:  # stopped: a version now would outlive it
            return
        self.receivers.request()

    # --- training ---------------------------------------------------------------------------------

    async def train_on(self, batch: TrainBatch) -> dict | None:
        if batch.batch_id in self._trained_ids:
            self.counters["duplicate_batches"] += 1
            return None
        if not batch.rows:
            return self._skip(batch)
        start = time.perf_counter()
        # Tokens too old for the weights about to be trained are masked out of the loss, whatever
        # the assembler knew when it built the batch (versions it is told arrive late, batches queue).
        samples, stale = mask_stale_tokens(batch.rows, self.weight_version, self.max_staleness_versions)
        self.counters["stale_tokens_masked"] += int(stale["stale_tokens_masked"])
        async with self._weights_lock:
            metrics = await self._on_every_rank("step", samples)
            # Bumped under the lock: a snapshot reads the version and the weights together.
            self.step += 1
            self.weight_version += 1
        if self.edges.record_batch is not None:
            trained = msgspec.structs.replace(batch, rows=samples)
            self.edges.record_batch(BatchRecord(
                batch_id=batch.batch_id, step=self.step, trained_from_version=self.weight_version - 1,
                loss=metrics["loss"], grad_norm=metrics["grad_norm"], rows=len(samples),
                batch=BATCH_CODEC.encode(trained), recorded_at=time.time()))
        self.counters["optimizer_updates"] += int(metrics["policy_updates"] - metrics["skipped_updates"])
        # Read here, on the loop, with the counter above: `stats()` may run while the next step's
        # thread is between an Adam step and its count.
        self._adam_steps = self.policy.optimizer_steps()
        self.timing["train_s"] += time.perf_counter() - start
        self._trained_ids.add(batch.batch_id)
        finished_ids, misfit_ids = self._ended(batch)
        self.counters["samples_trained"] += len(finished_ids)
        self.counters["rows_trained"] += len(batch.rows)
        record = {
            "step": self.step,
            "weight_version": self.weight_version,
            **{k: v for k, v in batch.stats.items() if k != "assembled_at"},
            **metrics,
            # Against the weights this step trained (the version before the bump), over the tokens
            # it trained: the bound `max_staleness_versions` holds for `staleness_max`.
            **stale,
            "staleness_mean": mean_staleness(self.weight_version - 1, [trained_versions(t) for t in samples]),
            "response_length_mean": sum(len(s.segment.new_token_ids) for s in batch.rows) / len(batch.rows),
            "lr": self.policy.scheduler.get_last_lr()[0],
            "train_s": time.perf_counter() - start,
        }
        self._metrics.append(record)
        if self.edges.trained is not None:
            await self.edges.trained(finished_ids)
        if misfit_ids and self.edges.dropped is not None:
            await self.edges.dropped(misfit_ids, DropReason.ROUTES_MISFIT)
        if self.receivers.generators:
            self._tell_listeners()
            self._request_delivery()
        elif not self.receivers.had_members:  # no generator at all (mode=learn): nothing waits for a delivery
            self._delivered(self.weight_version)
        else:  # every generator left or failed: this version reaches a generator when one joins
            self._tell_listeners()
        return record

    def _ended(self, batch: TrainBatch) -> tuple[list[str], list[str]]:
        """The samples the batch ends: (trained, those whose last row trained nothing because its
        routes are another model's: the step refuses them, so the ledger ends them as dropped)."""
        ended = [s for s in batch.rows if s.segment.finished]
        misfit = {s.segment.sample_id for s in ended if misfit_reason(s, self.route_shape) is not None}
        return [s.segment.sample_id for s in ended if s.segment.sample_id not in misfit], sorted(misfit)

    def _skip(self, batch: TrainBatch) -> dict:
        """A batch with no rows (bounded refill found no group with signal): the step is counted and
        recorded with its reason; no update, so the weights and their version stay."""
        self._trained_ids.add(batch.batch_id)
        self.step += 1
        self.counters["steps_skipped"] += 1
        record = {"step": self.step, "weight_version": self.weight_version, "skipped": 1.0,
                  "skip_reason": batch.skip_reason, **{k: v for k, v in batch.stats.items() if k != "assembled_at"},
                  "samples_in_batch": 0, "train_s": 0.0}
        self._metrics.append(record)
        return record

    async def step_once(self, timeout: float = 1.0) -> dict | None:
        if self.max_steps and self.step >= self.max_steps:
            await asyncio.sleep(min(timeout, 0.2))  # done: later batches stay queued (and checkpointed)
            return None
        async with self._step_lock:
            start = time.perf_counter()
            got = await self.batches.get(1, timeout=timeout)
            self.timing["wait_batch_s"] += time.perf_counter() - start
            if not got:
                return None
            record = await self.train_on(got[0])
            await self.batches.ack([got[0].batch_id])
        if record is not None and self.checkpoints.due(self.step, time.monotonic() - self._last_checkpoint_at):
            await self.save_checkpoint()
        return record

    def stop(self) -> None:
        self._running = False
        self.sender.slots.close()  # a killed learner cannot; the next one on the node removes its files

    async def run(self) -> None:
        self._running = True
        self.sender.slots.open()
        self._started = time.monotonic()
        while self._running:
            await self.step_once()

    def stats(self) -> dict:
        wall = max(time.monotonic() - self._started, 1e-9)
        return {"step": self.step, "weight_version": self.weight_version, "delivered_version": self.delivered_version,
                "generators": sorted(self.receivers.generators), "failed_generators": dict(self.receivers.failed),
                **self.counters, **self.timing, "busy_fraction": self.timing["train_s"] / wall,
                "wait_batch_fraction": self.timing["wait_batch_s"] / wall,
                "last_broadcast": self.last_broadcast, "last_checkpoint": self.last_checkpoint,
                "incarnation": self.incarnation, "incarnation_id": self.incarnation_id,
                "optimizer_steps": self._adam_steps,
                "precision": self.policy.objective.policy.compute.precision,  # precision=auto, as resolved
                "precision_choice": self.policy.precision.summary() if self.policy.precision else {}}


# --- builders and shells ------------------------------------------------------------------------------


def build_policy_learner(model: ModelConfig, algorithm: AlgorithmConfig, policy: PolicyConfig, engine: EngineConfig,
                         sampling: SamplingConfig, seed: int, batches: Mailbox, edges: LearnerEdges | None = None,
                         checkpoints: CheckpointPolicy = CheckpointPolicy(), max_steps: int = 0, parallel=None,
                         ranks=(), delivery_timeout_s: float = 300.0) -> PolicyLearner:
    """`parallel`, `ranks`: rank 0 of a sharded learner and the calls to its other ranks;
    `delivery_timeout_s`: a weight delivery to a generator that takes longer fails it."""
    rank, tokenizer = build_policy_rank(model, algorithm, policy, engine, sampling, seed, parallel)
    delta = held_dtype(engine, model) if policy.weight_delta else None
    return PolicyLearner(rank, batches, edges, checkpoints, policy.broadcast_bucket_mb << 20, tokenizer,
                         algorithm.max_staleness_versions, max_steps, ranks, delta, delivery_timeout_s)


class PolicyLearnerActor(RoleShell):
    """Edges: delivers to the generators that join (`join_generator`); tells `listeners` (the
    assembler, the prompt source) both versions; reports trained samples to the `ledger`; asks
    `checkpoint_parts` (prompt source, value learner) to write their parts of each checkpoint;
    sends trained batches to the `recorder`. `ranks`: the other ranks' actors of a sharded learner,
    which meet this one at `rendezvous`."""

    def __init__(self, model: ModelConfig, algorithm: AlgorithmConfig, policy: PolicyConfig, engine: EngineConfig,
                 sampling: SamplingConfig, seed: int, batches: Mailbox, *, listeners: list, ledger,
                 checkpoint_parts: list, checkpoints: CheckpointPolicy, max_steps: int = 0, recorder=None,
                 ranks: list = (), rendezvous: tuple[str, int] | None = None, delivery_timeout_s: float = 300.0):
        torch.set_num_threads(policy.compute.threads)
        parallel = (join_ranks(*rendezvous, len(ranks) + 1, 0, learner_backend(policy), policy.compute.timeout_s)
                    if ranks else None)

        async def trained(ids):
            await ledger.record.remote(ids, SampleState.TRAINED)

        async def dropped(ids, reason):
            await ledger.record.remote(ids, SampleState.DROPPED, reason)

        edges = LearnerEdges(
            # Fire-and-forget: the listeners take `max` of what they are told.
            listeners=[lambda w, d, actor=actor: actor.set_versions.remote(w, d) for actor in listeners],
            trained=trained, dropped=dropped, checkpoint_parts=[_part_writer(actor) for actor in checkpoint_parts],
            record_batch=(None if recorder is None else
                          lambda record: recorder.add_batch.remote(BATCH_RECORD_ENCODER.encode(record))))
        self.inner = build_policy_learner(model, algorithm, policy, engine, sampling, seed, batches, edges, checkpoints,
                                          max_steps, parallel, [_rank_call(r) for r in ranks], delivery_timeout_s)

    async def join_generator(self, generator_id: str, handle, path: str, group: tuple[str, int, str] | None = None) -> int:
        """A generator joins the pool (at start, as a replacement or when the pool grows): for the
        `group` path, this learner meets it at `group` (host, port, backend; the generator joins the
        same pair at the same time); then it gets the current version. Returns that version."""
        if group is not None:
            from asyncrl.weights.sync import WeightGroup

            host, port, backend = group
            # Bounded as every delivery (cluster.generator_timeout_s): a cut-off peer must not hold the others'.
            self.inner.sender.groups[generator_id] = await asyncio.to_thread(
                WeightGroup, host, port, 2, 0, backend, timeout_s=self.inner.receivers.timeout_s,
                local_address=node_address())
        return await self.inner.receivers.add(generator_id, handle, path)

    def leave_generator(self, generator_id: str) -> None:
        self.inner.receivers.remove(generator_id)

    def failed_generators(self) -> dict[str, str]:
        """Generators whose weight delivery failed or timed out (no longer receivers): the run's pool heals them."""
        return dict(self.inner.receivers.failed)

    def announce(self) -> None:
        """Tell the listeners the versions (after the first generators joined)."""
        self.inner._delivered(self.inner.weight_version)

    async def resume(self, checkpoint_dir: str) -> None:
        await self.inner.load_checkpoint(checkpoint_dir)

    async def save_checkpoint(self) -> str:
        return await self.inner.save_checkpoint()

    def pop_metrics(self) -> list[dict]:
        return self.inner.pop_metrics()

    async def weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        """(weight version, a snapshot of the parameters): for evaluation and the policy endpoint."""
        return await self.inner.snapshot()

    def weight_tag(self) -> tuple[str, int]:
        """(incarnation id, weight version): which line of versions, and where on it."""
        return self.inner.incarnation_id, self.inner.weight_version

    def weight_group_address(self) -> tuple[str, int]:
        return self.inner.weight_group_address()


def _rank_call(actor):
    return lambda method, *args: actor.call.remote(method, *args)


def _part_writer(actor):
    async def write(directory: str, writer: WriterClient) -> None:
        await actor.save_checkpoint_part.remote(directory, writer)
    return write
