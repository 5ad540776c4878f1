"""The embedded generation engine: a transformers causal LM driven by our own decode loop.

Samples with `asyncrl.algo.sampling` (temperature, top-p, top-k, FIRE, counter-based seeds) and
records the log-prob of each token under the distribution it was drawn from (the engine's own:
in bfloat16, the bfloat16 model's). Llama, Qwen2/2.5 and Qwen3 models, and the mixture-of-experts
Mixtral, Qwen2-MoE and Qwen3-MoE (their experts: `asyncrl.engines.moe`), run on the engine's own
forward (`asyncrl.engines.llama_decoder`) over a preallocated KV block, and keep each keyed
sequence's KV cache from one window to its next while the weights do not change
(`asyncrl.engines.kv_cache`); other models run transformers' forward over left-padded batches,
re-reading each context (said once, when the engine is built). A mixture-of-experts model's tokens
come with their routes (`WindowOutput.routes`: the experts of the position each was sampled from),
which the learners replay. A vision-language model's (Qwen2-VL's) prompts with images run on the
same decoder: the vision tower once per distinct image of a window, its features in place of the
image tokens' embeddings, the family's multimodal positions (`asyncrl.engines.vision_prompts`).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import threading
import time
from typing import Callable, Iterable, Sequence

import numpy as np
import torch
from transformers import PreTrainedModel

from asyncrl.engines import llama_decoder
from asyncrl.engines.base import SamplingParams, SequenceInput, WindowOutput
from asyncrl.engines.decode_loop import WindowRows, decode_window
from asyncrl.engines.kv_cache import CachedWindow, KeptCaches, share_prefixes
from asyncrl.engines.padded_window import PaddedWindow
from asyncrl.engines.row_sampling import LogitAdjust, RowSampling
from asyncrl.engines.vision_prompts import prompt_media
from asyncrl.messages.routes import route_dtype
from asyncrl.messages.structs import FinishReason
from asyncrl.models.precision import Precision, choose_precision
from asyncrl.models.vision import VisionInputs, is_vision_model, text_config
from asyncrl.weights import delta as weights_delta
from asyncrl.weights.lora import AdapterMerger, adapter_modules
from asyncrl.weights.shared_memory import SharedVersion, shared_views
from asyncrl.weights.sync import AdapterSpec, WeightTransferError

log = logging.getLogger(__name__)


def engine_precision(name: str, device: str, model, rows: int) -> Precision:
    """`engine.dtype` for `model` (`.dtype`: the torch dtype); auto: measured at `rows` rows, a
    decode step's batch (`asyncrl.models.precision.choose_precision`)."""
    if name not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"engine dtype must be auto, float32 or bfloat16, got {name!r}")
    return choose_precision(name, model, device, rows, "engine")


