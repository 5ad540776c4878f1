"""LoRA (`model.lora_rank`) on a tiny random Qwen3-MoE directory, routing replay on: what `all-linear`
adapts (attention; not the experts, 3-D parameters, nor the routers, which replay forces), learner
steps that move the adapter alone, and the embedded engine, merging each version into its base,
scoring as the learner in float32. The fused experts adapted when named (`experts.gate_up_proj`,
`experts.down_proj`, peft's `target_parameters`): our merge against peft's own forward and its
`ParamWrapper.get_delta_weight` on the three families, the engine after learner steps, a saved
adapter's export and peft's loading of it, and the names refused (routers, nothing selected). Seconds."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config import ConfigError, compose
from asyncrl.engines.generation import build_engine
from asyncrl.learning.rank import build_policy_rank
from asyncrl.learning.tensors import collate
from asyncrl.models.loading import load_policy
from asyncrl.weights import lora, lora_experts
from asyncrl.weights.sync import AdapterSpec
from engine_checks import PROMPTS, seq
from test_engine_moe import moe_model
from test_lora import random_b
from test_routing_replay import PARAMS, learner_logprobs, max_gap, rows_of, save_moe_directory

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
EXPERTS = "model.target_modules=[experts.gate_up_proj,experts.down_proj]"
IDS = torch.tensor([[3, 5, 7, 9, 11, 13], [4, 6, 8, 10, 12, 14]])


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
    # Qwen2-MoE: its shared expert and that expert's gate are linear layers, adapted; the router is not.
    leaves = {n.split("layers.0.")[1] for n in lora.adaptable_modules(moe_model("qwen2_moe")) if "layers.0." in n}
    assert leaves == {*(f"self_attn.{m}" for m in ATTENTION), "mlp.shared_expert_gate",
                      *(f"mlp.shared_expert.{m}" for m in ("gate_proj", "up_proj", "down_proj"))}


def two_steps(rank, engine, spec: AdapterSpec, prompts) -> set[str]:
    """Two learner steps on the engine's samples, each version's adapter loaded into the engine as
    the generators receive it; the names of the learner's parameters that moved."""
    before = {n: p.detach().clone() for n, p in rank.lm.named_parameters()}
    for version in (1, 2):
        rows = rows_of(prompts, engine.generate_window_sync([seq(i) for i in range(len(prompts))], 6, PARAMS))
        metrics = rank.step(rows)
        assert metrics["grad_norm"] > 0 and metrics["router_replayable"] > 0
        engine.load_adapter(rank.delivered_parameters(), spec, version)
    return {n for n, p in rank.lm.named_parameters() if not torch.equal(p, before[n])}


