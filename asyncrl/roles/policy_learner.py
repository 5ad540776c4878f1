"""Policy learner: owns the policy weights, the optimizer and the weight version.

Consumes `TrainBatch`es (deduplicated by batch id: a redelivered batch is never trained twice),
takes one optimizer step per batch, bumps the version, and broadcasts the new weights to every
generator in the background: training continues while a broadcast is in flight, and when several
versions pile up only the newest is sent.

It also coordinates checkpoints (every `checkpoint_every` steps, between two steps): the batches
not yet trained are taken from its mailbox first, then the other parts (the prompt source's
cursor and ledger, the value learner) are written, then its own state, and the directory is
committed atomically. Taking the batches before the ledger is what keeps resume exact: a sample
is either in a saved batch, or open in the ledger and regenerated, or already ended.
"""

from __future__ import annotations

import asyncio
import copy
import os
import time
from typing import Any, Awaitable, Callable

import torch

from asyncrl import checkpoint
from asyncrl.learning import PolicyLossSettings, policy_step
from asyncrl.mailbox import Mailbox, RecentIds
from asyncrl.schema import TrainBatch
from asyncrl.staleness import mean_staleness
from asyncrl.weight_sync import BucketPlan, broadcast_weights, plan_buckets

from asyncrl.roles.loop import TrainingLoop


