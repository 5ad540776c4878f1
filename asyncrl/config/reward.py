"""Reward endpoints and how they combine: the assembler's reward router reads `reward`; each
endpoint (an actor, or a Serve application `reward-<name>`) gets its own entry, a union keyed on
`kind`: each kind has its own settings and one scorer (`asyncrl.rewards.endpoint.SCORERS`)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from asyncrl.config.fields import (KindVariant, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, Section,
                                   UnitFloat)

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
    code_allow_no_cgroup: bool = False
    """code: where no cgroup can be made (Docker, most non-root hosts), run code rewards with memory
    limited per process only (64 processes x code_memory_mb) instead of refusing; logged loudly."""
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


class PythonRewardEndpoint(EndpointBase, tag="python", kw_only=True):
    """A reward function of your own, in a file or a module: verl's per-sample
    `compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)` or TRL's
    batched `fn(prompts, completions, **columns)` (docs/rewards.md). It runs in worker processes of
    the endpoint, each call with a timeout: a hang is killed, not waited for."""

    path: str
    """A `.py` file, or a module on the path (`package.module`)."""
    function: str = "compute_score"
    """The function's name in it."""
    signature: Literal["auto", "verl", "trl"] = "auto"
    """verl (per sample: data_source, solution_str, ground_truth, extra_info) | trl (per batch:
    prompts, completions, columns) | auto (from the parameter names; said at start-up)."""
    workers: PositiveInt = 2
    """Worker processes calling the function (a process, not a thread, so that a call past its
    timeout can be ended and a CPU-bound scorer runs beside the endpoint's event loop)."""
    call_timeout_s: PositiveFloat = 30.0
    """A call (one sample; with trl, one batch) that takes longer is killed: a failed reward."""
    worker_memory_mb: NonNegativeInt = 8192
    """Address space (RLIMIT_AS, MiB) of each worker process, the function's imports included: a
    call that allocates past it is a failed reward ("ran out of memory") and its worker is replaced
    by a fresh one. Virtual memory, so larger than what the worker holds (numpy's import alone maps
    ~150 MB, torch's ~650 MB). 0: no limit."""
    worker_max_calls: NonNegativeInt = 10000
    """A worker is replaced by a fresh one after this many calls, so memory the function leaks or
    caches is given back (a new worker imports the file again: ~0.2 s, more with heavy imports).
    0: never."""


class OpenAIJudgeEndpoint(EndpointBase, tag="openai", kw_only=True):
    """A generative judge behind an OpenAI-compatible API (a vLLM or SGLang server, a hosted model,
    another asyncrl policy endpoint): pointwise against the reference, or pairwise, as the built-in
    judge; its verdict read from the top log-probs of the first token when the server gives them,
    else from the reply's first word."""

    base_url: str
    """The API's base URL, e.g. http://127.0.0.1:8000/v1."""
    model: str
    """The model name the server serves."""
    api_key_env: str = ""
    """The environment variable holding the API key (empty: no key). The key itself never appears
    in the config, the logs or the records."""
    judge_mode: Literal["pointwise", "pairwise"] = "pointwise"
    """pointwise (Yes/No against the reference) | pairwise (the reference as the anchor)."""
    min_verdict_mass: UnitFloat = 1e-3
    """A verdict whose words carry less probability than this (or a reply that is neither) is no
    verdict: a failed reward."""
    max_concurrency: PositiveInt = 8
    """Requests in flight at once."""
    request_timeout_s: PositiveFloat = 60.0
    """One attempt of a request, whole (not per read: a server that trickles bytes is cut off here,
    its connection closed); a request that failed is retried, then its reward fails."""
    retries: NonNegativeInt = 2
    """Retries of a request that failed or timed out (with backoff)."""


Endpoint = (VerifierEndpoint | GenerativeJudgeEndpoint | ScalarRewardEndpoint | ProcessRewardEndpoint
            | PythonRewardEndpoint | OpenAIJudgeEndpoint)
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
    """The deadline of a reward call, retries included (never a hang): the endpoint stops the call a
    margin before it and answers with the rewards it had scored, the samples not scored failed with
    the reason; a call that does not answer by the deadline is cancelled at the endpoint, all its
    rewards failed. A pairwise judgement has the same."""
    retries: NonNegativeInt = 3
    """Retries of a reward call that failed with an error, while its deadline allows (a call that
    ran out of time is not retried: its retry would only add work to a slow endpoint)."""
    fail_fast_samples: NonNegativeInt = 32
    """When every reward of the first this many scored samples failed (or every reward of the
    held-out evaluation before training), `asyncrl train` stops at once with exit status 1, naming
    the function, the exception and the sample; under `serve run` the status and the log say it
    and training goes on (a reward application can be redeployed). 0: never stop for it."""
    use_serve: bool = False
    """Call the Serve applications `reward-<name>` (deployed by `serve run configs/serve.yaml`)
    instead of starting the endpoints as actors: they can then be redeployed while training runs."""
