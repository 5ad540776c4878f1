"""The embedded engine's own forward for Llama-architecture models, over a KV block it owns.

Three dense families share the architecture: Llama, Qwen2 (Qwen2.5 too: biases on the q/k/v
projections; and Qwen2-VL's language model, whose rotary positions have three axes for the
image tokens of a prompt: its own `rotary_emb` computes them, `asyncrl.engines.vision_prompts`
gives the positions and the image features that replace the image tokens' embeddings) and Qwen3 (an RMSNorm over each head of q and k, before the rotary embedding, and an
explicit `head_dim`; Qwen3-VL's language model too, its rotary axes interleaved by its own
`rotary_emb`, and the tower's deepstack features added to its first layers' outputs at the image tokens). Biases come with the model's own projection modules; the per-head norms are
used where the attention module has them. Three mixture-of-experts families have the same
attention (Mixtral: Llama's; Qwen2-MoE: Qwen2's; Qwen3-MoE: Qwen3's) and a sparse MLP on some or
all layers, computed by `asyncrl.engines.moe`; a forward can record or replay their routes.

transformers' forward grows a `DynamicCache` by concatenation at every decode step (8% of a
step at batch 64, measured), builds its masks from one shared cache position, and cannot take
keys and values computed in an earlier call. This forward reads the same parameters (the
model's own modules, so weight updates are seen as they land) and writes keys and values into
a preallocated block at a column the caller names, with a position per row: rows may continue
from keys kept from an earlier window while others start from their prompt.

The arithmetic is transformers' forward of these families (RMSNorm in float32, rotary embedding
from the model's own `inv_freq` and `attention_scaling`, grouped-query attention, SiLU MLP): the
engine's tests hold its log-probs to a teacher-forced transformers pass for each family.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from asyncrl.engines import moe
from asyncrl.models.vision import image_token_ids, is_vision_model, text_config, without_image_tokens

FAMILIES = ("llama", "qwen2", "qwen3") + moe.MOE_FAMILIES
# Vision-language families whose language model is one of the above, with multimodal rotary positions.
VISION_FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
# Rotary variants whose frequencies do not depend on the sequence length (transformers computes
# `inv_freq` once for them); "dynamic" and "longrope" rescale with the length.
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def unsupported(model) -> str | None:
    """Why `LlamaDecoder` cannot compute this model's forward (one phrase), or None when it can:
    a transformers model of one of `FAMILIES` with static rotary frequencies, SiLU, full attention
    on every layer (a sliding window shorter than the context is not implemented), one plain
    linear head, and experts in the layout `asyncrl.engines.moe` reads."""
    family = getattr(model.config, "model_type", None)
    if family not in FAMILIES + VISION_FAMILIES:
        return f"model_type {family!r} is not one of {', '.join(FAMILIES + VISION_FAMILIES)}"
    config = text_config(model.config)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in _STATIC_ROPE_TYPES:
        return f"rotary type {rope_type!r} rescales with the sequence length"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} is not silu"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1 splits the projections"
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    # Qwen2/Qwen3/Qwen2-MoE name their windowed layers; Mixtral and Qwen3-MoE window every layer
    # when the config has a window (Qwen3-MoE's is None unless `use_sliding_window`).
    windowed = "sliding_attention" in layer_types if layer_types is not None else bool(window)
    if windowed and window is not None and window < config.max_position_embeddings:
        return f"sliding-window attention ({window} tokens) is not implemented"
    if not (hasattr(model, "lm_head") and hasattr(model, "model")):
        return f"{type(model).__name__} has no plain LM head"
    return moe.unsupported(model) if family in moe.MOE_FAMILIES else None


def supports(model) -> bool:
    """Whether `LlamaDecoder` computes this model's forward (`unsupported` gives why not)."""
    return unsupported(model) is None