class PolicyLearner(TrainingLoop):
    def __init__(self, model, settings: PolicyLossSettings, batches: Mailbox, lr: float, weight_decay: float,
                 warmup_steps: int = 0, kl_coef: float = 0.0, pad_token_id: int = 0,
                 bucket_bytes: int = 64 << 20, notify_after_broadcast: bool = False, tokenizer=None):
        self.model = model.eval()
        self.settings = settings
        self.batches = batches
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0
        )
        self.reference = copy.deepcopy(model).eval().requires_grad_(False) if kl_coef > 0 else None
        self.pad_token_id = pad_token_id
        self.version = 0
        self.step = 0
        self.generators: list[Any] = []  # actor handles that receive broadcasts
        self.on_version: list[Any] = []  # callables notified of each new version (e.g. the assembler)
        self.plan: BucketPlan = plan_buckets(self.model.named_parameters(), bucket_bytes)
        self._trained_ids = RecentIds(10_000)
        # Told the sample ids whose last row was trained (the ledger); awaited, so a checkpoint's
        # ledger has seen every step before it.
        self.on_trained: Callable[[list[str]], Awaitable[Any]] | None = None
        # Checkpoints: parts written by other actors into the directory, given its path.
        self.tokenizer = tokenizer
        self.run_dir = ""
        self.checkpoint_every = 0
        self.checkpoint_keep = 2
        self.checkpoint_parts: list[Callable[[str], Awaitable[Any]]] = []
        self.incarnation = 0  # how many times this run was resumed
        self.max_steps = 0  # stop training at this step (0 = never; `asyncrl train` sets total_steps)
        self._step_lock = asyncio.Lock()
        self.last_checkpoint: dict[str, Any] = {}
        self._metrics: list[dict] = []
        self._broadcast_task: asyncio.Task | None = None
        self._broadcast_wanted = False
        self._running = False
        self._started = time.monotonic()
        self.timing = {"train_s": 0.0, "wait_batch_s": 0.0, "broadcast_s": 0.0, "checkpoint_s": 0.0}
        # A row is a whole response, or one window of it (T-PPO); a sample counts when its last row trains.
        self.counters = {"broadcasts": 0, "duplicate_batches": 0, "samples_trained": 0, "rows_trained": 0,
                         "checkpoints": 0}
        self.last_broadcast: dict[str, float] = {}
        # Synchronous mode: tell the prompt source and assembler of a version only once every
        # generator holds it, so the next batch is generated entirely by the new weights.
        self.notify_after_broadcast = notify_after_broadcast

    # --- weights ----------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().clone() for name, p in self.model.named_parameters()}

    async def _broadcast_loop(self) -> None:
        while self._broadcast_wanted:
            self._broadcast_wanted = False
            version, weights = self.version, self.snapshot()
            start = time.perf_counter()
            receivers = [g.receive_weights.remote(self.plan, version) for g in self.generators]
            timing = await asyncio.to_thread(broadcast_weights, self.plan, weights)
            paused = await asyncio.gather(*receivers)
            elapsed = time.perf_counter() - start
            self.timing["broadcast_s"] += elapsed
            self.counters["broadcasts"] += 1
            self.last_broadcast = {**timing, "version": version, "total_s": elapsed,
                                   "generator_pause_s_max": max(paused, default=0.0)}
            if self.notify_after_broadcast:
                self._notify(version)

    def _notify(self, version: int) -> None:
        for notify in self.on_version:
            notify(version)

    def _request_broadcast(self) -> None:
        if not self.generators:
            return
        self._broadcast_wanted = True
        if self._broadcast_task is None or self._broadcast_task.done():
            self._broadcast_task = asyncio.create_task(self._broadcast_loop())

    # --- training ---------------------------------------------------------------------------------

    async def train_on(self, batch: TrainBatch) -> dict | None:
        if batch.batch_id in self._trained_ids:
            self.counters["duplicate_batches"] += 1
            return None
        start = time.perf_counter()
        metrics = await asyncio.to_thread(
            policy_step, self.model, self.optimizer, batch.samples, self.settings, self.reference, self.pad_token_id
        )
        self.scheduler.step()
        self.timing["train_s"] += time.perf_counter() - start
        self._trained_ids.add(batch.batch_id)
        self.step += 1
        self.version += 1
        finished_ids = [s.segment.sample_id for s in batch.samples if s.segment.finished]
        self.counters["samples_trained"] += len(finished_ids)
        self.counters["rows_trained"] += len(batch.samples)
        record = {
            "step": self.step,
            "weight_version": self.version,
            **{k: v for k, v in batch.stats.items() if k != "assembled_at"},
            **metrics,
            # Against the weights this step trained (the version before the bump).
            "staleness_mean": mean_staleness(self.version - 1, [s.segment.new_versions for s in batch.samples]),
            "response_length_mean": sum(len(s.segment.new_token_ids) for s in batch.samples) / len(batch.samples),
            "lr": self.scheduler.get_last_lr()[0],
            "train_s": time.perf_counter() - start,
        }
        self._metrics.append(record)
        if self.on_trained is not None:
            await self.on_trained(finished_ids)
        if not self.notify_after_broadcast or not self.generators:
            self._notify(self.version)
        self._request_broadcast()
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
        if record is not None and self.checkpoint_every > 0 and self.step % self.checkpoint_every == 0:
            await self.save_checkpoint()
        return record

    async def run(self) -> None:
        self._running = True
        self._started = time.monotonic()
        while self._running:
            await self.step_once()

    # --- checkpoints ----------------------------------------------------------------------------

    async def save_checkpoint(self) -> str:
        """Write a checkpoint of the current step (between two steps) and return its path."""
        if not self.run_dir:
            raise RuntimeError("checkpoints need a run directory")
        async with self._step_lock:  # also waits for a checkpoint in progress
            if self.last_checkpoint.get("step") == self.step:  # this step is saved already
                return self.last_checkpoint["path"]
            start = time.perf_counter()
            tmp = checkpoint.begin(self.run_dir, self.step)
            pending = await self.batches.drain_unacked()  # before the ledger: see the module doc
            await asyncio.gather(*(part(tmp) for part in self.checkpoint_parts))
            await asyncio.to_thread(self._write_state, tmp, pending)
            path = await asyncio.to_thread(checkpoint.commit, tmp, self.step, self.checkpoint_keep)
            elapsed = time.perf_counter() - start
            self.timing["checkpoint_s"] += elapsed
            self.counters["checkpoints"] += 1
            self.last_checkpoint = {"path": path, "step": self.step, "seconds": elapsed,
                                    "saved_batches": len(pending)}
            return path

    def _write_state(self, directory: str, pending_batches: list[TrainBatch]) -> None:
        checkpoint.save_policy(self.model, self.tokenizer, os.path.join(directory, "policy"))
        checkpoint.save_tensors({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()},
                                os.path.join(directory, "learner.pt"))
        checkpoint.save_json({"step": self.step, "weight_version": self.version, "incarnation": self.incarnation,
                              "counters": self.counters}, os.path.join(directory, "learner.json"))
        checkpoint.save_batches(pending_batches, os.path.join(directory, "batches.msgpack"))

    def load_checkpoint(self, directory: str) -> None:
        """Continue from a checkpoint: weights, optimizer, scheduler, step, version, counters."""
        checkpoint.load_policy_weights(self.model, os.path.join(directory, "policy"))
        state = checkpoint.load_tensors(os.path.join(directory, "learner.pt"))
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        meta = checkpoint.load_json(os.path.join(directory, "learner.json"))
        self.step, self.version = int(meta["step"]), int(meta["weight_version"])
        self.incarnation = int(meta.get("incarnation", 0)) + 1
        self.counters.update({k: v for k, v in meta["counters"].items() if k in self.counters})

    async def publish(self) -> None:
        """Send the current weights to every generator and wait (a resumed run, before any
        prompt is issued), then announce the version."""
        if self.generators:
            self._request_broadcast()  # one broadcast loop at a time shares the group
            await self._broadcast_task
        self._notify(self.version)

    def stats(self) -> dict:
        wall = max(time.monotonic() - self._started, 1e-9)
        return {"step": self.step, "weight_version": self.version, **self.counters, **self.timing,
                "busy_fraction": self.timing["train_s"] / wall, "last_broadcast": self.last_broadcast,
                "last_checkpoint": self.last_checkpoint, "incarnation": self.incarnation,
                "optimizer_steps": self._optimizer_steps()}

    def _optimizer_steps(self) -> int:
        """Adam's step count of the first parameter (continues across a resume)."""
        for state in self.optimizer.state.values():
            return int(state["step"])
        return 0
