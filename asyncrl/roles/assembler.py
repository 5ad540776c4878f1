"""Trajectory assembler: collects the segments of each sample, has finished samples scored by the
reward router, and turns them into `TrainBatch`es through the run's advantage estimator.

The estimator is chosen by name from `ESTIMATORS` (`asyncrl.roles.estimators`), one explicit
mapping: `group` (GRPO/DAPO), `pairwise` (Pairwise PPO), `gae` (PPO/VC-PPO/VAPO/T-PPO). This
module holds what every estimator shares: intake and deduplication, scoring bookkeeping, the
ledger events of drops, and batch emission. The arithmetic is in `asyncrl.assembly`.

Segments are deduplicated by id (`prompt/sample/turn`), so a redelivered or regenerated segment is
counted once; a sample is scored once; a group or row is emitted or dropped once.

With a recorder (`trainer.record=true`), every finished sample's record (`asyncrl.store`) is sent
when its fate here is known: kept (sent to the learner), dropped (with the reason) or recorded
(`mode=generate`), with its reward and the values its advantages used.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import time
from typing import Awaitable, Callable

import numpy as np

from asyncrl.assembly import merge_segments
from asyncrl.mailbox import Mailbox, RecentIds
from asyncrl.roles.estimators import Estimator
from asyncrl.schema import Reward, RewardRequest, Segment, TrainBatch, TrainSample, sample_id
from asyncrl.store import TrajectoryRecord, record_of

ScoreFn = Callable[[list[RewardRequest]], Awaitable[list[Reward]]]
# The prompt source, told once per step: ledger events (sample ids, new state, reason of a drop) and
# samples' outcomes (prompt id, sample index, correct, score, failed) for its solve rates.
EventsFn = Callable[[list[tuple[list[str], str, str]], list[tuple[str, int, "bool | None", float, bool]]], None]
# The recorder: a list of `TrajectoryRecord`s, msgspec-encoded (nobody waits for it).
RecordFn = Callable[[list[TrajectoryRecord]], None]
# A sample's fate here, as the store names it.
RECORD_STATUS = {"awaiting_training": "kept", "dropped": "dropped", "recorded": "recorded"}


class _Unrecorded:
    """What a finished sample's record needs, gathered until its fate is known."""

    __slots__ = ("merged", "window_ends", "prompt_text", "response_text", "reward", "values")

    def __init__(self, merged: Segment, window_ends: list[int], prompt_text: str, response_text: str):
        self.merged, self.window_ends = merged, window_ends
        self.prompt_text, self.response_text = prompt_text, response_text
        self.reward: Reward | None = None
        self.values: np.ndarray | None = None


