"""Mixture-of-experts: what routing replay buys, what the MoE decoder costs, what a route weighs.

Side by side in one run, on a tiny random Qwen3-MoE drawn at a trained model's scale (8 experts,
top-2, 2 sparse layers; routers with logits of a few units, as a trained router's):

* **drift**: the embedded engine in bfloat16 samples responses and records their routes; the
  learner in float32 scores them (the production path: `token_logprobs` under `replayed_routes`)
  with replay off and on. `router_mismatch` is the share of generated (token, layer) routes whose
  float32 top-k differs from the rollout's (with replay a later layer sees the hidden states the
  rollout's experts made, so it differs a little less); what replay changes is `rollout_kl_k3`, the
  engine-learner mismatch of the sampled tokens' log-probs, and the share of tokens whose log-prob
  moved by more than 0.01 (the tokens whose importance ratio is noise without replay). A float32
  engine against the float32 learner is the floor.
* **decode**: tokens/s of the embedded engine's MoE decoder against transformers' `generate` on the
  same float32 model, batch 1/16/64 (paired rounds, `asyncrl.bench.engine.paired_rounds`).
* **route bytes**: what a route record adds per generated token (`asyncrl.messages.routes`), here
  and for Qwen3-30B-A3B's shape, and a finished segment's encoded size with and without its routes.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
import torch

from asyncrl.engines.base import SamplingParams, SequenceInput
from asyncrl.messages.structs import int32_array

EXPERTS, TOP_K, LAYERS = 8, 2, 2
NEVER = [0]  # an EOS id no prompt's response reaches (the vocabulary's pad): every row runs its length


def tiny_moe(seed: int = 0, vocab: int = 64):
    """A random Qwen3-MoE redrawn at a trained model's scale: routers with a clear top-k, distinct
    token embeddings, unit-variance experts."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                            moe_intermediate_size=32, intermediate_size=96, norm_topk_prob=True,
                            max_position_embeddings=512, tie_word_embeddings=False)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.3)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            elif ".mlp." in name:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
            elif "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return model.eval()


def write_tiny_moe(directory: str, seed: int = 0) -> str:
    """`tiny_moe` over the tiny task's character vocabulary, as a Hugging Face directory a run loads
    (`model=tiny model.source=hf model.path=<directory>`)."""
    from asyncrl.models.loading import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    model = tiny_moe(seed, vocab=len(tokenizer))
    model.config.update({"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
                         "eos_token_id": tokenizer.eos_token_id})
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def _prompts(count: int, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(1, vocab, size=int(rng.integers(4, 12))).tolist() for _ in range(count)]


def rows_of(prompts: list[list[int]], outs, advantage: float = 0.0) -> list:
    """Each engine output as a finished sample's training row, its routes as the generator sends them."""
    from asyncrl.messages.structs import FinishReason, Segment, TrainingRow

    rows = []
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        segment = Segment(prompt_id=f"p{i}", sample_idx=0, window=0, group_id=f"p{i}",
                          prompt_token_ids=int32_array(prompt), prior_response_ids=int32_array([]),
                          prior_versions=int32_array([]), new_token_ids=out.token_ids, new_logprobs=out.logprobs,
                          new_versions=np.zeros(len(out.token_ids), dtype=np.int32), finished=True,
                          finish_reason=out.finish_reason if out.finished else FinishReason.MAX_LENGTH,
                          new_routes=out.routes)
        rows.append(TrainingRow(segment=segment, score=1.0,
                                advantages=np.full(len(out.token_ids), advantage, np.float32)))
    return rows


def drift(model, engine_dtype: torch.dtype, prompts: list[list[int]], tokens: int) -> dict:
    """The learner (float32) against the engine (`engine_dtype`) on the engine's own samples, replay
    off and on: router_mismatch, rollout_kl_k3, the share of tokens whose log-prob moved > 0.01."""
    from asyncrl.algo.losses import rollout_mismatch
    from asyncrl.engines.torch_engine import TorchEngine
    from asyncrl.learning.routing import RouteStats, replayed_routes, route_metrics, route_shape
    from asyncrl.learning.scoring import PolicyForward, token_logprobs
    from asyncrl.learning.tensors import collate

    engine = TorchEngine(model, NEVER, dtype=engine_dtype)
    sequences = [SequenceInput(prompt_ids=int32_array(p), response_ids=int32_array([]), seed=i,
                               max_response_tokens=tokens) for i, p in enumerate(prompts)]
    rows = rows_of(prompts, engine.generate_window_sync(sequences, tokens, SamplingParams(temperature=1.0)))
    collated = collate(rows, 0)
    mask = collated.response_mask
    out = {}
    for replay in (False, True):
        stats = RouteStats(route_shape(model))
        with torch.no_grad(), replayed_routes(model, collated.routes, replay, stats, collated.attention_mask > 0):
            logp, _ = token_logprobs(PolicyForward(model), collated.input_ids, collated.attention_mask,
                                     collated.targets, 1.0, positions=mask > 0)
        moved = ((logp - collated.old_logprobs).abs() > 0.01) & (mask > 0)
        out["replay" if replay else "no_replay"] = {
            "router_mismatch": route_metrics(stats.sums(), stats.shape)["router_mismatch"],
            "rollout_kl_k3": rollout_mismatch(logp, collated.old_logprobs, mask)["rollout_kl_k3"],
            "tokens_moved_over_0.01": float(moved.sum() / mask.sum())}
    return out


