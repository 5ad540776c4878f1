"""Trajectory assembler: collects the segments of each sample, asks the reward endpoint to score
finished samples, and turns complete groups into `TrainBatch`es (via `asyncrl.assembly`).

Segments are deduplicated by id (`prompt/sample/turn`), so a redelivered or regenerated segment is
counted once; a sample is scored once; a group is emitted or dropped once.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Awaitable, Callable

from asyncrl.assembly import AssemblySettings, assemble_group, merge_segments
from asyncrl.mailbox import Mailbox
from asyncrl.schema import Reward, Segment, TrainBatch, TrainSample

from actors.verifier import RewardRequest

ScoreFn = Callable[[list[RewardRequest]], Awaitable[list[Reward]]]


class Assembler:
    def __init__(self, segments: Mailbox, batches: Mailbox, score: ScoreFn, decode: Callable[[list[int]], str],
                 settings: AssemblySettings, prompts_per_batch: int,
                 on_dropped_group: Callable[[str], None] = lambda reason: None):
        self.segments = segments
        self.batches = batches
        self.score = score
        self.decode = decode
        self.settings = settings
        self.prompts_per_batch = prompts_per_batch
        self.on_dropped_group = on_dropped_group
        self.policy_version = 0
        self._seen: set[str] = set()
        self._parts: dict[str, list[Segment]] = collections.defaultdict(list)  # sample id -> segments
        self._groups: dict[str, dict[int, tuple[Segment, Reward]]] = collections.defaultdict(dict)
        self._ready: list[list[TrainSample]] = []
        self._ready_stats: list[dict[str, float]] = []
        self._scoring: set[asyncio.Task] = set()
        self._batch_index = 0
        self._running = False
        self._failure: BaseException | None = None
        self.counters = collections.Counter()
        self.rewards_sum = 0.0
        # Reward over every sample scored since the last batch, dropped groups included: the policy's
        # reward. The batch's own mean is biased by dynamic sampling (kept groups are mixed).
        self._since_batch = [0.0, 0, 0]  # score sum, correct count, samples

    def set_policy_version(self, version: int) -> None:
        self.policy_version = max(self.policy_version, version)

    def _ingest(self, segments: list[Segment]) -> list[tuple[Segment, RewardRequest]]:
        to_score = []
        for seg in segments:
            if seg.msg_id in self._seen:
                self.counters["duplicate_segments"] += 1
                continue
            self._seen.add(seg.msg_id)
            self.counters["segments"] += 1
            self._parts[seg.sample_id].append(seg)
            if seg.finished:
                merged = merge_segments(self._parts.pop(seg.sample_id))
                to_score.append((merged, RewardRequest(
                    prompt_id=merged.prompt_id, sample_idx=merged.sample_idx,
                    response_text=self.decode(merged.new_token_ids.tolist()),
                    ground_truth=merged.ground_truth, data_source=merged.data_source)))
        return to_score

    async def _score_and_group(self, items: list[tuple[Segment, RewardRequest]]) -> None:
        rewards = await self.score([req for _, req in items])
        for (merged, _), reward in zip(items, rewards):
            self.counters["samples_scored"] += 1
            self.counters["reward_failures"] += int(reward.failed)
            self.rewards_sum += reward.score
            self._since_batch[0] += reward.score
            self._since_batch[1] += int(bool(reward.correct))
            self._since_batch[2] += 1
            group = self._groups[merged.group_id]
            group[merged.sample_idx] = (merged, reward)
            if len(group) == merged.group_size:
                self._close_group(merged.group_id)
        await self._emit_ready()

    def _close_group(self, group_id: str) -> None:
        group = self._groups.pop(group_id)
        members = [group[i] for i in sorted(group)]
        samples, rewards = [m[0] for m in members], [m[1] for m in members]
        train, reason, stats = assemble_group(samples, rewards, self.policy_version, self.settings)
        self.counters["groups_closed"] += 1
        if reason is not None:
            self.counters[f"dropped_{reason}_groups"] += 1
            self.counters[f"dropped_{reason}_samples"] += len(samples)
            self.counters["samples_dropped"] += len(samples)
            self.on_dropped_group(reason)
            return
        self._ready.append(train)
        self._ready_stats.append({**stats, "reward_mean": sum(r.score for r in rewards) / len(rewards),
                                  "accuracy": sum(bool(r.correct) for r in rewards) / len(rewards)})

    async def _emit_ready(self) -> None:
        while len(self._ready) >= self.prompts_per_batch:
            groups, self._ready = self._ready[: self.prompts_per_batch], self._ready[self.prompts_per_batch:]
            stats, self._ready_stats = self._ready_stats[: self.prompts_per_batch], self._ready_stats[self.prompts_per_batch:]
            batch = TrainBatch(
                batch_id=f"batch-{self._batch_index}",
                samples=[s for g in groups for s in g],
                stats={
                    "reward_mean": sum(s["reward_mean"] for s in stats) / len(stats),
                    "accuracy": sum(s["accuracy"] for s in stats) / len(stats),
                    "staleness_max": max(s["staleness_max"] for s in stats),
                    "reward_mean_generated": self._since_batch[0] / max(self._since_batch[2], 1),
                    "accuracy_generated": self._since_batch[1] / max(self._since_batch[2], 1),
                    "assembled_at": time.time(),
                },
            )
            self._batch_index += 1
            self._since_batch = [0.0, 0, 0]
            await self.batches.put([batch])
            self.counters["batches"] += 1
            self.counters["samples_emitted"] += len(batch.samples)

    async def step(self, timeout: float = 0.5) -> None:
        segments = await self.segments.get(256, timeout=timeout)
        if not segments:
            return
        to_score = self._ingest(segments)
        # Acknowledged once held here: from now on the assembler's state owns them.
        await self.segments.ack([s.msg_id for s in segments])
        if to_score:
            task = asyncio.create_task(self._score_and_group(to_score))
            self._scoring.add(task)
            task.add_done_callback(self._scoring_done)

    def _scoring_done(self, task: asyncio.Task) -> None:
        self._scoring.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._failure = task.exception()

    async def run(self) -> None:
        self._running = True
        while self._running:
            if self._failure is not None:
                raise self._failure  # surfaces in the driver's check_alive
            await self.step()

    def stop(self) -> None:
        self._running = False

    def stats(self) -> dict:
        scored = self.counters["samples_scored"]
        return {
            **self.counters,
            "reward_mean_all": self.rewards_sum / scored if scored else 0.0,
            "policy_version": self.policy_version,
            "open_groups": len(self._groups),
            "partial_samples": len(self._parts),
            "ready_groups": len(self._ready),
            "scoring_tasks": len(self._scoring),
        }
