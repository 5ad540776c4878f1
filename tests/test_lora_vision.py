"""LoRA on a vision-language model (`model.lora_rank` with `model=tiny_vl`, a random Qwen2-VL, or a
Qwen2-VL directory): `all-linear` is the language model's projections alone (never the vision tower
nor its merger); a learner step on image prompts moves the adapter alone, and the embedded engine,
given the adapter as the learner sends it, scores as the learner; a checkpoint resumes, and exports
(merged, and `--adapter`) with the image processor; a short real run. Real torch models and peft."""

from __future__ import annotations

import asyncio
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from asyncrl.config import ConfigError, compose
from asyncrl.data.files import load_examples
from asyncrl.data.tasks import encode_prompt
from asyncrl.engines.base import SamplingParams
from asyncrl.engines.generation import build_engine, sequence_input
from asyncrl.learning.rank import build_policy_rank
from asyncrl.learning.scoring import PolicyForward, token_logprobs
from asyncrl.messages.structs import FinishReason, Segment, TrainingRow, int32_array
from asyncrl.models.loading import load_policy
from asyncrl.models.vision import image_prep
from asyncrl.weights import lora, transport
from asyncrl.weights.sync import plan_buckets

VL = ["model=tiny_vl", "task=shapes", "algorithm=grpo"]
LORA = ["model.lora_rank=8", "model.lora_alpha=16", "policy.compute.precision=fp32"]
PROJECTIONS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj"]


