"""The value-based strategy (PPO, VC-PPO, VAPO, T-PPO): every row gets values from the value
learner and (E)GAE advantages. With `window_training` (T-PPO) each window is a row as soon as it
arrives, finished or not; otherwise a row is a whole finished response. Every finished response
also goes to the value learner as a `ScoredTrajectory`. Rows are dropped one by one (failed
reward, value warm-up); a batch ends at its N-th finished row. With whole-response rows, a group
filter (`group_filter`: DAPO's dynamic sampling) may hold each group's rows until the group is
complete and drop it whole when its members all scored alike (the critic still learns from them)."""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field
from typing import Awaitable, Callable, ClassVar

import numpy as np

from asyncrl.assembly.decisions import Decision, ReadyBatch, Scored
from asyncrl.assembly.groups import group_drop_reason
from asyncrl.assembly.rows import (RunningMoments, cut_row_batch, kl_rewards, recorded_values, value_rows, whiten_rows,
                                   widen_positive_rows)
from asyncrl.config import DynamicSampling, GAEAdvantage, KLPenalty
from asyncrl.learning.tensors import segment_images
from asyncrl.messages.mailbox import RecentIds
from asyncrl.messages.structs import DropReason, ScoredTrajectory, Segment, TrainingRow, routed_row

# (rows, each row's prompt images or None) -> an answer per row.
Images = list[tuple[str, ...]] | None
ValuesFn = Callable[[list[tuple[np.ndarray, np.ndarray]], Images], Awaitable[tuple[list[np.ndarray], int]]]
LogprobsFn = Callable[[list[tuple[np.ndarray, np.ndarray]], Images], Awaitable[list[np.ndarray]]]


@dataclass(frozen=True)
class ValueEdges:
    """What the value-based strategy asks of the value learner (a Ray actor's methods, or an
    in-process learner's for `mode=learn`): queries only, never an effect."""

    values: ValuesFn
    ready: Callable[[], Awaitable[bool]]
    reference_logprobs: LogprobsFn

    @classmethod
    def of(cls, learner) -> "ValueEdges":
        """Edges to an in-process `ValueLearner`."""
        async def ready() -> bool:
            return learner.ready

        return cls(values=learner.values, ready=ready, reference_logprobs=learner.reference_logprobs)


