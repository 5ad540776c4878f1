"""The engine's own forward for the mixture-of-experts families (Qwen3-MoE, Qwen2-MoE, Mixtral)
against transformers' own forward of the same weights; the routes it records and replays; the
experts grouped by expert.

Tiny random models built here with transformers' configs: 8 experts, top-2, one Qwen3-MoE with
`norm_topk_prob` and one without (whose `decoder_sparse_step` of 2 leaves its first layer dense), a
Qwen2-MoE with its shared expert and a dense layer (`mlp_only_layers`). transformers initialises
the experts and routers with a 0.02 standard deviation: the experts' outputs would vanish beside
the residual and the router's probabilities would be nearly uniform (and the 0.02 embeddings send
every token to the same experts), so a forward that got them wrong would still pass. They are
drawn at the scale of a trained model's here (unit-variance embeddings and outputs, decisive
routers), with the biases and norm weights drawn as in `tests/test_engine_families.py`."""

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from transformers import MixtralConfig, MixtralForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3MoeConfig, \
    Qwen3MoeForCausalLM

from asyncrl.config import ModelConfig
from asyncrl.engines import llama_decoder, moe
from asyncrl.engines.base import SamplingParams
from asyncrl.engines.torch_engine import TorchEngine
from engine_checks import NO_EOS, PROMPTS, assert_kept_kv_equals_reprefill, assert_own_forward_matches_transformers
from asyncrl.models.loading import load_model

VOCAB = 64
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, rms_norm_eps=1e-6, pad_token_id=0, num_experts_per_tok=2)
QWEN_MOE = dict(SHAPE, num_experts=8, moe_intermediate_size=32, intermediate_size=96)
MODELS = {
    # Qwen3-MoE: q/k norms per head, head_dim 32 (hidden / heads would be 16), top-k renormalised.
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(**QWEN_MOE, head_dim=32, norm_topk_prob=True)),
    # Qwen3-MoE, top-k weights as the softmax gives them; layer 0 dense (every 2nd layer sparse).
    "qwen3_moe_step2": lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(**QWEN_MOE, norm_topk_prob=False,
                                                                  decoder_sparse_step=2)),
    # Qwen2-MoE: q/k/v biases, a shared expert behind a sigmoid gate; layer 1 dense.
    "qwen2_moe": lambda: Qwen2MoeForCausalLM(Qwen2MoeConfig(**QWEN_MOE, shared_expert_intermediate_size=48,
                                                            mlp_only_layers=[1])),
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(**SHAPE, num_local_experts=8, intermediate_size=32)),
}


def moe_model(name: str, seed: int = 0):
    torch.manual_seed(seed)
    return at_trained_scale(MODELS[name]())


def at_trained_scale(model):
    """`model` (drawn by transformers at its 0.02 scale) redrawn at a trained model's scale."""
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("mlp.gate.weight") or pname.endswith("shared_expert_gate.weight"):
                p.normal_(0.0, 0.3)  # routers: logits of a few units, a clear top-k
            elif "embed_tokens" in pname:
                p.normal_(0.0, 1.0)  # distinct tokens: routed to distinct experts
            elif ".mlp." in pname:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))  # experts and dense MLPs: unit-variance outputs
            elif pname.endswith("bias"):
                p.normal_(0.0, 0.3)
            elif "norm" in pname:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return model.eval()




def prefill(decoder, ids: torch.Tensor, routes=None) -> torch.Tensor:
    """The decoder's logits of the last token of each row of `ids` `[b, S]`, from an empty block."""
    block = decoder.new_block(ids.shape[0], ids.shape[1])
    block.valid[:] = True
    positions = torch.arange(ids.shape[1])[None].expand_as(ids)
    with torch.no_grad():
        return decoder.forward(ids, positions, block, slice(None), 0, routes=routes)


