"""Trajectory assembler: collects the segments of each sample, asks the reward endpoint to score
finished samples, and turns them into `TrainBatch`es (the arithmetic is in `asyncrl.assembly`).

Two modes, by `algorithm.estimator`:
* `group` (GRPO/DAPO): a group of G finished samples becomes G rows with group-normalised
  advantages, or is dropped whole (stale, no signal).
* `gae` (PPO/VC-PPO/VAPO/T-PPO): every row gets values from the value learner and (E)GAE
  advantages. With `window_training` (T-PPO) each window is a row as soon as it arrives, finished
  or not; otherwise a row is a whole finished response. Every finished response also goes to the
  value learner as a `ScoredTrajectory`. Rows are dropped one by one (stale, value warm-up).

Segments are deduplicated by id (`prompt/sample/turn`), so a redelivered or regenerated segment is
counted once; a sample is scored once; a group or row is emitted or dropped once.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import numpy as np

from asyncrl.assembly import (AssemblySettings, Outcome, ValueAdvantageSettings, assemble_group, merge_segments,
                              RunningMoments, cut_row_batch, row_is_stale, value_rows, whiten_rows)
from asyncrl.learning import segment_row
from asyncrl.mailbox import Mailbox, RecentIds
from asyncrl.schema import PairRequest, Reward, RewardRequest, ScoredTrajectory, Segment, TrainBatch, TrainSample

ScoreFn = Callable[[list[RewardRequest]], Awaitable[list[Reward]]]
ValuesFn = Callable[[list[tuple[np.ndarray, np.ndarray]]], Awaitable[tuple[list[np.ndarray], int]]]
# Ledger events: (sample ids, new state, reason of a drop).
SamplesFn = Callable[[list[str], str, str], None]


@dataclass
class ValueMode:
    """What the `gae` mode needs: the value learner's endpoints and the advantage settings."""

    values: ValuesFn
    trajectories: Mailbox
    settings: ValueAdvantageSettings
    rows_per_batch: int  # finished samples per batch (with all windows that arrived before them)
    whiten: bool = False
    advantage_clamp: float = 0.0
    ready: bool = False  # the value learner finished its warm-up


@dataclass
class PairwiseMode:
    """What the `pairwise` estimator needs: a judge of `PairRequest`s (both orders, symmetrised)."""

    judge: Callable[[list[PairRequest]], Awaitable[list[dict]]]
    anchor: str = "group"  # group | reference


