"""A reward endpoint as a long-lived service: the same class is a Ray actor (`asyncrl train`) and a
Ray Serve deployment (`serve run`, application `reward-<name>`).

It builds its scorer (verifier, generative judge, BT model, PRM: one per kind, `SCORERS`) from its
section given as a dict, scores in a worker thread so its event loop stays responsive (a call its
caller cancels stops the scorer's pending work; a call given a `budget_s` stops at it and answers
with the rewards already scored: `asyncrl.rewards.calls`), and takes a new config in
place through `reconfigure` (Serve's `user_config`): settings and the reported version change
without a restart; a new model path reloads the model before the swap, so requests never see a
half-built scorer.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time

import msgspec

from asyncrl.config import (Endpoint, GenerativeJudgeEndpoint, ModelConfig, OpenAIJudgeEndpoint, ProcessRewardEndpoint,
                            PythonRewardEndpoint, ScalarRewardEndpoint, VerifierEndpoint)
from asyncrl.config.reward import EndpointBase
from asyncrl.messages.structs import PairRequest, Reward, RewardRequest
from asyncrl.rewards.calls import RewardCall, run_in_call


def endpoint_config(raw: dict | Endpoint) -> Endpoint:
    """An endpoint's section, from its dict (an actor's argument, Serve's `user_config`), checked."""
    if isinstance(raw, EndpointBase):
        return raw
    try:
        return msgspec.convert(raw, Endpoint)
    except msgspec.ValidationError as exc:
        raise ValueError(f"reward endpoint settings: {exc}") from exc


def _verifier(endpoint: VerifierEndpoint, model: ModelConfig | None, default_style: str):
    from asyncrl.rewards.verifier import Verifier

    return Verifier(endpoint, default_style)


def _generative_judge(endpoint: GenerativeJudgeEndpoint, model: ModelConfig | None, default_style: str):
    from asyncrl.models.loading import load_model, load_tokenizer
    from asyncrl.rewards.judge import GenerativeJudge, LocalVerdicts

    if endpoint.model_path:
        judge_model = ModelConfig(source="hf", path=endpoint.model_path)
    elif model is None:
        raise ValueError("a genrm endpoint without model_path needs the policy's model config")
    else:
        judge_model = model
    tokenizer = load_tokenizer(judge_model)
    verdicts = LocalVerdicts(load_model(judge_model, tokenizer), tokenizer,
                             use_chat_template=model.use_chat_template if model is not None else True,
                             model_path=endpoint.model_path)
    return GenerativeJudge(verdicts, endpoint)


def _openai_judge(endpoint: OpenAIJudgeEndpoint, model: ModelConfig | None, default_style: str):
    from asyncrl.rewards.judge import GenerativeJudge
    from asyncrl.rewards.openai_judge import OpenAIVerdicts

    return GenerativeJudge(OpenAIVerdicts(endpoint), endpoint)


def _python_reward(endpoint: PythonRewardEndpoint, model: ModelConfig | None, default_style: str):
    from asyncrl.rewards.user_function import PythonReward

    return PythonReward(endpoint)


def _scalar_reward_model(endpoint: ScalarRewardEndpoint, model: ModelConfig | None, default_style: str):
    from asyncrl.rewards.reward_model import ScalarRewardModel

    return ScalarRewardModel(endpoint)


def _process_reward_model(endpoint: ProcessRewardEndpoint, model: ModelConfig | None, default_style: str):
    from asyncrl.rewards.reward_model import ProcessRewardModel

    return ProcessRewardModel(endpoint)


# The one mapping from an endpoint's kind to what builds its scorer (a `Scorer`: `score`, `version`,
# `reconfigure` in place or False to be rebuilt; a judge and the verifier also `compare` pairs).
SCORERS = {"verifier": _verifier, "genrm": _generative_judge, "bt": _scalar_reward_model, "prm": _process_reward_model,
           "python": _python_reward, "openai": _openai_judge}


def build_scorer(endpoint: Endpoint, model: ModelConfig | None, default_style: str):
    return SCORERS[endpoint.kind](endpoint, model, default_style)