class KVBlock:
    """Keys and values of every layer for a batch of rows: `data` `[layers, 2, rows, kv_heads,
    columns, head_dim]` (zeros where nothing was written: a masked column must hold finite
    numbers, since attention multiplies it by a zero weight), and `valid` `[rows, columns]`, the
    columns each row attends to."""

    def __init__(self, layers: int, rows: int, kv_heads: int, columns: int, head_dim: int, dtype, device):
        self.data = torch.zeros((layers, 2, rows, kv_heads, columns, head_dim), dtype=dtype, device=device)
        self.valid = torch.zeros((rows, columns), dtype=torch.bool, device=device)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class LlamaDecoder:
    """`forward` runs new tokens of some rows of a `KVBlock` through the model, writing their keys
    and values at columns `start..start+S` and returning the logits of the last column."""

    def __init__(self, model):
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"LlamaDecoder does not support {type(model).__name__}: {reason}")
        self.model = model
        # The language model's trunk: a vision-language model's (`language_model`) or the model's own.
        self.inner = model.model.language_model if is_vision_model(model) else model.model
        self.mrope = is_vision_model(model)  # positions with three axes (Qwen2-VL's multimodal rotary)
        self.banned = image_token_ids(model) if self.mrope else None  # never sampled: a prompt's image tokens
        config = text_config(model.config)
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # A bool, not compared per call: traced by torch.compile with dynamic shapes, the comparison
        # of two int attributes is symbolic, and SDPA's `enable_gqa` takes only a real bool.
        self.grouped_query = self.kv_heads != self.heads
        attn = self.inner.layers[0].self_attn
        self.scale = float(attn.scaling)
        # Qwen3: q and k normalised per head (over head_dim) before the rotary embedding.
        self.qk_norm = hasattr(attn, "q_norm")
        # Each layer's index among the sparse (MoE) layers, None for a dense MLP.
        sparse = [moe.is_sparse(layer) for layer in self.inner.layers]
        self.sparse_index = [sum(sparse[:i]) if is_sparse else None for i, is_sparse in enumerate(sparse)]
        self.moe = moe.MoeMLP(config) if self.sparse_layers else None
        self.experts = next((layer.mlp.experts.gate_up_proj.shape[0] for layer in self.inner.layers
                             if moe.is_sparse(layer)), 0)  # per sparse layer (0: a dense model)

    @property
    def layers(self) -> int:
        return len(self.inner.layers)

    @property
    def sparse_layers(self) -> int:
        """Layers with a mixture-of-experts MLP (the second axis of `moe.Routes`)."""
        return sum(i is not None for i in self.sparse_index)

    def new_block(self, rows: int, columns: int) -> KVBlock:
        weight = self.model.lm_head.weight
        return KVBlock(self.layers, rows, self.kv_heads, columns, self.head_dim, weight.dtype, weight.device)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, block: KVBlock, rows: slice,
                start: int, logits: bool = True, routes: moe.Routes | None = None,
                embeds: torch.Tensor | None = None, deepstack: list[torch.Tensor] | None = None) -> torch.Tensor | None:
        """`tokens`, `positions`: `[b, S]` for block rows `rows` (b of them), written at columns
        `start..start+S`; `block.valid` must already mark those columns of real tokens. Each
        query attends to the valid columns up to its own. Returns float logits `[b, vocab]` of
        column `start+S-1` (None with `logits=False`: only the keys and values are wanted).
        `routes` (MoE models, opt-in): records the experts every position chose at every sparse
        layer, or forces them (`moe.Routes`). `embeds` `[b, S, hidden]`: the inputs' embeddings in
        place of the tokens' (a prompt's image features spliced in); `positions` `[b, S, 3]` with
        `mrope` (or `[b, S]`: the same position on every axis). `deepstack` (Qwen3-VL): layer i's
        output gains `deepstack[i]` `[b, S, hidden]` (image features at image tokens, zeros elsewhere)."""
        inner = self.inner
        width = tokens.shape[1]
        end = start + width
        # [b, 1, S, end]: a query at column start+j sees the valid columns <= start+j, and always
        # its own (a padding query with nothing to attend to would make NaNs, and its NaN keys
        # would reach the real queries through their zero weights).
        steps = torch.arange(width, device=tokens.device)
        causal = torch.ones((width, end), dtype=torch.bool, device=tokens.device).tril(start)
        own = torch.zeros((width, end), dtype=torch.bool, device=tokens.device)
        own[steps, start + steps] = True
        mask = (causal & (block.valid[rows, None, :end] | own))[:, None]
        hidden = inner.embed_tokens(tokens) if embeds is None else embeds
        cos, sin = self._rotary(positions, hidden.dtype)
        for index, layer in enumerate(inner.layers):
            hidden = self._attention(layer, hidden, cos, sin, block.data[index], rows, start, end, mask)
            hidden = hidden + self._mlp(layer, _rms_norm(hidden, layer.post_attention_layernorm),
                                        self.sparse_index[index], routes)
            if deepstack is not None and index < len(deepstack):
                hidden = hidden + deepstack[index].to(hidden.dtype)
        if routes is not None and self.moe is not None:
            routes.finish()
        if not logits:
            return None
        last = _rms_norm(hidden[:, -1], inner.norm)
        out = self.model.lm_head(last).float()
        return out if self.banned is None else without_image_tokens(out, self.banned)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.inner.embed_tokens(tokens)

    def _rotary(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        rotary = self.inner.rotary_emb
        if self.mrope:  # the family's own: each frequency reads the axis its mrope section names
            axes = positions if positions.dim() == 3 else positions[..., None].expand(*positions.shape, 3)
            cos, sin = rotary(torch.empty(0, dtype=dtype, device=positions.device), axes.permute(2, 0, 1))
            return cos[:, None], sin[:, None]
        freqs = positions[..., None].float() * rotary.inv_freq.float()
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]  # [b, 1, S, head_dim]
        return ((angles.cos() * rotary.attention_scaling).to(dtype),
                (angles.sin() * rotary.attention_scaling).to(dtype))

    def _attention(self, layer, hidden, cos, sin, kv, rows, start, end, mask):
        b, width, _ = hidden.shape
        attn = layer.self_attn
        x = _rms_norm(hidden, layer.input_layernorm)
        q = attn.q_proj(x).view(b, width, self.heads, self.head_dim)
        k = attn.k_proj(x).view(b, width, self.kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = _rms_norm(q, attn.q_norm), _rms_norm(k, attn.k_norm)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = attn.v_proj(x).view(b, width, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        kv[0, rows, :, start:end] = k
        kv[1, rows, :, start:end] = v
        out = F.scaled_dot_product_attention(q, kv[0, rows, :, :end], kv[1, rows, :, :end], attn_mask=mask,
                                             scale=self.scale, enable_gqa=self.grouped_query)
        return hidden + attn.o_proj(out.transpose(1, 2).reshape(b, width, self.heads * self.head_dim))

    def _mlp(self, layer, x, sparse_index, routes):
        mlp = layer.mlp
        if sparse_index is None:
            return mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        b, width, hidden = x.shape
        forced = routes.forced_at(sparse_index) if routes is not None else None
        out, ids = self.moe(mlp, x.reshape(-1, hidden), forced)
        if routes is not None:
            routes.record(ids, b, width)
        return out.view(b, width, hidden)


def _rms_norm(hidden: torch.Tensor, norm) -> torch.Tensor:
    x = hidden.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x.to(hidden.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
