"""Which streaming strategy feeds an advantage function: one per kind of `ADVANTAGES` entry, plus the
store-only strategy of `mode=generate`."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Callable, ClassVar

import msgspec

from asyncrl.algo.advantages import ADVANTAGES
from asyncrl.assembly.decisions import AssemblyStrategy, Decision, Scored
from asyncrl.assembly.groups import BatchReturnsStrategy, GroupStrategy, PairwiseStrategy
from asyncrl.assembly.values import ValueEdges, ValueStrategy
from asyncrl.config import AlgorithmConfig, EngineConfig, GAEAdvantage, PairwiseAdvantage
from asyncrl.messages.structs import TrainingRow
from asyncrl.rewards.hybrid import RewardRouter

# Advantage kind (`asyncrl.algo.advantages.Estimator.kind`) -> the strategy that feeds it.
STRATEGIES: dict[str, type] = {"group": GroupStrategy, "batch": BatchReturnsStrategy, "pairwise": PairwiseStrategy,
                               "value": ValueStrategy}


@dataclass
class StoreOnlyStrategy:
    """`mode=generate`: no learner. Every finished sample is scored and ends as `recorded` (in the
    trajectory store, with its reward); nothing is trained, so nothing is filtered or batched."""

    needs_value_learner: ClassVar[bool] = False
    row_kind: str = "none"

    async def decide(self, rows, scored: list[Scored]) -> Decision:
        return Decision(recorded=[s.sample.sample_id for s in scored])

    def finish_batch(self, rows: list[TrainingRow]) -> tuple[list[TrainingRow], dict[str, float]]:
        return rows, {}

    def stats(self) -> dict:
        return {"open_groups": 0, "ready_groups": 0, "ready_rows": 0, "value_ready": None}


def build_strategy(algorithm: AlgorithmConfig, engine: EngineConfig, prompts_per_step: int, router: RewardRouter,
                   decode: Callable[[list[int]], str], value_edges: ValueEdges | None = None,
                   mode: str = "train") -> AssemblyStrategy:
    """The strategy of the kind of `ADVANTAGES[algorithm.advantage.type]`, given what it asks;
    `mode=generate` stores only (no learner)."""
    if mode == "generate":
        return StoreOnlyStrategy()
    a, advantage = algorithm, algorithm.advantage
    entry = ADVANTAGES[advantage.type]
    kind = STRATEGIES[entry.kind]
    if isinstance(advantage, GAEAdvantage):
        return ValueStrategy(edges=value_edges, gae=advantage, window_tokens=engine.window_tokens,
                             rows_per_batch=prompts_per_step * a.group_size, advantage_fn=entry.fn,
                             nll_whole_response=a.nll_coef > 0, kl=a.kl if advantage.kl_in_reward else None,
                             group_filter=a.dynamic_sampling if a.dynamic_sampling.enabled else None)
    if isinstance(advantage, PairwiseAdvantage):
        async def judge(pairs):
            return await router.compare(advantage.endpoint, pairs)

        return PairwiseStrategy(a.dynamic_sampling, prompts_per_step, entry.fn, judge=judge, decode=decode,
                                anchor=advantage.anchor)
    # The variant's own fields are its function's keyword arguments: bound here, so that a field the
    # function does not take fails at start-up, not at the first group.
    fields = msgspec.structs.asdict(advantage)
    inspect.signature(entry.fn).bind_partial(**fields)
    return kind(a.dynamic_sampling, prompts_per_step, functools.partial(entry.fn, **fields))