@pytest.fixture
def store(tmp_path, monkeypatch):
    """Images kept under this test's directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path


def language_projections(layers: int) -> list[str]:
    return [f"model.language_model.layers.{i}.{p}" for i in range(layers) for p in PROJECTIONS]


def vl_directory(config, directory) -> str:
    """tiny_vl saved as a Hugging Face directory (weights, tokenizer, image processor)."""
    lm, tokenizer = load_policy(config.model)
    lm.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    image_prep(config.model, tokenizer).processor.save_pretrained(directory)
    return str(directory)


def test_all_linear_on_a_qwen2_vl_is_its_language_model_s_projections_alone(store):
    config = compose([*VL, *LORA])
    expected = language_projections(config.model.num_layers)
    lm, _ = load_policy(config.model)
    tower = [n for n, m in lm.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("model.visual.")]
    assert any(".merger." in n for n in tower) and any(".blocks." in n for n in tower)  # there to leave out
    assert lora.resolve_targets(lm, "all-linear") == expected
    assert lora.check_targets(config.model) == expected  # at start-up, on the meta device
    lora.wrap(lm, config.model)
    adapted = sorted({lora.module_of(n) for n, _ in lm.named_parameters() if lora.is_adapter(n)})
    assert adapted == sorted(expected)
    assert {n for n, p in lm.named_parameters() if p.requires_grad} == {
        n for n, _ in lm.named_parameters() if lora.is_adapter(n)}  # the tower and the head frozen

    # A Qwen2-VL directory: the same modules, at start-up and in the learner's wrap.
    hf = compose(["model.source=hf", f"model.path={vl_directory(config, store / 'vl')}", "model.use_chat_template=false",
                  "task=shapes", "algorithm=grpo", *LORA])
    assert lora.check_targets(hf.model) == expected
    loaded, _ = load_policy(hf.model)
    lora.wrap(loaded, hf.model)
    assert sorted({lora.module_of(n) for n, _ in loaded.named_parameters() if lora.is_adapter(n)}) == sorted(expected)

    # By name: the language model's (and the untied head when named); a vision tower's name is refused.
    fresh, _ = load_policy(config.model)
    assert lora.resolve_targets(fresh, ["q_proj", "lm_head"]) == [
        f"model.language_model.layers.{i}.self_attn.q_proj" for i in range(config.model.num_layers)] + ["lm_head"]
    with pytest.raises(ConfigError, match="no linear module named qkv; .* never the vision tower's"):
        lora.resolve_targets(fresh, ["qkv"])
    # The tower trained whole beside an adapter would reach no generator: refused at start-up.
    with pytest.raises(ConfigError, match="model.freeze_vision_tower=false .* needs model.lora_rank=0"):
        compose([*VL, *LORA, "model.freeze_vision_tower=false"])


def _image_prompts(config, tokenizer, lm, n: int):
    prep = image_prep(config.model, tokenizer, lm)
    return [(encode_prompt(ex, tokenizer, False, images=prep), prep.processed(ex.images))
            for ex in load_examples(config.task, "train", n)]


def _rows(seqs, outs, advantages) -> list[TrainingRow]:
    rows = []
    for s, o, a in zip(seqs, outs, advantages):
        segment = Segment(prompt_id="p", sample_idx=0, window=0, group_id="p", prompt_token_ids=int32_array(s.prompt_ids),
                          prior_response_ids=int32_array([]), prior_versions=int32_array([]),
                          new_token_ids=int32_array(o.token_ids), new_logprobs=o.logprobs.astype(np.float32),
                          new_versions=int32_array([0] * len(o.token_ids)), finished=True,
                          finish_reason=FinishReason.EOS, images=s.images)
        rows.append(TrainingRow(segment=segment, score=a, advantages=np.full(len(o.token_ids), a, np.float32)))
    return rows


def _learner_logprobs(lm, seqs, outs) -> np.ndarray:
    """The learner's forward's log-probs of the engine's tokens, with the rows' images."""
    length = max(len(s.prompt_ids) + len(o.token_ids) for s, o in zip(seqs, outs))
    ids = torch.zeros((len(seqs), length), dtype=torch.long)
    mask, targets, trained = torch.zeros_like(ids), torch.zeros_like(ids), torch.zeros_like(ids, dtype=torch.bool)
    for i, (s, o) in enumerate(zip(seqs, outs)):
        row = np.concatenate([s.prompt_ids, o.token_ids]).astype(np.int64)
        ids[i, :len(row)], mask[i, :len(row)] = torch.from_numpy(row), 1
        start = len(s.prompt_ids) - 1
        targets[i, start:start + len(o.token_ids)] = torch.from_numpy(o.token_ids.astype(np.int64))
        trained[i, start:start + len(o.token_ids)] = True
    with torch.no_grad():
        logp, _ = token_logprobs(PolicyForward(lm), ids, mask, targets, 1.0, positions=trained,
                                 images=[s.images for s in seqs])
    return logp[trained].numpy()


def test_a_learner_step_on_images_moves_the_adapter_alone_and_the_merged_engine_scores_as_the_learner(store):
    config = compose([*VL, *LORA, "policy.optimizer.lr=0.05", "sampling.temperature=1.0"])
    rank, tokenizer = build_policy_rank(config.model, config.algorithm, config.policy, config.engine,
                                        config.sampling, 0)
    engine, _ = build_engine(config.model, dtype=torch.float32)
    base = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    prompts = _image_prompts(config, tokenizer, rank.lm, 2)
    params = SamplingParams.of(config.sampling)
    seqs = [sequence_input(ids, j, 4, images=refs) for ids, refs in prompts for j in range(2)]
    rows = _rows(seqs, engine.generate_window_sync(seqs, 4, params), (1.0, -1.0, -1.0, 1.0))
    before = {n: p.detach().clone() for n, p in rank.lm.named_parameters()}
    for _ in range(2):
        metrics = rank.step(rows)
    assert metrics["vision_s"] > 0 and metrics["grad_norm"] > 0
    moved = {n for n, p in rank.lm.named_parameters() if not torch.equal(p, before[n])}
    assert any(".lora_B." in n for n in moved) and all(lora.is_adapter(n) for n in moved), sorted(moved)[:5]
    assert {id(p) for group in rank.optimizer.param_groups for p in group["params"]} == {
        id(p) for n, p in rank.lm.named_parameters() if lora.is_adapter(n)}

    # The version as the learner sends it (shared memory): the adapter of the language model alone.
    sender = transport.WeightSender(plan_buckets(rank.delivered_parameters(), 1 << 20), rank.adapter)
    try:
        delivery, payload = sender.delivery(sender.stage(1, rank.delivered_parameters(), None, {"shm"}), "shm")
        assert all(s.name.startswith("model.language_model.") and s.name.endswith((".lora_A", ".lora_B"))
                   for s in payload.tensors)
        transport.load(engine, delivery, payload, None)
    finally:
        sender.slots.close()
    assert engine.weight_version == 1
    changed = {n for n, p in engine.model.named_parameters() if not torch.equal(p, base[n])}
    assert changed == {m + ".weight" for m in language_projections(config.model.num_layers)}  # tower, head as base

    seqs = [sequence_input(ids, 10 + j, 6, images=refs) for ids, refs in prompts for j in range(3)]
    outs = engine.generate_window_sync(seqs, 6, params)
    engine_lp = np.concatenate([o.logprobs for o in outs])
    learner_lp = _learner_logprobs(rank.lm, seqs, outs)
    assert np.abs(engine_lp - learner_lp).max() < 1e-4
    base_model, _ = load_policy(config.model)
    assert np.abs(_learner_logprobs(base_model, seqs, outs) - learner_lp).max() > 0.05  # the adapter matters (0.69)


def test_a_lora_vl_checkpoint_resumes_and_exports_merged_and_as_adapter_with_the_image_processor(store):
    from peft import PeftModel
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from actors.policy_learner import CheckpointPolicy, build_policy_learner
    from asyncrl.cli import main
    from asyncrl.messages.mailbox import InProcessMailbox

    config = compose([*VL, *LORA, "policy.optimizer.lr=0.05"])
    run = store / "run"

    def learner():
        return build_policy_learner(config.model, config.algorithm, config.policy, config.engine, config.sampling,
                                    0, InProcessMailbox(2), checkpoints=CheckpointPolicy(str(run)))

    first = learner()
    prompts = _image_prompts(config, first.tokenizer, first.policy.lm, 2)
    seqs = [sequence_input(ids, 0, 2, images=refs) for ids, refs in prompts]
    tokens = [SimpleNamespace(token_ids=np.array([5, 1]), logprobs=np.full(2, -3.0)) for _ in seqs]  # as an engine's
    first.policy.step(_rows(seqs, tokens, (1.0, -1.0)))
    first.step = first.weight_version = 1
    path = asyncio.run(first.save_checkpoint())
    policy = os.path.join(path, "policy")
    assert lora.is_adapter_dir(policy) and os.path.exists(os.path.join(policy, "preprocessor_config.json"))
    second = learner()
    asyncio.run(second.load_checkpoint(path))
    assert second.weight_version == 1 and second.policy.optimizer_steps() == first.policy.optimizer_steps() > 0
    for (name, a), (_, b) in zip(first.model.named_parameters(), second.model.named_parameters()):
        assert torch.equal(a, b), name

    assert main(["export", str(run), str(store / "merged")]) == 0
    assert main(["export", "--adapter", str(run), str(store / "adapter")]) == 0
    for out in ("merged", "adapter"):
        processor = AutoImageProcessor.from_pretrained(store / out)
        assert type(processor).__name__ == "Qwen2VLImageProcessorPil" and processor.merge_size == 2
    merged = AutoModelForImageTextToText.from_pretrained(store / "merged")
    adapted = PeftModel.from_pretrained(load_policy(config.model)[0], store / "adapter")
    expected = _learner_logprobs(first.policy.lm, seqs, tokens)
    np.testing.assert_allclose(_learner_logprobs(merged, seqs, tokens), expected, atol=1e-5)
    np.testing.assert_allclose(_learner_logprobs(adapted.get_base_model(), seqs, tokens), expected, atol=1e-5)
    base = dict(load_policy(config.model)[0].named_parameters())
    changed = {n for n, p in merged.named_parameters() if not torch.equal(p, base[n])}
    assert changed == {m + ".weight" for m in language_projections(config.model.num_layers)}
    assert json.load(open(store / "adapter" / "adapter_config.json"))["r"] == 8


@pytest.mark.slow  # a run through Ray, 40-90 s: the engine's merge and the export are checked above without it
def test_a_short_lora_run_on_tiny_vl_keeps_its_ledger_and_exports_a_model_transformers_loads(ray_session, store):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from asyncrl.cli import main
    from asyncrl.driver import train

    run = store / "run"
    # Synchronous: step 2 trains tokens the generator drew with version 1, the adapter merged into its base.
    config = compose([*VL, "model.lora_rank=8", "engine.dtype=float32", "policy.compute.precision=fp32",
                      "policy.optimizer.lr=0.05", "trainer.synchronous=true", "algorithm.max_staleness_versions=0",
                      "trainer.total_steps=2", "trainer.prompts_per_step=2",
                      f"trainer.run_dir={run}", "trainer.wandb_mode=disabled"])
    summary = train(config, progress=False, eval_prompts=2)
    assert summary["steps"] == 2
    assert summary["final_status"]["ledger"]["problems"] == []
    records = [json.loads(line) for line in open(run / "metrics.jsonl")]
    # Each step trains tokens of the weights it holds: engine and learner agree (float32), at version 0
    # (the base) and at version 1 (the generator's merge of the first adapter).
    assert all(r["staleness_max"] == 0 and r["rollout_kl_k3"] < 1e-5 for r in records), records
    assert all(r["vision_s"] > 0 for r in records)
    assert summary["final_status"]["last_broadcast"]["bytes"] == sum(
        4 * 8 * (m.in_features + m.out_features) for n, m in load_policy(config.model)[0].named_modules()
        if n in language_projections(config.model.num_layers))  # the adapter alone travels
    assert lora.is_adapter_dir(os.path.join(summary["last_checkpoint"], "policy"))
    assert main(["export", str(run), str(store / "merged")]) == 0
    assert os.path.exists(store / "merged" / "preprocessor_config.json")
    AutoImageProcessor.from_pretrained(store / "merged")
    model = AutoModelForImageTextToText.from_pretrained(store / "merged")
    base = dict(load_policy(config.model)[0].named_parameters())
    assert not any(not torch.equal(p, base[n]) for n, p in model.named_parameters() if n.startswith("model.visual."))
