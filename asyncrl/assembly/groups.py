"""Group strategies (GRPO, Dr.GRPO, RLOO, REINFORCE++, Pairwise PPO): a group of G finished samples
becomes G rows, or is dropped whole (failed reward, no signal: `group_drop_reason`, the one group
filter); `prompts_per_step` groups make a batch. The advantage is the pure function of the advantage
type (`asyncrl.algo.advantages.ADVANTAGES`): per group, or over the whole batch as it leaves."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Awaitable, Callable, ClassVar

import msgspec
import numpy as np
import torch

from asyncrl.algo.advantages import judged_pairs, preference_matrix
from asyncrl.algo.shaping import filter_metric, group_has_signal
from asyncrl.assembly.decisions import Decision, ReadyBatch, Scored
from asyncrl.assembly.rows import reward_to_go, undiscounted_rewards
from asyncrl.config import DynamicSampling
from asyncrl.data.tasks import reference_response
from asyncrl.messages.structs import DropReason, PairRequest, Reward, TrainingRow, ground_truth_text

JudgeFn = Callable[[list[PairRequest]], Awaitable[list[dict]]]


def group_drop_reason(rewards: list[Reward], dynamic_sampling: DynamicSampling) -> DropReason | None:
    """Why a complete group is dropped whole, or None to keep it: the group filter of every strategy."""
    if any(r.failed for r in rewards):
        # A reward endpoint that timed out or errored gave no score: a made-up 0 would be trained
        # as a real outcome, and a group's advantages depend on every member.
        return DropReason.REWARD_FAILED
    # The filter reads the raw reward (correctness by default), never the shaped score: an overlong
    # penalty must not keep an all-wrong group alive.
    metric = filter_metric([r.correct for r in rewards], [r.score for r in rewards], dynamic_sampling.metric)
    if dynamic_sampling.enabled and not group_has_signal(metric):
        return DropReason.NO_SIGNAL
    return None


def group_rows(members: list[Scored], dynamic_sampling: DynamicSampling,
               advantage_fn: Callable[[torch.Tensor], torch.Tensor]) -> tuple[list[TrainingRow], DropReason | None]:
    """A closed group -> its rows, or why it is dropped. `advantage_fn`: the group's shaped scores
    `[G]` -> one advantage per sample. Dense (process) rewards add per-token credit on top."""
    reason = group_drop_reason([m.reward for m in members], dynamic_sampling)
    if reason is not None:
        return [], reason
    advantages = advantage_fn(torch.tensor([m.score for m in members], dtype=torch.float32))
    rows = []
    for m, adv in zip(members, advantages.tolist()):
        token_adv = np.full(len(m.sample.new_token_ids), adv, dtype=np.float32)
        if m.reward.token_rewards is not None:
            token_adv = token_adv + reward_to_go(m.reward.token_rewards, len(token_adv))
        rows.append(TrainingRow(segment=m.sample, score=m.score, advantages=token_adv, correct=m.reward.correct))
    return rows, None


@dataclass
class GroupStrategy:
    """GRPO, Dr.GRPO, RLOO: the group's shaped scores through `advantage_fn`; `_close` is where
    Pairwise PPO differs, `finish_batch` where REINFORCE++ does."""

    dynamic_sampling: DynamicSampling
    prompts_per_batch: int
    advantage_fn: Callable[[torch.Tensor], torch.Tensor]
    needs_value_learner: ClassVar[bool] = False
    row_kind: str = "none"
    _groups: dict[str, dict[int, Scored]] = field(default_factory=lambda: collections.defaultdict(dict))
    _ready: list[tuple[list[TrainingRow], dict[str, float]]] = field(default_factory=list)
    _closed_since_batch: int = 0  # groups closed (kept or dropped) since the last batch left

    async def decide(self, rows, scored: list[Scored]) -> Decision:
        decision = Decision()
        for s in scored:
            group = self._groups[s.sample.group_id]
            group[s.sample.sample_idx] = s
            if len(group) == s.sample.group_size:
                members = [group[i] for i in sorted(group)]
                del self._groups[s.sample.group_id]
                await self._close(members, decision)
                self._batches(decision)  # after each group: the refill bound is exact
        self._batches(decision)
        return decision

    async def _close(self, members: list[Scored], decision: Decision, advantage_fn=None) -> None:
        train, reason = group_rows(members, self.dynamic_sampling, advantage_fn or self.advantage_fn)
        decision.counters["groups_closed"] += 1
        self._closed_since_batch += 1
        ids = [m.sample.sample_id for m in members]
        if reason is not None:
            decision.counters[f"dropped_{reason.value}_groups"] += 1
            decision.drop(ids, reason)
            return
        decision.keep(ids)
        self._ready.append((train, {"reward_mean": sum(m.reward.score for m in members) / len(members),
                                    "accuracy": sum(bool(m.reward.correct) for m in members) / len(members)}))

    def _refill_exhausted(self) -> bool:
        """Bounded refill: `max_refill_rounds` generation rounds closed since the last batch."""
        rounds = self.dynamic_sampling.max_refill_rounds
        return rounds > 0 and self._closed_since_batch >= rounds * self.prompts_per_batch

    def _batches(self, decision: Decision) -> None:
        n = self.prompts_per_batch
        while len(self._ready) >= n or (self._refill_exhausted() and len(self._ready) < n):
            rounds = self._closed_since_batch / n
            groups, self._ready = self._ready[:n], self._ready[n:]
            self._closed_since_batch = 0
            if not groups:
                # Nothing with a learning signal in `max_refill_rounds` rounds: the learner skips the
                # step and says why (never a silent spin; prompt retirement removes the cause).
                decision.counters["steps_skipped_no_signal"] += 1
                decision.batches.append(ReadyBatch([], {"refill_rounds": rounds},
                                                   f"no group with a learning signal in {rounds:.0f} generation "
                                                   f"rounds (algorithm.dynamic_sampling.max_refill_rounds)"))
                continue
            if len(groups) < n:
                decision.counters["batches_partial"] += 1
            decision.batches.append(ReadyBatch([row for rows, _ in groups for row in rows], {
                "reward_mean": sum(s["reward_mean"] for _, s in groups) / len(groups),
                "accuracy": sum(s["accuracy"] for _, s in groups) / len(groups),
                "refill_rounds": rounds, "groups_in_batch": float(len(groups))}))

    def finish_batch(self, rows: list[TrainingRow]) -> tuple[list[TrainingRow], dict[str, float]]:
        return rows, {}

    def stats(self) -> dict:
        return {"open_groups": len(self._groups), "ready_groups": len(self._ready), "ready_rows": 0,
                "value_ready": None}


@dataclass
class BatchReturnsStrategy(GroupStrategy):
    """REINFORCE++: groups close and are filtered as GRPO's are, their rows carrying their
    undiscounted returns (the score plus the process rewards after each token); the advantages are
    computed over the whole batch as it leaves (`advantage_fn`: token rewards, masks -> `[B, T]`)."""

    async def _close(self, members: list[Scored], decision: Decision, advantage_fn=None) -> None:
        await super()._close(members, decision, lambda scores: scores)

    def finish_batch(self, rows: list[TrainingRow]) -> tuple[list[TrainingRow], dict[str, float]]:
        width = max(len(r.advantages) for r in rows)
        rewards = torch.zeros(len(rows), width, dtype=torch.float64)
        mask, trained = torch.zeros_like(rewards), torch.zeros_like(rewards)
        for i, row in enumerate(rows):
            n = len(row.advantages)
            rewards[i, :n] = torch.from_numpy(undiscounted_rewards(row.advantages))
            mask[i, :n] = 1.0
            trained[i, :n] = torch.from_numpy(row.loss_mask.astype(np.float64)) if row.loss_mask is not None else 1.0
        advantages = self.advantage_fn(rewards, mask, trained=trained).numpy()
        out = [msgspec.structs.replace(row, advantages=advantages[i, :len(row.advantages)].astype(np.float32))
               for i, row in enumerate(rows)]
        return out, {"return_mean": float((rewards.sum(1)).mean())}


@dataclass
class PairwiseStrategy(GroupStrategy):
    """Pairwise PPO: judge each closed group's responses against each other (or the reference) in
    both orders; advantages from the symmetrised win probabilities (`advantage_fn` takes the
    preference matrix), plus each sample's overlong penalty (a reward term's advantage adds). The
    judge is a generative one (`genrm`) or the rule verifier (`verifier`: the higher score wins)."""

    judge: JudgeFn | None = None
    decode: Callable[[list[int]], str] | None = None
    anchor: str = "group"  # group | reference

    async def _close(self, members: list[Scored], decision: Decision, advantage_fn=None) -> None:
        first = members[0].sample
        texts = [self.decode(m.sample.new_token_ids.tolist()) for m in members]
        prompt = self.decode(first.prompt_token_ids.tolist())
        pairs = judged_pairs(len(members), self.anchor == "reference")
        reference = reference_response(first.data_source, first.ground_truth)
        # A generative judge reads the texts (the reference shown beside two responses, not beside
        # itself); a verifier judge checks both responses against the ground truth as the data holds it.
        requests = [PairRequest(prompt_text=prompt, first=texts[i], second=reference if j is None else texts[j],
                                ground_truth="" if j is None else ground_truth_text(first.ground_truth),
                                data_source=first.data_source, truth=first.ground_truth, second_is_reference=j is None)
                    for i, j in pairs]
        verdicts = await self.judge(requests) if requests else []
        decision.counters["pairs_judged"] += len(verdicts)
        decision.counters["pairs_inconsistent"] += sum(not v["consistent"] for v in verdicts)
        decision.counters["pairs_failed"] += sum(bool(v["failed"]) for v in verdicts)
        if any(v["failed"] for v in verdicts):
            # A failed judgement has no verdict: a neutral 0.5 would be trained as a real tie, and
            # every advantage of the group depends on it (as a failed reward drops a group).
            decision.counters["groups_closed"] += 1
            decision.counters["dropped_reward_failed_groups"] += 1
            self._closed_since_batch += 1
            decision.drop([m.sample.sample_id for m in members], DropReason.REWARD_FAILED)
            return
        prefs = preference_matrix(len(members), pairs, [v["p_first"] for v in verdicts])
        penalties = torch.tensor([m.penalty for m in members], dtype=torch.float32)
        await super()._close(members, decision, lambda scores: self.advantage_fn(prefs) + penalties)
