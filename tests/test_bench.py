"""The benchmarks' measuring parts on tiny sizes: they run, move every byte, and report sane figures
(the figures themselves live in docs/benchmarks.md, never in assertions on speed)."""

import pytest
import torch

from asyncrl.bench import broadcast, learner, mailbox


def test_both_weight_paths_move_every_byte_of_the_model_and_report_against_memcpy(ray_session):
    result = broadcast.measure("tiny", rounds=2, bucket_mb=1)
    shapes = broadcast.shapes_of("tiny")
    for path in ("shm", "group"):
        r = result[path]
        assert r["bytes"] == sum(torch.Size(s).numel() * 4 for s, _ in shapes.values())
        assert r["parameters"] > 100_000 and r["rounds"] == 2
        # Checksums are compared inside (the receiver's model equals the sender's); timings paired.
        assert r["seconds_per_update_median"] > 0 and r["memcpy_s_median"] > 0 and r["memcpy_bandwidth_share"] > 0
    assert result["group"]["buckets"] >= 1
    assert "| tiny | shm |" in broadcast.report({"tiny": result})


def test_half_billion_model_shapes_without_allocating():
    shapes = broadcast.shapes_of("0.5b")
    params = sum(torch.Size(s).numel() for s, _ in shapes.values())
    assert 480e6 < params < 500e6  # Qwen2.5-0.5B: 494M with tied embeddings
    shapes = broadcast.shapes_of("1.5b")
    assert 1.50e9 < sum(torch.Size(s).numel() for s, _ in shapes.values()) < 1.56e9  # Qwen2.5-1.5B: 1.54B


def test_the_learner_benchmark_times_the_learners_own_step_in_each_precision():
    result = learner.run(quick=True)
    assert {"cpu_fp32", "cpu_bf16", "precision", "optimizer"} <= set(result)
    optimizer = result["optimizer"]
    assert optimizer["parameters"] > 0 and optimizer["adamw_default_s"] > 0 and optimizer["adamw_fused_s"] > 0
    for name, r in result.items():
        if name not in ("precision", "optimizer", "lora_memory"):  # the steps' timings; the others: bf16 against fp32, AdamW
            assert r["trained_tokens_per_s"] > 0 and r["policy_updates"] >= 1 and r["rounds"] == 2
    assert result["cpu_fp32"]["speedup_over_cpu_fp32"] == 1.0
    gap = result["precision"]
    assert gap["trained_tokens"] > 0 and 0 <= gap["logprob_gap_mean"] <= gap["logprob_gap_max"]
    assert 0.9 < gap["grad_cosine_bf16_fp32"] <= 1.0 + 1e-6  # bf16 autocast points the same way
    assert "| cpu, bf16 |" in learner.report(result) and "fused (the learners')" in learner.report(result)
    # LoRA (rank 32 on every linear layer) against full fine-tuning: fewer trained parameters, less Adam state.
    memory = result["lora_memory"]
    assert 0 < memory["lora_r32"]["trainable_parameters"] < memory["full"]["trainable_parameters"]
    assert memory["lora_r32"]["optimizer_state_mb"] <= memory["full"]["optimizer_state_mb"]
    assert "lora_r32: " in learner.report(result)


def test_mailbox_across_ray_msgspec_and_pickle(ray_session):
    result = mailbox.run(sizes={256: 64}, rounds=1)
    row = result["256_tokens"]
    for key in ("in_process_segments_per_s", "ray_msgspec_segments_per_s", "ray_pickle_segments_per_s"):
        assert row[key] > 0
    assert row["segment_bytes"] > 256 * 4 and row["ray_ratio_msgspec_over_pickle_median"] > 0
    assert "256 tokens" in mailbox.report(result)


