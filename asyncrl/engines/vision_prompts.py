"""A prompt's images as the engine's own decoder takes them (Qwen2-VL's language model).

Each row of a window whose prompt has images gets a `PromptMedia`: the multimodal rotary
positions of its prompt (transformers' `get_rope_index`: an image token's (t, h, w) in its grid,
text after it continuing from the largest), the delta that places every later token (position
j + delta on each axis), and, when the row still has image tokens to feed (its first window, or
a cache dropped), the vision tower's features for them. The tower runs once per distinct image of
a window (`VisionInputs.features`): the G rows of a group, and the prefix they share, read one copy.
A family with deepstack features (Qwen3-VL) also gets, per feeding decoder layer, what that
layer adds at the image tokens. Rows without images get None and text positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from asyncrl.models.vision import VisionInputs


@dataclass
class PromptMedia:
    """One row's images: `positions` `[P, 3]` of its prompt's P tokens, `delta`, the image token
    id and its processed image references; `features` `[image tokens, hidden]` once fetched, and
    `deepstack` (Qwen3-VL): one such tensor per decoder layer that adds them."""

    positions: np.ndarray
    delta: int
    image_token_id: int
    refs: tuple[str, ...]
    features: torch.Tensor | None = None
    deepstack: tuple[torch.Tensor, ...] = ()

    def positions_of(self, start: int, end: int) -> np.ndarray:
        """`[end - start, 3]`: the positions of context tokens start..end (past the prompt: j + delta)."""
        index = np.arange(start, end)
        out = np.repeat((index + self.delta)[:, None], 3, axis=1)
        inside = index < len(self.positions)
        out[inside] = self.positions[index[inside]]
        return out

    def feeds_images(self, context: np.ndarray, start: int) -> bool:
        """Whether feeding `context[start:]` feeds an image token."""
        return bool((context[start:] == self.image_token_id).any())

    def splice(self, embeds: torch.Tensor, tokens: np.ndarray, context: np.ndarray, start: int,
               deepstack: list[torch.Tensor] | None = None) -> None:
        """Write the features of the image tokens among `tokens` (= `context[start:]`, right-aligned
        in the row `embeds` `[width, hidden]`) in place of their embeddings, and each layer's
        deepstack features at the same places of that layer's row of `deepstack` (zeros elsewhere)."""
        before = int((context[:start] == self.image_token_id).sum())
        where = np.flatnonzero(tokens == self.image_token_id)
        if len(where):
            at = torch.from_numpy(embeds.shape[0] - len(tokens) + where)
            embeds[at] = self.features[before:before + len(where)].to(embeds.dtype)
            for layer, features in zip(deepstack or (), self.deepstack):
                layer[at] = features[before:before + len(where)].to(layer.dtype)


def prompt_media(vision: VisionInputs, prompts: list[np.ndarray], images: list[tuple[str, ...]]) -> list[PromptMedia | None]:
    """Each row's `PromptMedia` (None where it has no images); the rotary index once per distinct prompt."""
    done: dict[tuple, PromptMedia] = {}
    out: list[PromptMedia | None] = []
    for prompt, refs in zip(prompts, images):
        if not refs:
            out.append(None)
            continue
        key = (prompt.tobytes(), refs)
        if key not in done:
            ids = torch.from_numpy(np.asarray(prompt, dtype=np.int64))
            positions, delta = vision.rope_index(ids, list(refs))
            done[key] = PromptMedia(positions.T.numpy().copy(), delta, vision.config.image_token_id, refs)
        out.append(done[key])
    return out


def fetch_features(vision: VisionInputs, media: list[PromptMedia | None], contexts: list[np.ndarray],
                   starts: list[int]) -> None:
    """Features for the rows that will feed image tokens from `starts` on: each distinct image
    through the tower once (the rows of one prompt share one `PromptMedia`)."""
    needed = [m for m, c, s in zip(media, contexts, starts) if m is not None and m.features is None
              and m.feeds_images(c, s)]
    features = vision.features([ref for m in needed for ref in m.refs])
    for m in needed:
        m.features = torch.cat([features[ref].embeds for ref in m.refs]) if m.refs else None
        m.deepstack = tuple(torch.cat(layer) for layer in zip(*(features[ref].deepstack for ref in m.refs)))


def media_key(media: PromptMedia | None) -> tuple[str, ...]:
    """What besides its tokens tells two prompts apart: their images."""
    return () if media is None else media.refs
