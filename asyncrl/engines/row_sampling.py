"""Each row's sampling settings in one decode step of the embedded engine.

A window's rows may come from requests with settings of their own (the policy endpoint batches
every client's rows together): temperature, top-k, top-p, min-p, greedy, FIRE, penalties and logit
bias are one value for the window where every row agrees, else one per row (a `[B]` tensor,
`asyncrl.algo.sampling.Setting`). A row's tokens and log-probs do not depend on its neighbours'
settings: the rows that sample plainly (temperature alone) take the plain draw over their own
subset, the others the filtered distribution over theirs, each computed row by row as it would be
alone. A generator's window, one setting for all, takes the single path it always took.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch

from asyncrl.algo.sampling import (
    Setting,
    greedy_from_logprobs,
    penalised_logits,
    sample_from_logits,
    sample_from_logprobs,
    step_logprobs,
)
from asyncrl.engines.base import SamplingParams, SequenceInput

_PER_ROW = {"temperature": torch.float32, "top_k": torch.int64, "top_p": torch.float32, "min_p": torch.float32,
            "greedy": torch.bool, "first_token_top_k": torch.int64, "presence_penalty": torch.float32,
            "frequency_penalty": torch.float32}


def _setting(values: list, dtype: torch.dtype, device) -> Setting | bool:
    """One value when every row has it, else a tensor of one per row."""
    first = values[0]
    if all(v == first for v in values):
        return first
    return torch.tensor(values, dtype=dtype, device=device)


def _pick(value, index: torch.Tensor):
    return value.index_select(0, index.to(value.device)) if isinstance(value, torch.Tensor) else value


@dataclass(frozen=True)
class RowSampling:
    """A window's sampling settings, per row where rows differ (see the module's docstring)."""

    temperature: Setting
    top_k: int | torch.Tensor
    top_p: Setting
    min_p: Setting
    greedy: bool | torch.Tensor
    first_token_temperature: Setting | None  # per row: NaN where FIRE is off
    first_token_top_k: int | torch.Tensor
    presence_penalty: Setting
    frequency_penalty: Setting
    logit_bias: torch.Tensor | None  # [V] for every row, [B, V] per row, None: none
    top_logprobs: int  # the most any row asks for (each caller keeps its own count)

    @classmethod
    def of(cls, params: SamplingParams | Sequence[SamplingParams], rows: int, vocab: int, device) -> "RowSampling":
        """From one `SamplingParams` for every row, or one per row."""
        each = [params] * rows if isinstance(params, SamplingParams) else list(params)
        if len(each) != rows:
            raise ValueError(f"{len(each)} sampling settings for {rows} sequences")
        values = {name: _setting([getattr(p, name) for p in each], dtype, device) for name, dtype in _PER_ROW.items()}
        fire = [p.first_token_temperature for p in each]
        first = (None if all(t is None for t in fire) else fire[0] if all(t == fire[0] for t in fire)
                 else torch.tensor([float("nan") if t is None else t for t in fire], device=device))
        return cls(**values, first_token_temperature=first, logit_bias=_bias(each, vocab, device),
                   top_logprobs=max(p.top_logprobs for p in each))

    def select(self, order: list[int]) -> "RowSampling":
        """The settings of the rows in `order` (the engine's row order)."""
        index = torch.tensor(order)
        picked = {name: _pick(getattr(self, name), index) for name in (*_PER_ROW, "first_token_temperature")}
        bias = self.logit_bias
        return replace(self, **picked, logit_bias=_pick(bias, index) if bias is not None and bias.dim() == 2 else bias)

    @property
    def fire(self) -> bool | torch.Tensor:
        """FIRE on, for every row or per row."""
        first = self.first_token_temperature
        return ~first.isnan() if isinstance(first, torch.Tensor) else first is not None

    @property
    def penalises(self) -> bool:
        return bool(torch.as_tensor(self.presence_penalty).ne(0).any() or torch.as_tensor(self.frequency_penalty).ne(0).any())

    def plain_rows(self, positions: torch.Tensor) -> torch.Tensor | bool:
        """Rows drawn by temperature alone at this step (`sample_from_logits`): no top-k, top-p,
        min-p or greedy, and no FIRE token at this position. A bool when every row agrees (a
        generator's window, every decode step: no tensor work), else one per row."""
        settings = (self.top_k, self.top_p, self.min_p, self.greedy)
        if any(isinstance(v, torch.Tensor) for v in settings):
            plain = (torch.as_tensor(self.top_k).eq(0) & torch.as_tensor(self.top_p).ge(1.0)
                     & torch.as_tensor(self.min_p).eq(0) & ~torch.as_tensor(self.greedy)).to(positions.device)
        else:
            plain = self.top_k == 0 and self.top_p >= 1.0 and self.min_p == 0 and not self.greedy
        fire = self.fire
        if plain is not False and (isinstance(fire, torch.Tensor) or fire):
            first = positions == 0
            if isinstance(fire, torch.Tensor):
                first = first & fire.to(positions.device)
            if bool(first.any()):
                plain = ~first if plain is True else plain & ~first
        if isinstance(plain, torch.Tensor) and bool(plain.all()) != bool(plain.any()):
            return plain  # mixed: each part over its own rows
        return bool(plain.all()) if isinstance(plain, torch.Tensor) else plain


def _bias(each: list[SamplingParams], vocab: int, device) -> torch.Tensor | None:
    if not any(p.logit_bias for p in each):
        return None
    shared = all(p.logit_bias == each[0].logit_bias for p in each)
    bias = torch.zeros((1 if shared else len(each), vocab), dtype=torch.float32, device=device)
    for row, p in enumerate(each[:1] if shared else each):
        if p.logit_bias:
            ids, values = zip(*p.logit_bias)
            bias[row, torch.tensor(ids, device=device)] = torch.tensor(values, dtype=torch.float32, device=device)
    return bias[0] if shared else bias


@dataclass
class LogitAdjust:
    """OpenAI's penalties and logit bias for a window: each row's token counts in its response so
    far `[B, V]` (None without a penalty) and the settings they are applied with."""

    counts: torch.Tensor | None
    sampling: RowSampling

    @classmethod
    def of(cls, sequences: list[SequenceInput], sampling: RowSampling, vocab: int, device) -> "LogitAdjust | None":
        if not sampling.penalises and sampling.logit_bias is None:
            return None
        counts = None
        if sampling.penalises:
            counts = torch.zeros((len(sequences), vocab), dtype=torch.float32, device=device)
            for row, s in enumerate(sequences):
                if len(s.response_ids):
                    ids = torch.as_tensor(s.response_ids.astype(np.int64), device=device)
                    counts[row].index_add_(0, ids, torch.ones(len(ids), device=device))
        return cls(counts, sampling)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        s = self.sampling
        return penalised_logits(logits, self.counts, s.presence_penalty, s.frequency_penalty, s.logit_bias)

    def count(self, tokens: torch.Tensor, running: torch.Tensor) -> None:
        if self.counts is not None:
            self.counts.scatter_add_(1, tokens[:, None], running.float()[:, None])


def sample_step(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, sampling: RowSampling,
                top_n: int = 0):
    """`(tokens, their log-probs, top)` for one decode step: top is None, or with `top_n` the
    `torch.topk` of the log-probs of the distribution each row was sampled from."""
    plain = sampling.plain_rows(positions)
    if isinstance(plain, bool):
        return (_plain(logits, seeds, positions, sampling, top_n) if plain
                else _filtered(logits, seeds, positions, sampling, top_n))
    parts = [(rows, draw(logits[rows], seeds[rows], positions[rows], sampling.select(rows.tolist()), top_n))
             for rows, draw in ((plain.nonzero().flatten(), _plain), ((~plain).nonzero().flatten(), _filtered))
             if rows.numel()]
    tokens, token_lp = torch.empty_like(seeds), torch.empty(len(seeds), dtype=torch.float32, device=logits.device)
    top = (torch.return_types.topk((torch.empty((len(seeds), top_n), device=logits.device),
                                     torch.empty((len(seeds), top_n), dtype=torch.long, device=logits.device)))
           if top_n else None)
    for rows, (tok, lp, part_top) in parts:
        tokens[rows], token_lp[rows] = tok, lp
        if top is not None:
            top.values[rows], top.indices[rows] = part_top.values, part_top.indices
    return tokens, token_lp, top


def _plain(logits, seeds, positions, sampling: RowSampling, top_n: int):
    tok, tok_lp = sample_from_logits(logits, sampling.temperature, seeds, positions)
    temperature = sampling.temperature
    temperature = temperature[:, None] if isinstance(temperature, torch.Tensor) else temperature
    # The same distribution, `filtered_logprobs` at this temperature: only when asked for.
    top = torch.topk(torch.log_softmax(logits.float() / temperature, -1), top_n, -1) if top_n else None
    return tok, tok_lp, top


def _filtered(logits, seeds, positions, sampling: RowSampling, top_n: int):
    s = sampling
    dist = step_logprobs(logits, positions, s.temperature, s.top_k, s.top_p, s.first_token_temperature,
                         s.first_token_top_k, s.min_p)
    greedy = s.greedy
    if isinstance(greedy, torch.Tensor):
        g_tok, g_lp = greedy_from_logprobs(dist)
        r_tok, r_lp = sample_from_logprobs(dist, seeds, positions)
        tok, tok_lp = torch.where(greedy, g_tok, r_tok), torch.where(greedy, g_lp, r_lp)
    else:
        tok, tok_lp = greedy_from_logprobs(dist) if greedy else sample_from_logprobs(dist, seeds, positions)
    return tok, tok_lp, torch.topk(dist, top_n, dim=-1) if top_n else None
