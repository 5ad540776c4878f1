"""Trajectory assembler: collects the segments of each sample, has finished samples scored by the
reward router, and turns them into `TrainBatch`es through the run's assembly strategy (the role,
its builder, its Ray shell).

The strategy decides (`asyncrl.assembly`: kept, dropped with a reason, ready batches, trajectories
for the critic); this role alone acts on what it decides: the ledger events (sent to the prompt
source in one call per step), the counters, the trajectory store, the staleness mask (once, as a
batch leaves: against the weight version it was told last) and the batches. Overlong shaping is
applied here, once, when a reward arrives; a prompt's data row is fetched once, for the reward
calls (`asyncrl.assembly.prompt_rows`).

Segments are deduplicated by id (`prompt/sample/turn`, per generator), so a redelivered segment is
counted once; a sample is scored once; a group or row is emitted or dropped once. One copy of a
sample is kept (`asyncrl.assembly.copies`): two exist when a prompt's lease ran out while its
generator still worked on it, or when a generator left the pool (`retire_generator`) and its
unacknowledged prompts went to another; the first copy to finish is the sample. A retired
generator's segments are still taken: what it finished counts. With a recorder, every finished
sample's record (`asyncrl.storage.trajectory_store`) is sent when its fate here is known: kept,
dropped (with the reason) or recorded (`mode=generate`), with its reward and values.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import time
from typing import Any, Awaitable, Callable

import msgspec
import numpy as np
import torch

from actors.base import RoleShell
from asyncrl.algo.shaping import shaped_score
from asyncrl.assembly.copies import SampleCopies
from asyncrl.assembly.decisions import AssemblyStrategy, Decision, ReadyBatch, Scored
from asyncrl.assembly.prompt_rows import PromptRows, scoring_with_rows
from asyncrl.assembly.reward_tally import RewardTally
from asyncrl.assembly.rows import merge_segments
from asyncrl.assembly.strategies import build_strategy
from asyncrl.assembly.values import ValueEdges
from asyncrl.config import (NO_BOUND, AlgorithmConfig, EngineConfig, ModelConfig, OverlongShaping, RewardConfig,
                            RouteConfig, route_checks)
from asyncrl.engines.generation import decode
from asyncrl.messages.mailbox import Mailbox
from asyncrl.messages.structs import (DropReason, Reward, RewardRequest, SampleState, Segment, TrainBatch, final_turn_start,
                                      sample_id)
from asyncrl.models.loading import load_tokenizer
from asyncrl.rewards.hybrid import RewardRouter, build_reward_router
from asyncrl.staleness import has_trained_tokens, mask_stale_tokens
from asyncrl.storage.trajectory_store import PendingRecord, TrajectoryRecord, record_of

ScoreFn = Callable[[list[RewardRequest]], Awaitable[list[Reward]]]
# The prompt source, told once per step: ledger events (sample ids, new state, reason of a drop) and
# samples' outcomes (prompt id, sample index, correct, score, failed) for its retirement rule.
EventsFn = Callable[[list[tuple[list[str], SampleState, "DropReason | None"]],
                     list[tuple[str, int, "bool | None", float, bool]]], None]
# The recorder: a list of `TrajectoryRecord`s (nobody waits for it).
StoreTrajectoriesFn = Callable[[list[TrajectoryRecord]], Any]
# A sample's fate here, as the store names it.
RECORD_STATUS = {SampleState.AWAITING_TRAINING: "kept", SampleState.DROPPED: "dropped",
                 SampleState.RECORDED: "recorded"}


class Assembler:
    def __init__(self, segments: Mailbox, batches: Mailbox, score: ScoreFn, decode: Callable[[list[int]], str],
                 strategy: AssemblyStrategy, overlong: OverlongShaping, max_response_tokens: int,
                 max_staleness_versions: int = NO_BOUND,
                 events: EventsFn = lambda events, outcomes: None, trajectories: Mailbox | None = None,
                 max_pending_tasks: int = 64, batch_prefix: str = "batch",
                 store_trajectories: StoreTrajectoriesFn | None = None, synchronous: bool = False):
        self.segments, self.batches, self.trajectories = segments, batches, trajectories
        self.score, self.decode = score, decode
        self.strategy = strategy
        self.overlong, self.max_response_tokens = overlong, max_response_tokens  # DAPO's shaping, applied once
        self.max_staleness_versions = max_staleness_versions
        self.events = events  # the prompt source: where each sample went, and how it scored
        self._events: list[tuple[list[str], SampleState, DropReason | None]] = []
        self._outcomes: list[tuple[str, int, bool | None, float, bool]] = []
        self.store_trajectories = store_trajectories  # the trajectory store (None: not storing)
        self._unrecorded: dict[str, PendingRecord] = {}
        self._records: list[TrajectoryRecord] = []
        self.batch_prefix = batch_prefix  # unique per incarnation of a resumed run
        self.max_pending_tasks = max_pending_tasks
        # The staleness mask is measured against the weights being trained (the learner's version);
        # the synchronous baseline's batches against the weights every generator holds.
        self.synchronous = synchronous
        self.weight_version = 0
        self._copies = SampleCopies()  # one copy of each sample
        self._tasks: set[asyncio.Task] = set()
        self._batch_index = 0
        self._running = False
        self._failure: BaseException | None = None
        self.counters = collections.Counter()
        self.rewards = RewardTally()  # what the rewards say, overall and since the last batch

    def set_versions(self, weight_version: int, delivered_version: int) -> None:
        """The learner's versions (the one conduit); the staleness mask reads one of them."""
        self.weight_version = max(self.weight_version, delivered_version if self.synchronous else weight_version)

    # --- acting on decisions --------------------------------------------------------------------------

    async def _process(self, rows: list[Segment], to_score: list[tuple[Segment, RewardRequest]]) -> None:
        """Score the finished samples, shape their rewards once, let the strategy decide, act on it."""
        scored = []
        if to_score:
            rewards = await self.score([request for _, request in to_score])
            for (merged, _), reward in zip(to_score, rewards):
                self._note_scored(reward, merged.data_source)
                scored.append(Scored(merged, reward, shaped_score(
                    reward.score, len(merged.new_token_ids), self.max_response_tokens,
                    self.overlong.buffer_tokens, self.overlong.penalty_factor)))
        await self._act(await self.strategy.decide(rows, scored))

    async def _act(self, decision: Decision) -> None:
        for sid, values in decision.values.items():  # for the store: the values the sample was valued with
            if (pending := self._unrecorded.get(sid)) is not None:
                pending.values = values
        if decision.kept:
            self._event(decision.kept, SampleState.AWAITING_TRAINING)
        for sample_ids, reason in decision.dropped:
            self._drop(sample_ids, reason)
        for row, reason in decision.dropped_rows:
            self._drop_row(row, reason)
        if decision.recorded:
            self._event(decision.recorded, SampleState.RECORDED)
        self.counters.update(decision.counters)
        for batch in decision.batches:
            await self._emit(batch)
        # Last: a value learner behind the stream applies backpressure here (pending tasks then
        # throttle segment intake) without delaying the rows above.
        if decision.trajectories:
            await self.trajectories.put(decision.trajectories)
            self.counters["trajectories_sent"] += len(decision.trajectories)
            self.counters["trajectories_with_recorded_values"] += sum(t.values is not None for t in decision.trajectories)

    def _event(self, sample_ids: list[str], state: SampleState, reason: DropReason | None = None) -> None:
        """A ledger event (sent with the step's others); a final one here also completes the
        samples' records."""
        self._events.append((list(sample_ids), state, reason))
        # A kept sample is recorded when its batch goes out: the staleness mask may still drop it.
        if state != SampleState.AWAITING_TRAINING:
            self._complete_records(sample_ids, state, reason)

    def _complete_records(self, sample_ids: list[str], state: SampleState, reason: DropReason | None = None) -> None:
        status = RECORD_STATUS.get(state)
        if self.store_trajectories is None or status is None:
            return
        for sid in sample_ids:
            pending = self._unrecorded.pop(sid, None)
            if pending is not None:
                self._records.append(record_of(pending.merged, pending.window_ends, pending.reward,
                                               pending.prompt_text, pending.response_text, status,
                                               reason.value if reason else "", pending.values, self.weight_version))

    def _drop(self, sample_ids: list[str], reason: DropReason) -> None:
        """Samples that end here: counted, and their share of a prompt returns to the admission budget."""
        self.counters[f"dropped_{reason.value}_samples"] += len(sample_ids)
        self.counters["samples_dropped"] += len(sample_ids)
        self._event(sample_ids, SampleState.DROPPED, reason)

    def _drop_row(self, row: Segment, reason: DropReason) -> None:
        self.counters[f"dropped_{reason.value}_rows"] += 1
        if row.finished:
            self._drop([row.sample_id], reason)

    async def _emit(self, batch: ReadyBatch) -> None:
        """One `TrainBatch` to the learner: its tokens too stale for the weights it will train
        masked (rows left with none are dropped), finished by the strategy, with the reward of
        everything generated since the last one. No rows and a `skip_reason`: the learner skips the
        step, saying why."""
        rows, stats = batch.rows, dict(batch.stats)
        if rows:
            masked, stale = mask_stale_tokens(rows, self.weight_version, self.max_staleness_versions)
            rows = []
            for before, row in zip(batch.rows, masked):
                if has_trained_tokens(before) and not has_trained_tokens(row):
                    self._drop_row(row.segment, DropReason.STALE)
                else:
                    rows.append(row)
            self._complete_records([r.segment.sample_id for r in rows if r.segment.finished],
                                   SampleState.AWAITING_TRAINING)
            if not rows:
                return
            rows, finished_stats = self.strategy.finish_batch(rows)
            stats.update(finished_stats, staleness_max_assembled=stale["staleness_max"],
                         stale_tokens_masked_assembled=stale["stale_tokens_masked"])
        out = TrainBatch(batch_id=f"{self.batch_prefix}-{self._batch_index}", rows=rows,
                         stats={**stats, **self.rewards.generated_stats(), "assembled_at": time.time()},
                         skip_reason=batch.skip_reason)
        self._batch_index += 1
        self.rewards.batch_sent()
        await self.batches.put([out])
        self.counters["batches"] += 1
        self.counters["samples_emitted"] += sum(r.segment.finished for r in rows)
        self.counters["rows_emitted"] += len(rows)

    def _note_scored(self, reward: Reward, data_source: str = "") -> None:
        self._outcomes.append((reward.prompt_id, reward.sample_idx, reward.correct, reward.score, reward.failed))
        if self.store_trajectories is not None and (
                pending := self._unrecorded.get(sample_id(reward.prompt_id, reward.sample_idx))):
            pending.reward = reward
        self.rewards.add(reward, data_source)

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
            return self.store_trajectories(records)
        return None

    # --- intake -----------------------------------------------------------------------------------

    def _ingest(self, segments: list[Segment]) -> tuple[list[Segment], list[tuple[Segment, RewardRequest]]]:
        """New segments -> (rows for the strategy, finished samples to score). Rows exist for the
        value-based strategy only: every window (T-PPO) or every finished response."""
        rows, to_score = [], []
        for seg in segments:
            taken, parts = self._copies.add(seg)
            if taken and self.strategy.row_kind == "windows" and self._copies.is_row(seg):
                rows.append(self._copies.with_prior_routes(seg, parts))
            if parts is not None:
                self._finish(parts, rows, to_score)
        return rows, to_score

    def _finish(self, parts: list[Segment], rows: list[Segment], to_score: list[tuple[Segment, RewardRequest]]) -> None:
        """A copy finished first: it is the sample (merged, to be scored)."""
        merged = merge_segments(parts)
        self._event([merged.sample_id], SampleState.AWAITING_REWARD)
        if self.strategy.row_kind == "responses":
            rows.append(merged)
        # An episode is judged on its final turn (what the policy answered after its last
        # observation), so an answer the tool printed is not the policy's answer.
        request = RewardRequest(
            prompt_id=merged.prompt_id, sample_idx=merged.sample_idx,
            response_text=self.decode(merged.new_token_ids[final_turn_start(merged.new_observation):].tolist()),
            ground_truth=merged.ground_truth, data_source=merged.data_source,
            prompt_text=self.decode(merged.prompt_token_ids.tolist()),
            response_token_ids=merged.new_token_ids, row=merged.row)
        to_score.append((merged, request))
        if self.store_trajectories is not None:
            ends = np.cumsum([len(p.new_token_ids) for p in parts]).tolist()
            transcript = (self.decode(merged.new_token_ids.tolist()) if merged.new_observation is not None
                          else request.response_text)  # an episode's: every turn and observation
            self._unrecorded[merged.sample_id] = PendingRecord(merged, ends, request.prompt_text, transcript)

    def retire_generator(self, generator_id: str) -> int:
        """A generator left the pool. Nothing of it is dropped: what it finished counts (its segments
        may still be on their way), and its partial copies wait for another copy of their sample to
        finish (its unacknowledged prompts go to another generator). Returns how many partial
        copies it leaves."""
        self.counters["generators_retired"] += 1
        return self._copies.retire(generator_id)

    async def step(self, timeout: float = 0.5) -> None:
        # Backpressure: while many scoring/valuing tasks are pending, stop taking segments.
        while len(self._tasks) >= self.max_pending_tasks and self._failure is None:
            await asyncio.sleep(0.01)
        self.flush_events()  # what the tasks decided since the last step, in one call
        if self.store_trajectories is not None:
            self._send_records()
        segments = await self.segments.get(256, timeout=timeout)
        if not segments:
            return
        rows, to_score = self._ingest(segments)
        # Acknowledged once held here: from now on the assembler's state owns them.
        await self.segments.ack([s.msg_id for s in segments])
        if rows or to_score:
            task = asyncio.create_task(self._process(rows, to_score))
            self._tasks.add(task)
            task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._failure = task.exception()

    async def run(self) -> None:
        self._running = True
        try:
            while self._running:
                if self._failure is not None:
                    raise self._failure  # surfaces in the run's health check
                await self.step()
        finally:
            self.flush_events()
            if self.store_trajectories is not None:
                # The last records are awaited: the run closes the store's files after this loop
                # ends, and calls from here reach the recorder in order, so every earlier one is in.
                last = self._send_records()
                if last is not None and inspect.isawaitable(last):
                    await last

    def stop(self) -> None:
        self._running = False

    def stats(self) -> dict:
        return {
            **self.counters,
            **self._copies.counters,
            **self.rewards.stats(),
            "weight_version": self.weight_version,
            "partial_samples": len(self._copies),
            "scoring_tasks": len(self._tasks),
            "unrecorded_samples": len(self._unrecorded),
            **self.strategy.stats(),
        }


