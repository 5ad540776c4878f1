"""A window on transformers' own forward: the embedded engine's path for models its own decoder
(`asyncrl.engines.llama_decoder`) does not cover."""

from __future__ import annotations

import numpy as np
import torch
from transformers import DynamicCache


class PaddedWindow:
    """A window on transformers' own forward, for models `LlamaDecoder` does not cover: contexts
    left-padded to one width, a `DynamicCache` that lives for this window only."""

    def __init__(self, model, contexts: list[np.ndarray], window_tokens: int, pad_token_id: int):
        batch, dev = len(contexts), next(model.parameters()).device
        width = max(len(c) for c in contexts)
        self.model, self.width = model, width
        self.input_ids = torch.full((batch, width), pad_token_id, dtype=torch.long, device=dev)
        # Allocated once for the whole window; decode steps take a growing prefix view.
        self.full_mask = torch.ones((batch, width + window_tokens), dtype=torch.long, device=dev)
        self.full_mask[:, :width] = 0
        for row, ctx in enumerate(contexts):
            self.input_ids[row, width - len(ctx):] = torch.from_numpy(ctx).to(dev)
            self.full_mask[row, width - len(ctx):width] = 1
        self.next_position = torch.tensor([len(c) for c in contexts], device=dev)
        self.cache = DynamicCache()
        self.steps = 0

    def start(self) -> torch.Tensor:
        mask = self.full_mask[:, :self.width]
        out = self.model(input_ids=self.input_ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                         past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        out = self.model(input_ids=tokens[:, None], attention_mask=self.full_mask[:, :self.width + self.steps],
                         position_ids=(self.next_position + self.steps - 1)[:, None], past_key_values=self.cache,
                         use_cache=True)
        return out.logits[:, -1, :]