class Assembler:
    def __init__(self, segments: Mailbox, batches: Mailbox, score: ScoreFn, decode: Callable[[list[int]], str],
                 estimator: Estimator, events: EventsFn = lambda events, outcomes: None,
                 max_pending_tasks: int = 64, batch_prefix: str = "batch", record: RecordFn | None = None):
        self.segments = segments
        self.batches = batches
        self.score = score
        self.decode = decode
        self.estimator = estimator
        self.events = events  # the prompt source: where each sample went, and how it scored
        self._events: list[tuple[list[str], str, str]] = []
        self._outcomes: list[tuple[str, int, bool | None, float, bool]] = []
        self.record = record  # the trajectory store (None: not recording)
        self._unrecorded: dict[str, _Unrecorded] = {}
        self._records: list[TrajectoryRecord] = []
        self.batch_prefix = batch_prefix  # unique per incarnation of a resumed run
        self.max_pending_tasks = max_pending_tasks
        self.policy_version = 0
        self._seen = RecentIds(200_000)
        self._parts: dict[str, list[Segment]] = collections.defaultdict(list)  # sample id -> segments
        self._scoring: set[asyncio.Task] = set()
        self._batch_index = 0
        self._running = False
        self._failure: BaseException | None = None
        self.counters = collections.Counter()
        self.rewards_sum = 0.0
        self.last_reward_failure = ""
        # Reward over every sample scored since the last batch, dropped groups included: the policy's
        # reward. The batch's own mean is biased by dynamic sampling (kept groups are mixed).
        self._since_batch = [0.0, 0, 0, 0]  # score sum, correct count, samples, suspicious
        self._last_generated = {"reward_mean_generated": 0.0, "accuracy_generated": 0.0,
                                "reward_suspicious_share_generated": 0.0}

    def set_policy_version(self, version: int) -> None:
        self.policy_version = max(self.policy_version, version)

    # --- shared by the estimators -------------------------------------------------------------------

    def on_samples(self, sample_ids: list[str], state: str, reason: str = "") -> None:
        """A ledger event (sent with the step's others); a final one here also completes the
        samples' records."""
        self._events.append((list(sample_ids), state, reason))
        status = RECORD_STATUS.get(state)
        if self.record is None or status is None:
            return
        for sid in sample_ids:
            pending = self._unrecorded.pop(sid, None)
            if pending is not None:
                self._records.append(record_of(pending.merged, pending.window_ends, pending.reward,
                                               pending.prompt_text, pending.response_text, status, reason,
                                               pending.values, self.policy_version))

    def note_values(self, sid: str, values: np.ndarray | None) -> None:
        """The values a sample's advantages were computed with (value-based estimators), for its record."""
        pending = self._unrecorded.get(sid)
        if pending is not None:
            pending.values = values

    def flush_events(self) -> None:
        """Send the ledger events and outcomes gathered since the last call, in one call."""
        if self._events or self._outcomes:
            events, self._events = self._events, []
            outcomes, self._outcomes = self._outcomes, []
            self.events(events, outcomes)
            self.counters["event_calls"] += 1

    def _send_records(self):
        """Send the finished records (the recorder's call; what it returns can be awaited)."""
        if self._records:
            records, self._records = self._records, []
            self.counters["trajectories_recorded"] += len(records)
            return self.record(records)
        return None

    def note_scored(self, reward: Reward) -> None:
        self._outcomes.append((reward.prompt_id, reward.sample_idx, reward.correct, reward.score, reward.failed))
        if self.record is not None and (pending := self._unrecorded.get(sample_id(reward.prompt_id, reward.sample_idx))):
            pending.reward = reward
        self.counters["samples_scored"] += 1
        self.counters["reward_failures"] += int(reward.failed)
        if reward.failed:  # the counter says how many, this says why
            self.last_reward_failure = str(reward.details.get("error", ""))[:300]
        self.counters[f"rewards_by_version.{reward.source_version or reward.source}"] += 1
        for conduct in reward.suspicious:  # reward hacking, by kind
            self.counters[f"suspicious.{conduct}"] += 1
        self.counters["rewards_suspicious"] += int(bool(reward.suspicious))
        self.rewards_sum += reward.score
        self._since_batch[0] += reward.score
        self._since_batch[1] += int(bool(reward.correct))
        self._since_batch[2] += 1
        self._since_batch[3] += int(bool(reward.suspicious))

    def drop_samples(self, sample_ids: list[str], reason: str) -> None:
        """Samples that end here: counted, and their share of a prompt returns to the admission budget."""
        self.counters[f"dropped_{reason}_samples"] += len(sample_ids)
        self.counters["samples_dropped"] += len(sample_ids)
        self.on_samples(sample_ids, "dropped", reason)

    def drop_row(self, row: Segment, reason: str) -> None:
        self.counters[f"dropped_{reason}_rows"] += 1
        if row.finished:
            self.drop_samples([row.sample_id], reason)

    async def emit(self, samples: list[TrainSample], stats: dict[str, float], samples_emitted: int,
                   skip_reason: str = "") -> None:
        """One `TrainBatch` to the learner, with the reward of everything generated since the last
        one (no rows and a `skip_reason`: the learner skips the step, saying why)."""
        batch = TrainBatch(batch_id=f"{self.batch_prefix}-{self._batch_index}", samples=samples,
                           stats={**stats, **self._generated_stats(), "assembled_at": time.time()},
                           skip_reason=skip_reason)
        self._batch_index += 1
        self._since_batch = [0.0, 0, 0, 0]
        await self.batches.put([batch])
        self.counters["batches"] += 1
        self.counters["samples_emitted"] += samples_emitted
        self.counters["rows_emitted"] += len(samples)

    def _generated_stats(self) -> dict[str, float]:
        """Reward and accuracy of every sample scored since the previous batch; when none was (two
        batches emitted back to back), the previous figures stand rather than a false 0."""
        total, correct, n, suspicious = self._since_batch
        if n:
            # The share of rewards that came with a sign of reward hacking: a user sees it begin.
            self._last_generated = {"reward_mean_generated": total / n, "accuracy_generated": correct / n,
                                    "reward_suspicious_share_generated": suspicious / n}
        return dict(self._last_generated)

    # --- intake -----------------------------------------------------------------------------------

    def _ingest(self, segments: list[Segment]) -> tuple[list[Segment], list[tuple[Segment, RewardRequest]]]:
        """New segments -> (rows to value, finished samples to score). Rows exist for value-based
        estimators only: every window (T-PPO) or every finished response."""
        rows, to_score = [], []
        for seg in segments:
            if seg.msg_id in self._seen:
                self.counters["duplicate_segments"] += 1
                continue
            self._seen.add(seg.msg_id)
            self.counters["segments"] += 1
            self._parts[seg.sample_id].append(seg)
            if self.estimator.window_rows:
                rows.append(seg)
            if seg.finished:
                parts = self._parts.pop(seg.sample_id)
                merged = merge_segments(parts)
                self.on_samples([merged.sample_id], "awaiting_reward", "")
                if self.estimator.response_rows:
                    rows.append(merged)
                request = RewardRequest(
                    prompt_id=merged.prompt_id, sample_idx=merged.sample_idx,
                    response_text=self.decode(merged.new_token_ids.tolist()),
                    ground_truth=merged.ground_truth, data_source=merged.data_source,
                    prompt_text=self.decode(merged.prompt_token_ids.tolist()),
                    response_token_ids=merged.new_token_ids)
                to_score.append((merged, request))
                if self.record is not None:
                    ends = np.cumsum([len(p.new_token_ids) for p in parts]).tolist()
                    self._unrecorded[merged.sample_id] = _Unrecorded(merged, ends, request.prompt_text,
                                                                     request.response_text)
        return rows, to_score

    async def step(self, timeout: float = 0.5) -> None:
        # Backpressure: while many scoring/valuing tasks are pending, stop taking segments.
        while len(self._scoring) >= self.max_pending_tasks and self._failure is None:
            await asyncio.sleep(0.01)
        self.flush_events()  # what the estimators' tasks did since the last step, in one call
        if self.record is not None:
            self._send_records()
        segments = await self.segments.get(256, timeout=timeout)
        if not segments:
            return
        rows, to_score = self._ingest(segments)
        # Acknowledged once held here: from now on the assembler's state owns them.
        await self.segments.ack([s.msg_id for s in segments])
        if rows or to_score:
            task = asyncio.create_task(self.estimator.process(self, rows, to_score))
            self._scoring.add(task)
            task.add_done_callback(self._scoring_done)

    def _scoring_done(self, task: asyncio.Task) -> None:
        self._scoring.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._failure = task.exception()

    async def run(self) -> None:
        self._running = True
        try:
            while self._running:
                if self._failure is not None:
                    raise self._failure  # surfaces in the supervisor's check
                await self.step()
        finally:
            self.flush_events()
            if self.record is not None:
                # The last records are awaited: the run closes the store's files after this loop
                # ends, and calls from here reach the recorder in order, so every earlier one is in.
                last = self._send_records()
                if last is not None and inspect.isawaitable(last):
                    await last

    def stop(self) -> None:
        self._running = False

    def stats(self) -> dict:
        scored = self.counters["samples_scored"]
        return {
            **self.counters,
            "reward_mean_all": self.rewards_sum / scored if scored else 0.0,
            "policy_version": self.policy_version,
            "partial_samples": len(self._parts),
            "scoring_tasks": len(self._scoring),
            "unrecorded_samples": len(self._unrecorded),
            "last_reward_failure": self.last_reward_failure,
            **self.estimator.stats(),
        }
