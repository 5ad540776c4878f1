"""The engine's own forward for each model family it knows (Llama, Qwen2, Qwen3), against
transformers' own forward of the same weights, and the fallback for a family it does not know.

Tiny random models built here with transformers' configs: grouped-query attention, Qwen3's
explicit `head_dim` (not hidden / heads), tied embeddings for one family. transformers
initialises biases to zero and norm weights to one, which would leave Qwen2's q/k/v biases and
Qwen3's q/k norms without effect: they are drawn at random here, so a forward that skipped them
would fail."""

import logging

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, \
    Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from asyncrl.engines.base import SamplingParams
from asyncrl.engines.torch_engine import TorchEngine
from asyncrl.learning.scoring import token_logprobs
from engine_checks import (NO_EOS, PROMPTS, assert_kept_kv_equals_reprefill,
                           assert_own_forward_matches_transformers, seq, teacher_forced)

VOCAB = 64
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, pad_token_id=0)
FAMILIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SHAPE, rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
    # Qwen2 (and Qwen2.5): biases on q/k/v; tied embeddings as the small Qwen2.5 models have.
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SHAPE, tie_word_embeddings=True,
                                                  rope_parameters={"rope_type": "default", "rope_theta": 1e4})),
    # Qwen3: q/k RMSNorm per head, head_dim 32 (hidden / heads would be 16).
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=32,
                                                  rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
}


def family_model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    model = FAMILIES[family]()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.3)
            elif "norm" in name:  # RMSNorm weights: ones at init
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return model.eval()




def test_the_families_have_what_the_forward_must_handle():
    """The tiny models carry each family's difference, so the tests below exercise it."""
    qwen2, qwen3 = family_model("qwen2"), family_model("qwen3")
    attn2, attn3 = qwen2.model.layers[0].self_attn, qwen3.model.layers[0].self_attn
    assert attn2.q_proj.bias is not None and attn2.q_proj.bias.abs().sum() > 0 and attn2.o_proj.bias is None
    assert qwen2.lm_head.weight.data_ptr() == qwen2.model.embed_tokens.weight.data_ptr()
    assert attn3.q_norm.weight.shape == (32,) and attn3.q_proj.out_features == 4 * 32 != qwen3.config.hidden_size


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9, top_k=12)])
def test_own_forward_logprobs_match_transformers_forward_in_fp32(family, params):
    """fp32: the bound of the Llama path (`tests/test_engine.py`): 1e-4 nats from a teacher-forced
    pass, and the same tokens and log-probs (1e-5) as the engine on transformers' forward."""
    assert_own_forward_matches_transformers(family_model(family), params)


# The Llama path's bf16 bounds (tests/test_engine_cache.py: BF16_MEAN_BOUND, BF16_MAX_BOUND).
BF16_MEAN_BOUND, BF16_MAX_BOUND = 0.004, 0.02


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_logprobs_are_within_the_llama_paths_bound_of_the_fp32_forward(family):
    model = family_model(family)
    engine = TorchEngine(model, NO_EOS, dtype=torch.bfloat16)
    assert engine.decoder is not None and next(engine.model.parameters()).dtype == torch.bfloat16
    outs = engine.generate_window_sync([seq(i) for i in range(5)], 24, SamplingParams(temperature=0.7))
    gaps = []
    for i, out in enumerate(outs):
        ids = torch.tensor([PROMPTS[i] + out.token_ids.tolist()])
        targets = torch.zeros_like(ids)
        targets[0, :-1] = ids[0, 1:]
        with torch.no_grad():
            logp, _ = token_logprobs(model, ids, torch.ones_like(ids), targets, 0.7)
        gaps.append(np.abs(out.logprobs - logp[0, len(PROMPTS[i]) - 1:-1].numpy()))
    gaps = np.concatenate(gaps)
    assert 0 < gaps.mean() < BF16_MEAN_BOUND and gaps.max() < BF16_MAX_BOUND, (gaps.mean(), gaps.max())


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_kept_kv_across_windows_equals_re_prefill(family):
    """Rows join and leave across three windows; with KV kept, the same tokens and log-probs as
    an engine that re-reads every context."""
    assert_kept_kv_equals_reprefill(family_model(family, seed=1))


def test_a_family_the_decoder_does_not_know_falls_back_with_a_notice(caplog):
    """Mistral (not one of the families) and a Qwen2 whose sliding window is shorter than its
    context: transformers' forward, said once at start-up with the reason, and still right."""
    torch.manual_seed(0)
    models = {"model_type 'mistral' is not one of llama, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe":
              MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=None)).eval(),
              "sliding-window attention (16 tokens)":
              Qwen2ForCausalLM(Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=16,
                                           max_window_layers=0)).eval()}
    for reason, model in models.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="asyncrl.engines.torch_engine"):
            engine = TorchEngine(model, NO_EOS)
        assert engine.decoder is None
        notices = [r.getMessage() for r in caplog.records]
        assert len(notices) == 1 and "transformers' forward, the slower path" in notices[0] and reason in notices[0]
        out = engine.generate_window_sync([seq(0)], 6, SamplingParams())[0]
        np.testing.assert_allclose(out.logprobs, teacher_forced(model, PROMPTS[0], out.token_ids.tolist(),
                                                                SamplingParams()), atol=1e-4)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="asyncrl.engines.torch_engine"):
        assert TorchEngine(family_model("qwen3"), NO_EOS).decoder is not None
    assert not caplog.records
