"""Verifier: the rule-based reward endpoint (math answers, code in the sandbox, format, tiny tasks).

Bad input never crashes it: an empty, huge or undecodable response, a malformed ground truth or a
verifier bug becomes a failed zero reward with the reason in `details`. A request whose data
source has no ground truth is marked not applicable, so a hybrid route falls through to a judge.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncrl.environments.tools import episode_truth
from asyncrl.rewards.sandbox import SandboxLimits
from asyncrl.rewards.verifiers import kind_for, verify
from asyncrl.schema import Reward, RewardRequest


@dataclass
class VerifierSettings:
    style: str = "zero_one"
    kinds: dict[str, str] = field(default_factory=dict)  # data_source -> verifier kind (default: by name)
    code_wall_s: float = 5.0
    code_memory_mb: int = 512
    code_isolation: str = "auto"
    code_allow_unisolated: bool = False
    code_allow_no_cgroup: bool = False
    math_timeout_s: float = 6.0

    @classmethod
    def from_dict(cls, raw: dict) -> "VerifierSettings":
        unknown = set(raw) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown verifier settings {sorted(unknown)}")
        return cls(**raw)


def not_applicable(req: RewardRequest, source: str, version: str, why: str) -> Reward:
    return Reward(prompt_id=req.prompt_id, sample_idx=req.sample_idx, score=0.0, correct=None, source=source,
                  source_version=version, failed=True, details={"not_applicable": True, "error": why})


def failed(req: RewardRequest, source: str, version: str, exc: BaseException | str) -> Reward:
    reason = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    return Reward(prompt_id=req.prompt_id, sample_idx=req.sample_idx, score=0.0, correct=False, source=source,
                  source_version=version, failed=True, details={"error": reason[:500]})


class Verifier:
    """Scores `RewardRequest`s with the verifier its data source maps to."""

    name = "verifier"

    def __init__(self, settings: VerifierSettings | None = None, version: str = "1"):
        self.settings = settings or VerifierSettings()
        self.version = version
        self.scored = 0
        self.failed = 0

    def reconfigure(self, settings: VerifierSettings, version: str) -> None:
        self.settings, self.version = settings, version

    def score(self, requests: list[RewardRequest]) -> list[Reward]:
        rewards = []
        limits = SandboxLimits(wall_s=self.settings.code_wall_s, cpu_s=int(self.settings.code_wall_s) + 2,
                               memory_mb=self.settings.code_memory_mb, isolation=self.settings.code_isolation,
                               allow_unisolated=self.settings.code_allow_unisolated,
                               allow_no_cgroup=self.settings.code_allow_no_cgroup)
        for req in requests:
            kind = self.settings.kinds.get(req.data_source) or kind_for(req.data_source)
            if kind == "none":  # no rule checks this data source (e.g. open-ended chat): a judge should
                rewards.append(not_applicable(req, self.name, self.version, f"no verifier for {req.data_source!r}"))
                continue
            if not req.ground_truth and kind != "format":
                rewards.append(not_applicable(req, self.name, self.version, "no ground truth to verify against"))
                continue
            truth = episode_truth(req.ground_truth, req.prompt_id, req.sample_idx)
            try:
                verdict = verify(kind, req.response_text, truth, self.settings.style, limits,
                                 self.settings.math_timeout_s)
                rewards.append(Reward(prompt_id=req.prompt_id, sample_idx=req.sample_idx, score=verdict.score,
                                      correct=verdict.correct, source=self.name, source_version=self.version,
                                      details={"verifier": kind, **verdict.details},
                                      suspicious=list(verdict.suspicious)))
            except Exception as exc:  # a verifier bug or bad ground truth must not lose the sample
                self.failed += 1
                rewards.append(failed(req, self.name, self.version, exc))
            self.scored += 1
        return rewards

    def stats(self) -> dict:
        return {"scored": self.scored, "failed": self.failed, "version": self.version}
