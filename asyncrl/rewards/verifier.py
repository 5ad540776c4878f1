"""Verifier: the rule-based reward endpoint (math answers, code in the sandbox, format, tiny tasks).

Bad input never crashes it: an empty, huge or undecodable response, a malformed ground truth or a
verifier bug becomes a failed zero reward with the reason in `details`. A request whose data
source has no ground truth is marked not applicable, so a hybrid route falls through to a judge.
A stopped call (`asyncrl.rewards.calls`) scores no further sample: its math worker or sandbox is
killed, the samples scored keep their rewards and the others fail with the reason.

`failed` is how every scorer records a failure: its text masked (`asyncrl.redaction`).
"""

from __future__ import annotations

from asyncrl.config import VerifierEndpoint
from asyncrl.messages.structs import Reward, RewardRequest, has_ground_truth
from asyncrl.redaction import masked
from asyncrl.rewards.calls import CallStopped, current_call
from asyncrl.rewards.sandbox import SandboxLimits
from asyncrl.rewards.verifiers import episode_truth, kind_for, verify


def not_applicable(req: RewardRequest, source: str, version: str, why: str) -> Reward:
    return Reward(prompt_id=req.prompt_id, sample_idx=req.sample_idx, score=0.0, correct=None, source=source,
                  source_version=version, failed=True, details={"not_applicable": True, "error": masked(why)})


def failed(req: RewardRequest, source: str, version: str, exc: BaseException | str) -> Reward:
    reason = exc if isinstance(exc, str) else str(exc) if isinstance(exc, CallStopped) else f"{type(exc).__name__}: {exc}"
    return Reward(prompt_id=req.prompt_id, sample_idx=req.sample_idx, score=0.0, correct=False, source=source,
                  source_version=version, failed=True, details={"error": masked(reason)[:500]})


class Verifier:
    """Scores `RewardRequest`s with the verifier its data source maps to."""

    name = "verifier"

    def __init__(self, endpoint: VerifierEndpoint | None = None, default_style: str = "zero_one"):
        """`endpoint`: its section; `default_style`: task.reward, the style where the section leaves it empty."""
        self.endpoint = endpoint or VerifierEndpoint()
        self.default_style = default_style
        self.scored = 0
        self.failed = 0

    @property
    def version(self) -> str:
        return self.endpoint.version

    def reconfigure(self, endpoint: VerifierEndpoint) -> bool:
        """Takes every change in place (a verifier holds no model)."""
        self.endpoint = endpoint
        return True

    def score(self, requests: list[RewardRequest]) -> list[Reward]:
        rewards = []
        e = self.endpoint
        limits = SandboxLimits(wall_s=e.code_wall_s, cpu_s=int(e.code_wall_s) + 2, memory_mb=e.code_memory_mb,
                               isolation=e.code_isolation, allow_unisolated=e.code_allow_unisolated,
                               allow_no_cgroup=e.code_allow_no_cgroup)
        style = e.style or self.default_style
        call = current_call()
        for req in requests:
            if call.stopped:  # past the deadline or cancelled: what is scored stays, the rest fails
                rewards.append(failed(req, self.name, self.version, call.reason))
                continue
            kind = e.verifier_kinds.get(req.data_source) or kind_for(req.data_source)
            if kind == "none":  # no rule checks this data source (e.g. open-ended chat): a judge should
                rewards.append(not_applicable(req, self.name, self.version, f"no verifier for {req.data_source!r}"))
                continue
            if not has_ground_truth(req.ground_truth) and kind != "format":
                rewards.append(not_applicable(req, self.name, self.version, "no ground truth to verify against"))
                continue
            truth = episode_truth(req.ground_truth, req.prompt_id, req.sample_idx)
            try:
                check = verify(kind, req.response_text, truth, style, limits, e.math_timeout_s)
                rewards.append(Reward(prompt_id=req.prompt_id, sample_idx=req.sample_idx, score=check.score,
                                      correct=check.correct, source=self.name, source_version=self.version,
                                      details={"verifier": kind, **check.details},
                                      suspicious=list(check.suspicious)))
            except Exception as exc:  # a verifier bug or bad ground truth must not lose the sample
                self.failed += 1
                rewards.append(failed(req, self.name, self.version, exc))
            self.scored += 1
        return rewards

    def stats(self) -> dict:
        return {"scored": self.scored, "failed": self.failed, "version": self.version}
