"""Which streaming strategy feeds an advantage estimator: one per kind of `ADVANTAGES` entry, plus
the record-only strategy of `mode=generate`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

from asyncrl.algo.advantages import ADVANTAGES
from asyncrl.assembly.decisions import Decision, Estimator, Scored
from asyncrl.assembly.groups import GroupEstimator, GroupSettings, PairwiseEstimator
from asyncrl.assembly.rows import KLRewardSettings, ValueAdvantageSettings
from asyncrl.assembly.values import ValueEdges, ValueEstimator
from asyncrl.config import AlgorithmConfig, EngineConfig
from asyncrl.rewards.hybrid import RewardRouter
from asyncrl.schema import TrainSample

# Advantage kind (`asyncrl.algo.advantages.Advantage.kind`) -> the strategy that feeds it.
STRATEGIES: dict[str, type] = {"group": GroupEstimator, "pairwise": PairwiseEstimator, "value": ValueEstimator}


@dataclass
class RecordOnlyEstimator:
    """`mode=generate`: no learner. Every finished sample is scored and ends as `recorded` (in the
    trajectory store, with its reward); nothing is trained, so nothing is filtered or batched."""

    needs_value_learner: ClassVar[bool] = False
    row_kind: str = "none"

    async def decide(self, rows, scored: list[Scored]) -> Decision:
        return Decision(recorded=[s.sample.sample_id for s in scored])

    def finish_batch(self, rows: list[TrainSample]) -> tuple[list[TrainSample], dict[str, float]]:
        return rows, {}

    def stats(self) -> dict:
        return {"open_groups": 0, "ready_groups": 0, "ready_rows": 0, "value_ready": None}


def build_estimator(algorithm: AlgorithmConfig, engine: EngineConfig, prompts_per_step: int, router: RewardRouter,
                    decode: Callable[[list[int]], str], value_edges: ValueEdges | None = None,
                    mode: str = "train") -> Estimator:
    """The strategy of `ADVANTAGES[algorithm.estimator]`'s kind, given what it asks; `mode=generate`
    records only (no learner)."""
    a = algorithm
    if mode == "generate":
        return RecordOnlyEstimator()
    advantage = ADVANTAGES[a.estimator]
    kind = STRATEGIES[advantage.kind]
    if kind is ValueEstimator:
        settings = ValueAdvantageSettings(
            gamma=a.gamma, lam=a.lam, length_adaptive_alpha=a.length_adaptive_alpha, lambda_floor=a.lambda_floor,
            edge_mask_tokens=a.edge_mask_tokens, window_training=a.window_training,
            window_tokens=engine.window_tokens, bootstrap=a.egae_bootstrap)
        return ValueEstimator(edges=value_edges, settings=settings, rows_per_batch=prompts_per_step * a.group_size,
                              advantage_fn=advantage.fn, whiten=a.whiten_advantages, advantage_clamp=a.advantage_clamp,
                              nll_whole_response=a.nll_coef > 0,
                              kl=KLRewardSettings(a.kl_coef, a.kl_estimator) if a.kl_in_reward else None,
                              group_filter=a.filter_metric if a.dynamic_sampling else None)
    settings = GroupSettings(dynamic_sampling=a.dynamic_sampling, filter_metric=a.filter_metric,
                             max_refill_rounds=a.max_refill_rounds)
    if kind is PairwiseEstimator:
        async def judge(pairs):
            return await router.compare(a.pairwise_endpoint, pairs)

        return PairwiseEstimator(settings, prompts_per_step, advantage.fn, judge=judge, decode=decode,
                                 anchor=a.pairwise_anchor)
    return kind(settings, prompts_per_step, advantage.fn)