class Assembler:
    def __init__(self, segments: Mailbox, batches: Mailbox, score: ScoreFn, decode: Callable[[list[int]], str],
                 settings: AssemblySettings, prompts_per_batch: int,
                 on_samples: SamplesFn = lambda ids, state, reason: None,
                 value_mode: ValueMode | None = None, max_pending_tasks: int = 64,
                 pairwise_mode: PairwiseMode | None = None, batch_prefix: str = "batch"):
        self.segments = segments
        self.batches = batches
        self.score = score
        self.decode = decode
        self.settings = settings
        self.prompts_per_batch = prompts_per_batch
        self.on_samples = on_samples  # the ledger: where each sample went
        self.batch_prefix = batch_prefix  # unique per incarnation of a resumed run
        self.value_mode = value_mode
        self.pairwise_mode = pairwise_mode
        self.max_pending_tasks = max_pending_tasks
        self._ready_rows: list[TrainSample] = []
        self._moments = RunningMoments()
        self.policy_version = 0
        self._seen = RecentIds(200_000)
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
        self.last_reward_failure = ""
        # Reward over every sample scored since the last batch, dropped groups included: the policy's
        # reward. The batch's own mean is biased by dynamic sampling (kept groups are mixed).
        self._since_batch = [0.0, 0, 0]  # score sum, correct count, samples
        self._last_generated = {"reward_mean_generated": 0.0, "accuracy_generated": 0.0}

    def set_policy_version(self, version: int) -> None:
        self.policy_version = max(self.policy_version, version)

    def _generated_stats(self) -> dict[str, float]:
        """Reward and accuracy of every sample scored since the previous batch; when none was (two
        batches emitted back to back), the previous figures stand rather than a false 0."""
        total, correct, n = self._since_batch
        if n:
            self._last_generated = {"reward_mean_generated": total / n, "accuracy_generated": correct / n}
        return dict(self._last_generated)

    def set_value_ready(self) -> None:
        if self.value_mode is not None:
            self.value_mode.ready = True

    def _ingest(self, segments: list[Segment]) -> tuple[list[Segment], list[tuple[Segment, RewardRequest]]]:
        """New segments -> (rows to value, finished samples to score). Rows are used in `gae` mode only."""
        rows, to_score = [], []
        window_rows = self.value_mode is not None and self.value_mode.settings.window_training
        for seg in segments:
            if seg.msg_id in self._seen:
                self.counters["duplicate_segments"] += 1
                continue
            self._seen.add(seg.msg_id)
            self.counters["segments"] += 1
            self._parts[seg.sample_id].append(seg)
            if window_rows:
                rows.append(seg)
            if seg.finished:
                merged = merge_segments(self._parts.pop(seg.sample_id))
                self.on_samples([merged.sample_id], "awaiting_reward", "")
                if self.value_mode is not None and not window_rows:
                    rows.append(merged)
                to_score.append((merged, RewardRequest(
                    prompt_id=merged.prompt_id, sample_idx=merged.sample_idx,
                    response_text=self.decode(merged.new_token_ids.tolist()),
                    ground_truth=merged.ground_truth, data_source=merged.data_source,
                    prompt_text=self.decode(merged.prompt_token_ids.tolist()),
                    response_token_ids=merged.new_token_ids)))
        return rows, to_score

    def _note_scored(self, reward: Reward) -> None:
        self.counters["samples_scored"] += 1
        self.counters["reward_failures"] += int(reward.failed)
        if reward.failed:  # the counter says how many, this says why
            self.last_reward_failure = str(reward.details.get("error", ""))[:300]
        self.counters[f"rewards_by_version.{reward.source_version or reward.source}"] += 1
        self.rewards_sum += reward.score
        self._since_batch[0] += reward.score
        self._since_batch[1] += int(bool(reward.correct))
        self._since_batch[2] += 1

    async def _score_and_group(self, items: list[tuple[Segment, RewardRequest]]) -> None:
        rewards = await self.score([req for _, req in items])
        for (merged, _), reward in zip(items, rewards):
            self._note_scored(reward)
            group = self._groups[merged.group_id]
            group[merged.sample_idx] = (merged, reward)
            if len(group) == merged.group_size:
                if self.pairwise_mode is not None:
                    await self._close_pairwise_group(merged.group_id)
                else:
                    self._close_group(merged.group_id)
        await self._emit_ready()

    async def _close_pairwise_group(self, group_id: str) -> None:
        """Pairwise PPO: judge the group's responses against each other (or the reference) in both
        orders, and build advantages from the symmetrised win probabilities."""
        from asyncrl.algo.advantages import judged_pairs, pairwise_advantages, preference_matrix

        group = self._groups[group_id]
        members = [group[i] for i in sorted(group)]
        texts = [self.decode(m[0].new_token_ids.tolist()) for m in members]
        prompt = self.decode(members[0][0].prompt_token_ids.tolist())
        truth = members[0][0].ground_truth
        pairs = judged_pairs(len(members), self.pairwise_mode.anchor == "reference")
        requests = [PairRequest(prompt_text=prompt, first=texts[i], second=truth if j is None else texts[j],
                                ground_truth="" if j is None else truth) for i, j in pairs]
        verdicts = await self.pairwise_mode.judge(requests) if requests else []
        for v in verdicts:
            self.counters["pairs_judged"] += 1
            self.counters["pairs_inconsistent"] += int(not v["consistent"])
            self.counters["pairs_failed"] += int(v["failed"])
        prefs = preference_matrix(len(members), pairs, [v["p_first"] for v in verdicts])
        self._close_group(group_id, advantages=pairwise_advantages(prefs).tolist())

    async def _score_and_value(self, rows: list[Segment], items: list[tuple[Segment, RewardRequest]]) -> None:
        """`gae` mode: score finished samples, feed them to the value learner, value and train rows."""
        mode = self.value_mode
        outcomes: dict[str, Outcome] = {}
        trajectories = []
        if items:
            rewards = await self.score([req for _, req in items])
            for (merged, _), reward in zip(items, rewards):
                self._note_scored(reward)
                outcomes[merged.sample_id] = Outcome(reward.score, reward.correct, reward.token_rewards, reward.failed)
                if not reward.failed:  # the critic learns from real outcomes only
                    trajectories.append(ScoredTrajectory(segment=merged, score=reward.score,
                                                         token_rewards=reward.token_rewards, correct=reward.correct))
        keep = []
        for row in rows:
            outcome_failed = row.finished and outcomes.get(row.sample_id) is not None and \
                outcomes[row.sample_id].failed
            if outcome_failed:
                self._drop_row(row, "reward_failed")
            elif not mode.ready:
                self._drop_row(row, "value_warmup")
            elif row_is_stale(row, self.policy_version, mode.settings.max_staleness_versions):
                self._drop_row(row, "stale")
            else:
                keep.append(row)
        if keep:
            values, value_version = await mode.values([segment_row(r) for r in keep])
            trained = value_rows(keep, values, [outcomes.get(r.sample_id) if r.finished else None for r in keep],
                                 mode.settings, value_version)
            self._ready_rows.extend(trained)
            finished = [r.sample_id for r in keep if r.finished]
            if finished:
                self.on_samples(finished, "awaiting_training", "")
            self.counters["rows_ready"] += len(trained)
        await self._emit_ready_rows()
        # Last: a value learner behind the stream applies backpressure here (pending tasks then
        # throttle segment intake) without delaying the rows above.
        if trajectories:
            await mode.trajectories.put(trajectories)
            self.counters["trajectories_sent"] += len(trajectories)

    def _drop_row(self, row: Segment, reason: str) -> None:
        self.counters[f"dropped_{reason}_rows"] += 1
        if row.finished:
            # The sample ends here: count it and return its share of a prompt to the admission budget.
            self.counters[f"dropped_{reason}_samples"] += 1
            self.counters["samples_dropped"] += 1
            self.on_samples([row.sample_id], "dropped", reason)

    def _close_group(self, group_id: str, advantages: list[float] | None = None) -> None:
        group = self._groups.pop(group_id)
        members = [group[i] for i in sorted(group)]
        samples, rewards = [m[0] for m in members], [m[1] for m in members]
        train, reason, stats = assemble_group(samples, rewards, self.policy_version, self.settings, advantages)
        self.counters["groups_closed"] += 1
        if reason is not None:
            self.counters[f"dropped_{reason}_groups"] += 1
            self.counters[f"dropped_{reason}_samples"] += len(samples)
            self.counters["samples_dropped"] += len(samples)
            self.on_samples([m.sample_id for m in samples], "dropped", reason)
            return
        self.on_samples([m.sample_id for m in samples], "awaiting_training", "")
        self._ready.append(train)
        self._ready_stats.append({**stats, "reward_mean": sum(r.score for r in rewards) / len(rewards),
                                  "accuracy": sum(bool(r.correct) for r in rewards) / len(rewards)})

    async def _emit_ready(self) -> None:
        while len(self._ready) >= self.prompts_per_batch:
            groups, self._ready = self._ready[: self.prompts_per_batch], self._ready[self.prompts_per_batch:]
            stats, self._ready_stats = self._ready_stats[: self.prompts_per_batch], self._ready_stats[self.prompts_per_batch:]
            batch = TrainBatch(
                batch_id=f"{self.batch_prefix}-{self._batch_index}",
                samples=[s for g in groups for s in g],
                stats={
                    "reward_mean": sum(s["reward_mean"] for s in stats) / len(stats),
                    "accuracy": sum(s["accuracy"] for s in stats) / len(stats),
                    "staleness_max": max(s["staleness_max"] for s in stats),
                    **self._generated_stats(),
                    "assembled_at": time.time(),
                },
            )
            self._batch_index += 1
            self._since_batch = [0.0, 0, 0]
            await self.batches.put([batch])
            self.counters["batches"] += 1
            self.counters["samples_emitted"] += len(batch.samples)

    async def _emit_ready_rows(self) -> None:
        mode = self.value_mode
        while (cut := cut_row_batch(self._ready_rows, mode.rows_per_batch)) is not None:
            taken, self._ready_rows = self._ready_rows[:cut], self._ready_rows[cut:]
            # The bound holds when the batch leaves (rows may have waited here for the N-th sample).
            rows = []
            for r in taken:
                if row_is_stale(r.segment, self.policy_version, mode.settings.max_staleness_versions):
                    self._drop_row(r.segment, "stale")
                else:
                    rows.append(r)
            if not rows:
                continue
            if mode.whiten:
                self._moments.update(rows)
                rows = whiten_rows(rows, mode.advantage_clamp, self._moments.mean, self._moments.var**0.5)
            elif mode.advantage_clamp > 0:
                rows = whiten_rows(rows, mode.advantage_clamp, 0.0, 1.0)  # clamp only
            finished = [r for r in rows if r.segment.finished]
            oldest = min(int(r.segment.new_versions.min()) for r in rows if len(r.segment.new_versions)) \
                if any(len(r.segment.new_versions) for r in rows) else self.policy_version
            batch = TrainBatch(
                batch_id=f"{self.batch_prefix}-{self._batch_index}",
                samples=rows,
                stats={
                    "reward_mean": sum(r.score for r in finished) / max(len(finished), 1),
                    "accuracy": sum(bool(r.correct) for r in finished) / max(len(finished), 1),
                    "finished_row_fraction": len(finished) / len(rows),
                    "staleness_max": float(self.policy_version - oldest),
                    "value_version_min": float(min(r.value_version or 0 for r in rows)),
                    **self._generated_stats(),
                    "assembled_at": time.time(),
                },
            )
            self._batch_index += 1
            self._since_batch = [0.0, 0, 0]
            await self.batches.put([batch])
            self.counters["batches"] += 1
            self.counters["samples_emitted"] += len(finished)
            self.counters["rows_emitted"] += len(rows)

    async def step(self, timeout: float = 0.5) -> None:
        # Backpressure: while many scoring/valuing tasks are pending, stop taking segments.
        while len(self._scoring) >= self.max_pending_tasks and self._failure is None:
            await asyncio.sleep(0.01)
        segments = await self.segments.get(256, timeout=timeout)
        if not segments:
            return
        rows, to_score = self._ingest(segments)
        # Acknowledged once held here: from now on the assembler's state owns them.
        await self.segments.ack([s.msg_id for s in segments])
        if self.value_mode is not None:
            work = self._score_and_value(rows, to_score) if rows or to_score else None
        else:
            work = self._score_and_group(to_score) if to_score else None
        if work is not None:
            task = asyncio.create_task(work)
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
            "ready_rows": len(self._ready_rows),
            "value_ready": self.value_mode.ready if self.value_mode is not None else None,
            "last_reward_failure": self.last_reward_failure,
        }
