"""Routes: the experts a mixture-of-experts model used for each generated token, as they travel.

A route array is `[tokens, sparse_layers, top_k]` expert ids, one entry per token: the top-k
experts each sparse layer chose at the position whose logits the token was sampled from (the
previous token's position; the last prompt token's for a response's first token), so a learner
replays a token's route exactly where it scores that token. uint8 for models with fewer than 255
experts, int16 otherwise; a token whose route was not recorded (an environment's observation, an
earlier window the row does not hold) has every entry `UNROUTED` of its dtype: the learner routes
that position itself. Definitions only: numpy, nothing of asyncrl.
"""

from __future__ import annotations

import numpy as np

ROUTE_DTYPES = (np.dtype("uint8"), np.dtype("int16"))
UNROUTED = {np.dtype("uint8"): 255, np.dtype("int16"): -1}


def route_dtype(experts: int) -> np.dtype:
    """The compact dtype for expert ids of a model with `experts` experts (one value kept for `UNROUTED`)."""
    if experts < 255:
        return np.dtype("uint8")
    if experts <= np.iinfo(np.int16).max:
        return np.dtype("int16")
    raise ValueError(f"{experts} experts do not fit the route dtypes (int16 at most)")


def check_routes(name: str, value, length: int) -> None:
    """A route array's shape and dtype (`msgspec` runs this on decode too): `[length, layers, top_k]`."""
    if not isinstance(value, np.ndarray):
        raise TypeError(f"field `{name}`: expected a numpy array, got {type(value).__name__}")
    if value.dtype not in ROUTE_DTYPES:
        raise TypeError(f"field `{name}`: expected dtype uint8 or int16, got {value.dtype}")
    if value.ndim != 3 or value.shape[0] != length:
        raise ValueError(f"field `{name}`: expected shape [{length}, sparse_layers, top_k], got {list(value.shape)}")


def unrouted(tokens: int, like: np.ndarray) -> np.ndarray:
    """`tokens` rows of `UNROUTED`, of `like`'s dtype and per-token shape."""
    return np.full((tokens, *like.shape[1:]), UNROUTED[like.dtype], dtype=like.dtype)


def joined_routes(parts: list[tuple[np.ndarray | None, int]]) -> np.ndarray | None:
    """The routes of consecutive token runs, each `(routes or None, tokens)`, as one array: a run
    without routes is `UNROUTED`; None when no run has any. Runs whose routes differ in shape or
    dtype (two models) raise: a sample's routes are one model's."""
    known = [r for r, _ in parts if r is not None]
    if not known:
        return None
    first = known[0]
    if any(r.shape[1:] != first.shape[1:] or r.dtype != first.dtype for r in known):
        shapes = sorted({f"{r.dtype}{list(r.shape[1:])}" for r in known})
        raise ValueError(f"routes of one sample disagree in shape: {', '.join(shapes)}")
    return np.concatenate([r if r is not None else unrouted(n, first) for r, n in parts])


def routed_tokens(routes: np.ndarray) -> np.ndarray:
    """bool `[tokens]`: the tokens whose route was recorded."""
    return (routes != UNROUTED[routes.dtype]).all(axis=(1, 2))


def routes_as_lists(routes: np.ndarray | None) -> tuple[list[list[int]] | None, int]:
    """Routes as plain lists for a file (`asyncrl.storage.trajectory_store`): per token, its
    `sparse_layers * top_k` ids layer by layer (-1 where not recorded), and top-k (0: none)."""
    if routes is None:
        return None, 0
    flat = routes.reshape(len(routes), -1).astype(np.int16)
    flat[~routed_tokens(routes)] = -1
    return flat.tolist(), int(routes.shape[2])


def routes_from_lists(rows: list[list[int]] | None, top_k: int) -> np.ndarray | None:
    """`routes_as_lists`' inverse, in the compact dtype the ids fit (`route_dtype`)."""
    if rows is None or not top_k:
        return None
    flat = np.asarray(rows, dtype=np.int16).reshape(len(rows), -1)
    dtype = route_dtype(int(flat.max(initial=0)) + 1)
    out = flat.astype(dtype)
    out[(flat < 0).any(axis=1)] = UNROUTED[dtype]
    return out.reshape(len(rows), -1, top_k)
