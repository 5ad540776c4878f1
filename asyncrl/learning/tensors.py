"""Training rows as padded tensors: a row is `context + new tokens` (prompt and earlier windows,
then the tokens it trains), right-padded into `[B, L]`; micro-batches by token count; the
optimizer step both learners share.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from asyncrl.algo.shaping import is_positive
from asyncrl.config import Optimizer
from asyncrl.messages.routes import routed_tokens
from asyncrl.messages.structs import TrainingRow, observation_mask, response_routes, segment_row, scored_mask
from asyncrl.weights.sharding import DataParallel, parts_of_rank


@dataclass
class Collated:
    """Right-padded rows: context (prompt + earlier windows) then this row's new tokens."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    response_mask: torch.Tensor  # [B, L]: 1 where a position's *next* token is a trained new token
    targets: torch.Tensor  # [B, L]: the next token at each position (0 where not trained)
    old_logprobs: torch.Tensor  # [B, L], behaviour log-probs aligned with targets
    advantages: torch.Tensor  # [B, L]
    nll_mask: torch.Tensor  # [B, L]: every generated token of finished, positive rows (positive-example NLL)
    # [B, L, sparse_layers, top_k] int16: the rollout's experts at each position (`place_routes`);
    # None: no row has any (a dense model).
    routes: torch.Tensor | None = None
    # Each row's processed images by reference (`Segment.images`); None: no row has any.
    images: list[tuple[str, ...]] | None = None

    def _tensors(self) -> tuple[torch.Tensor | None, ...]:
        return (self.input_ids, self.attention_mask, self.response_mask, self.targets, self.old_logprobs,
                self.advantages, self.nll_mask, self.routes)

    def select(self, rows: list[int]) -> "Collated":
        index = torch.as_tensor(rows, dtype=torch.long, device=self.input_ids.device)
        return Collated(*(None if t is None else t.index_select(0, index) for t in self._tensors()),
                        images=None if self.images is None else [self.images[i] for i in rows])

    def to(self, device: torch.device | str) -> "Collated":
        return Collated(*(None if t is None else t.to(device) for t in self._tensors()), images=self.images)

    def images_of(self, rows: slice) -> list[tuple[str, ...]] | None:
        """The images of a micro-batch's rows (None: none has any)."""
        return None if self.images is None else self.images[rows]


