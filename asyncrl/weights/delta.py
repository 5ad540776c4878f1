"""Delta weight updates for full fine-tuning (`policy.weight_delta`): a generator receives only
what changed since the version it holds, in the engine's dtype.

A learner step moves every fp32 weight a little; in the engine's bf16 many of those moves round
to the value the generator already holds. So the learner keeps the version every generator holds
as the engine sees it (`DeltaTracker`: the weights cast to the engine's dtype), and for the next
version sends, per tensor, nothing when no value changed, the changed values and their flat
indices when that is smaller (`<name>@index` int32, `<name>@values`), or else the whole tensor.
Values are compared as bits, so the generator's weights after `apply` are bit for bit the cast of
the learner's (a -0.0 that became 0.0 is a change). Every delta names the version it applies to;
a generator holding another one refuses it.
"""

from __future__ import annotations

from typing import Iterable

import torch

INDEX, VALUES = "@index", "@values"
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def held_dtype(engine, model) -> torch.dtype:
    """The dtype the generators hold the weights in, which a delta is computed in: the embedded
    engine's `engine.dtype` (set, not auto: `asyncrl.config.checks`), an inference server's the
    model's (`model.dtype`: SGLang and vLLM load the weights so)."""
    return getattr(torch, engine.dtype if engine.name == "torch" else model.dtype)


def target(name: str) -> str:
    """The tensor a delta's piece writes into (`<name>`, `<name>@index` or `<name>@values`)."""
    return name.removesuffix(INDEX).removesuffix(VALUES)


def changed(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Bool mask of the elements whose bits differ (flat)."""
    if old.shape != new.shape or old.dtype != new.dtype:
        raise ValueError(f"a delta compares tensors of one shape and dtype: {tuple(old.shape)} {old.dtype} "
                         f"against {tuple(new.shape)} {new.dtype}")
    bits = _BITS[old.element_size()]
    return old.reshape(-1).view(bits) != new.reshape(-1).view(bits)


def encode(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> tuple[list[tuple[str, torch.Tensor]], dict]:
    """What turns `old` into `new`, as named tensors in `new`'s order: nothing for a tensor with no
    changed value; `<name>@index`, `<name>@values` when n changed values and their int32 indices
    take fewer bytes than the tensor (n * (4 + size) < numel * size); the tensor otherwise. Also
    the counts: elements and tensors changed, bytes sent."""
    pieces: list[tuple[str, torch.Tensor]] = []
    stats = {"elements": 0, "elements_changed": 0, "tensors": len(new), "tensors_changed": 0, "tensors_sparse": 0}
    for name, tensor in new.items():
        mask = changed(old[name], tensor)
        count = int(mask.sum())
        stats["elements"] += tensor.numel()
        stats["elements_changed"] += count
        if not count:
            continue
        stats["tensors_changed"] += 1
        size = tensor.element_size()
        if count * (4 + size) < tensor.numel() * size:
            index = mask.nonzero().squeeze(1)
            pieces += [(name + INDEX, index.to(torch.int32)), (name + VALUES, tensor.reshape(-1)[index])]
            stats["tensors_sparse"] += 1
        else:
            pieces.append((name, tensor))
    stats["bytes"] = sum(t.numel() * t.element_size() for _, t in pieces)
    return pieces, stats


def apply(weights: dict[str, torch.Tensor], pieces: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Write a delta of `encode` into `weights` in place (each a contiguous tensor of the dtype the
    delta was computed in)."""
    index = None
    with torch.no_grad():
        for name, tensor in pieces:
            into = weights[target(name)]
            if not name.endswith(INDEX) and tensor.dtype != into.dtype:
                raise ValueError(f"a delta in {tensor.dtype} for {name}, whose weights are {into.dtype}: "
                                 f"deltas are exact only in the engine's own dtype")
            if name.endswith(INDEX):
                index = (name[: -len(INDEX)], tensor.long())
            elif name.endswith(VALUES):
                if index is None or index[0] != target(name):
                    raise ValueError(f"delta values of {target(name)} without its indices")
                weights[target(name)].view(-1).index_copy_(0, index[1], tensor)
                index = None
            else:
                weights[name].copy_(tensor)


class DeltaTracker:
    """The learner's side: the version every generator holds, in the engine's dtype. `stage` casts
    the current weights and returns what to send: the whole cast when no version is held (the first
    one, or after `reset`: a failed delivery, a generator that joined), else the delta from it."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.version = -1
        self.held: dict[str, torch.Tensor] | None = None

    def stage(self, version: int, named: Iterable[tuple[str, torch.Tensor]]
              ) -> tuple[list[tuple[str, torch.Tensor]], int, dict]:
        """(named tensors to send, the version they apply to: -1 for a whole version, the stats)."""
        cast = {name: t.detach().to(self.dtype, copy=True).contiguous() for name, t in named}
        if self.held is None:
            pieces, base = list(cast.items()), -1
            total = sum(t.numel() for t in cast.values())
            stats = {"elements": total, "elements_changed": total, "tensors": len(cast),
                     "tensors_changed": len(cast), "tensors_sparse": 0,
                     "bytes": sum(t.numel() * t.element_size() for t in cast.values())}
        else:
            (pieces, stats), base = encode(self.held, cast), self.version
        self.held, self.version = cast, version
        return pieces, base, stats

    def reset(self) -> None:
        self.held, self.version = None, -1
