"""The embedded engine's decode loop over one window: each step's logits from the window (its
own forward over a KV block, or transformers' over padded rows), adjusted and sampled per row
(`asyncrl.engines.row_sampling`), EOS, budgets and minimum lengths applied, every token streamed as
it is sampled; and what the rows got, as `WindowOutput`s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from asyncrl.engines.base import SequenceInput, WindowOutput, scored_positions
from asyncrl.engines.row_sampling import LogitAdjust, RowSampling, sample_step
from asyncrl.messages.structs import FinishReason


@dataclass
class WindowRows:
    """Per-row limits of a window, as tensors on the engine's device."""

    prior: torch.Tensor  # response tokens generated before this window
    length_left: torch.Tensor  # tokens each row may still generate (response budget, context limit)
    budget: torch.Tensor  # tokens each row may generate in this window
    seeds: torch.Tensor
    min_tokens: torch.Tensor

    @classmethod
    def of(cls, sequences: list[SequenceInput], contexts: list[np.ndarray], window_tokens: int, max_positions: int,
           device) -> "WindowRows":
        prior = torch.tensor([len(s.response_ids) for s in sequences], device=device)
        length_left = torch.minimum(torch.tensor([s.max_response_tokens for s in sequences], device=device) - prior,
                                    max_positions - torch.tensor([len(c) for c in contexts], device=device))
        budget = length_left.clamp(max=window_tokens)
        if bool((budget <= 0).any()):
            raise ValueError("a sequence passed to generate_window has no response budget left")
        return cls(prior, length_left, budget, torch.tensor([s.seed for s in sequences], dtype=torch.int64, device=device),
                   torch.tensor([s.min_response_tokens for s in sequences], device=device))

    def select(self, order: list[int]) -> "WindowRows":
        index = torch.tensor(order, device=self.prior.device)
        return WindowRows(*(t.index_select(0, index) for t in (self.prior, self.length_left, self.budget, self.seeds,
                                                          self.min_tokens)))


@dataclass
class DecodedWindow:
    tokens: torch.Tensor  # [B, W]
    logprobs: torch.Tensor  # [B, W]
    produced: torch.Tensor  # [B]
    reason: torch.Tensor  # [B]: -1 running, 0 eos, 1 max length
    complete: bool  # False when a stream's consumer stopped it
    scored: torch.Tensor | None = None  # uint8 [B, W] (`scored_positions`), None when every position was
    top_ids: torch.Tensor | None = None  # [B, W, k] with `params.top_logprobs` = k
    top_logprobs: torch.Tensor | None = None
    routes: torch.Tensor | None = None  # [B, W, sparse_layers, top_k] (a mixture-of-experts model)

    def output(self, row: int) -> WindowOutput:
        """One row's output (a row that ended: its positions are written no more)."""
        n, top = int(self.produced[row]), self.top_ids is not None
        return WindowOutput(token_ids=self.tokens[row, :n].to(torch.int32).cpu().numpy(),
                            logprobs=self.logprobs[row, :n].cpu().numpy().copy(),
                            finish_reason=_FINISH[int(self.reason[row])],
                            scored=None if self.scored is None else self.scored[row, :n].cpu().numpy().copy(),
                            top_ids=self.top_ids[row, :n].to(torch.int32).cpu().numpy() if top else None,
                            top_logprobs=self.top_logprobs[row, :n].cpu().numpy().copy() if top else None,
                            routes=None if self.routes is None else self.routes[row, :n].cpu().numpy().copy())

    def outputs(self) -> list[WindowOutput]:
        # Whole arrays to numpy once, then rows (per-row tensor slicing cost 2.5 ms a window at batch 64).
        tokens = self.tokens.to(torch.int32).cpu().numpy()
        logprobs = self.logprobs.cpu().numpy()
        scored = None if self.scored is None else self.scored.cpu().numpy()
        top = self.top_ids is not None
        top_ids = self.top_ids.to(torch.int32).cpu().numpy() if top else None
        top_lps = self.top_logprobs.cpu().numpy() if top else None
        routes = None if self.routes is None else self.routes.cpu().numpy()
        return [WindowOutput(token_ids=tokens[row, :n].copy(), logprobs=logprobs[row, :n].copy(),
                             finish_reason=_FINISH[code], scored=None if scored is None else scored[row, :n].copy(),
                             top_ids=top_ids[row, :n].copy() if top else None,
                             top_logprobs=top_lps[row, :n].copy() if top else None,
                             routes=None if routes is None else routes[row, :n].copy())
                for row, (n, code) in enumerate(zip(self.produced.tolist(), self.reason.tolist()))]


