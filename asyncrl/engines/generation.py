"""Prompt -> text: the one path from prompt token ids through engine windows to decoded text.

Every caller that wants whole responses goes through `complete` / `complete_async`: held-out
evaluation, `asyncrl generate`, Pre-PPO's candidate scoring, the policy endpoint and the engine
benchmark. The generator role, which streams windows, builds its inputs with `sequence_input`
and samples from the same distribution of the run (`SamplingParams.of(config.sampling)`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from asyncrl.config import EngineConfig, ModelConfig
from asyncrl.engines.base import SamplingParams, SequenceInput
from asyncrl.engines.torch_engine import TorchEngine, engine_precision
from asyncrl.messages.structs import FinishReason
from asyncrl.models.loading import eos_token_ids, load_policy

EMPTY = np.zeros(0, dtype=np.int32)


def build_engine(model: ModelConfig, policy: tuple | None = None, device: str = "cpu",
                 dtype: torch.dtype | None = None) -> tuple[TorchEngine, object]:
    """The embedded engine and tokenizer of `model` (on `device`); `policy` = an already loaded
    `(model, tokenizer)`. `dtype`: the engine computes on a copy in it (None: `model.dtype`, the
    learner's own numbers, as evaluation uses)."""
    lm, tokenizer = policy if policy is not None else load_policy(model)
    engine = TorchEngine(lm.to(device), eos_token_ids(lm, tokenizer), tokenizer.pad_token_id or 0, dtype=dtype)
    return engine, tokenizer


def build_generator_engine(model: ModelConfig, engine: EngineConfig, seed: int = 0) -> tuple[object, dict]:
    """The engine a generator runs, the embedded one, SGLang's (`engine.name=sglang`) or vLLM's
    (`engine.name=vllm`), and its precision as the generator reports it (the embedded engine's
    `engine.dtype`, resolved)."""
    if engine.name == "vllm":
        from asyncrl.engines.vllm_launch import start_vllm  # imports vLLM: only in its venv

        return start_vllm(model, engine, seed), {"precision": model.dtype, "reason": "vLLM runs model.dtype"}
    if engine.name == "sglang":
        from asyncrl.engines.sglang_launch import start_sglang  # imports SGLang: only in its venv

        return start_sglang(model, engine, seed), {"precision": model.dtype, "reason": "SGLang runs model.dtype"}
    policy = load_policy(model)
    precision = engine_precision(engine.dtype, engine.device, policy[0], engine.max_inflight_sequences)
    return build_engine(model, policy, engine.device, precision.dtype)[0], precision.summary()


def sequence_input(prompt_ids: Sequence[int] | np.ndarray, seed: int, max_response_tokens: int,
                   response_ids: Sequence[int] | np.ndarray = EMPTY, min_response_tokens: int = 0,
                   key: str | None = None, images: tuple[str, ...] = ()) -> SequenceInput:
    """A sequence to advance: its prompt, the response so far (empty for a new one), its seed;
    `key`, its identity across windows (the engine may keep its KV cache between them); `images`,
    the prompt's processed images by reference."""
    return SequenceInput(prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
                         response_ids=np.asarray(response_ids, dtype=np.int32), seed=seed,
                         max_response_tokens=max_response_tokens, min_response_tokens=min_response_tokens, key=key,
                         images=tuple(images))


def decode(tokenizer, token_ids: Sequence[int] | np.ndarray) -> str:
    """Response text as users, verifiers and judges see it (special tokens dropped)."""
    ids = token_ids.tolist() if isinstance(token_ids, np.ndarray) else list(token_ids)
    return tokenizer.decode(ids, skip_special_tokens=True)


@dataclass(frozen=True)
class Completion:
    token_ids: np.ndarray  # int32 [N]
    logprobs: np.ndarray  # float32 [N], under the distribution sampled from
    finish_reason: FinishReason  # EOS or MAX_LENGTH
    text: str
    # With `SamplingParams.top_logprobs` = k: each position's k most likely tokens [N, k] and their
    # log-probs (`WindowOutput.top_ids` / `top_logprobs`); None otherwise.
    top_ids: np.ndarray | None = None
    top_logprobs: np.ndarray | None = None


def _inputs(prompts: list[Sequence[int]], seeds: list[int], max_tokens: int,
            images: list[tuple[str, ...]] | None = None) -> list[SequenceInput]:
    if len(prompts) != len(seeds) or (images is not None and len(images) != len(prompts)):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds{'' if images is None else f' and {len(images)} image lists'}")
    return [sequence_input(ids, seed, max_tokens, images=images[i] if images is not None else ())
            for i, (ids, seed) in enumerate(zip(prompts, seeds))]


def _completions(tokenizer, outputs) -> list[Completion]:
    return [Completion(o.token_ids, o.logprobs, o.finish_reason, decode(tokenizer, o.token_ids), o.top_ids, o.top_logprobs)
            for o in outputs]


def complete(engine, tokenizer, prompts: list[Sequence[int]], seeds: list[int], max_tokens: int,
             params: SamplingParams, batch_size: int = 16, on_batch=None,
             images: list[tuple[str, ...]] | None = None) -> list[Completion]:
    """Whole responses (one window of `max_tokens`) to `prompts` (with their processed `images`,
    one tuple each, where they have any), `batch_size` sequences per engine call; `on_batch(n)`
    after each call (a progress bar's `update`)."""
    inputs = _inputs(prompts, seeds, max_tokens, images)
    out: list[Completion] = []
    # With a progress bar, a small first batch: its rate gives an estimate of the whole within
    # seconds (a first batch of 16 on a busy machine took minutes with no estimate at all).
    first = min(4, batch_size) if on_batch is not None else batch_size
    starts = [0] + list(range(first, len(inputs), max(1, batch_size)))
    for start, end in zip(starts, starts[1:] + [len(inputs)]):
        if start >= end:
            continue
        outputs = engine.generate_window_sync(inputs[start:end], max_tokens, params)
        out += _completions(tokenizer, outputs)
        if on_batch is not None:
            on_batch(len(outputs))
    return out


async def complete_async(engine, tokenizer, prompts: list[Sequence[int]], seeds: list[int], max_tokens: int,
                         params: SamplingParams, batch_size: int | None = None) -> list[Completion]:
    """`complete` for callers on an event loop: the engine runs off the loop. `batch_size=None`:
    every prompt in one engine call (the policy endpoint's `n` choices)."""
    if batch_size is None:
        outputs = await engine.generate_window(_inputs(prompts, seeds, max_tokens), max_tokens, params)
        return _completions(tokenizer, outputs)
    return await asyncio.to_thread(complete, engine, tokenizer, prompts, seeds, max_tokens, params, batch_size)


class EngineCalls:
    """A generator's engine calls in progress (windows, weight loads): the age of the oldest is its
    liveness (`oldest_s`), since a generator whose engine is wedged in its thread still answers.
    Load tests make the calls of a kind hang (`faults`: `window_hang_s`, `load_hang_s`; 0 clears,
    and clearing ends a hang in progress)."""

    def __init__(self):
        self._started: dict[int, float] = {}
        self._count = 0
        self.faults = {"load_hang_s": 0.0, "window_hang_s": 0.0}

    @contextlib.asynccontextmanager
    async def call(self, kind: str):
        """One engine call of `kind` (window | load), timed while it runs."""
        self._count += 1
        token = self._count
        self._started[token] = time.monotonic()
        try:
            start, hang = time.monotonic(), f"{kind}_hang_s"
            while self.faults[hang] and time.monotonic() - start < self.faults[hang]:
                await asyncio.sleep(0.1)
            yield
        finally:
            del self._started[token]

    def oldest_s(self, progress_at: float = 0.0) -> float:
        """How long the oldest call in progress has run without progress (0: none runs).
        `progress_at`: the engine's last sign of work within a call (a decode step, monotonic
        time), so a long window that is decoding is not taken for a wedged one."""
        if not self._started:
            return 0.0
        return time.monotonic() - max(min(self._started.values()), progress_at)

    def inject(self, **faults: float) -> dict:
        unknown = sorted(set(faults) - set(self.faults))
        if unknown:
            raise ValueError(f"unknown fault(s) {unknown}; the generator takes {sorted(self.faults)}")
        self.faults.update({k: float(v) for k, v in faults.items()})
        return dict(self.faults)