def decode_rates(model, batches: tuple[int, ...], tokens: int, rounds: int) -> list[dict]:
    """Tokens/s of the embedded engine (its MoE decoder, float32) and of transformers' `generate`."""
    from asyncrl.bench.engine import paired_rounds
    from asyncrl.engines.torch_engine import TorchEngine

    engine = TorchEngine(model, NEVER)
    assert engine.decoder is not None, "the MoE decoder did not take the model"
    out = []
    for batch in batches:
        wall, _ = paired_rounds({"engine": engine}, model, _prompts(batch, model.config.vocab_size), tokens, 0,
                                rounds, "cpu")
        rate = {name: float(np.median([batch * tokens / t for t in times])) for name, times in wall.items()}
        out.append({"batch": batch, "engine_tokens_per_s": rate["engine"], "generate_tokens_per_s": rate["generate"],
                    "engine_over_generate": float(np.median([g / e for e, g in zip(wall["engine"], wall["generate"])]))})
        print(f"moe decode, batch {batch}: {out[-1]}", flush=True)
    return out


def route_bytes(model, tokens: int) -> dict:
    """Bytes a route adds per generated token (here and at Qwen3-30B-A3B's 48 layers x top-8 of 128
    experts), and one finished segment encoded with and without its routes."""
    from asyncrl.engines.torch_engine import TorchEngine
    from asyncrl.messages.routes import route_dtype
    from asyncrl.messages.structs import Codec, Segment

    engine = TorchEngine(model, NEVER)
    sequence = SequenceInput(prompt_ids=int32_array([1, 2, 3, 4]), response_ids=int32_array([]), seed=0,
                             max_response_tokens=tokens)
    segment = rows_of([[1, 2, 3, 4]], engine.generate_window_sync([sequence], tokens, SamplingParams()))[0].segment
    bare, codec = msgspec.structs.replace(segment, new_routes=None), Codec(Segment)  # the mailboxes' codec
    return {"per_token_here": LAYERS * TOP_K * route_dtype(EXPERTS).itemsize,
            "per_token_qwen3_30b_a3b": 48 * 8 * route_dtype(128).itemsize,
            "segment_tokens": tokens, "segment_bytes_with_routes": len(codec.encode(segment)),
            "segment_bytes_without": len(codec.encode(bare))}


def run(quick: bool = False, overrides: list[str] | None = None) -> dict:
    from asyncrl.bench.common import machine

    torch.set_num_threads(1)  # a generator's setting
    model = tiny_moe()
    prompts = _prompts(16 if quick else 64, model.config.vocab_size)
    tokens = 16 if quick else 32
    return {"machine": machine(), "model": {"experts": EXPERTS, "top_k": TOP_K, "sparse_layers": LAYERS,
                                            "parameters": sum(p.numel() for p in model.parameters())},
            "drift_bf16_engine": drift(model, torch.bfloat16, prompts, tokens),
            "drift_fp32_engine": drift(model, torch.float32, prompts, tokens),
            "decode": decode_rates(model, (1, 16) if quick else (1, 16, 64), tokens, 2 if quick else 3),
            "route_bytes": route_bytes(model, tokens)}


def report(r: dict) -> str:
    m = r["model"]
    lines = [f"mixture-of-experts ({r['machine']['cpu']}): tiny Qwen3-MoE, {m['experts']} experts, top-{m['top_k']}, "
             f"{m['sparse_layers']} sparse layers, {m['parameters']:,} parameters; learner float32",
             "  engine dtype | replay | router_mismatch | rollout_kl_k3 | tokens whose log-prob moved > 0.01"]
    for name, key in (("bfloat16", "drift_bf16_engine"), ("float32", "drift_fp32_engine")):
        for replay in ("no_replay", "replay"):
            d = r[key][replay]
            lines.append(f"  {name:12s} | {'on' if replay == 'replay' else 'off':6s} | {d['router_mismatch']:15.4f} | "
                         f"{d['rollout_kl_k3']:13.2e} | {d['tokens_moved_over_0.01']:.4f}")
    lines.append("  batch | MoE decoder tok/s | transformers generate tok/s | decoder / generate (paired)")
    for row in r["decode"]:
        lines.append(f"  {row['batch']:5d} | {row['engine_tokens_per_s']:17.0f} | {row['generate_tokens_per_s']:27.0f} | "
                     f"{row['engine_over_generate']:.2f}x")
    b = r["route_bytes"]
    lines.append(f"  a route adds {b['per_token_here']} B per generated token here ({b['per_token_qwen3_30b_a3b']} B at "
                 f"Qwen3-30B-A3B's 48 layers x top-8 of 128); a {b['segment_tokens']}-token segment encodes to "
                 f"{b['segment_bytes_with_routes']} B with its routes, {b['segment_bytes_without']} B without")
    return "\n".join(lines)