def test_the_moe_models_have_what_the_forward_must_handle():
    """The tiny models carry each family's difference, so the tests below exercise it."""
    q3, step2, q2, mx = (moe_model(name) for name in ("qwen3_moe", "qwen3_moe_step2", "qwen2_moe", "mixtral"))
    assert [moe.is_sparse(layer) for layer in step2.model.layers] == [False, True]
    assert [moe.is_sparse(layer) for layer in q2.model.layers] == [True, False]
    assert all(moe.is_sparse(layer) for model in (q3, mx) for layer in model.model.layers)
    assert q3.config.norm_topk_prob and not step2.config.norm_topk_prob and not q2.config.norm_topk_prob
    assert q2.model.layers[0].mlp.shared_expert.gate_proj.out_features == 48
    assert q2.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    assert q3.model.layers[0].self_attn.q_norm.weight.shape == (32,)
    assert mx.model.layers[0].mlp.experts.gate_up_proj.shape == (8, 2 * 32, 64)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_unsupported_is_none_and_the_engine_gives_no_fallback_notice(name, caplog):
    model = moe_model(name)
    assert llama_decoder.unsupported(model) is None
    with caplog.at_level(logging.WARNING, logger="asyncrl.engines.torch_engine"):
        engine = TorchEngine(model, NO_EOS)
    assert engine.decoder is not None and engine.decoder.moe is not None and not caplog.records


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9, top_k=12)])
def test_own_forward_logprobs_match_transformers_forward_in_fp32(name, params):
    """The dense families' bounds (`tests/test_engine_families.py`): 1e-4 nats from a
    teacher-forced pass, and the same tokens and log-probs (1e-5) as transformers' padded path."""
    assert_own_forward_matches_transformers(moe_model(name), params)


@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral"])
def test_kept_kv_across_windows_equals_re_prefill(name):
    """Rows join and leave across three windows; with KV kept, the same tokens and log-probs as
    an engine that re-reads every context."""
    assert_kept_kv_equals_reprefill(moe_model(name, seed=1))


def test_a_moe_model_loaded_from_its_directory_runs_in_the_decoder_and_sees_weight_updates(tmp_path):
    """A Hugging Face directory (experts saved one by one, as on the Hub; fused when loaded), then
    an in-place change of the expert weights: the decoder follows transformers through both."""
    moe_model("qwen3_moe").save_pretrained(tmp_path)
    model = load_model(ModelConfig(source="hf", path=str(tmp_path)), None).eval()
    decoder = llama_decoder.LlamaDecoder(model)
    ids = torch.tensor([PROMPTS[4]])
    for _ in range(2):
        with torch.no_grad():
            theirs = model(input_ids=ids).logits[:, -1]
        torch.testing.assert_close(prefill(decoder, ids), theirs, atol=1e-5, rtol=0)
        with torch.no_grad():
            model.model.layers[1].mlp.experts.down_proj.mul_(-2.0)


def test_a_moe_model_with_a_sliding_window_falls_back_with_a_notice(caplog):
    torch.manual_seed(0)
    windowed = [MixtralForCausalLM(MixtralConfig(**SHAPE, num_local_experts=8, intermediate_size=32,
                                                 sliding_window=16)).eval(),
                Qwen3MoeForCausalLM(Qwen3MoeConfig(**QWEN_MOE, use_sliding_window=True, sliding_window=16)).eval()]
    for model in windowed:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="asyncrl.engines.torch_engine"):
            assert TorchEngine(model, NO_EOS).decoder is None
        assert [r.getMessage().count("sliding-window attention (16 tokens)") for r in caplog.records] == [1]


# Whether each test model's family renormalises the top-k weights (transformers' routers).
RENORMALISES = {"qwen3_moe": True, "qwen3_moe_step2": False, "qwen2_moe": False, "mixtral": True}
ROWS = torch.tensor([PROMPTS[4], PROMPTS[4][::-1]])  # two rows of 9 tokens


@pytest.mark.parametrize("name", sorted(MODELS))
def test_recorded_routes_are_transformers_router_top_k(name):
    model = moe_model(name)
    decoder = llama_decoder.LlamaDecoder(model)
    routes = moe.Routes()
    prefill(decoder, ROWS, routes)
    assert routes.chosen.dtype == torch.int16 and routes.chosen.shape == (2, 9, decoder.sparse_layers, 2)
    with torch.no_grad():
        router_logits = model(input_ids=ROWS, output_router_logits=True).router_logits
    assert len(router_logits) == decoder.sparse_layers == (1 if name in ("qwen3_moe_step2", "qwen2_moe") else 2)
    theirs = torch.stack([torch.topk(logits.float().softmax(-1), 2).indices.view(2, 9, 2)
                          for logits in router_logits], dim=2)
    assert torch.equal(routes.chosen.long(), theirs)
    assert len(routes.chosen.unique()) > 4  # the tokens go to many experts, not the same two


