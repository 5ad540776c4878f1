"""LoRA (`model.lora_rank`) on a tiny random Qwen3-MoE directory, routing replay on: what `all-linear`
adapts (attention; never the experts, 3-D parameters, nor the routers, which replay forces), learner
steps that move the adapter alone, and the embedded engine, merging each version into its base,
scoring as the learner in float32. Seconds."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config import ConfigError, compose
from asyncrl.engines.generation import build_engine
from asyncrl.learning.rank import build_policy_rank
from asyncrl.learning.tensors import collate
from asyncrl.weights import lora
from asyncrl.weights.sync import AdapterSpec
from engine_checks import PROMPTS, seq
from test_engine_moe import moe_model
from test_routing_replay import PARAMS, learner_logprobs, max_gap, rows_of, save_moe_directory

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def lora_config(directory, *extra):
    return compose(["model=tiny", "task=tiny", "algorithm=grpo", "model.source=hf", f"model.path={directory}",
                    "model.lora_rank=4", "model.lora_alpha=8", "policy.optimizer.lr=0.05", *extra])


def test_all_linear_adapts_attention_not_the_experts_nor_the_routers(tmp_path):
    config = lora_config(save_moe_directory(tmp_path / "moe"))
    attention = [f"model.layers.{i}.self_attn.{m}" for i in (0, 1) for m in ATTENTION]
    assert lora.check_targets(config.model) == attention
    rank, _ = build_policy_rank(config.model, config.algorithm, config.policy, config.engine, config.sampling, 0)
    assert sorted({lora.module_of(n) for n, _ in rank.lm.named_parameters() if lora.is_adapter(n)}) == sorted(attention)
    assert rank.objective.router_replay  # auto: on, for a mixture-of-experts model
    # peft alone would adapt the fused experts and the routers (its target_parameters): asyncrl names its modules.
    assert not any(isinstance(m, torch.nn.Module) and type(m).__name__ == "ParamWrapper" for m in rank.lm.modules())
    for named in ("experts.gate_up_proj", "gate"):
        with pytest.raises(ConfigError, match=rf"no linear module named {named}; the modules LoRA can adapt are "
                                              r"k_proj, lm_head, o_proj, q_proj, v_proj; on a mixture-of-experts model LoRA "
                                              r"adapts neither the experts .* nor the routers"):
            lora.check_targets(lora_config(tmp_path / "moe", f"model.target_modules=[{named}]").model)
    # Qwen2-MoE: its shared expert and that expert's gate are linear layers, adapted; the router is not.
    leaves = {n.split("layers.0.")[1] for n in lora.adaptable_modules(moe_model("qwen2_moe")) if "layers.0." in n}
    assert leaves == {*(f"self_attn.{m}" for m in ATTENTION), "mlp.shared_expert_gate",
                      *(f"mlp.shared_expert.{m}" for m in ("gate_proj", "up_proj", "down_proj"))}


def test_learner_steps_move_the_adapter_alone_and_the_merged_engine_scores_as_the_learner(tmp_path):
    config = lora_config(save_moe_directory(tmp_path / "moe"), "sampling.temperature=1.0")
    rank, _ = build_policy_rank(config.model, config.algorithm, config.policy, config.engine, config.sampling, 0)
    engine, _ = build_engine(config.model, dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in rank.lm.named_parameters()}
    spec = AdapterSpec(config.model.lora_rank, config.model.lora_alpha)
    prompts = PROMPTS[:4]
    for version in (1, 2):
        rows = rows_of(prompts, engine.generate_window_sync([seq(i) for i in range(len(prompts))], 6, PARAMS))
        metrics = rank.step(rows)
        assert metrics["grad_norm"] > 0 and metrics["router_replayable"] > 0
        engine.load_adapter(lora.adapter_tensors(rank.lm.named_parameters()), spec, version)
    moved = {n for n, p in rank.lm.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all(lora.is_adapter(n) for n in moved)  # experts, routers, attention's base: unmoved
    # The engine's weights: its base merged with version 2's adapter; its log-probs the learner's, replayed.
    rows = rows_of(prompts, engine.generate_window_sync([seq(i) for i in range(len(prompts))], 6, PARAMS))
    collated = collate(rows, 0)
    logp = learner_logprobs(rank.lm, collated, replay=True)
    assert max_gap(logp, collated) < 1e-4
    base, _ = build_engine(config.model, dtype=torch.float32)
    assert max_gap(learner_logprobs(base.model, collated, replay=True), collated) > 1e-3  # the adapter moved
