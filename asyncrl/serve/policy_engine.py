"""The policy endpoint's engine: the run's own engine (`engine.name`, on `engine.device`), owned by
the `policy` replica, and how requests and weight versions reach it.

* `engine=torch`: the embedded engine behind `WindowBatcher` (`asyncrl.engines.batching`), which
  batches concurrent requests into shared engine windows (up to `serve.max_batch_sequences`
  sequences, a KV block of at most `serve.max_kv_mb`).
* `engine=sglang` / `engine=vllm`: SGLang's offline engine or vLLM's `AsyncLLM`; each sequence is
  a streamed request (`server_stream.RequestSteps`), and the server's scheduler batches them
  continuously within its own KV pool.

An engine of its own, not a generator's: the `policy` application is deployed, scaled and
redeployed apart from `train` (it also serves a frozen policy with no run at all,
`serve.follow_learner=false`), a generator pool grows, shrinks and heals under a run, and queries
must never hold the generators' windows or their weight deliveries (the admission budget waits
for every generator to hold a version). The price is a second copy of the weights and KV cache
on the device. Its weights follow the learner by the generators' update path: each new version is
loaded with `Engine.update_weights` (the path of the `group` and `cuda_ipc` deliveries), stamped
with the learner's version number; the embedded engine takes it between two windows, SGLang and
vLLM while requests run (those cut continue under the new weights, as a generator's do).
"""

from __future__ import annotations

import asyncio
from typing import Iterable

import torch

from asyncrl.config import Config
from asyncrl.engines.base import SamplingParams, SequenceInput


def kv_bytes_per_position(model) -> int:
    """Keys and values of one token position, every layer, in the model's dtype (a vision-language
    model's: its language model's)."""
    from asyncrl.models.vision import text_config

    config = text_config(model.config)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * 2 * heads * head_dim * next(model.parameters()).element_size()


class EmbeddedPolicy:
    """The embedded engine, batched across requests."""

    takes_images = True  # a vision-language model's prompts with images (`SequenceInput.images`)

    def __init__(self, config: Config):
        from asyncrl.engines.batching import WindowBatcher
        from asyncrl.engines.generation import build_generator_engine

        self.engine, self.precision = build_generator_engine(config.model, config.engine)
        positions = (config.serve.max_kv_mb << 20) // kv_bytes_per_position(self.engine.model)
        self.batcher = WindowBatcher(self.engine, config.serve.max_batch_sequences, config.serve.batch_window_tokens,
                                     positions, config.serve.batch_gather_s, config.serve.batch_cut_after_s)
        self.vocab_size = self.engine.vocab_size

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    @property
    def context_tokens(self) -> int:
        return self.engine.max_positions

    def stream(self, sequences: list[SequenceInput], params: SamplingParams, live: bool):
        """`live`: steps as they are sampled (a streamed request), else a window's at once."""
        return self.batcher.stream(sequences, params, live)

    async def load(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        await self.batcher.load(lambda: self.engine.update_weights(named, version))

    def stats(self) -> dict:
        return self.batcher.stats()


class ServerPolicy:
    """SGLang's or vLLM's engine (`engine.name`): every sequence a request of its own, batched by
    the server's scheduler."""

    takes_images = False  # the image_url parts of chat requests are served by the embedded engine only, for now

    def __init__(self, config: Config, engine=None):
        """`engine`: a `server_engine.ServerEngine` already started for `config.model` (else one is)."""
        from asyncrl.models.loading import load_tokenizer

        self.engine = engine if engine is not None else _start_server(config)
        self.vocab_size = len(load_tokenizer(config.model))
        if config.engine.name == "vllm":
            self.max_positions, self.kv_setting = self.engine.kv_positions, "engine.vllm_kv_cache_mb"
        else:
            self.max_positions = config.engine.sglang_max_total_tokens or (1 << 62)
            self.kv_setting = "engine.sglang_max_total_tokens"
        self.max_rows = config.serve.max_batch_sequences

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    @property
    def context_tokens(self) -> int:
        return self.engine.context_tokens

    def stream(self, sequences: list[SequenceInput], params: SamplingParams, live: bool):
        """Steps as the server returns them (`live` or not: its outputs come in chunks of its own)."""
        from asyncrl.engines.batch_jobs import TooLarge

        positions = sum(len(s.prompt_ids) + s.max_response_tokens for s in sequences)
        if len(sequences) > self.max_rows:
            raise TooLarge(f"{len(sequences)} sequences (prompts x n) in one request; at most {self.max_rows} "
                           "(serve.max_batch_sequences)")
        if positions > self.max_positions:
            raise TooLarge(f"{len(sequences)} sequence(s) need {positions} token positions of KV cache; "
                           f"{self.engine.server}'s holds {self.max_positions} ({self.kv_setting})")
        return self.engine.stream(sequences, params)

    async def load(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        await asyncio.to_thread(self.engine.update_weights, named, version)

    def stats(self) -> dict:
        return {"running_sequences": len(self.engine._inflight), **self.engine.counters}  # noqa: SLF001


def _start_server(config: Config):
    if config.engine.name == "vllm":
        from asyncrl.engines.vllm_launch import start_vllm

        return start_vllm(config.model, config.engine, config.trainer.seed)
    from asyncrl.engines.sglang_launch import start_sglang

    return start_sglang(config.model, config.engine, config.trainer.seed)


def build_policy_engine(config: Config) -> EmbeddedPolicy | ServerPolicy:
    """The run's engine: SGLang's or vLLM's where `engine.name` says so, else the embedded one."""
    return ServerPolicy(config) if config.engine.name in ("sglang", "vllm") else EmbeddedPolicy(config)