@dataclass
class RowLayout:
    """Right-padded token rows `context + new`; row i's new tokens are scored at `slices[i]`
    (the logits/hidden state at position p belong to the token at p+1)."""

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    slices: list[slice]

    def place(self, per_row: list[np.ndarray], dtype=torch.float32) -> torch.Tensor:
        """Scatter one array per row (aligned with its new tokens) into a `[B, L]` tensor (on the
        layout's device): one indexed write for every row (a write per row cost ~10 µs each, a
        fifth of a tiny learner step's collation at 64 rows)."""
        rows, columns = self._positions
        arrays = [np.asarray(v).reshape(-1) for v in per_row]
        if [len(a) for a in arrays] != [sl.stop - sl.start for sl in self.slices]:
            raise ValueError(f"values per row {[len(a) for a in arrays]} do not match the rows' new tokens "
                             f"{[sl.stop - sl.start for sl in self.slices]}")
        values = np.concatenate(arrays) if arrays else np.zeros(0)
        out = torch.zeros(self.input_ids.shape, dtype=dtype)
        out[torch.from_numpy(rows), torch.from_numpy(columns)] = torch.as_tensor(values, dtype=dtype)
        return out.to(self.input_ids.device)

    @functools.cached_property
    def _positions(self) -> tuple[np.ndarray, np.ndarray]:
        """(row, column) of every new-token position, rows in order (once per layout: `collate`
        places five arrays on one)."""
        lengths = np.array([sl.stop - sl.start for sl in self.slices], dtype=np.int64)
        rows = np.repeat(np.arange(len(self.slices), dtype=np.int64), lengths)
        starts = np.array([sl.start for sl in self.slices], dtype=np.int64)
        # Column = the row's start + the position within the row.
        within = np.arange(len(rows), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        return rows, np.repeat(starts, lengths) + within

    def gather(self, full: torch.Tensor) -> list[np.ndarray]:
        return [full[i, sl].detach().float().cpu().numpy().copy() for i, sl in enumerate(self.slices)]


def place_routes(layout: RowLayout, routes: list[np.ndarray | None]) -> torch.Tensor | None:
    """`[B, L, sparse_layers, top_k]` int16: each row's routes (`asyncrl.messages.routes`; they
    cover the row's last tokens) at the positions that score those tokens, -1 elsewhere (the
    router chooses there: the prompt, padding, tokens not recorded). None when no row has any."""
    known = [r for r in routes if r is not None]
    if not known:
        return None
    out = torch.full((*layout.input_ids.shape, *known[0].shape[1:]), -1, dtype=torch.int16)
    for i, (row, sl) in enumerate(zip(routes, layout.slices)):
        if row is not None:
            ids = row.astype(np.int16)
            ids[~routed_tokens(row)] = -1
            out[i, sl.stop - len(row):sl.stop] = torch.from_numpy(ids)
    return out.to(layout.input_ids.device)


def row_routes(layout: RowLayout, rows: list[tuple]) -> torch.Tensor | None:
    """`place_routes` of rows laid out by `layout_rows`: a triple's third item, a pair's none."""
    return place_routes(layout, [row[2] if len(row) > 2 else None for row in rows])


def device_of(model) -> torch.device:
    return next(model.parameters()).device


def layout_rows(rows: list[tuple], pad_token_id: int = 0, device="cpu") -> RowLayout:
    """`rows` = (context ids, new ids) pairs (or `routed_row`'s triples: the routes are placed by
    `row_routes`), as tensors on `device`. A row needs at least one context token."""
    if any(len(row[0]) < 1 for row in rows):
        raise ValueError("a row needs at least one context (prompt) token")
    lengths = [len(row[0]) + len(row[1]) for row in rows]
    input_ids = np.full((len(rows), max(lengths)), pad_token_id, dtype=np.int64)
    attention_mask = (np.arange(max(lengths))[None, :] < np.array(lengths)[:, None]).astype(np.int64)
    for i, (context, new, *_) in enumerate(rows):  # numpy row writes: a tenth of torch's per-call cost
        input_ids[i, :len(context)] = context
        input_ids[i, len(context):lengths[i]] = new
    slices = [slice(len(row[0]) - 1, len(row[0]) - 1 + len(row[1])) for row in rows]
    return RowLayout(torch.from_numpy(input_ids).to(device), torch.from_numpy(attention_mask).to(device), slices)


def collate(samples: list[TrainingRow], pad_token_id: int = 0) -> Collated:
    """Samples as right-padded tensors. A token is trained where its loss mask is 1 and the engine
    marked it scored (FIRE's hot first token and EOS held back by a minimum length were drawn from a
    distribution the learner does not score)."""
    layout = layout_rows([segment_row(s.segment) for s in samples], pad_token_id)
    ones = [np.ones(len(s.segment.new_token_ids), dtype=np.float32) for s in samples]
    loss_masks = [(m if s.loss_mask is None else s.loss_mask.astype(np.float32)) * scored_mask(s.segment)
                  for s, m in zip(samples, ones)]
    positive = [float(s.segment.finished and is_positive(s.correct, s.score)) for s in samples]
    return Collated(
        input_ids=layout.input_ids,
        attention_mask=layout.attention_mask,
        response_mask=layout.place(loss_masks),
        targets=layout.place([s.segment.new_token_ids for s in samples], torch.long),
        old_logprobs=layout.place([s.segment.new_logprobs for s in samples]),
        advantages=layout.place([s.advantages for s in samples]),
        # Every generated token of a positive row, never an environment's observation.
        nll_mask=layout.place([(1.0 - observation_mask(s.segment)) * p for s, p in zip(samples, positive)]),
        routes=place_routes(layout, [response_routes(s.segment) for s in samples]),
        images=segment_images([s.segment for s in samples]),
    )


def segment_images(segments: list) -> list[tuple[str, ...]] | None:
    """Each segment's prompt images by reference, as a forward of their rows takes them (the
    policy's, the critic's, the reference's); None when no segment has any."""
    return [s.images for s in segments] if any(s.images for s in segments) else None


def row_length(segment) -> int:
    return len(segment.prompt_token_ids) + len(segment.prior_response_ids) + len(segment.new_token_ids)


def width_of(attention_mask: torch.Tensor, rows: slice) -> int:
    """Columns a micro-batch of right-padded rows needs (its longest row): a batch holding one long
    row would otherwise pad every micro-batch to that length."""
    return int(attention_mask[rows].sum(-1).max())


def padded_chunks(lengths: list[int], max_tokens: int) -> list[slice]:
    """Contiguous ranges of rows (of these lengths, in this order) whose padded token count (the
    longest row times the rows) stays under `max_tokens`, at least one row each: the one chunking
    rule of training micro-batches and of inference over many rows."""
    slices, start, longest = [], 0, 0
    for i, length in enumerate(lengths):
        if i > start and max(longest, length) * (i - start + 1) > max_tokens:
            slices.append(slice(start, i))
            start, longest = i, 0
        longest = max(longest, length)
    slices.append(slice(start, len(lengths)))
    return slices


def micro_batches_of(layout: RowLayout | Collated, max_tokens: int) -> list[slice]:
    """A batch's micro-batches: `padded_chunks` of its rows as laid out (sorted by length)."""
    return padded_chunks(layout.attention_mask.sum(-1).tolist(), max_tokens)


def rank_micro_batches(collated: Collated, max_tokens: int, parallel: DataParallel | None) -> list[tuple[slice, bool]]:
    """This rank's micro-batches of `collated` as (rows, ghost): all of them on one rank; dealt
    round-robin over the ranks of a sharded learner, each rank getting as many (a ghost, weighted
    0, evens a short share: every rank runs the same number of forwards and backwards, as FSDP's
    collectives require)."""
    return parts_of_rank(micro_batches_of(collated, max_tokens), parallel)


def mini_batch_rows(n_rows: int, mini_batches: int) -> list[list[int]]:
    """Rows (sorted by length) dealt round-robin into `mini_batches` updates: each update gets a
    spread of lengths and stays sorted, so its micro-batches pad little."""
    k = max(1, min(mini_batches, n_rows))
    return [list(range(i, n_rows, k)) for i in range(k)]


def length_sorted_chunks(rows: list[tuple[np.ndarray, np.ndarray]], max_tokens: int) -> Iterator[list[int]]:
    """Indices of `rows` (context, new) in length order, in `padded_chunks`: inference over many
    rows with little padding."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]) + len(rows[i][1]))
    for chunk in padded_chunks([len(rows[i][0]) + len(rows[i][1]) for i in order], max_tokens):
        yield order[chunk]


def adamw(parameters, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """The learners' optimizer: AdamW, fused (one kernel over every parameter: 0.16 s against 0.65 s
    a step for the embedded model's 135M fp32 parameters on one CPU thread) where the parameters are
    plain tensors; FSDP2's sharded ones (DTensors) take the default implementation."""
    parameters = list(parameters)
    fused = all(type(p) is torch.nn.Parameter and p.device.type in ("cpu", "cuda") for p in parameters)
    return torch.optim.AdamW(parameters, lr=lr, weight_decay=weight_decay, fused=fused or None)


def build_optimizer(parameters, optimizer: Optimizer) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """A learner's `optimizer` section: AdamW (`adamw`) and its learning-rate schedule
    (`lr_factor`; the learner steps it once per batch it trains)."""
    adam = adamw(parameters, optimizer.lr, optimizer.weight_decay)
    return adam, torch.optim.lr_scheduler.LambdaLR(adam, lambda step: lr_factor(optimizer, step))


def lr_factor(optimizer: Optimizer, step: int) -> float:
    """The learning rate of learner step `step` (0 = the first) as a fraction of `optimizer.lr`: a
    linear warm-up over `warmup_steps`, then constant, or linear or half-cosine down to
    `min_lr_ratio` at `decay_steps` (counted from the start), held there after."""
    if step < optimizer.warmup_steps:
        return (step + 1) / optimizer.warmup_steps
    if optimizer.schedule == "constant":
        return 1.0
    span = optimizer.decay_steps - optimizer.warmup_steps
    progress = min(1.0, (step - optimizer.warmup_steps) / span) if span > 0 else 1.0
    shape = 1.0 - progress if optimizer.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return optimizer.min_lr_ratio + (1.0 - optimizer.min_lr_ratio) * shape


def clip_and_step(model, optimizer, grad_clip: float) -> torch.Tensor:
    """Clip the gradient norm and step; a non-finite norm skips the step (no NaN reaches the weights)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    if hasattr(grad_norm, "full_tensor"):  # sharded parameters: the norm over every rank's shard
        grad_norm = grad_norm.full_tensor()
    if math.isfinite(float(grad_norm)):
        optimizer.step()
    else:
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    return grad_norm


def autocast(model, precision: str):
    """bf16 autocast on the model's device (fp32 master weights: only the matmuls run in bf16).
    `precision` is resolved (fp32 | bf16): `auto` is the builder's to decide (`learner_precision`)."""
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision {precision!r} is not resolved: fp32 or bf16 (auto is decided by the builder)")
    return torch.autocast(device_type=device_of(model).type, dtype=torch.bfloat16, enabled=precision == "bf16")

