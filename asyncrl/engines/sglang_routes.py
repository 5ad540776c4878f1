"""A mixture-of-experts model's routes from SGLang, as the embedded engine records them (routing
replay: `asyncrl.messages.routes`).

SGLang 0.5.23 (`--enable-return-routed-experts`, `sglang.srt.state_capturer.routed_experts`)
captures at every forward the top-k expert ids each MoE layer's router chose at each position; a
request with `return_routed_experts` gets, when it comes back, those of its positions
`[routed_experts_start_len, seqlen - 1)` in `meta_info["routed_experts"]`: base64 of int32
`[positions, num_hidden_layers, top_k]`, in the router's top-k order. A window's request starts
them at its last input token (`len(input_ids) - 1`): row t is the position the request's t-th new
token was sampled from, the route the embedded engine records for that token
(`asyncrl.engines.kv_cache.CachedWindow`); prompt positions and earlier windows' tokens are not
sent again. SGLang builds every layer of these families sparse and captures them all; the rows keep
the layers transformers makes sparse (`mlp_only_layers`, `decoder_sparse_step`: the learner's
`asyncrl.learning.routing.route_shape`), in layer order, in the compact dtype of the model's
expert count (`route_dtype`).

Only the families routing replay knows (`asyncrl.engines.moe.MOE_FAMILIES`): another model's routes
would be refused by the learner (`refuse_misfit_routes`), so SGLang is not asked for them.
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass

import numpy as np

from asyncrl.engines.moe import MOE_FAMILIES
from asyncrl.messages.routes import route_dtype


@dataclass(frozen=True)
class RouteLayout:
    """What SGLang returns for a model (`layers` x `top_k` per position) and what a route keeps."""

    layers: int  # num_hidden_layers: SGLang's rows have one entry per layer
    sparse: tuple[int, ...]  # the layers whose routes are kept, in order
    top_k: int
    dtype: np.dtype

    @staticmethod
    def request_fields(input_length: int) -> dict:
        """`Engine.async_generate`'s arguments for the routes of a request's new tokens only."""
        return {"return_routed_experts": True, "routed_experts_start_len": input_length - 1}

    def decode(self, encoded: str | None) -> np.ndarray | None:
        """`meta_info["routed_experts"]` as routes `[tokens, sparse layers, top_k]`; None when absent."""
        if encoded is None:
            return None
        ids = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
        return ids.reshape(-1, self.layers, self.top_k)[:, list(self.sparse)].astype(self.dtype)


def route_layout(directory: str) -> RouteLayout | None:
    """The routes of the model in a Hugging Face directory, or None: a dense model, or one whose
    family routing replay does not know."""
    from transformers import AutoConfig

    with open(os.path.join(directory, "config.json")) as f:
        if json.load(f).get("model_type") not in MOE_FAMILIES:  # before transformers reads another family's
            return None
    config = AutoConfig.from_pretrained(directory)
    family = config.model_type
    experts = int(getattr(config, "num_local_experts" if family == "mixtral" else "num_experts", 0) or 0)
    if experts <= 0:
        return None
    layers = int(config.num_hidden_layers)
    # transformers' rule for the Qwen MoE families; every Mixtral layer is sparse.
    dense, step = set(getattr(config, "mlp_only_layers", None) or ()), int(getattr(config, "decoder_sparse_step", 1))
    sparse = tuple(i for i in range(layers) if family == "mixtral" or (i not in dense and (i + 1) % step == 0))
    return RouteLayout(layers, sparse, int(config.num_experts_per_tok), route_dtype(experts))
