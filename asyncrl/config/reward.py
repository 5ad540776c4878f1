"""Reward endpoints and how they combine: the assembler's reward router reads `reward`; each
endpoint (an actor, or a Serve application `reward-<name>`) gets its own entry, a union keyed on
`kind`: each kind has its own settings and one scorer (`asyncrl.rewards.endpoint.SCORERS`)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from asyncrl.config.fields import KindVariant, NonNegativeFloat, NonNegativeInt, PositiveFloat, Section, UnitFloat

VerifierKind = Literal["math", "code", "format", "tiny", "tiny_seq", "tiny_tool", "none"]


class EndpointBase(KindVariant):
    """What every reward endpoint has, whatever its kind."""

    version: str = "1"
    """Reported in every Reward this endpoint produces; bump it when swapping code or model."""
    fault_delay_s: NonNegativeFloat = 0.0
    """Fault injection (load_tests/faults.py): every call waits this long first, e.g. longer than
    reward.timeout_s to make the endpoint hang. 0 in any real run."""


class VerifierEndpoint(EndpointBase, tag="verifier"):
    """Rule-based verifiers (math answers, code in the sandbox, format, the tiny tasks) chosen by data_source."""

    style: Literal["", "zero_one", "plus_minus"] = ""
    """zero_one | plus_minus (empty = task.reward)."""
    verifier_kinds: dict[str, VerifierKind] = msgspec.field(default_factory=dict)
    """data_source -> math | code | format | tiny | tiny_seq | tiny_tool | none (none: not applicable,
    so a hybrid route falls through to the judge). Unlisted sources get a kind by name."""
    code_wall_s: PositiveFloat = 5.0
    """code: wall-clock limit of one test (a run of several asserts gets up to 3x, plus 1 s)."""
    code_memory_mb: Annotated[int, msgspec.Meta(ge=16)] = 512
    """code: memory of the whole sandbox (a cgroup), else of each process."""
    code_isolation: Literal["auto", "namespaces", "user_namespaces", "unisolated"] = "auto"
    """code: auto | namespaces (as root) | user_namespaces | unisolated (rlimits only; needs code_allow_unisolated)."""
    code_allow_unisolated: bool = False
    """code: where no namespace can be made, run code rewards with rlimits alone instead of refusing."""
    math_timeout_s: PositiveFloat = 6.0
    """math: a symbolic check past this is killed (a worker process) and counts as wrong."""


class GenerativeJudgeEndpoint(EndpointBase, tag="genrm"):
    """A generative judge: P(Yes) against the reference answer, or pairwise with position swap."""

    model_path: str = ""
    """A local HF directory of the judge; empty = the policy's model (the embedded SmolLM2 on CPU)."""
    judge_mode: Literal["pointwise", "pairwise"] = "pointwise"
    """pointwise (Yes/No against the reference) | pairwise (the reference as the anchor)."""
    min_verdict_mass: UnitFloat = 1e-3
    """A verdict whose words (Yes/No, A/B) carry less probability than this at the judge's next
    token is no verdict: a failed reward, not a guess."""


class ScalarRewardEndpoint(EndpointBase, tag="bt", kw_only=True):
    """A scalar Bradley–Terry reward model (sequence classification with one label)."""

    model_path: str
    """A local HF directory (required)."""
    sigmoid: bool = False
    """Squash the logit into (0, 1)."""


class ProcessRewardEndpoint(EndpointBase, tag="prm", kw_only=True):
    """A process reward model: a score at every line end of a response (token classification)."""

    model_path: str
    """A local HF directory (required)."""


Endpoint = VerifierEndpoint | GenerativeJudgeEndpoint | ScalarRewardEndpoint | ProcessRewardEndpoint
"""An entry of `reward.endpoints`: one of these by its `kind`."""


class RouteConfig(Section):
    """Which endpoints score a data source (fnmatch pattern), and how their rewards combine."""

    match: str = "*"
    """fnmatch pattern over data_source."""
    endpoints: list[str] = msgspec.field(default_factory=lambda: ["verifier"])
    """The endpoints that score it, in order."""
    combine: Literal["first", "mix"] = "first"
    """first: the first endpoint that applies (verifier first, the judge where no verifier applies) |
    mix: weighted mean of the endpoints' scores."""
    weights: list[float] = msgspec.field(default_factory=list)
    """mix: one weight per endpoint."""
    dense: list[str] = msgspec.field(default_factory=list)
    """Endpoints adding per-token (process) rewards, scaled by dense_lambda_fail/pass by outcome."""
    dense_lambda_fail: NonNegativeFloat = 0.25
    """Scale of the process rewards of a wrong response."""
    dense_lambda_pass: NonNegativeFloat = 0.025
    """Scale of the process rewards of a correct response."""


class RewardConfig(Section):
    """The reward endpoints of a run and the routes between them."""

    endpoints: dict[str, Endpoint] = msgspec.field(default_factory=lambda: {"verifier": VerifierEndpoint()})
    """Endpoint name -> its settings."""
    routes: list[RouteConfig] = msgspec.field(default_factory=lambda: [RouteConfig()])
    """The first route whose pattern matches a sample's data_source scores it."""
    timeout_s: PositiveFloat = 120.0
    """A reward call slower than this is retried, then recorded as a failed reward (never a hang)."""
    retries: NonNegativeInt = 3
    """Retries of a failed or timed-out reward call."""
    use_serve: bool = False
    """Call the Serve applications `reward-<name>` (deployed by `serve run configs/serve.yaml`)
    instead of starting the endpoints as actors: they can then be redeployed while training runs."""