class TorchEngine:
    """`dtype`: run a copy of `model` in this dtype (None: the model itself, as it is, so a caller
    that trains it is generating from its current weights). `max_kept_bytes`: the bound on KV
    caches kept between windows (one window's block at most; a larger one is not kept)."""

    # Updates land between windows (the generator holds them until the window ends).
    updates_mid_window = False

    def __init__(self, model: PreTrainedModel, eos_token_ids: Iterable[int], pad_token_id: int = 0,
                 dtype: torch.dtype | None = None, max_kept_bytes: int = 2 << 30):
        if dtype is not None and dtype != next(model.parameters()).dtype:
            model = copy.deepcopy(model).to(dtype)  # the caller's model stays as it is
        self.model = model.eval()
        # The model's device (engine.device=cuda puts it on the GPU): every tensor of a window is made there.
        self.device = next(model.parameters()).device
        self.eos_token_ids = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long, device=self.device)
        if self.eos_token_ids.numel() == 0:
            raise ValueError("an engine needs at least one EOS token id")
        self.pad_token_id = pad_token_id
        self.last_step_at = 0.0  # monotonic time of the last decode step: a long window's progress
        self.max_positions = int(getattr(text_config(model.config), "max_position_embeddings", 1 << 30))
        self.vision = VisionInputs(model) if is_vision_model(model) else None  # a prompt's images, if any
        reason = llama_decoder.unsupported(model)
        if reason is not None:
            log.warning("embedded engine: %s runs on transformers' forward, the slower path (each window "
                        "left-padded, its whole context re-read, no KV kept across windows): %s",
                        type(model).__name__, reason)
        self.decoder = llama_decoder.LlamaDecoder(model) if reason is None else None
        # A mixture-of-experts model's routes are recorded with every token (`WindowOutput.routes`).
        experts = self.decoder.experts if self.decoder is not None else 0
        self.routes_dtype = getattr(torch, route_dtype(experts).name) if experts else None
        self.kept = KeptCaches(max_kept_bytes)
        self.share_prefixes = True  # rows of a window compute what their prompts share once (`share_prefixes`)
        self.largest_block_positions = 0  # rows x columns of the largest KV block a window allocated
        self._version = 0
        self._updates = 0  # weight loads through this engine (part of the stamp kept caches carry)
        self._shared = None  # what adopted shared-memory weights view (kept alive while in use)
        self._lora: AdapterMerger | None = None  # the base of adapted modules, from the first adapter on
        # Weight updates and generation never overlap: updates land between windows.
        self._lock = threading.Lock()

    @functools.cached_property
    def vocab_size(self) -> int:
        """Rows of the output projection (what a logit adjustment indexes); read when first needed."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def keeps_caches(self) -> bool:
        """Whether a sequence's next window goes on from its kept KV cache (the engine's own decoder),
        rather than re-reading its whole context (transformers' padded path)."""
        return self.decoder is not None

    async def generate_window(
        self, sequences: list[SequenceInput], window_tokens: int, params: SamplingParams
    ) -> list[WindowOutput]:
        return await asyncio.to_thread(self.generate_window_sync, sequences, window_tokens, params)

    async def stream_window(self, sequences: list[SequenceInput], window_tokens: int, params: SamplingParams):
        """`generate_window` that yields each decode step as it is sampled: a list of
        `(row, token_id, logprob, finish_reason or None, top)` for the rows that produced a token
        (top: None, or `(ids, logprobs)` of the `params.top_logprobs` most likely tokens). Closing
        the iterator early (a client gone, every stop string found) ends the decode loop."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()

        def on_step(items: list) -> bool:
            loop.call_soon_threadsafe(queue.put_nowait, items)
            return not cancelled.is_set()

        def run() -> None:
            try:
                self.generate_window_sync(sequences, window_tokens, params, on_step=on_step)
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, None)

        worker = asyncio.ensure_future(asyncio.to_thread(run))
        try:
            while (items := await queue.get()) is not None:
                yield items
            await worker  # an engine error reaches the caller
        finally:
            cancelled.set()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy new weights into the model (between windows)."""
        state = dict(self.model.named_parameters())
        state.update(self.model.named_buffers())
        with self._lock, torch.no_grad():
            self._updates += 1
            self.kept.clear()
            for name, tensor in named_tensors:
                if name not in state:
                    raise KeyError(f"weight update names unknown parameter {name!r}")
                if self._shared is not None:  # the weights are read-only shared views: replace them
                    state[name].data = tensor.to(state[name].dtype).clone()
                else:
                    state[name].copy_(tensor)
            self._shared = None
            self._version = version

    def load_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], adapter: AdapterSpec,
                     version: int) -> None:
        """A LoRA version (`asyncrl.weights.lora`): its adapter merged into the unmerged base of its modules,
        a copy taken at the first adapter (a LoRA run sends nothing else, so the weights are the
        base then). Merging once per version was faster than LoRA in the forward (docs/benchmarks.md)."""
        tensors = dict(named_tensors)
        if self._lora is None:
            self._lora = AdapterMerger.of(dict(self.model.named_parameters()), adapter_modules(tensors))
        self.update_weights(self._lora.merged(tensors, adapter.scaling), version)

    def hold_version(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """A whole version in delta mode: copied into the engine's own weights, which deltas change."""
        self.update_weights(named_tensors, version)

    def apply_delta(self, named_tensors: Iterable[tuple[str, torch.Tensor]], base_version: int, version: int) -> None:
        """What changed since `base_version` (`asyncrl.weights.delta`), written into the engine's own weights."""
        with self._lock:
            if self._version != base_version or self._shared is not None:
                raise WeightTransferError(f"a delta from version {base_version}, but the engine holds version "
                                          f"{self._version}{' as shared views' if self._shared is not None else ''}")
            self._updates += 1
            self.kept.clear()
            weights_delta.apply({name: p.data for name, p in self.model.named_parameters()}, named_tensors)
            self._version = version

    def adopt_weights(self, named_views: Iterable[tuple[str, torch.Tensor]], version: int, keepalive) -> None:
        """Take views of weights in shared memory as the model's parameters, without a copy (the
        `shm` path). `keepalive` holds the memory they view until the next update replaces them;
        a view whose dtype differs from the model's is copied."""
        state = dict(self.model.named_parameters())
        with self._lock, torch.no_grad():
            self._updates += 1
            self.kept.clear()
            for name, view in named_views:
                if name not in state:
                    raise KeyError(f"weight update names unknown parameter {name!r}")
                param = state[name]
                if view.shape != param.shape:
                    raise ValueError(f"weight update: {name} has shape {tuple(view.shape)}, the model {tuple(param.shape)}")
                param.data = view if view.dtype == param.dtype else view.to(param.dtype)
            self._shared = keepalive
            self._version = version

    def window_positions(self, sequences: list[SequenceInput], window_tokens: int) -> int:
        """The token positions (rows x columns) of the KV block a window over `sequences` allocates
        now: what a caller bounds before it asks (`CachedWindow`: the longest kept cache plus the
        longest suffix plus the window; transformers' forward: the longest context plus the window)."""
        contexts = [np.concatenate([s.prompt_ids, s.response_ids]) for s in sequences]
        if self.decoder is None:
            return len(sequences) * (max(len(c) for c in contexts) + window_tokens)
        kept = self.kept.reusable([s.key for s in sequences], contexts, self.weights_stamp())
        columns = max(kept) + max(len(c) - k for c, k in zip(contexts, kept)) + window_tokens - 1
        return len(sequences) * columns

    def _stepped(self) -> None:
        self.last_step_at = time.monotonic()

    def weights_stamp(self) -> tuple:
        """Changes whenever the weights may have: a load through the engine, or any parameter
        replaced or modified in place (an optimizer step on a model the engine shares)."""
        return self._updates, tuple((p.data_ptr(), p._version) for p in self.model.parameters())

    def adopt_shared(self, shared: SharedVersion, version: int) -> None:
        """Adopt a version in the node's shared memory (`asyncrl.weights.shared_memory.SharedSlots`) as views."""
        views = shared_views(shared)
        self.adopt_weights(views, version, keepalive=views)

    @torch.inference_mode()
    def generate_window_sync(
        self, sequences: list[SequenceInput], window_tokens: int, params: SamplingParams | Sequence[SamplingParams],
        on_step=None, cut: Callable[[], bool] | None = None, on_end=None,
    ) -> list[WindowOutput]:
        """`params`: one setting for every sequence, or one each (`asyncrl.engines.row_sampling`).
        `on_step(items)`: each decode step as `stream_window` yields it; returning False stops the
        window (its rows' kept caches are dropped). `cut()`: asked after each decode step; True ends
        the window there as a full window ends (its rows go on in a next window, their caches kept).
        `on_end(ended)`: on a step where rows ended (EOS or length), `[(index in sequences, its
        WindowOutput)]`, so a caller need not wait for the window's end to have them."""
        if window_tokens < 1:
            raise ValueError(f"window_tokens must be >= 1, got {window_tokens}")
        if not sequences:
            return []
        with self._lock:
            return self._generate(sequences, window_tokens, params, on_step, cut, on_end)

    def _generate(self, sequences: list[SequenceInput], window_tokens: int,
                  params: SamplingParams | Sequence[SamplingParams], on_step=None, cut: Callable[[], bool] | None = None, on_end=None) -> list[WindowOutput]:
        contexts = [np.concatenate([s.prompt_ids, s.response_ids]).astype(np.int64) for s in sequences]
        rows = WindowRows.of(sequences, contexts, window_tokens, self.max_positions, self.device)  # checks budgets first
        media = self._media(sequences)
        if self.decoder is None:
            window, order = PaddedWindow(self.model, contexts, window_tokens, self.pad_token_id), list(range(len(sequences)))
        else:
            stamp = self.weights_stamp()
            kept = self.kept.take([s.key for s in sequences], contexts, stamp)
            if self.share_prefixes:
                kept, spared = share_prefixes(self.decoder, contexts, kept, self.pad_token_id, media, self.vision)
                self.kept.stats["prefill_tokens_shared"] += spared
            # Longest suffix (tokens not in a kept cache) first: `CachedWindow` prefills in slices.
            suffix = [len(c) - (0 if k is None else len(k.tokens)) for c, k in zip(contexts, kept)]
            order = sorted(range(len(sequences)), key=lambda i: suffix[i], reverse=True)
            window = CachedWindow(self.decoder, [contexts[i] for i in order], [kept[i] for i in order],
                                  window_tokens, self.pad_token_id, self.routes_dtype,
                                  None if media is None else [media[i] for i in order], self.vision)
            self.largest_block_positions = max(self.largest_block_positions, window.block.valid.numel())
        sampling = RowSampling.of(params, len(sequences), self.vocab_size, self.device).select(order)
        adjust = LogitAdjust.of([sequences[i] for i in order], sampling, self.vocab_size, self.device)
        decoded = decode_window(window, rows.select(order), window_tokens, sampling, self.eos_token_ids, on_step, order,
                          adjust, cut, on_end, self._stepped)
        outputs = decoded.outputs()
        if self.decoder is not None and decoded.complete:
            keep = {sequences[i].key: window.kept(row, outputs[row].token_ids) for row, i in enumerate(order)
                    if sequences[i].key is not None and outputs[row].finish_reason is FinishReason.WINDOW}
            self.kept.keep(keep, stamp, window.block.nbytes)
        results: list[WindowOutput] = [None] * len(sequences)  # type: ignore[list-item]
        for row, i in enumerate(order):
            results[i] = outputs[row]
        return results

    def _media(self, sequences: list[SequenceInput]) -> list | None:
        """Each row's images as the decoder takes them (None: no row has any). Images on a model
        without a vision tower, or on transformers' padded path, are refused naming the model."""
        if not any(s.images for s in sequences):
            return None
        if self.vision is None or self.decoder is None:
            raise ValueError(f"prompts with images, but {type(self.model).__name__} "
                             f"({getattr(self.model.config, 'model_type', '?')}) "
                             f"{'is a text-only model' if self.vision is None else 'does not run on the engine decoder'}")
        return prompt_media(self.vision, [s.prompt_ids for s in sequences], [s.images for s in sequences])
