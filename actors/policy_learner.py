"""Policy learner: owns the policy weights, the optimizer and the weight version.

Consumes `TrainBatch`es (deduplicated by batch id: a redelivered batch is never trained twice),
takes one optimizer step per batch, bumps the version, and broadcasts the new weights to every
generator in the background: training continues while a broadcast is in flight, and when several
versions pile up only the newest is sent.
"""

from __future__ import annotations

import asyncio
import copy
import time
from typing import Any

import torch

from asyncrl.learning import PolicyLossSettings, policy_step
from asyncrl.mailbox import Mailbox
from asyncrl.schema import TrainBatch
from asyncrl.weight_sync import BucketPlan, broadcast_weights, plan_buckets

from actors.loop import TrainingLoop


class PolicyLearner(TrainingLoop):
    def __init__(self, model, settings: PolicyLossSettings, batches: Mailbox, lr: float, weight_decay: float,
                 warmup_steps: int = 0, kl_coef: float = 0.0, pad_token_id: int = 0,
                 bucket_bytes: int = 64 << 20, notify_after_broadcast: bool = False):
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
        self._trained_ids: set[str] = set()
        self._metrics: list[dict] = []
        self._broadcast_task: asyncio.Task | None = None
        self._broadcast_wanted = False
        self._running = False
        self._started = time.monotonic()
        self.timing = {"train_s": 0.0, "wait_batch_s": 0.0, "broadcast_s": 0.0}
        # A row is a whole response, or one window of it (T-PPO); a sample counts when its last row trains.
        self.counters = {"broadcasts": 0, "duplicate_batches": 0, "samples_trained": 0, "rows_trained": 0}
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
        self.counters["samples_trained"] += sum(1 for s in batch.samples if s.segment.finished)
        self.counters["rows_trained"] += len(batch.samples)
        staleness = [self.version - 1 - int(s.segment.new_versions.min()) for s in batch.samples if len(s.segment.new_versions)]
        record = {
            "step": self.step,
            "weight_version": self.version,
            **{k: v for k, v in batch.stats.items() if k != "assembled_at"},
            **metrics,
            "staleness_mean": sum(staleness) / max(len(staleness), 1),
            "response_length_mean": sum(len(s.segment.new_token_ids) for s in batch.samples) / len(batch.samples),
            "lr": self.scheduler.get_last_lr()[0],
            "train_s": time.perf_counter() - start,
        }
        self._metrics.append(record)
        if not self.notify_after_broadcast or not self.generators:
            self._notify(self.version)
        self._request_broadcast()
        return record

    async def step_once(self, timeout: float = 1.0) -> dict | None:
        start = time.perf_counter()
        got = await self.batches.get(1, timeout=timeout)
        self.timing["wait_batch_s"] += time.perf_counter() - start
        if not got:
            return None
        record = await self.train_on(got[0])
        await self.batches.ack([got[0].batch_id])
        return record

    async def run(self) -> None:
        self._running = True
        self._started = time.monotonic()
        while self._running:
            await self.step_once()

    def stats(self) -> dict:
        wall = max(time.monotonic() - self._started, 1e-9)
        return {"step": self.step, "weight_version": self.version, **self.counters, **self.timing,
                "busy_fraction": self.timing["train_s"] / wall, "last_broadcast": self.last_broadcast}
