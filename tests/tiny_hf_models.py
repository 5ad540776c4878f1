"""Tiny random Hugging Face models that the real-engine tests save with transformers and load into
SGLang or vLLM (tests/test_sglang_real.py, tests/test_vllm_real.py), beside the learner's copy."""

from __future__ import annotations

import torch

from asyncrl.models.loading import build_tiny_tokenizer


def tiny_qwen2(seed: int = 0, hidden_size: int = 64):
    """A random Qwen2 over the tiny character tokenizer, with EOS made rare (~0.6% a token at T=1,
    ~2% at T=3) so that long requests stay long and EOS still comes at a hot temperature: residual
    dimension 0 is held at 50 (every embedding carries it, no layer writes it) and EOS's logit reads
    it with weight -0.5. Four heads: `hidden_size` 128 gives vLLM's CPU attention a head size it
    takes (32; it has no kernel for 16)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tiny_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False, initializer_range=0.2, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).float().eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 50.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[tokenizer.eos_token_id, 0] = -0.5
    return model, tokenizer


def perturbed(model, seed: int):
    """Other weights of the same shapes (attention and MLP inputs moved; dimension 0 left alone)."""
    from transformers import Qwen2ForCausalLM

    other = Qwen2ForCausalLM(model.config).float().eval()
    other.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in other.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")):
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
    return other