def test_learner_steps_move_the_adapter_alone_and_the_merged_engine_scores_as_the_learner(tmp_path):
    config = lora_config(save_moe_directory(tmp_path / "moe"), "sampling.temperature=1.0")
    rank, _ = build_policy_rank(config.model, config.algorithm, config.policy, config.engine, config.sampling, 0)
    engine, _ = build_engine(config.model, dtype=torch.float32)
    spec = AdapterSpec(config.model.lora_rank, config.model.lora_alpha)
    prompts = PROMPTS[:4]
    moved = two_steps(rank, engine, spec, prompts)
    assert moved and all(lora.is_adapter(n) for n in moved)  # experts, routers, attention's base: unmoved
    # The engine's weights: its base merged with version 2's adapter; its log-probs the learner's, replayed.
    rows = rows_of(prompts, engine.generate_window_sync([seq(i) for i in range(len(prompts))], 6, PARAMS))
    collated = collate(rows, 0)
    logp = learner_logprobs(rank.lm, collated, replay=True)
    assert max_gap(logp, collated) < 1e-4
    base, _ = build_engine(config.model, dtype=torch.float32)
    assert max_gap(learner_logprobs(base.model, collated, replay=True), collated) > 1e-3  # the adapter moved


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_expert_adapters_merge_as_peft_computes_them(family):
    """The fused experts alone adapted: peft's own forward of the adapted model is the base model's
    with our merged weights (learner side, `merged_weights`, and generator side, `AdapterMerger`), and
    our merge is peft's `ParamWrapper.get_delta_weight` on every expert parameter."""
    config = compose(["model=tiny", "model.lora_rank=4", "model.lora_alpha=8", EXPERTS])
    lm = moe_model(family)
    peft_model = lora.wrap(lm, config.model)
    random_b(lm)
    wrapped = lora_experts.wrapped_parameters(lm)
    fused = [n for n, p in moe_model(family).named_parameters() if p.dim() == 3]  # the sparse layers' experts
    assert fused and sorted(wrapped.values()) == sorted(fused)
    assert all(lora.module_of(n) in wrapped for n, _ in lm.named_parameters() if lora.is_adapter(n))  # experts alone
    scaling = 8 / 4
    state = {name: p.detach() for name, p in lm.named_parameters()}
    adapter = dict(lora.adapter_tensors(lm.named_parameters(), wrapped))
    assert set(adapter) == {f"{p}.lora_{k}" for p in wrapped.values() for k in "AB"}
    for module_name, module in lm.named_modules():
        if module_name in wrapped:  # its base parameter [E, out, in]; peft's delta alone
            base = module.get_param().detach()
            ours = lora_experts.merge_experts(base, adapter[wrapped[module_name] + ".lora_A"],
                                              adapter[wrapped[module_name] + ".lora_B"], scaling) - base
            assert ours.abs().max() > 0.01
            torch.testing.assert_close(ours, module.get_delta_weight(lora.ADAPTER), atol=1e-6, rtol=0)
    with torch.no_grad():
        peft_logits = peft_model(input_ids=IDS).logits
        with peft_model.disable_adapter():
            base_logits = peft_model(input_ids=IDS).logits
        plain = moe_model(family)  # the same base weights (the same seed)
        merged = lora.merged_weights(state, scaling, wrapped)
        assert set(merged) == {n for n, _ in plain.named_parameters()}
        plain.load_state_dict(merged)
        merged_logits = plain(input_ids=IDS).logits
        generator = moe_model(family)
        merger = lora.AdapterMerger.of(dict(generator.named_parameters()), lora.adapter_modules(adapter))
        served = dict(merger.merged(adapter, scaling))
        assert set(served) == set(wrapped.values())  # the engine's own names, no `.weight`
        for name, tensor in served.items():
            assert torch.equal(tensor, merged[name]), name
    assert (peft_logits - base_logits).abs().max() > 0.1  # the experts' adapter matters
    torch.testing.assert_close(merged_logits, peft_logits, atol=1e-5, rtol=0)


def test_the_expert_merge_is_computed_in_float32_and_returned_in_the_weight_dtype():
    w = torch.zeros(2, 3, 4)  # E = 2, out = 3, in = 4; r = 2
    a, b = torch.arange(16.0).reshape(4, 4), torch.arange(12.0).reshape(3, 4)
    # peft's layout: A_e = a.reshape(E, r, in)[e] (rows in blocks), B_e = b.reshape(out, r, E)[:, :, e] (interleaved).
    for e in (0, 1):
        a_e, b_e = a[2 * e:2 * e + 2], b[:, [e, e + 2]]
        assert torch.equal(lora_experts.merge_experts(w, a, b, 0.5)[e], 0.5 * b_e @ a_e)
    w16 = torch.ones(1, 1, 1, dtype=torch.bfloat16)
    merged = lora_experts.merge_experts(w16, torch.tensor([[2.0 ** -9]]), torch.tensor([[1.0]]), 1.0)
    assert merged.dtype == torch.bfloat16 and float(merged) == 1.0  # one rounding of the float32 sum
    with pytest.raises(ValueError, match="does not fit experts"):
        lora_experts.merge_experts(w, a[:, :3], b, 1.0)


def test_learner_steps_move_the_expert_adapters_and_the_merged_engine_scores_as_the_learner(tmp_path):
    config = lora_config(save_moe_directory(tmp_path / "moe"), "sampling.temperature=1.0",
                         "model.target_modules=[q_proj,experts.gate_up_proj,experts.down_proj]")
    rank, _ = build_policy_rank(config.model, config.algorithm, config.policy, config.engine, config.sampling, 0)
    engine, _ = build_engine(config.model, dtype=torch.float32)
    assert engine.decoder is not None and engine.decoder.experts == 8  # the embedded MoE decoder
    base = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    spec = AdapterSpec(config.model.lora_rank, config.model.lora_alpha)
    prompts = PROMPTS[:4]
    moved = two_steps(rank, engine, spec, prompts)
    assert moved and all(lora.is_adapter(n) for n in moved)
    assert {lora.module_of(n) for n in moved if ".lora_B." in n} == set(rank.experts) | {
        f"model.layers.{i}.self_attn.q_proj" for i in (0, 1)}  # every expert adapter learnt
    adapter = dict(rank.delivered_parameters())
    weights = dict(engine.model.named_parameters())
    for name in rank.experts.values():  # the engine's fused experts: its base merged with version 2
        assert not torch.equal(weights[name], base[name])
        assert torch.equal(weights[name], lora_experts.merge_experts(base[name], adapter[name + ".lora_A"],
                                                                     adapter[name + ".lora_B"], spec.scaling))
        assert torch.equal(rank.snapshot()[name], weights[name])  # the learner's merged view
    rows = rows_of(prompts, engine.generate_window_sync([seq(i) for i in range(len(prompts))], 6, PARAMS))
    collated = collate(rows, 0)
    assert max_gap(learner_logprobs(rank.lm, collated, replay=True), collated) < 1e-4
    base_engine, _ = build_engine(config.model, dtype=torch.float32)
    assert max_gap(learner_logprobs(base_engine.model, collated, replay=True), collated) > 1e-3