@dataclass
class ValueStrategy:
    """PPO family: values from the value learner, (E)GAE per row, batches of N finished samples."""

    edges: ValueEdges
    gae: GAEAdvantage
    window_tokens: int  # engine.window_tokens (T-PPO's λ length of a cut row)
    rows_per_batch: int  # finished samples per batch (with all windows that arrived before them)
    advantage_fn: Callable | None = None  # ADVANTAGES["gae"].fn (EGAE)
    nll_whole_response: bool = False  # T-PPO with positive-example NLL: last rows carry the whole response
    kl: KLPenalty | None = None  # KL in the reward (the PPO baseline): β and the KL estimator
    group_filter: DynamicSampling | None = None  # dynamic sampling on whole-response rows
    needs_value_learner: ClassVar[bool] = True
    ready: bool = False
    _ready_rows: list[TrainingRow] = field(default_factory=list)
    _moments: RunningMoments = field(default_factory=RunningMoments)
    # Values of each in-flight sample's valued windows, by response offset (the critic's clip anchor).
    _recorded: dict[str, dict[int, np.ndarray]] = field(default_factory=lambda: collections.defaultdict(dict))
    _finished: RecentIds = field(default_factory=RecentIds)  # samples whose recorded values were used
    # The KL rewards of each in-flight sample's valued windows, by response offset (the critic's return).
    _recorded_kl: dict[str, dict[int, np.ndarray]] = field(default_factory=lambda: collections.defaultdict(dict))
    _kl_since_batch: list[float] = field(default_factory=lambda: [0.0, 0])  # KL reward sum, tokens
    _groups: dict[str, dict[int, tuple[Segment, Scored]]] = field(
        default_factory=lambda: collections.defaultdict(dict))  # group filter: rows waiting for their group

    @property
    def row_kind(self) -> str:
        return "windows" if self.gae.window_training else "responses"

    async def decide(self, rows: list[Segment], scored: list[Scored]) -> Decision:
        """Value and train rows; finished samples go to the value learner."""
        decision = Decision()
        outcomes = {s.sample.sample_id: s for s in scored}
        if not self.ready:
            self.ready = await self.edges.ready()
        if self.group_filter is not None:
            rows = self._filter_groups(rows, outcomes, decision)
        keep = []
        for row in rows:
            done = outcomes.get(row.sample_id) if row.finished else None
            if done is not None and done.reward.failed:
                decision.drop_row(row, DropReason.REWARD_FAILED)
            elif not self.ready:
                decision.drop_row(row, DropReason.VALUE_WARMUP)
            else:
                keep.append(row)
        if keep:
            await self._value(keep, outcomes, decision)
        decision.batches = self._batches()
        # The critic learns from real outcomes only.
        decision.trajectories = [await self._trajectory(s) for s in scored if not s.reward.failed]
        for s in scored:
            self._recorded.pop(s.sample.sample_id, None)
            self._recorded_kl.pop(s.sample.sample_id, None)
            self._finished.add(s.sample.sample_id)
        return decision

    def _filter_groups(self, rows: list[Segment], outcomes: dict[str, Scored], decision: Decision) -> list[Segment]:
        """Whole-response rows held until their group is complete; a group whose members all scored
        alike (no signal under group-relative comparison) or with a failed reward leaves whole."""
        ready = []
        for row in rows:
            group = self._groups[row.group_id]
            group[row.sample_idx] = (row, outcomes[row.sample_id])
            if len(group) < row.group_size:
                continue
            members = [group[i] for i in sorted(group)]
            del self._groups[row.group_id]
            decision.counters["groups_closed"] += 1
            reason = group_drop_reason([done.reward for _, done in members], self.group_filter)
            if reason is None:
                ready += [member for member, _ in members]
                continue
            decision.counters[f"dropped_{reason.value}_groups"] += 1
            for member, _ in members:
                decision.drop_row(member, reason)
        return ready

    async def _value(self, keep: list[Segment], outcomes: dict[str, Scored], decision: Decision) -> None:
        (values, value_version), kl = await asyncio.gather(self.edges.values([routed_row(r) for r in keep],
                                                                             segment_images(keep)),
                                                            self._kl_rewards(keep))
        for i, (row, v) in enumerate(zip(keep, values)):
            if row.sample_id not in self._finished:  # a later window's call may have ended it
                offset = len(row.prior_response_ids)
                self._recorded[row.sample_id][offset] = np.asarray(v[: len(row.new_token_ids)], dtype=np.float32)
                if kl is not None:
                    self._recorded_kl[row.sample_id][offset] = kl[i]
        trained = value_rows(keep, values, [outcomes[r.sample_id].outcome if r.finished else None for r in keep],
                             self.gae, self.window_tokens, value_version, kl, self.advantage_fn)
        if self.gae.window_training and self.nll_whole_response:
            trained = widen_positive_rows(trained)
        self._ready_rows.extend(trained)
        done = [r for r in keep if r.finished]
        for row in done:  # for the trajectory store: the values the response was trained with
            decision.values[row.sample_id] = recorded_values(self._recorded.get(row.sample_id, {}),
                                                             len(row.prior_response_ids) + len(row.new_token_ids))
        decision.keep([r.sample_id for r in done])
        decision.counters["rows_ready"] += len(trained)

    async def _kl_rewards(self, rows: list[Segment]) -> list[np.ndarray] | None:
        """`−β·KL_t` per token of each row (None when the KL is not in the reward)."""
        if self.kl is None:
            return None
        reference = await self.edges.reference_logprobs([routed_row(r) for r in rows], segment_images(rows))
        out = [kl_rewards(row, ref, self.kl) for row, ref in zip(rows, reference)]
        self._kl_since_batch[0] += float(sum(r.sum() for r in out))
        self._kl_since_batch[1] += sum(len(r) for r in out)
        return out

    async def _trajectory(self, done: Scored) -> ScoredTrajectory:
        """What the value learner trains on: the reward the policy is trained with (the shaped
        score, the process rewards and the KL penalty of every token), and the values recorded when
        its rows were valued, the anchor of the clipped value loss (None when a window was never
        valued: warm-up, a stale window)."""
        merged = done.sample
        n = len(merged.new_token_ids)
        values = recorded_values(self._recorded.get(merged.sample_id, {}), n)
        token_rewards = done.reward.token_rewards
        if self.kl is not None:
            kl = recorded_values(self._recorded_kl.get(merged.sample_id, {}), n)
            if kl is None:  # a window never valued (warm-up, stale): score the whole response now
                kl = (await self._kl_rewards([merged]))[0]
            dense = np.zeros(n, dtype=np.float32)
            if token_rewards is not None:
                dense[: min(n, len(token_rewards))] = token_rewards[:n]
            token_rewards = dense + kl
        return ScoredTrajectory(segment=merged, score=done.score, token_rewards=token_rewards,
                                correct=done.reward.correct, values=values)

    def _batches(self) -> list[ReadyBatch]:
        out = []
        while (cut := cut_row_batch(self._ready_rows, self.rows_per_batch)) is not None:
            taken, self._ready_rows = self._ready_rows[:cut], self._ready_rows[cut:]
            out.append(ReadyBatch(taken, {}))
        return out

    def finish_batch(self, rows: list[TrainingRow]) -> tuple[list[TrainingRow], dict[str, float]]:
        """Whiten (against the stream's recent moments) and clamp the rows that stayed; the stats of
        the batch as it leaves."""
        if self.gae.whiten:
            self._moments.update(rows)
            rows = whiten_rows(rows, self.gae.clamp, self._moments.mean, self._moments.var**0.5)
        elif self.gae.clamp > 0:
            rows = whiten_rows(rows, self.gae.clamp, 0.0, 1.0)  # clamp only
        done = [r for r in rows if r.segment.finished]
        return rows, {
            "reward_mean": sum(r.score for r in done) / max(len(done), 1),
            "accuracy": sum(bool(r.correct) for r in done) / max(len(done), 1),
            "finished_row_fraction": len(done) / len(rows),
            "value_version_min": float(min(r.value_version or 0 for r in rows)),
            **self._kl_stats(),
        }

    def _kl_stats(self) -> dict[str, float]:
        """Mean KL reward per token valued since the previous batch (KL in the reward only)."""
        if self.kl is None:
            return {}
        total, tokens = self._kl_since_batch
        self._kl_since_batch = [0.0, 0]
        return {"kl_reward_token_mean": total / tokens if tokens else 0.0}

    def stats(self) -> dict:
        return {"open_groups": len(self._groups), "ready_groups": 0, "ready_rows": len(self._ready_rows),
                "value_ready": self.ready}