@pytest.mark.parametrize("name", sorted(MODELS))
def test_forcing_the_recorded_routes_reproduces_the_logits_exactly(name):
    decoder = llama_decoder.LlamaDecoder(moe_model(name))
    recorded = moe.Routes()
    logits = prefill(decoder, ROWS, recorded)
    assert torch.equal(prefill(decoder, ROWS), logits)  # asking for routes changes nothing
    replayed = moe.Routes(forced=recorded.chosen)
    assert torch.equal(prefill(decoder, ROWS, replayed), logits)
    assert torch.equal(replayed.chosen, recorded.chosen)
    # Other routes (the second expert moved) are the ones used, and change the logits.
    other = recorded.chosen.clone()
    other[..., 1] = (other[..., 0] + 4) % 8
    moved = moe.Routes(forced=other)
    assert not torch.allclose(prefill(decoder, ROWS, moved), logits, atol=1e-3)
    assert torch.equal(moved.chosen, other)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_bf16_forward_keeps_each_familys_rounding_of_the_router_weights(name):
    """In bfloat16 the families differ: Mixtral weights its experts in float32, the Qwen routers
    round the weights to bf16 first. The decoder's logits stay within 1e-3 of transformers' bf16
    forward (0 on this version); the other family's rounding moves them by a bf16 step (2e-3+)."""
    decoder = llama_decoder.LlamaDecoder(moe_model(name).to(torch.bfloat16))
    with torch.no_grad():
        theirs = decoder.model(input_ids=ROWS).logits[:, -1].float()
    torch.testing.assert_close(prefill(decoder, ROWS), theirs, atol=1e-3, rtol=0)
    decoder.moe.float_weights = not decoder.moe.float_weights
    assert (prefill(decoder, ROWS) - theirs).abs().max() > 1e-3


@pytest.mark.parametrize("name", sorted(MODELS))
def test_router_weights_are_transformers_and_forced_ids_take_the_routers_probabilities(name):
    model = moe_model(name)
    mlp = next(layer.mlp for layer in model.model.layers if moe.is_sparse(layer))
    x = torch.randn(10, 64)
    router = moe.MoeMLP(model.config)
    with torch.no_grad():
        router_logits, scores, indices = mlp.gate(x)
        ids, weights = router.route(mlp.gate.weight, x)
        assert torch.equal(ids, indices)
        torch.testing.assert_close(weights, scores, atol=1e-7, rtol=0)
        forced = torch.stack([(indices[:, 0] + 3) % 8, indices[:, 0]], dim=1)
        ids, weights = router.route(mlp.gate.weight, x, forced)
    probs = router_logits.float().softmax(-1).gather(-1, forced)
    expected = probs / probs.sum(-1, keepdim=True) if RENORMALISES[name] else probs
    assert torch.equal(ids, forced)
    torch.testing.assert_close(weights, expected, atol=1e-7, rtol=0)


def per_token_experts(experts, x, ids, weights) -> torch.Tensor:
    """The reference: every token through each of its experts, one at a time."""
    out = torch.zeros_like(x)
    inter = experts.down_proj.shape[-1]
    for token in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            expert = ids[token, slot]
            gate_up = experts.gate_up_proj[expert] @ x[token]
            hidden = F.silu(gate_up[:inter]) * gate_up[inter:]
            out[token] += weights[token, slot] * (experts.down_proj[expert] @ hidden)
    return out


class LinearRows(TorchFunctionMode):
    """The rows of every `F.linear` call made inside it."""

    def __init__(self):
        super().__init__()
        self.rows: list[int] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            self.rows.append(args[0].shape[0])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral"])
def test_experts_run_grouped_by_expert_and_equal_a_per_token_loop(name):
    model = moe_model(name)
    mlp = model.model.layers[0].mlp
    x = torch.randn(3, 64)  # 6 (token, slot) pairs: some of the 8 experts have no token
    router = moe.MoeMLP(model.config)
    with torch.no_grad():
        ids, weights = router.route(mlp.gate.weight, x)
        assert 2 < len(ids.unique()) < 8
        with LinearRows() as calls:
            out = moe.grouped_experts(mlp.experts, x, ids, weights)
        torch.testing.assert_close(out, per_token_experts(mlp.experts, x, ids, weights), atol=1e-5, rtol=1e-5)
        # One gate-up and one down matmul per expert that has tokens, each (token, slot) pair
        # through each once: not every expert over every token.
        assert len(calls.rows) == 2 * len(ids.unique()) and sum(calls.rows) == 2 * ids.numel()
        # The whole MLP (Qwen2-MoE: with its gated shared expert) is transformers' block.
        torch.testing.assert_close(router(mlp, x)[0], mlp(x[None])[0], atol=1e-5, rtol=0)