def decode_window(window, rows: WindowRows, window_tokens: int, sampling: RowSampling, eos_ids: torch.Tensor, on_step,
            order: list[int], adjust: LogitAdjust | None = None, cut: Callable[[], bool] | None = None,
            on_end=None, stepped: Callable[[], None] = lambda: None) -> DecodedWindow:
    """The sampling loop: one token per running row per step, until every row ended or filled
    its window, or `cut` says so. `window.start()` gives the first logits, `window.step(tokens)` the next."""
    batch, dev = len(rows.prior), rows.prior.device
    hold_eos = bool((rows.min_tokens > rows.prior).any())
    tokens = torch.zeros((batch, window_tokens), dtype=torch.long, device=dev)
    logprobs = torch.zeros((batch, window_tokens), dtype=torch.float32, device=dev)
    produced = torch.zeros(batch, dtype=torch.long, device=dev)
    reason = torch.full((batch,), -1, dtype=torch.long, device=dev)
    logits = window.start()
    top_n = min(sampling.top_logprobs, logits.shape[-1])
    top_ids = torch.zeros((batch, window_tokens, top_n), dtype=torch.long, device=dev) if top_n else None
    top_lps = torch.zeros((batch, window_tokens, top_n), dtype=torch.float32, device=dev) if top_n else None
    scored = scored_positions(rows.prior.cpu(), rows.min_tokens.cpu(), window_tokens, sampling.fire)
    # A mixture-of-experts model's window records each token's route (`CachedWindow.routes`).
    routes = None if getattr(window, "routes", None) is None else window.routes.new_zeros(
        (batch, window_tokens, *window.routes.shape[1:]))
    for step in range(window_tokens):
        running = reason < 0
        if routes is not None:  # the route of the position these logits came from
            routes[:, step] = window.routes
        if adjust is not None:
            logits = adjust.apply(logits)
        if hold_eos:  # rows below their minimum length cannot sample EOS
            early = (rows.prior + step < rows.min_tokens)[:, None]
            logits[:, eos_ids] = torch.where(early, float("-inf"), logits[:, eos_ids])
        tok, tok_lp, top = sample_step(logits, rows.seeds, rows.prior + step, sampling, top_n)
        stepped()  # progress: a window longer than the pool's liveness bound is not a hung one
        if top is not None:  # a row's positions past its end are cut off by `produced`
            top_lps[:, step], top_ids[:, step] = top.values, top.indices
        tokens[:, step] = torch.where(running, tok, tokens[:, step])
        logprobs[:, step] = torch.where(running, tok_lp, logprobs[:, step])
        produced += running.long()
        if adjust is not None:
            adjust.count(tok, running)
        hit_eos = running & torch.isin(tok, eos_ids)
        # Out of response budget or context: MAX_LENGTH. A row that merely fills the window
        # stays running and is reported as WINDOW.
        out_of_length = running & ~hit_eos & (produced >= rows.length_left)
        reason = torch.where(hit_eos, 0, reason)
        reason = torch.where(out_of_length, 1, reason)
        window_full = produced >= rows.budget
        if cut is not None and cut():  # the rows still running fill their window here
            window_full = torch.ones_like(window_full)
        last = step == window_tokens - 1 or bool((reason >= 0).all()) or bool(window_full.all())
        stopped = on_step is not None and not on_step(_step_items(tok, tok_lp, running, reason, window_full, order, top))
        if on_end is not None and (ended := (running & (reason >= 0)).nonzero().flatten().tolist()):
            so_far = DecodedWindow(tokens, logprobs, produced, reason, True, scored, top_ids, top_lps, routes)
            on_end([(order[row], so_far.output(row)) for row in ended])
        if stopped or last:  # stopped: the consumer of a stream is gone
            return DecodedWindow(tokens, logprobs, produced, reason, not stopped, scored, top_ids, top_lps, routes)
        logits = window.step(tok)
    return DecodedWindow(tokens, logprobs, produced, reason, True, scored, top_ids, top_lps, routes)


_FINISH = {0: FinishReason.EOS, 1: FinishReason.MAX_LENGTH, -1: FinishReason.WINDOW}


def _step_items(tok: torch.Tensor, tok_lp: torch.Tensor, running: torch.Tensor, reason: torch.Tensor,
                window_full: torch.Tensor, order: list[int], top=None) -> list[tuple]:
    """One decode step as a stream sees it: each row that produced a token (by its index in the
    caller's list), how it ended if it did (WINDOW when its window is full but the response goes
    on), and its most likely tokens (`top`, a `torch.topk` result, or None)."""
    tokens, logprobs, codes, full = tok.tolist(), tok_lp.tolist(), reason.tolist(), window_full.tolist()
    top_ids, top_lps = (top.indices.tolist(), top.values.tolist()) if top is not None else (None, None)
    return sorted(((order[row], tokens[row], logprobs[row],
                    _FINISH[codes[row]] if codes[row] >= 0 else FinishReason.WINDOW if full[row] else None,
                    (top_ids[row], top_lps[row]) if top is not None else None)
                   for row in running.nonzero().flatten().tolist()), key=lambda item: item[0])