def test_a_saved_expert_adapter_exports_and_loads_in_peft_with_its_logits(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = lora_config(save_moe_directory(tmp_path / "moe"), "model.target_modules=[q_proj,experts.down_proj]")
    rank, tokenizer = build_policy_rank(config.model, config.algorithm, config.policy, config.engine,
                                        config.sampling, 0)
    random_b(rank.lm)
    rank.save_policy(str(tmp_path / "policy"), rank.state()[0], tokenizer)
    with torch.no_grad():
        expected = rank.peft_model(input_ids=IDS).logits
        with rank.peft_model.disable_adapter():
            assert (expected - rank.peft_model(input_ids=IDS).logits).abs().max() > 0.1
    assert set(rank.read_policy(str(tmp_path / "policy"))) == {n for n, _ in rank.lm.named_parameters()
                                                               if lora.is_adapter(n)}
    merged, _ = lora.merged_model(str(tmp_path / "policy"))
    lora.export(str(tmp_path / "policy"), str(tmp_path / "merged"), adapter_only=False)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    adapted = PeftModel.from_pretrained(load_policy(config.model)[0], tmp_path / "policy")
    assert sum(type(m).__name__ == "ParamWrapper" for m in adapted.modules()) == 2  # down_proj of each layer
    with torch.no_grad():
        for model in (merged, exported, adapted):
            torch.testing.assert_close(model(input_ids=IDS).logits, expected, atol=1e-5, rtol=0)


def test_routers_and_names_that_select_nothing_are_refused(tmp_path):
    directory = save_moe_directory(tmp_path / "moe")
    for named in ("gate", "mlp.gate"):
        with pytest.raises(ConfigError, match=rf"model.target_modules: {named} names the routers of "
                                              r"Qwen3MoeForCausalLM's mixture-of-experts blocks .*LoRA never adapts a "
                                              r"router: routing replay forces the rollout's experts"):
            lora.check_targets(lora_config(directory, f"model.target_modules=[q_proj,{named}]").model)
    # A bare gate_up_proj selects nothing: the experts are named with their module.
    for named in ("gate_up_proj", "experts.up_proj", "experts"):
        with pytest.raises(ConfigError, match=rf"no linear module named {named}; the modules LoRA can adapt are "
                                              r"experts.down_proj, experts.gate_up_proj, k_proj, lm_head, o_proj, "
                                              r"q_proj, v_proj; on a mixture-of-experts model LoRA adapts the experts "
                                              r"when named with their module .* never the routers"):
            lora.check_targets(lora_config(directory, f"model.target_modules=[{named}]").model)
    assert lora.check_targets(lora_config(directory, "model.target_modules=[layers.1.mlp.experts.down_proj]").model) == [
        "model.layers.1.mlp.experts.down_proj"]
    with pytest.raises(ConfigError, match="LoRA on the experts needs the embedded engine"):
        lora.check_targets(lora_config(directory, EXPERTS).model, "sglang")
    # Qwen2-MoE (layer 1 dense): a bare down_proj is a linear layer's (the shared expert's, the dense MLP's),
    # experts.down_proj the fused experts'.
    qwen2 = moe_model("qwen2_moe")
    assert lora.resolve_targets(qwen2, ["down_proj"]) == ["model.layers.0.mlp.shared_expert.down_proj",
                                                          "model.layers.1.mlp.down_proj"]
    assert lora.resolve_targets(qwen2, ["experts.down_proj"]) == ["model.layers.0.mlp.experts.down_proj"]