def build_assembler(model: ModelConfig, algorithm: AlgorithmConfig, engine: EngineConfig, router: RewardRouter,
                    prompts_per_step: int, segments: Mailbox, batches: Mailbox, value_edges: ValueEdges | None = None,
                    trajectories: Mailbox | None = None, events: EventsFn = lambda events, outcomes: None,
                    store_trajectories: StoreTrajectoriesFn | None = None, batch_prefix: str = "batch",
                    mode: str = "train", synchronous: bool = False, rows: PromptRows | None = None) -> Assembler:
    """`rows`: the prompts' data rows, fetched once per prompt for the reward calls (None: a
    request carries what its segment brought)."""
    tokenizer = load_tokenizer(model)

    def decode_ids(ids):
        return decode(tokenizer, ids)

    strategy = build_strategy(algorithm, engine, prompts_per_step, router, decode_ids, value_edges, mode)
    score = router.score if rows is None else scoring_with_rows(router.score, rows)
    return Assembler(segments, batches, score, decode_ids, strategy, algorithm.overlong,
                     engine.max_response_tokens,
                     max_staleness_versions=algorithm.max_staleness_versions if mode == "train" else NO_BOUND,
                     events=events, trajectories=trajectories, batch_prefix=batch_prefix,
                     store_trajectories=store_trajectories, synchronous=synchronous)


