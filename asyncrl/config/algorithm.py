"""The algorithm: how finished samples become training rows (the assembler's section), and the knobs
several roles share. `algorithm.advantage` is a union keyed on `type`: each advantage estimator is
one variant with its own knobs, computed by the pure function of the same name in
`asyncrl.algo.advantages.ADVANTAGES`. Formulas and the papers' defaults: docs/algorithms.md.

Adding an estimator with one knob: its pure function and an entry of `ADVANTAGES`, one variant below
(its knob with its range and docstring, added to `Advantage`), one YAML under configs/algorithm/.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from asyncrl.config.fields import NonNegativeFloat, NonNegativeInt, PositiveInt, Section, UnitFloat, Variant

Discount = Annotated[float, msgspec.Meta(gt=0, le=1)]


class GRPOAdvantage(Variant, tag="grpo"):
    """Group-normalised outcome (DeepSeekMath): (R_i − mean_g) / (std_g + ε) per sample."""


class DrGRPOAdvantage(Variant, tag="drgrpo"):
    """Dr.GRPO: the group mean alone as the baseline, R_i − mean_g (not divided by the std)."""


class RLOOAdvantage(Variant, tag="rloo"):
    """RLOO (arXiv 2402.14740, verl's `rloo`): each sample against the mean of the others in its
    group, R_i − mean_{j≠i} R_j."""


class ReinforcePlusPlusAdvantage(Variant, tag="reinforce_plus_plus"):
    """REINFORCE++ (arXiv 2501.03262, verl's `reinforce_plus_plus`): discounted token returns,
    whitened over the trained tokens of the whole batch (no critic, no group baseline)."""

    gamma: Discount = 1.0
    """Discount of the token rewards in the returns (1: every token's return is the outcome plus the
    process rewards after it)."""


class PairwiseAdvantage(Variant, tag="pairwise"):
    """Pairwise PPO: mean win probability against the group (or the reference) from a pairwise judge."""

    endpoint: str = "genrm"
    """The endpoint of reward.endpoints that judges pairs: kind genrm (a generative judge, both orders
    averaged) or verifier (each response checked by the data source's rule: the higher score wins,
    equal scores tie; a judge that knows the answer, where a verifier applies)."""
    anchor: Literal["group", "reference"] = "group"
    """group (every other response of the group) | reference (the ground-truth answer, written as a
    response; a verifier judge takes it as correct)."""


class GAEAdvantage(Variant, tag="gae"):
    """The PPO family: (E)GAE over the values of a value learner (PPO, VC-PPO, VAPO, T-PPO)."""

    gamma: Discount = 1.0
    """Discount γ of (E)GAE and the critic's returns."""
    lam: UnitFloat = 0.95
    """Policy GAE λ (used when length-adaptive λ is off; the floor of the T-PPO clamp)."""
    length_adaptive_alpha: NonNegativeFloat = 0.0
    """VAPO length-adaptive λ = 1 − 1/(α·l); 0 = off (use `lam`). Paper: 0.05."""
    lambda_floor: bool = False
    """How length-adaptive λ is clamped: True = max(λ, `lam`) (T-PPO recipe), False = into [0, 1] (NeMo-RL)."""
    window_training: bool = False
    """T-PPO: train the policy on every window as it streams (EGAE), not only on finished responses."""
    bootstrap: Literal["previous", "next"] = "previous"
    """Value of the state after a cut window: previous = V(s_{l-1}) (T-PPO's EGAE) | next = the value
    model's V(s_l), which a streaming system has at no extra cost (the window's last token is known)."""
    edge_mask_tokens: NonNegativeInt = 0
    """T-PPO: the last N tokens of an unfinished window carry no policy loss (recipe: 8)."""
    whiten: bool = False
    """Whiten advantages over the stream's recent trained tokens (PPO/T-PPO), then clamp to ±clamp."""
    clamp: NonNegativeFloat = 0.0
    """Clamp advantages to ±this after whitening (0 = no clamp)."""
    kl_in_reward: bool = False
    """PPO baseline (docs/algorithms.md §1, verl `use_kl_in_reward`): put `−algorithm.kl.coef·KL_t`
    into each token's reward before GAE (and into the critic's return) instead of a KL loss term.
    The value learner holds the reference policy and scores each row's tokens."""


Advantage = (GRPOAdvantage | DrGRPOAdvantage | RLOOAdvantage | ReinforcePlusPlusAdvantage | PairwiseAdvantage
             | GAEAdvantage)
"""`algorithm.advantage`: one of these by its `type`."""


class DynamicSampling(Section):
    """DAPO's dynamic sampling: groups whose filter metric is all equal carry no gradient and are dropped."""

    enabled: bool = True
    """Drop groups whose filter metric is all equal (no gradient) and count them."""
    metric: Literal["acc", "score"] = "acc"
    """acc (correctness; a reward without a correctness flag, such as a Bradley-Terry model, falls
    back to its score) | score (the raw score)."""
    max_refill_rounds: NonNegativeInt = 0
    """Bounded refill (verl's max_num_gen_batches): after this many generation rounds
    (prompts_per_step groups each) without a full batch of groups with signal, the learner trains on
    the groups that have signal, or, with none, skips the step with the reason. 0 = no bound."""


class OverlongShaping(Section):
    """DAPO's soft overlong punishment, added once to every reward (L_max = engine.max_response_tokens)."""

    buffer_tokens: NonNegativeInt = 0
    """The buffer L_cache before L_max over which the penalty ramps in (0 = off)."""
    penalty_factor: NonNegativeFloat = 1.0
    """The penalty at L_max (it ramps linearly over the buffer)."""


class KLPenalty(Section):
    """The KL to the reference (initial) policy: a loss term, or with `advantage.kl_in_reward` a token reward."""

    coef: NonNegativeFloat = 0.0
    """Its weight β; 0 = no reference model."""
    estimator: Literal["k1", "k2", "low_var_kl"] = "low_var_kl"
    """k1 | k2 | low_var_kl (k3, Schulman's unbiased low-variance estimator; GRPO's)."""


class AlgorithmConfig(Section):
    """How finished samples become training rows (the assembler's section), and what the prompt
    source, the assembler and the learners must agree on (group size, staleness, KL, NLL)."""

    name: str = "dapo"
    """The recipe's name: one of configs/algorithm/ (informational; the fields below decide)."""
    group_size: PositiveInt = 8
    """G: samples per prompt."""
    max_staleness_versions: NonNegativeInt = 4
    """No token more than this many versions behind the weights being trained is trained: the learner
    masks such tokens out of the loss at its step (the assembler already does when a batch leaves)."""
    advantage: Advantage = msgspec.field(default_factory=GRPOAdvantage)
    """The advantage estimator and its own knobs, by `type`: grpo | drgrpo | rloo |
    reinforce_plus_plus | pairwise | gae."""
    dynamic_sampling: DynamicSampling = msgspec.field(default_factory=DynamicSampling)
    """DAPO's group filter."""
    overlong: OverlongShaping = msgspec.field(default_factory=OverlongShaping)
    """DAPO's soft overlong punishment."""
    kl: KLPenalty = msgspec.field(default_factory=KLPenalty)
    """The KL to the reference policy."""
    nll_coef: NonNegativeFloat = 0.0
    """VAPO positive-example LM loss weight μ on the tokens of correct finished responses (paper: 0.1)."""

    @property
    def value_based(self) -> bool:
        """The advantage needs a value learner (GAE)."""
        return isinstance(self.advantage, GAEAdvantage)

    @property
    def kl_in_reward(self) -> bool:
        return isinstance(self.advantage, GAEAdvantage) and self.advantage.kl_in_reward

    @property
    def kl_loss(self) -> KLPenalty:
        """The KL as the policy loss's term: none when it is in the reward (the value learner scores it there)."""
        return msgspec.structs.replace(self.kl, coef=0.0) if self.kl_in_reward else self.kl
