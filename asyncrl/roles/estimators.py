"""The advantage estimators of the assembler, chosen by `algorithm.estimator` through `ESTIMATORS`.

* `group` (GRPO/DAPO): a group of G finished samples becomes G rows with group-normalised
  advantages, or is dropped whole (stale, failed reward, no signal).
* `pairwise` (Pairwise PPO): the same groups, with advantages from a pairwise judge's symmetrised
  win probabilities instead of the scores.
* `gae` (PPO/VC-PPO/VAPO/T-PPO): every row gets values from the value learner and (E)GAE
  advantages. With `window_training` (T-PPO) each window is a row as soon as it arrives, finished
  or not; otherwise a row is a whole finished response. Every finished response also goes to the
  value learner as a `ScoredTrajectory`. Rows are dropped one by one (stale, value warm-up).

Each estimator is told by the assembler of new rows and finished samples (`process`) and calls
back into it to count, drop and emit; the maths are the pure functions of `asyncrl.assembly`.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field
from typing import Awaitable, Callable, ClassVar, Protocol

import numpy as np

from asyncrl.assembly import (AssemblySettings, KLRewardSettings, Outcome, RunningMoments, ValueAdvantageSettings,
                              assemble_group, cut_row_batch, kl_rewards, recorded_values, shaped_score, value_rows,
                              whiten_rows, widen_positive_rows)
from asyncrl.mailbox import Mailbox, RecentIds
from asyncrl.tasks import reference_response
from asyncrl.schema import PairRequest, Reward, RewardRequest, ScoredTrajectory, Segment, TrainSample, segment_row
from asyncrl.staleness import all_stale, has_trained_tokens, mask_stale_tokens

Scored = list[tuple[Segment, RewardRequest]]
ValuesFn = Callable[[list[tuple[np.ndarray, np.ndarray]]], Awaitable[tuple[list[np.ndarray], int]]]
LogprobsFn = Callable[[list[tuple[np.ndarray, np.ndarray]]], Awaitable[list[np.ndarray]]]
JudgeFn = Callable[[list[PairRequest]], Awaitable[list[dict]]]


class Assembler(Protocol):
    """What an estimator uses of the assembler (`asyncrl.roles.assembler.Assembler`)."""

    policy_version: int
    counters: collections.Counter
    score: Callable[[list[RewardRequest]], Awaitable[list[Reward]]]
    decode: Callable[[list[int]], str]

    def on_samples(self, sample_ids: list[str], state: str, reason: str = "") -> None: ...

    def note_scored(self, reward: Reward) -> None: ...

    def note_values(self, sid: str, values: np.ndarray | None) -> None: ...

    def drop_samples(self, sample_ids: list[str], reason: str) -> None: ...

    def drop_row(self, row: Segment, reason: str) -> None: ...

    async def emit(self, samples: list[TrainSample], stats: dict[str, float], samples_emitted: int,
                   skip_reason: str = "") -> None: ...


class Estimator(Protocol):
    needs_value_learner: ClassVar[bool]  # the run starts a value learner for it
    window_rows: bool  # every window is a row as it arrives (T-PPO)
    response_rows: bool  # every finished response is a row (value-based, not window training)

    async def process(self, asm: Assembler, rows: list[Segment], scored: Scored) -> None: ...

    def stats(self) -> dict: ...


@dataclass
class GroupEstimator:
    """GRPO/DAPO: group-normalised outcomes; `close_group` is where Pairwise PPO differs."""

    settings: AssemblySettings
    prompts_per_batch: int
    needs_value_learner: ClassVar[bool] = False
    window_rows: bool = False
    response_rows: bool = False
    _groups: dict[str, dict[int, tuple[Segment, Reward]]] = field(default_factory=lambda: collections.defaultdict(dict))
    _ready: list[list[TrainSample]] = field(default_factory=list)
    _ready_stats: list[dict[str, float]] = field(default_factory=list)
    _closed_since_batch: int = 0  # groups closed (kept or dropped) since the last batch left

    async def process(self, asm: Assembler, rows: list[Segment], scored: Scored) -> None:
        if scored:
            rewards = await asm.score([req for _, req in scored])
            for (merged, _), reward in zip(scored, rewards):
                asm.note_scored(reward)
                group = self._groups[merged.group_id]
                group[merged.sample_idx] = (merged, reward)
                if len(group) == merged.group_size:
                    await self.close_group(asm, merged.group_id)
                    await self._emit_ready(asm)  # after each group: the refill bound is exact
        await self._emit_ready(asm)

    async def close_group(self, asm: Assembler, group_id: str) -> None:
        self._close(asm, group_id, None)

    def _close(self, asm: Assembler, group_id: str, advantages: list[float] | None) -> None:
        group = self._groups.pop(group_id)
        members = [group[i] for i in sorted(group)]
        samples, rewards = [m[0] for m in members], [m[1] for m in members]
        train, reason, stats = assemble_group(samples, rewards, asm.policy_version, self.settings, advantages)
        asm.counters["groups_closed"] += 1
        self._closed_since_batch += 1
        if reason is not None:
            asm.counters[f"dropped_{reason}_groups"] += 1
            asm.drop_samples([m.sample_id for m in samples], reason)
            return
        asm.on_samples([m.sample_id for m in samples], "awaiting_training", "")
        self._ready.append(train)
        self._ready_stats.append({**stats, "reward_mean": sum(r.score for r in rewards) / len(rewards),
                                  "accuracy": sum(bool(r.correct) for r in rewards) / len(rewards)})

    def _refill_exhausted(self) -> bool:
        """Bounded refill: `max_refill_rounds` generation rounds closed since the last batch."""
        rounds = self.settings.max_refill_rounds
        return rounds > 0 and self._closed_since_batch >= rounds * self.prompts_per_batch

    async def _emit_ready(self, asm: Assembler) -> None:
        n = self.prompts_per_batch
        while len(self._ready) >= n or (self._refill_exhausted() and len(self._ready) < n):
            rounds = self._closed_since_batch / n
            groups, self._ready = self._ready[:n], self._ready[n:]
            stats, self._ready_stats = self._ready_stats[:n], self._ready_stats[n:]
            self._closed_since_batch = 0
            samples = [s for g in groups for s in g]
            if not groups:
                # Nothing with a learning signal in `max_refill_rounds` rounds: the learner skips the
                # step and says why (never a silent spin; prompt retirement removes the cause).
                asm.counters["steps_skipped_no_signal"] += 1
                await asm.emit([], {"refill_rounds": rounds}, samples_emitted=0,
                               skip_reason=f"no group with a learning signal in {rounds:.0f} generation rounds "
                                           f"(algorithm.max_refill_rounds)")
                continue
            if len(groups) < n:
                asm.counters["batches_partial"] += 1
            await asm.emit(samples, {
                "reward_mean": sum(s["reward_mean"] for s in stats) / len(stats),
                "accuracy": sum(s["accuracy"] for s in stats) / len(stats),
                "staleness_max_assembled": max(s["staleness_max"] for s in stats),
                "stale_tokens_masked_assembled": sum(s["stale_tokens_masked"] for s in stats),
                "refill_rounds": rounds, "groups_in_batch": float(len(groups)),
            }, samples_emitted=len(samples))

    def stats(self) -> dict:
        return {"open_groups": len(self._groups), "ready_groups": len(self._ready), "ready_rows": 0,
                "value_ready": None}


@dataclass
class PairwiseEstimator(GroupEstimator):
    """Pairwise PPO: judge each closed group's responses against each other (or the reference) in
    both orders; advantages from the symmetrised win probabilities."""

    judge: JudgeFn | None = None
    anchor: str = "group"  # group | reference

    async def close_group(self, asm: Assembler, group_id: str) -> None:
        from asyncrl.algo.advantages import judged_pairs, pairwise_advantages, preference_matrix

        group = self._groups[group_id]
        members = [group[i] for i in sorted(group)]
        texts = [asm.decode(m[0].new_token_ids.tolist()) for m in members]
        prompt = asm.decode(members[0][0].prompt_token_ids.tolist())
        truth = members[0][0].ground_truth
        pairs = judged_pairs(len(members), self.anchor == "reference")
        reference = reference_response(members[0][0].data_source, truth)
        requests = [PairRequest(prompt_text=prompt, first=texts[i], second=reference if j is None else texts[j],
                                ground_truth="" if j is None else truth) for i, j in pairs]
        verdicts = await self.judge(requests) if requests else []
        for v in verdicts:
            asm.counters["pairs_judged"] += 1
            asm.counters["pairs_inconsistent"] += int(not v["consistent"])
            asm.counters["pairs_failed"] += int(v["failed"])
        if any(v["failed"] for v in verdicts):
            # A failed judgement has no verdict: a neutral 0.5 would be trained as a real tie, and
            # every advantage of the group depends on it (as a failed reward drops a group).
            self._groups.pop(group_id)
            asm.counters["groups_closed"] += 1
            asm.counters["dropped_reward_failed_groups"] += 1
            asm.drop_samples([m[0].sample_id for m in members], "reward_failed")
            return
        prefs = preference_matrix(len(members), pairs, [v["p_first"] for v in verdicts])
        self._close(asm, group_id, pairwise_advantages(prefs).tolist())


@dataclass(frozen=True)
class ValueEdges:
    """What a value-based estimator asks of the value learner (a Ray actor's methods, or an
    in-process learner's for `mode=learn`)."""

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
class ValueEstimator:
    """PPO family: values from the value learner, (E)GAE per row, batches of N finished samples."""

    values: ValuesFn
    value_ready: Callable[[], Awaitable[bool]]  # asked until the value learner's warm-up is over
    trajectories: Mailbox  # finished, scored responses for the value learner
    settings: ValueAdvantageSettings
    rows_per_batch: int  # finished samples per batch (with all windows that arrived before them)
    whiten: bool = False
    advantage_clamp: float = 0.0
    nll_whole_response: bool = False  # T-PPO with positive-example NLL: last rows carry the whole response
    # KL in the reward (the PPO baseline): the reference's log-probs of rows' tokens, and β.
    reference_logprobs: LogprobsFn | None = None
    kl: KLRewardSettings | None = None
    needs_value_learner: ClassVar[bool] = True
    ready: bool = False
    _ready_rows: list[TrainSample] = field(default_factory=list)
    _moments: RunningMoments = field(default_factory=RunningMoments)
    # Values of each in-flight sample's valued windows, by response offset (the critic's clip anchor).
    _recorded: dict[str, dict[int, np.ndarray]] = field(default_factory=lambda: collections.defaultdict(dict))
    _finished: RecentIds = field(default_factory=RecentIds)  # samples whose recorded values were used
    # The KL rewards of each in-flight sample's valued windows, by response offset (the critic's return).
    _recorded_kl: dict[str, dict[int, np.ndarray]] = field(default_factory=lambda: collections.defaultdict(dict))
    _kl_since_batch: list[float] = field(default_factory=lambda: [0.0, 0])  # KL reward sum, tokens

    @property
    def window_rows(self) -> bool:
        return self.settings.window_training

    @property
    def response_rows(self) -> bool:
        return not self.settings.window_training

    async def process(self, asm: Assembler, rows: list[Segment], scored: Scored) -> None:
        """Score finished samples, value and train rows, feed finished samples to the value learner."""
        st = self.settings
        outcomes: dict[str, Outcome] = {}
        finished: list[tuple[Segment, Reward]] = []
        if scored:
            rewards = await asm.score([req for _, req in scored])
            for (merged, _), reward in zip(scored, rewards):
                asm.note_scored(reward)
                outcomes[merged.sample_id] = Outcome(reward.score, reward.correct, reward.token_rewards, reward.failed)
                if not reward.failed:  # the critic learns from real outcomes only
                    finished.append((merged, reward))
        if not self.ready:
            self.ready = await self.value_ready()
        keep = []
        for row in rows:
            outcome = outcomes.get(row.sample_id) if row.finished else None
            if outcome is not None and outcome.failed:
                asm.drop_row(row, "reward_failed")
            elif not self.ready:
                asm.drop_row(row, "value_warmup")
            elif all_stale(asm.policy_version, row.new_versions, st.max_staleness_versions):
                asm.drop_row(row, "stale")  # every token too old: nothing would be left to train
            else:
                keep.append(row)
        if keep:
            (values, value_version), kl = await asyncio.gather(self.values([segment_row(r) for r in keep]),
                                                                self._kl_rewards(keep))
            for i, (row, v) in enumerate(zip(keep, values)):
                if row.sample_id not in self._finished:  # a later window's call may have ended it
                    offset = len(row.prior_response_ids)
                    self._recorded[row.sample_id][offset] = np.asarray(v[: len(row.new_token_ids)], dtype=np.float32)
                    if kl is not None:
                        self._recorded_kl[row.sample_id][offset] = kl[i]
            trained = value_rows(keep, values, [outcomes.get(r.sample_id) if r.finished else None for r in keep],
                                 st, value_version, kl)
            if st.window_training and self.nll_whole_response:
                trained = widen_positive_rows(trained)
            self._ready_rows.extend(trained)
            done = [r for r in keep if r.finished]
            for row in done:  # for the trajectory store: the values the response was trained with
                asm.note_values(row.sample_id, recorded_values(self._recorded.get(row.sample_id, {}),
                                                               len(row.prior_response_ids) + len(row.new_token_ids)))
            if done:
                asm.on_samples([r.sample_id for r in done], "awaiting_training", "")
            asm.counters["rows_ready"] += len(trained)
        await self._emit_ready_rows(asm)
        trajectories = [await self._trajectory(merged, reward) for merged, reward in finished]
        for merged, _ in scored:
            self._recorded.pop(merged.sample_id, None)
            self._recorded_kl.pop(merged.sample_id, None)
            self._finished.add(merged.sample_id)
        # Last: a value learner behind the stream applies backpressure here (pending tasks then
        # throttle segment intake) without delaying the rows above.
        if trajectories:
            await self.trajectories.put(trajectories)
            asm.counters["trajectories_sent"] += len(trajectories)
            asm.counters["trajectories_with_recorded_values"] += sum(t.values is not None for t in trajectories)

    async def _kl_rewards(self, rows: list[Segment]) -> list[np.ndarray] | None:
        """`−β·KL_t` per token of each row (None when the KL is not in the reward)."""
        if self.kl is None:
            return None
        reference = await self.reference_logprobs([segment_row(r) for r in rows])
        out = [kl_rewards(row, ref, self.kl) for row, ref in zip(rows, reference)]
        self._kl_since_batch[0] += float(sum(r.sum() for r in out))
        self._kl_since_batch[1] += sum(len(r) for r in out)
        return out

    async def _trajectory(self, merged: Segment, reward: Reward) -> ScoredTrajectory:
        """What the value learner trains on: the reward the policy is trained with (the shaped
        score, the process rewards and the KL penalty of every token), and the values recorded when
        its rows were valued, the anchor of the clipped value loss (None when a window was never
        valued: warm-up, a stale window)."""
        st = self.settings
        n = len(merged.new_token_ids)
        values = recorded_values(self._recorded.get(merged.sample_id, {}), n)
        score = shaped_score(reward.score, n, st.max_response_tokens, st.overlong_buffer_tokens,
                             st.overlong_penalty_factor)
        token_rewards = reward.token_rewards
        if self.kl is not None:
            kl = recorded_values(self._recorded_kl.get(merged.sample_id, {}), n)
            if kl is None:  # a window never valued (warm-up, stale): score the whole response now
                kl = (await self._kl_rewards([merged]))[0]
            dense = np.zeros(n, dtype=np.float32)
            if token_rewards is not None:
                dense[: min(n, len(token_rewards))] = token_rewards[:n]
            token_rewards = dense + kl
        return ScoredTrajectory(segment=merged, score=score, token_rewards=token_rewards,
                                correct=reward.correct, values=values)

    async def _emit_ready_rows(self, asm: Assembler) -> None:
        limit = self.settings.max_staleness_versions
        while (cut := cut_row_batch(self._ready_rows, self.rows_per_batch)) is not None:
            taken, self._ready_rows = self._ready_rows[:cut], self._ready_rows[cut:]
            # The bound is applied again when the batch leaves (rows may have waited here for the
            # N-th sample), and once more by the learner at its step.
            masked, stale_stats = mask_stale_tokens(taken, asm.policy_version, limit)
            rows = []
            for before, r in zip(taken, masked):
                if has_trained_tokens(before) and not has_trained_tokens(r):
                    asm.drop_row(r.segment, "stale")
                else:
                    rows.append(r)
            if not rows:
                continue
            if self.whiten:
                self._moments.update(rows)
                rows = whiten_rows(rows, self.advantage_clamp, self._moments.mean, self._moments.var**0.5)
            elif self.advantage_clamp > 0:
                rows = whiten_rows(rows, self.advantage_clamp, 0.0, 1.0)  # clamp only
            done = [r for r in rows if r.segment.finished]
            await asm.emit(rows, {
                "reward_mean": sum(r.score for r in done) / max(len(done), 1),
                "accuracy": sum(bool(r.correct) for r in done) / max(len(done), 1),
                "finished_row_fraction": len(done) / len(rows),
                "staleness_max_assembled": stale_stats["staleness_max"],
                "value_version_min": float(min(r.value_version or 0 for r in rows)),
                **self._kl_stats(),
            }, samples_emitted=len(done))

    def _kl_stats(self) -> dict[str, float]:
        """Mean KL reward per token valued since the previous batch (KL in the reward only)."""
        if self.kl is None:
            return {}
        total, tokens = self._kl_since_batch
        self._kl_since_batch = [0.0, 0]
        return {"kl_reward_token_mean": total / tokens if tokens else 0.0}

    def stats(self) -> dict:
        return {"open_groups": 0, "ready_groups": 0, "ready_rows": len(self._ready_rows), "value_ready": self.ready}


@dataclass
class RecordOnlyEstimator:
    """`mode=generate`: no learner. Every finished sample is scored and ends as `recorded` (in the
    trajectory store, with its reward); nothing is trained, so nothing is filtered or batched."""

    needs_value_learner: ClassVar[bool] = False
    window_rows: bool = False
    response_rows: bool = False

    async def process(self, asm: Assembler, rows: list[Segment], scored: Scored) -> None:
        if not scored:
            return
        rewards = await asm.score([req for _, req in scored])
        for reward in rewards:
            asm.note_scored(reward)
        asm.on_samples([merged.sample_id for merged, _ in scored], "recorded", "")

    def stats(self) -> dict:
        return {"open_groups": 0, "ready_groups": 0, "ready_rows": 0, "value_ready": None}


# The one mapping from `algorithm.estimator` to its strategy (`asyncrl.config.ESTIMATORS` names them).
ESTIMATORS: dict[str, type] = {"group": GroupEstimator, "pairwise": PairwiseEstimator, "gae": ValueEstimator}
