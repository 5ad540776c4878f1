"""Reward endpoints and how they combine: the assembler's reward router reads `reward`; each
endpoint (an actor, or a Serve application `reward-<name>`) gets its own entry."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EndpointConfig:
    """One reward endpoint (an actor, or the Serve application `reward-<name>` under `serve run`)."""

    kind: str = "verifier"
    """verifier | genrm (generative judge) | bt (scalar Bradley–Terry RM) | prm (process reward model)."""
    model_path: str = ""
    """genrm: empty = the policy's model (the embedded SmolLM2 on CPU); bt/prm: a local HF directory."""
    judge_mode: str = "pointwise"
    """genrm: pointwise (Yes/No against the reference) | pairwise (the reference as the anchor)."""
    style: str = ""
    """verifier: zero_one | plus_minus (empty = task.reward)."""
    verifier_kinds: dict[str, str] = field(default_factory=dict)
    """verifier: data_source -> math | code | format | tiny | tiny_seq | none (none: not applicable, so a
    hybrid route falls through to the judge). Unlisted sources get a kind by name."""
    code_wall_s: float = 5.0
    """code: wall-clock limit of one test (a run of several asserts gets up to 3x, plus 1 s)."""
    code_memory_mb: int = 512
    """code: memory of the whole sandbox (a cgroup), else of each process."""
    code_isolation: str = "auto"
    """code: auto | namespaces (as root) | user_namespaces | unisolated (rlimits only; needs code_allow_unisolated)."""
    code_allow_unisolated: bool = False
    """code: where no namespace can be made, run code rewards with rlimits alone instead of refusing."""
    code_allow_no_cgroup: bool = False
    """code: where no cgroup can be made (Docker, most non-root hosts), run code rewards with memory
    limited per process only (64 processes x code_memory_mb) instead of refusing; logged loudly."""
    math_timeout_s: float = 6.0
    """math: a symbolic check past this is killed (a worker process) and counts as wrong."""
    sigmoid: bool = False
    """bt: squash the logit into (0, 1)."""
    version: str = "1"
    """Reported in every Reward this endpoint produces; bump it when swapping code or model."""
    fault_delay_s: float = 0.0
    """Fault injection (load_tests/faults.py): every call waits this long first, e.g. longer than
    reward.timeout_s to make the endpoint hang. 0 in any real run."""


@dataclass
class RouteConfig:
    """Which endpoints score a data source (fnmatch pattern), and how their rewards combine."""

    match: str = "*"
    """fnmatch pattern over data_source."""
    endpoints: list[str] = field(default_factory=lambda: ["verifier"])
    """The endpoints that score it, in order."""
    combine: str = "first"
    """first: the first endpoint that applies (verifier first, the judge where no verifier applies) |
    mix: weighted mean of the endpoints' scores."""
    weights: list[float] = field(default_factory=list)
    """mix: one weight per endpoint."""
    dense: list[str] = field(default_factory=list)
    """Endpoints adding per-token (process) rewards, scaled by dense_lambda_fail/pass by outcome."""
    dense_lambda_fail: float = 0.25
    """Scale of the process rewards of a wrong response."""
    dense_lambda_pass: float = 0.025
    """Scale of the process rewards of a correct response."""


@dataclass
class RewardConfig:
    """The reward endpoints of a run and the routes between them."""

    endpoints: dict[str, EndpointConfig] = field(default_factory=lambda: {"verifier": EndpointConfig()})
    """Endpoint name -> its settings."""
    routes: list[RouteConfig] = field(default_factory=lambda: [RouteConfig()])
    """The first route whose pattern matches a sample's data_source scores it."""
    timeout_s: float = 120.0
    """The deadline of a reward call, retries included: a call still running then is cancelled at
    the endpoint and its rewards recorded as failed (never a hang). A pairwise judgement has the same."""
    retries: int = 3
    """Retries of a reward call that failed with an error, while its deadline allows (a call that
    ran out of time is not retried: its retry would only add work to a slow endpoint)."""
    use_serve: bool = False
    """Call the Serve applications `reward-<name>` (deployed by `serve run configs/serve.yaml`)
    instead of starting the endpoints as actors: they can then be redeployed while training runs."""
