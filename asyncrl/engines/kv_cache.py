"""KV caches kept across a sequence's windows, and one window's forward over a `KVBlock`.

A sequence advanced window by window used to re-read its whole context in a prefill at every
window. The engine now keeps the keys and values a window computed, keyed by the sequence's
`SequenceInput.key`, and the next window of that sequence feeds only the tokens they do not
cover (normally one: the last token sampled). Invariants, held here:

* **Only the weights that computed them.** Kept caches carry the weights' stamp of their window
  (the engine's update count and each parameter's storage and version counter, so an in-place
  change behind the engine's back counts too); a window under another stamp drops them all.
* **Only the tokens they were computed for.** A kept cache is used only when its tokens are a
  strict prefix of the sequence's context as passed now; otherwise it is dropped. Tokens after the
  prefix are fed whoever made them: a multi-turn episode resumed with an observation appended
  continues from its cache; a turn cut inside the kept tokens (just after its call) is re-read.
* **Bounded.** Between windows at most one block is held: the last window's, for its unfinished
  keyed rows, and only if it is at most `max_bytes`. A sequence that finished, or was not in the
  last call (no longer in flight, or an episode parked while its tool call is answered), has no
  cache.

Within a window, rows that start from their prompt share what their prompts share
(`share_prefixes`): the samples of a group have one prompt, and a chat template opens every
prompt with the same turns. Their keys and values are computed once and handed to each row as if
kept (a prefix's keys do not depend on the tokens after it, so this is exact). Prompts with images
(`asyncrl.engines.vision_prompts`) are one prompt only with the same images, and what distinct
prompts share ends before the first image token.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from asyncrl.engines import moe
from asyncrl.engines.llama_decoder import KVBlock, LlamaDecoder
from asyncrl.engines.vision_prompts import PromptMedia, fetch_features, media_key


@dataclass
class KeptKV:
    """Row `row` of `block`: keys and values of `tokens` at the block's columns `columns`."""

    block: KVBlock
    row: int
    columns: torch.Tensor  # int64 [n]
    tokens: np.ndarray  # int64 [n]

    def continues(self, context: np.ndarray) -> bool:
        n = len(self.tokens)
        return n < len(context) and np.array_equal(self.tokens, context[:n])


class KeptCaches:
    """The caches kept between windows (see the module's invariants)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: dict[str, KeptKV] = {}
        self._stamp = None
        # reused / prefilled: rows per window; dropped_*: kept caches not used, by reason.
        self.stats: Counter = Counter()

    def take(self, keys: list[str | None], contexts: list[np.ndarray], stamp) -> list[KeptKV | None]:
        """The kept cache of each row, or None; the store is emptied (the window keeps what it
        hands back through `keep`)."""
        if len(set(k for k in keys if k is not None)) != sum(k is not None for k in keys):
            raise ValueError("two sequences of one window share a key")
        entries, self._entries = self._entries, {}
        if entries and stamp != self._stamp:
            self.stats["dropped_weights_changed"] += len(entries)
            entries = {}
        out = []
        for key, context in zip(keys, contexts):
            entry = entries.pop(key, None) if key is not None else None
            if entry is not None and not entry.continues(context):
                self.stats["dropped_tokens_differ"] += 1
                entry = None
            self.stats["reused" if entry is not None else "prefilled"] += 1
            out.append(entry)
        self.stats["dropped_not_in_flight"] += len(entries)
        return out

    def reusable(self, keys: list[str | None], contexts: list[np.ndarray], stamp) -> list[int]:
        """The tokens each row's kept cache would give it (0: none), as `take` would; nothing changes."""
        if stamp != self._stamp:
            return [0] * len(keys)
        entries = [self._entries.get(k) if k is not None else None for k in keys]
        return [len(e.tokens) if e is not None and e.continues(c) else 0 for e, c in zip(entries, contexts)]

    def keep(self, entries: dict[str, KeptKV], stamp, block_bytes: int) -> None:
        if block_bytes > self.max_bytes:
            self.stats["dropped_over_bound"] += len(entries)
            return
        self._entries, self._stamp = entries, stamp

    def clear(self) -> None:
        """Drop every kept cache (the engine loads new weights)."""
        self.stats["dropped_weights_changed"] += len(self._entries)
        self._entries = {}

    def __len__(self) -> int:
        return len(self._entries)


# Rows whose prompts share fewer leading tokens than this are prefilled apart (a separate pass for
# a handful of tokens costs more than it saves).
MIN_SHARED_TOKENS = 4


