"""A reward endpoint as a long-lived service: the same class is a Ray actor (`asyncrl train`) and a
Ray Serve deployment (`serve run`, application `reward-<name>`).

It builds its scorer (verifier, generative judge, BT model, PRM) from an `EndpointConfig` given as
a dict, scores in a worker thread so its event loop stays responsive, and takes a new config in
place through `reconfigure` (Serve's `user_config`): settings and the reported version change
without a restart; a new model path reloads the model before the swap, so requests never see a
half-built scorer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time

import msgspec

from asyncrl.config import EndpointConfig, ModelConfig
from asyncrl.schema import PairRequest, Reward, RewardRequest


def endpoint_config(raw: dict | EndpointConfig) -> EndpointConfig:
    if isinstance(raw, EndpointConfig):
        return raw
    unknown = set(raw) - {f.name for f in dataclasses.fields(EndpointConfig)}
    if unknown:
        raise ValueError(f"unknown reward endpoint settings {sorted(unknown)}")
    return EndpointConfig(**raw)


def verifier_settings(config: EndpointConfig, default_style: str):
    from asyncrl.rewards.verifier import VerifierSettings

    return VerifierSettings(style=config.style or default_style, kinds=dict(config.verifier_kinds),
                            code_wall_s=config.code_wall_s, code_memory_mb=config.code_memory_mb,
                            code_isolation=config.code_isolation, code_allow_unisolated=config.code_allow_unisolated,
                            code_allow_no_cgroup=config.code_allow_no_cgroup,
                            math_timeout_s=config.math_timeout_s)


def build_scorer(config: EndpointConfig, model: ModelConfig | None, default_style: str):
    from asyncrl.rewards.reward_model import GenerativeJudge, JudgeSettings, ProcessRewardModel, ScalarRewardModel
    from asyncrl.rewards.verifier import Verifier

    if config.kind == "verifier":
        return Verifier(verifier_settings(config, default_style), config.version)
    if config.kind == "genrm":
        from asyncrl.models import load_model, load_tokenizer

        if config.model_path:
            judge_model = ModelConfig(source="hf", path=config.model_path)
        elif model is None:
            raise ValueError("a genrm endpoint without model_path needs the policy's model config")
        else:
            judge_model = model
        tokenizer = load_tokenizer(judge_model)
        settings = JudgeSettings(mode=config.judge_mode,
                                 use_chat_template=model.use_chat_template if model is not None else True)
        return GenerativeJudge(load_model(judge_model, tokenizer), tokenizer, settings, config.version)
    if config.kind == "bt":
        return ScalarRewardModel(config.model_path, sigmoid=config.sigmoid, version=config.version)
    if config.kind == "prm":
        return ProcessRewardModel(config.model_path, version=config.version)
    raise ValueError(f"unknown reward endpoint kind {config.kind!r}")


class RewardEndpoint:
    def __init__(self, name: str, config: dict | EndpointConfig, model: dict | ModelConfig | None = None,
                 default_style: str = "zero_one"):
        self.name = name
        self.model = ModelConfig(**model) if isinstance(model, dict) else model
        self.default_style = default_style
        self.config = endpoint_config(config)
        self.scorer = build_scorer(self.config, self.model, default_style)
        self.started = time.time()
        self.counters = {"requests": 0, "rewards": 0, "failed": 0, "reconfigurations": 0, "cancelled": 0}

    @property
    def version(self) -> str:
        return f"{self.name}:{self.config.kind}:{self.config.version}"

    def reconfigure(self, user_config: dict) -> None:
        """Serve calls this with the deployment's `user_config` at start and on every update."""
        if not user_config:
            return
        new = endpoint_config({**dataclasses.asdict(self.config), **user_config})
        if new.kind != self.config.kind or new.model_path != self.config.model_path:
            scorer = build_scorer(new, self.model, self.default_style)  # built first, then swapped
        else:
            scorer = self.scorer
            if hasattr(scorer, "reconfigure"):
                if new.kind == "verifier":
                    scorer.reconfigure(verifier_settings(new, self.default_style), new.version)
                elif new.kind == "genrm":
                    scorer.reconfigure(dataclasses.replace(scorer.settings, mode=new.judge_mode), new.version)
            else:
                scorer.version = new.version
        self.config, self.scorer = new, scorer
        self.counters["reconfigurations"] += 1

    async def score(self, requests: list[RewardRequest]) -> list[Reward]:
        self.counters["requests"] += 1
        try:
            await self._fault_delay()
            scorer = self.scorer  # a reconfigure during this call does not change the scorer it uses
            rewards = await asyncio.to_thread(scorer.score, requests)
        except asyncio.CancelledError:  # the caller's deadline passed (its router cancels the call)
            self.counters["cancelled"] += 1
            raise
        # Every reward names this endpoint and its version (the hybrid router records both).
        rewards = [msgspec.structs.replace(r, source=self.name, source_version=self.version) for r in rewards]
        self.counters["rewards"] += len(rewards)
        self.counters["failed"] += sum(r.failed for r in rewards)
        return rewards

    async def compare(self, pairs: list[PairRequest]) -> list[dict]:
        if not hasattr(self.scorer, "compare"):
            raise ValueError(f"reward endpoint {self.name} ({self.config.kind}) cannot judge pairs")
        scorer = self.scorer
        out = await asyncio.to_thread(scorer.compare, pairs)
        return [{**o, "source_version": self.version} for o in out]

    async def _fault_delay(self) -> None:
        """Fault injection: wait `fault_delay_s`, re-reading it, so clearing the fault (a
        reconfigure to 0) releases the calls already waiting."""
        start = time.monotonic()
        while time.monotonic() - start < self.config.fault_delay_s:
            await asyncio.sleep(min(0.1, self.config.fault_delay_s))

    def pid(self) -> int:
        return os.getpid()

    def stats(self) -> dict:
        inner = self.scorer.stats() if hasattr(self.scorer, "stats") else {}
        return {**inner, "name": self.name, "version": self.version, **self.counters}

    def check_health(self) -> None:  # Serve health check: trivial by design
        return None