class AssemblerActor(RoleShell):
    """Edges: `value_learner` (values, readiness, reference log-probs), the `ledger` (prompt
    source), the `recorder` (the trajectory store, when recording)."""

    def __init__(self, model: ModelConfig, algorithm: AlgorithmConfig, engine: EngineConfig, reward: RewardConfig,
                 prompts_per_step: int, segments: Mailbox, batches: Mailbox, endpoints: dict[str, Any],
                 ledger, value_learner=None, trajectories: Mailbox | None = None, batch_prefix: str = "batch",
                 recorder=None, mode: str = "train", synchronous: bool = False):
        from asyncrl.storage.trajectory_store import RECORDS_ENCODER

        torch.set_num_threads(1)
        self.router = build_reward_router(reward, endpoints)
        self.endpoint_names = set(reward.endpoints)
        edges = None
        if value_learner is not None:  # (a Ray call's reference is awaitable: the edges are the calls)
            edges = ValueEdges(values=value_learner.values.remote, ready=value_learner.ready.remote,
                               reference_logprobs=value_learner.reference_logprobs.remote)
        def store_trajectories(records):  # nobody waits (but at stop): the recorder writes at its own pace
            return recorder.add_trajectories.remote(RECORDS_ENCODER.encode(records))

        self.prompt_rows = PromptRows(ledger.rows.remote)
        self.inner = build_assembler(model, algorithm, engine, self.router, prompts_per_step, segments, batches, edges,
                                     trajectories, lambda events, outcomes: ledger.record_events.remote(events, outcomes),
                                     store_trajectories if recorder is not None else None, batch_prefix, mode,
                                     synchronous, self.prompt_rows)

    def set_versions(self, weight_version: int, delivered_version: int) -> None:
        self.inner.set_versions(weight_version, delivered_version)

    def retire_generator(self, generator_id: str) -> int:
        return self.inner.retire_generator(generator_id)

    def set_reward_routes(self, routes: list[dict]) -> list[dict]:
        """Admin: change the hybrid mix while training runs (validated like the config)."""
        try:
            parsed = msgspec.convert(routes, list[RouteConfig])
        except msgspec.ValidationError as exc:
            raise ValueError(f"reward routes: {exc}") from exc
        errors = [message for ok, message in route_checks(parsed, self.endpoint_names) if not ok]
        if errors:
            raise ValueError("; ".join(errors))
        self.router.set_routes(parsed)
        return msgspec.to_builtins(parsed)

    def stats(self) -> dict:
        return {**super().stats(), "reward_router": self.router.stats(), "prompt_rows_fetched": self.prompt_rows.fetched}

    def reward_health(self) -> dict:
        """Small, read at every poll: samples scored, rewards failed, each endpoint's first failure."""
        tally = self.inner.rewards.counters
        return {"samples_scored": tally["samples_scored"], "reward_failures": tally["reward_failures"],
                "endpoints": self.router.failures()}