def share_prefixes(decoder: LlamaDecoder, contexts: list[np.ndarray], kept: list[KeptKV | None],
                   pad_token_id: int, media: list[PromptMedia | None] | None = None,
                   vision=None) -> tuple[list[KeptKV | None], int]:
    """`kept` with the rows that have no kept cache given one for what they share, and the number
    of tokens this spares the window's prefill. Each distinct context (all but its last token,
    which the window still feeds for its first logits; with its images) is prefilled once,
    continuing from the prefix every distinct context shares, itself prefilled once."""
    media = media if media is not None else [None] * len(contexts)
    groups: dict[tuple, list[int]] = {}
    for i, (context, entry) in enumerate(zip(contexts, kept)):
        if entry is None and len(context) > 1:
            groups.setdefault((context[:-1].tobytes(), media_key(media[i])), []).append(i)
    heads = [contexts[rows[0]][:-1] for rows in groups.values()]
    head_media = [media[rows[0]] for rows in groups.values()]
    common = _common_prefix(heads) if len(heads) > 1 else 0
    for head, m in zip(heads, head_media):  # images differ from their first token on: shared up to it
        first_image = np.flatnonzero(head == m.image_token_id) if m is not None else ()
        if len(first_image):
            common = min(common, int(first_image[0]))
    shared_common = common >= MIN_SHARED_TOKENS
    if len(heads) == sum(len(rows) for rows in groups.values()) and not shared_common:
        return kept, 0  # every prompt distinct, nothing in common worth a pass
    base = _prefill(decoder, [heads[0][:common]], [None], pad_token_id)[0] if shared_common else None
    # Heads that are the common prefix itself take `base`; the others continue from it.
    longer = sorted((h for h in range(len(heads)) if base is None or len(heads[h]) > common),
                    key=lambda h: len(heads[h]), reverse=True)
    entries = dict(zip(longer, _prefill(decoder, [heads[h] for h in longer], [base] * len(longer), pad_token_id,
                                        [head_media[h] for h in longer], vision)))
    out = list(kept)
    for h, rows in enumerate(groups.values()):
        for i in rows:
            out[i] = entries.get(h, base)
    base_tokens = common if base is not None else 0
    fed = base_tokens + sum(len(heads[h]) - base_tokens for h in longer)
    return out, sum(len(contexts[i]) - 1 for rows in groups.values() for i in rows) - fed


def _common_prefix(arrays: list[np.ndarray]) -> int:
    n = min(len(a) for a in arrays)
    first = arrays[0][:n]
    for a in arrays[1:]:
        differ = np.flatnonzero(a[:n] != first)
        n = int(differ[0]) if len(differ) else n
        first = first[:n]
    return n


def _prefill(decoder: LlamaDecoder, contexts: list[np.ndarray], kept: list[KeptKV | None],
             pad_token_id: int, media: list[PromptMedia | None] | None = None, vision=None) -> list[KeptKV]:
    """The keys and values of `contexts` (longest suffix first) as kept caches, without logits."""
    window = CachedWindow(decoder, contexts, kept, 1, pad_token_id, media=media, vision=vision)
    window.start(logits=False)
    no_tokens = np.zeros(1, dtype=np.int64)  # `kept` keeps all but the last of the tokens produced: none
    return [window.kept(row, no_tokens) for row in range(len(contexts))]