@pytest.mark.slow
def test_the_compile_benchmark_times_the_engines_own_decode_step_eager_and_compiled():
    """`load_tests/engine_compile.py` on the tiny model: the compiled variant decodes the same
    tokens to the same logits as eager (a compiled step that computed something else would not be
    a comparison). Slow (`make test-slow`): compiling costs 50 s of CI for a measurement whose answer
    is that the engine stays eager. The frozen-weights variant, whose only difference is
    inductor's `freezing` switch, costs another compile and is left to the script's own runs."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "load_tests"))
    import engine_compile

    variants = ("eager", "compiled")
    rows = engine_compile.measure("tiny", [2], context=16, tokens=8, variants=variants)
    assert set(rows) == {(variant, 2) for variant in variants}
    for compiling_s, step_s, logit_gap in rows.values():
        assert compiling_s > 0 and step_s > 0 and logit_gap < 0.05  # bf16 logits of a tiny random model
    assert "| 2 |" in engine_compile.report(rows, [2])


def test_the_engine_benchmark_times_distinct_prompts_and_grpo_groups_against_generate(monkeypatch, tmp_path):
    """`asyncrl bench engine --quick` on the tiny model (SGLang's and vLLM's columns skipped: no
    environment at the root they are pointed at): every row has both clocks for the engine and `generate`, and the
    last row is the batch a GRPO generator runs, rows sharing their prompts."""
    from asyncrl.bench import engine

    monkeypatch.setenv("ASYNCRL_SGLANG_ROOT", str(tmp_path))
    monkeypatch.setenv("ASYNCRL_VLLM_ROOT", str(tmp_path))
    result = engine.run(quick=True, overrides=["model=tiny", "task=tiny"])
    assert list(result["batches"]) == ["batch_1", "batch_4", "groups_4"]
    groups = result["batches"]["groups_4"]
    assert groups["batch"] == 4 and groups["samples_per_prompt"] == 2
    for row in result["batches"].values():
        for variant in ("engine", "engine_fp32", "generate"):
            assert row[f"{variant}_tokens_per_s"] > 0 and row[f"{variant}_tokens_per_cpu_s"] > 0
        assert row["engine_over_generate"] > 0 and row["engine_over_generate_cpu"] > 0
    assert result["families"]["families"] == {"llama": True, "qwen2": True, "qwen3": True}
    assert "missing" in result["sglang"]["skipped"] and "make vllm" in result["vllm"]["skipped"]
    text = engine.report(result)
    assert "| 4 (2 prompts x 2) |" in text and "| 1 |" in text


def test_the_int8_benchmark_measures_speed_and_the_shift_of_each_rounding():
    """`load_tests/int8_products.py` on the tiny model: every dtype is timed at every row count, every
    variant's shift from fp32 is measured, and each variant rounds what it says it rounds (int8
    weights keep at most 255 levels a row, within half a step; per-row activations 256 levels)."""
    import os
    import sys

    import torch

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "load_tests"))
    import int8_products

    result = int8_products.measure(["model=tiny", "task=tiny"], prompts=2, new_tokens=8)
    assert set(result["speed"]) == set(int8_products.ROWS)
    assert all(s > 0 for row in result["speed"].values() for s in row.values())
    assert set(result["shift"]) == set(int8_products.VARIANTS)
    assert all(0 < s["logprob_change_mean"] <= s["logprob_change_max"] for s in result["shift"].values())
    assert "| int8 W8A8 per row |" in int8_products.report(result)

    layer = torch.nn.Linear(64, 8)
    rounded = int8_products.variant_model(torch.nn.Sequential(layer), "int8 weights")[0].weight.detach()
    step = layer.weight.detach().abs().amax(1, keepdim=True) / 127
    assert all(len(row.unique()) <= 255 for row in rounded)
    assert ((rounded - layer.weight.detach()).abs() <= step / 2 + 1e-7).all()
    assert not torch.equal(rounded, layer.weight.detach())
    x = torch.randn(3, 1000)
    (quantized,) = int8_products._int8_rows(None, (x,))
    assert all(len(row.unique()) <= 256 for row in quantized)
    assert ((quantized - x).abs() <= (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / 255 / 2 + 1e-6).all()


def test_the_moe_benchmark_measures_replay_decode_and_route_bytes():
    """`asyncrl bench moe` on a few rows: where bf16 flips a route, replay brings the learner's
    log-probs closer to the engine's; the
    float32 engine is the learner exactly; the MoE decoder is the engine's own; a route costs its bytes."""
    import numpy as np

    from asyncrl.bench import moe

    model = moe.tiny_moe()
    prompts = moe._prompts(16, model.config.vocab_size)
    bf16 = moe.drift(model, torch.bfloat16, prompts, 16)
    flipped = bf16["no_replay"]["router_mismatch"]
    if flipped:  # (bf16 rounds alike on every CPU here, but a flip is the rounding's to give)
        assert bf16["replay"]["rollout_kl_k3"] < bf16["no_replay"]["rollout_kl_k3"]
    fp32 = moe.drift(model, torch.float32, prompts, 16)
    assert fp32["replay"]["router_mismatch"] == 0 and fp32["replay"]["rollout_kl_k3"] < 1e-8
    rows = moe.decode_rates(model, (2,), 4, 1)
    assert rows[0]["engine_tokens_per_s"] > 0 and rows[0]["generate_tokens_per_s"] > 0
    size = moe.route_bytes(model, 8)
    assert size["per_token_here"] == moe.LAYERS * moe.TOP_K and size["per_token_qwen3_30b_a3b"] == 384
    assert size["segment_bytes_with_routes"] - size["segment_bytes_without"] >= 8 * size["per_token_here"]
    assert np.isfinite(bf16["no_replay"]["rollout_kl_k3"])