class RewardEndpoint:
    def __init__(self, name: str, config: dict | Endpoint, model: dict | ModelConfig | None = None,
                 default_style: str = "zero_one"):
        self.name = name
        self.model = msgspec.convert(model, ModelConfig) if isinstance(model, dict) else model
        self.default_style = default_style
        self.config = endpoint_config(config)
        self.scorer = build_scorer(self.config, self.model, default_style)
        self.started = time.time()
        self.counters = {"requests": 0, "rewards": 0, "failed": 0, "reconfigurations": 0, "cancelled": 0,
                         "stopped_at_deadline": 0}
        # Calls at work on each scorer (by id), and the replaced scorers that wait for theirs to end
        # before they close: a hot swap loses no reward that was being scored.
        self._calls: dict[int, int] = {}
        self._replaced: dict[int, object] = {}
        self._calls_lock = threading.Lock()  # Serve may run `reconfigure` off the event loop

    @property
    def version(self) -> str:
        return f"{self.name}:{self.config.kind}:{self.config.version}"

    def reconfigure(self, user_config: dict) -> None:
        """Serve calls this with the deployment's `user_config` at start and on every update."""
        if not user_config:
            return
        current = msgspec.to_builtins(self.config)
        if user_config.get("kind", current["kind"]) != current["kind"]:
            current = {}  # another kind: its own settings, from its defaults
        new = endpoint_config({**current, **user_config})
        old = self.scorer
        scorer = old
        if new.kind != self.config.kind or not old.reconfigure(new):
            scorer = build_scorer(new, self.model, self.default_style)  # built first, then swapped
        with self._calls_lock:
            self.config, self.scorer = new, scorer
            if scorer is not old:
                self._replaced[id(old)] = old
        if scorer is not old:
            self._close_when_idle(old)
        self.counters["reconfigurations"] += 1

    def _close_when_idle(self, scorer) -> None:
        """Close a replaced scorer's worker processes or connections once no call is at work on it."""
        with self._calls_lock:
            idle = self._calls.get(id(scorer), 0) == 0 and self._replaced.pop(id(scorer), None) is not None
        if idle and hasattr(scorer, "close"):
            scorer.close()

    @contextlib.contextmanager
    def _using(self):
        """The current scorer and its version, counted as at work while the block runs; the last
        call on a replaced scorer closes it."""
        with self._calls_lock:
            scorer, version = self.scorer, self.version
            self._calls[id(scorer)] = self._calls.get(id(scorer), 0) + 1
        try:
            yield scorer, version
        finally:
            with self._calls_lock:
                self._calls[id(scorer)] -= 1
                last = not self._calls[id(scorer)]
                if last:
                    del self._calls[id(scorer)]
            if last:
                self._close_when_idle(scorer)

    async def score(self, requests: list[RewardRequest], budget_s: float | None = None) -> list[Reward]:
        """The rewards of `requests`. With `budget_s` (the router's deadline less the time to answer)
        the call stops then and answers with what it scored, the rest failed with the reason."""
        stop_at = None if budget_s is None else time.monotonic() + budget_s
        self.counters["requests"] += 1
        try:
            await self._fault_delay()
            # The scorer and version of this call, whatever swaps in meanwhile (it finishes on them).
            with self._using() as (scorer, version):
                rewards = await self._run(scorer.score, requests, stop_at)
        except asyncio.CancelledError:  # the caller's deadline passed: the scorer's pending work is stopped
            self.counters["cancelled"] += 1
            raise
        # Every reward names this endpoint and its version (the hybrid router records both).
        rewards = [msgspec.structs.replace(r, source=self.name, source_version=version) for r in rewards]
        self.counters["rewards"] += len(rewards)
        self.counters["failed"] += sum(r.failed for r in rewards)
        return rewards

    async def compare(self, pairs: list[PairRequest], budget_s: float | None = None) -> list[dict]:
        if not hasattr(self.scorer, "compare"):
            raise ValueError(f"reward endpoint {self.name} ({self.config.kind}) cannot judge pairs")
        stop_at = None if budget_s is None else time.monotonic() + budget_s
        try:
            with self._using() as (scorer, version):
                out = await self._run(scorer.compare, pairs, stop_at)
        except asyncio.CancelledError:
            self.counters["cancelled"] += 1
            raise
        return [{**o, "source_version": version} for o in out]

    async def _run(self, method, items: list, stop_at: float | None):
        call = RewardCall()
        out = await run_in_call(call, method, items, stop_at=stop_at)
        self.counters["stopped_at_deadline"] += int(call.stopped)
        return out

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