class CachedWindow:
    """One window of a batch over a fresh `KVBlock`.

    Columns of row i: `[0, C)` its kept keys, right-aligned (C = the longest kept); `[C, C+S)`
    the tokens it still has to feed (its suffix), right-aligned (S = the longest suffix); then one
    column per decode step. Holes between the parts are masked. `start` prefills the suffixes in
    chunks of similar length (a continuing row's suffix is one token, a new row's a prompt: one
    chunk would pad every continuing row to a prompt's length); the caller orders rows by suffix
    length, longest first, so each chunk is a slice of rows.

    `routes_dtype` (a mixture-of-experts model; None: not recorded): after `start` and each `step`,
    `routes` holds the experts `[B, sparse_layers, top_k]` of the position whose logits were
    returned, in this dtype: the route of the token sampled from them.

    `media` (rows whose prompts have images; `vision` runs the tower for those that feed image
    tokens): their multimodal positions and image features (`asyncrl.engines.vision_prompts`)."""

    def __init__(self, decoder: LlamaDecoder, contexts: list[np.ndarray], kept: list[KeptKV | None],
                 window_tokens: int, pad_token_id: int, routes_dtype: torch.dtype | None = None,
                 media: list[PromptMedia | None] | None = None, vision=None):
        self.decoder, self.contexts, self.pad_token_id = decoder, contexts, pad_token_id
        self.media = media if media is not None and any(m is not None for m in media) else None
        self.routes_dtype = routes_dtype if decoder.moe is not None else None
        self.routes: torch.Tensor | None = None
        self.reused = [0 if k is None else len(k.tokens) for k in kept]
        self.suffix = [len(c) - n for c, n in zip(contexts, self.reused)]
        if any(b > a for a, b in zip(self.suffix, self.suffix[1:])):
            raise ValueError("rows must come longest suffix first")
        kept_width, self.suffix_width = max(self.reused), max(self.suffix)
        self.first_decode = kept_width + self.suffix_width
        self.block = decoder.new_block(len(contexts), self.first_decode + window_tokens - 1)
        device = self.block.valid.device
        deltas = [0 if self.media is None or self.media[i] is None else self.media[i].delta for i in range(len(contexts))]
        self.positions = torch.tensor([len(c) + d for c, d in zip(contexts, deltas)], device=device)
        if self.media is not None:
            fetch_features(vision, self.media, contexts, self.reused)
        columns = torch.arange(self.block.valid.shape[1], device=device)[None]
        reused = torch.tensor(self.reused, device=device)[:, None]
        suffix = torch.tensor(self.suffix, device=device)[:, None]
        self.block.valid[:] = (((columns >= kept_width - reused) & (columns < kept_width))
                               | ((columns >= self.first_decode - suffix) & (columns < self.first_decode)))
        for row, (entry, n) in enumerate(zip(kept, self.reused)):
            if entry is not None:
                source = entry.block.data[:, :, entry.row].index_select(3, entry.columns)
                self.block.data[:, :, row, :, kept_width - n:kept_width] = source
        self.steps = 0

    def start(self, logits: bool = True) -> torch.Tensor | None:
        """Feed every row's suffix; the logits `[B, vocab]` of each row's last context token (None
        with `logits=False`: only the keys and values are wanted)."""
        out, routes, row = [], [], 0
        while row < len(self.contexts):
            end = row + 1
            while end < len(self.contexts) and 2 * self.suffix[end] > self.suffix[row]:
                end += 1
            chunk = moe.Routes() if self.routes_dtype is not None and logits else None
            out.append(self._prefill(row, end, logits, chunk))
            if chunk is not None:
                routes.append(chunk.chosen[:, -1])  # the last column: where the logits are
            row = end
        self.routes = torch.cat(routes).to(self.routes_dtype) if routes else None
        return torch.cat(out) if logits else None

    def _prefill(self, first: int, end: int, logits: bool, routes: moe.Routes | None = None) -> torch.Tensor | None:
        width, device = self.suffix[first], self.block.valid.device
        tokens = np.full((end - first, width), self.pad_token_id, dtype=np.int64)
        positions = np.zeros((end - first, width, 3) if self.decoder.mrope else (end - first, width), dtype=np.int64)
        for i in range(first, end):
            n, s = self.reused[i], self.suffix[i]
            tokens[i - first, width - s:] = self.contexts[i][n:]
            media = self.media[i] if self.media is not None else None
            at = np.arange(n, n + s)
            positions[i - first, width - s:] = media.positions_of(n, n + s) if media is not None else (
                at[:, None] if self.decoder.mrope else at)
        token_tensor = torch.from_numpy(tokens).to(device)
        embeds, deepstack = self._embeds(first, end, token_tensor, tokens)
        return self.decoder.forward(token_tensor, torch.from_numpy(positions).to(device), self.block,
                                    slice(first, end), self.first_decode - width, logits, routes, embeds, deepstack)

    def _embeds(self, first: int, end: int, token_tensor: torch.Tensor,
                tokens: np.ndarray) -> tuple[torch.Tensor | None, list[torch.Tensor] | None]:
        """The rows' input embeddings with their image features spliced in, and what each deepstack
        layer adds (Qwen3-VL; zeros off the image tokens); (None, None): no row feeds an image."""
        rows = [i for i in range(first, end) if self.media is not None and self.media[i] is not None
                and self.media[i].feeds_images(self.contexts[i], self.reused[i])]
        if not rows:
            return None, None
        embeds = self.decoder.embed(token_tensor)
        layers = max(len(self.media[i].deepstack) for i in rows)
        deepstack = [torch.zeros_like(embeds) for _ in range(layers)] or None
        for i in rows:
            self.media[i].splice(embeds[i - first], tokens[i - first, tokens.shape[1] - self.suffix[i]:],
                                 self.contexts[i], self.reused[i],
                                 None if deepstack is None else [layer[i - first] for layer in deepstack])
        return embeds, deepstack

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed one token per row (`[B]`); the logits of the next."""
        column = self.first_decode + self.steps
        self.block.valid[:, column] = True
        routes = moe.Routes() if self.routes_dtype is not None else None
        logits = self.decoder.forward(tokens[:, None], (self.positions + self.steps)[:, None], self.block,
                                      slice(None), column, routes=routes)
        self.routes = routes.chosen[:, 0].to(self.routes_dtype) if routes is not None else None
        self.steps += 1
        return logits

    def kept(self, row: int, new_tokens: np.ndarray) -> KeptKV:
        """Row `row`'s keys and values after its window produced `new_tokens`: all of them but
        the last token, which no step fed."""
        fed = np.concatenate([self.contexts[row], new_tokens[:-1].astype(np.int64)])
        columns = self.block.valid[row].nonzero().squeeze(1)
        if len(columns) != len(fed):
            raise RuntimeError(f"row {row}: {len(columns)} cached columns for {len(fed)} tokens fed")
        return KeptKV(self.block, row, columns, fed)
