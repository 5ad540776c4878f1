"""The embedded generation engine: a transformers causal LM driven by our own decode loop on CPU.

Batches sequences of different lengths with left padding, keeps a KV cache across the tokens of
a window, samples with `asyncrl.algo.sampling` (temperature, top-p, top-k, FIRE, counter-based
seeds) and records the log-prob of each token under the distribution it was drawn from.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Iterable

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel

from asyncrl.algo.sampling import greedy_from_logprobs, sample_from_logprobs, step_logprobs
from asyncrl.engines.base import SamplingParams, SequenceInput, WindowOutput, scored_positions
from asyncrl.schema import FinishReason
from asyncrl.weight_sync import SharedVersion, shared_views


class TorchEngine:
    # Updates land between windows (the generator holds them until the window ends).
    updates_mid_window = False

    def __init__(self, model: PreTrainedModel, eos_token_ids: Iterable[int], pad_token_id: int = 0):
        self.model = model.eval()
        # The model's device (engine.device=cuda puts it on the GPU): every tensor of a window is made there.
        self.device = next(model.parameters()).device
        self.eos_token_ids = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long, device=self.device)
        if self.eos_token_ids.numel() == 0:
            raise ValueError("an engine needs at least one EOS token id")
        self.pad_token_id = pad_token_id
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self._version = 0
        self._shared = None  # what adopted shared-memory weights view (kept alive while in use)
        # Weight updates and generation never overlap: updates land between windows.
        self._lock = threading.Lock()

    @property
    def weight_version(self) -> int:
        return self._version

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
            for name, tensor in named_tensors:
                if name not in state:
                    raise KeyError(f"weight update names unknown parameter {name!r}")
                if self._shared is not None:  # the weights are read-only shared views: replace them
                    state[name].data = tensor.to(state[name].dtype).clone()
                else:
                    state[name].copy_(tensor)
            self._shared = None
            self._version = version

    def adopt_weights(self, named_views: Iterable[tuple[str, torch.Tensor]], version: int, keepalive) -> None:
        """Take views of weights in shared memory as the model's parameters, without a copy (the
        `shm` path). `keepalive` holds the memory they view until the next update replaces them;
        a view whose dtype differs from the model's is copied."""
        state = dict(self.model.named_parameters())
        with self._lock, torch.no_grad():
            for name, view in named_views:
                if name not in state:
                    raise KeyError(f"weight update names unknown parameter {name!r}")
                param = state[name]
                if view.shape != param.shape:
                    raise ValueError(f"weight update: {name} has shape {tuple(view.shape)}, the model {tuple(param.shape)}")
                param.data = view if view.dtype == param.dtype else view.to(param.dtype)
            self._shared = keepalive
            self._version = version

    def adopt_shared(self, shared: SharedVersion, version: int) -> None:
        """Adopt a version in the node's shared memory (`asyncrl.weight_sync.SharedSlots`) as views."""
        views = shared_views(shared)
        self.adopt_weights(views, version, keepalive=views)

    @torch.inference_mode()
    def generate_window_sync(
        self, sequences: list[SequenceInput], window_tokens: int, params: SamplingParams, on_step=None
    ) -> list[WindowOutput]:
        if window_tokens < 1:
            raise ValueError(f"window_tokens must be >= 1, got {window_tokens}")
        if not sequences:
            return []
        with self._lock:
            return self._generate(sequences, window_tokens, params, on_step)

    def _generate(
        self, sequences: list[SequenceInput], window_tokens: int, params: SamplingParams, on_step=None
    ) -> list[WindowOutput]:
        batch, dev = len(sequences), self.device
        contexts = [np.concatenate([s.prompt_ids, s.response_ids]).astype(np.int64) for s in sequences]
        context_lens = torch.tensor([len(c) for c in contexts], device=dev)
        prior = torch.tensor([len(s.response_ids) for s in sequences], device=dev)
        # Tokens each row may still generate in this window (response budget and context limit).
        length_left = torch.minimum(
            torch.tensor([s.max_response_tokens for s in sequences], device=dev) - prior,
            self.max_positions - context_lens,
        )
        budget = length_left.clamp(max=window_tokens)
        if bool((budget <= 0).any()):
            raise ValueError("a sequence passed to generate_window has no response budget left")
        seeds = torch.tensor([s.seed for s in sequences], dtype=torch.int64, device=dev)
        min_tokens = torch.tensor([s.min_response_tokens for s in sequences], device=dev)
        hold_eos = bool((min_tokens > prior).any())

        width = int(context_lens.max())
        input_ids = torch.full((batch, width), self.pad_token_id, dtype=torch.long, device=dev)
        # Allocated once for the whole window; decode steps take a growing prefix view.
        full_mask = torch.ones((batch, width + window_tokens), dtype=torch.long, device=dev)
        full_mask[:, :width] = 0
        attention_mask = full_mask[:, :width]
        for row, ctx in enumerate(contexts):
            input_ids[row, width - len(ctx):] = torch.from_numpy(ctx).to(dev)
            attention_mask[row, width - len(ctx):] = 1
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)

        cache = DynamicCache()
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1, :]
        next_position = context_lens.clone()

        tokens = torch.zeros((batch, window_tokens), dtype=torch.long, device=dev)
        logprobs = torch.zeros((batch, window_tokens), dtype=torch.float32, device=dev)
        top_n = min(params.top_logprobs, logits.shape[-1])
        top_ids = torch.zeros((batch, window_tokens, top_n), dtype=torch.long, device=dev)
        top_logprobs = torch.zeros((batch, window_tokens, top_n), dtype=torch.float32, device=dev)
        produced = torch.zeros(batch, dtype=torch.long, device=dev)
        reason = torch.full((batch,), -1, dtype=torch.long, device=dev)  # -1 running, 0 eos, 1 max length
        for step in range(window_tokens):
            running = reason < 0
            if hold_eos:  # rows below their minimum length cannot sample EOS
                early = (prior + step < min_tokens)[:, None]
                logits[:, self.eos_token_ids] = torch.where(early, float("-inf"), logits[:, self.eos_token_ids])
            dist = step_logprobs(
                logits,
                prior + step,
                params.temperature,
                params.top_k,
                params.top_p,
                params.first_token_temperature,
                params.first_token_top_k,
            )
            if params.greedy:
                tok, tok_lp = greedy_from_logprobs(dist)
            else:
                tok, tok_lp = sample_from_logprobs(dist, seeds, prior + step)
            top = None
            if top_n:  # from `dist`, the distribution sampled from (a row's later positions are cut off below)
                top = torch.topk(dist, top_n, dim=-1)
                top_logprobs[:, step], top_ids[:, step] = top.values, top.indices
            tokens[:, step] = torch.where(running, tok, tokens[:, step])
            logprobs[:, step] = torch.where(running, tok_lp, logprobs[:, step])
            produced += running.long()
            hit_eos = running & torch.isin(tok, self.eos_token_ids)
            # Out of response budget or context: MAX_LENGTH. A row that merely fills the window
            # stays running and is reported as WINDOW below.
            out_of_length = running & ~hit_eos & (produced >= length_left)
            reason = torch.where(hit_eos, 0, reason)
            reason = torch.where(out_of_length, 1, reason)
            last = step == window_tokens - 1 or bool((reason >= 0).all()) or bool((produced >= budget).all())
            if on_step is not None and not on_step(_step_items(tok, tok_lp, running, reason, produced >= budget, top)):
                break  # the consumer of a stream is gone
            if last:
                break
            attention_mask = full_mask[:, : width + step + 1]
            out = self.model(
                input_ids=tok[:, None],
                attention_mask=attention_mask,
                position_ids=next_position[:, None],
                past_key_values=out.past_key_values,
                use_cache=True,
            )
            logits = out.logits[:, -1, :]
            next_position += 1

        results = []
        tokens, logprobs, produced, reason = tokens.cpu(), logprobs.cpu(), produced.cpu(), reason.cpu()
        scored = scored_positions(prior.cpu(), min_tokens.cpu(), window_tokens, params.first_token_temperature is not None)
        top_ids, top_logprobs = top_ids.cpu(), top_logprobs.cpu()
        for row in range(batch):
            n = int(produced[row])
            finish = _FINISH[int(reason[row])]
            results.append(
                WindowOutput(
                    token_ids=tokens[row, :n].to(torch.int32).numpy().copy(),
                    logprobs=logprobs[row, :n].numpy().copy(),
                    finish_reason=finish,
                    scored=None if scored is None else scored[row, :n].numpy().copy(),
                    top_ids=top_ids[row, :n].to(torch.int32).numpy().copy() if top_n else None,
                    top_logprobs=top_logprobs[row, :n].numpy().copy() if top_n else None,
                )
            )
        return results


_FINISH = {0: FinishReason.EOS, 1: FinishReason.MAX_LENGTH, -1: FinishReason.WINDOW}


def _step_items(tok: torch.Tensor, tok_lp: torch.Tensor, running: torch.Tensor, reason: torch.Tensor,
                window_full: torch.Tensor, top=None) -> list[tuple]:
    """One decode step as a stream sees it: each row that produced a token, how it ended if it did
    (WINDOW when its window is full but the response goes on), and its most likely tokens (`top`,
    a `torch.topk` result, or None)."""
    tokens, logprobs, codes, full = tok.tolist(), tok_lp.tolist(), reason.tolist(), window_full.tolist()
    top_ids, top_lps = (top.indices.tolist(), top.values.tolist()) if top is not None else (None, None)
    return [(row, tokens[row], logprobs[row],
             _FINISH[codes[row]] if codes[row] >= 0 else FinishReason.WINDOW if full[row] else None,
             (top_ids[row], top_lps[row]) if top is not None else None)
            for row in running.nonzero().flatten().tolist()]
