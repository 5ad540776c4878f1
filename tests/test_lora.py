"""LoRA (`model.lora_rank`, `asyncrl.weights.lora`): the merge by hand, our forward against peft's own
model, the embedded engine merging each version's adapter into its unmerged base (three versions
in a row, through the learner's own sender and the shared-memory path), a LoRA checkpoint's resume
and export, and a target module the model lacks refused at start-up. On the tiny random model:
seconds."""

from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest
import torch

from asyncrl.bench.learner import synthetic_batch
from asyncrl.config import ConfigError, compose
from asyncrl.engines.base import SamplingParams
from asyncrl.engines.generation import build_engine, sequence_input
from asyncrl.learning.rank import build_policy_rank
from asyncrl.learning.scoring import PolicyForward, response_logprobs
from asyncrl.models.loading import load_policy
from asyncrl.weights import lora, transport
from asyncrl.weights.sync import plan_buckets

LORA = ["model=tiny", "model.lora_rank=4", "model.lora_alpha=8"]
PROMPTS = [[5, 6, 7], [8, 9, 10, 11], [12, 13], [14, 15, 16, 17, 18]]
TARGETS_AND_HEAD = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def random_b(lm, seed: int = 1) -> None:
    """peft starts B at 0 (the adapter adds nothing); a trained one does not."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def test_the_merge_is_w_plus_alpha_over_r_times_b_a():
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    a = torch.tensor([[1.0, -1.0]])  # r = 1, in = 2
    b = torch.tensor([[2.0], [0.5]])  # out = 2
    # B @ A = [[2, -2], [0.5, -0.5]]; scaling alpha / r = 3 / 1 -> W + [[6, -6], [1.5, -1.5]]
    assert torch.equal(lora.merge(w, a, b, 3.0), torch.tensor([[7.0, -4.0], [4.5, 2.5]]))
    # In bf16 the sum is taken in float32 and rounded once: 1 + 2^-9 is a tie that rounds to 1.
    w16 = torch.tensor([[1.0]], dtype=torch.bfloat16)
    merged = lora.merge(w16, torch.tensor([[2.0 ** -9]]), torch.tensor([[1.0]]), 1.0)
    assert merged.dtype == torch.bfloat16 and float(merged) == 1.0
    assert float(lora.merge(w16, torch.tensor([[2.0 ** -7]]), torch.tensor([[1.0]]), 1.0)) == 1.0 + 2.0 ** -7


@pytest.mark.parametrize("targets", ["all-linear", TARGETS_AND_HEAD], ids=["all-linear", "and-the-head"])
def test_learner_forward_merged_model_and_engine_give_peft_models_logits(targets):
    config = compose([*LORA, f"model.target_modules={targets if isinstance(targets, str) else '[' + ','.join(targets) + ']'}"])
    lm, _ = load_policy(config.model)
    peft_model = lora.wrap(lm, config.model)
    random_b(lm)
    assert not any(p.requires_grad for n, p in lm.named_parameters() if not lora.is_adapter(n))
    ids = torch.tensor([[3, 5, 7, 9, 11, 13], [4, 6, 8, 10, 12, 14]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        peft_logits = peft_model(input_ids=ids, attention_mask=mask).logits
        with peft_model.disable_adapter():
            base_logits = peft_model(input_ids=ids, attention_mask=mask).logits
        learner = PolicyForward(lm)(ids, mask, selected=mask.bool())
        plain, _ = load_policy(config.model)
        state = {name: p.detach() for name, p in lm.named_parameters()}
        plain.load_state_dict(lora.merged_weights(state, 8 / 4))
        merged = plain(input_ids=ids, attention_mask=mask).logits
    assert (peft_logits - base_logits).abs().max() > 0.1  # the adapter matters
    torch.testing.assert_close(learner, peft_logits[mask.bool()], atol=1e-5, rtol=0)
    torch.testing.assert_close(merged, peft_logits, atol=1e-5, rtol=0)
    engine, _ = build_engine(config.model)
    engine.load_adapter(lora.adapter_tensors(lm.named_parameters()), lora_spec(config), 1)
    with torch.no_grad():
        torch.testing.assert_close(engine.model(input_ids=ids).logits, peft_logits, atol=1e-5, rtol=0)


def lora_spec(config):
    from asyncrl.weights.sync import AdapterSpec

    return AdapterSpec(config.model.lora_rank, config.model.lora_alpha)


def test_a_merged_engine_scores_as_the_learner_after_three_updates_in_a_row():
    """Three learner steps, each version's adapter (every linear layer and the untied head) sent as
    the learner sends it (shared memory) to an fp32 and a bf16 engine: the fp32 engine's log-probs
    are the learner's, and each engine's weights are its base merged with that version's adapter,
    never with an earlier merge."""
    config = compose([*LORA, "policy.optimizer.lr=0.02", "sampling.temperature=1.0",
                      f"model.target_modules=[{','.join(TARGETS_AND_HEAD)}]"])
    rank, tokenizer = build_policy_rank(config.model, config.algorithm, config.policy, config.engine,
                                        config.sampling, 0)
    engines = {dtype: build_engine(config.model, dtype=dtype)[0] for dtype in (torch.float32, torch.bfloat16)}
    base = {dtype: {n: p.detach().clone() for n, p in e.model.named_parameters()} for dtype, e in engines.items()}
    sender = transport.WeightSender(plan_buckets(rank.delivered_parameters(), 1 << 20), rank.adapter)
    batch = synthetic_batch(8, 6, 6, rank.lm.config.vocab_size)
    params = SamplingParams.of(config.sampling)
    try:
        for version in (1, 2, 3):
            rank.step(batch)
            staged = sender.stage(version, rank.delivered_parameters(), None, {"shm"})
            delivery, payload = sender.delivery(staged, "shm")
            assert delivery.adapter == rank.adapter and {s.name.rsplit(".", 1)[1] for s in payload.tensors} == {
                "lora_A", "lora_B"}
            for engine in engines.values():
                transport.load(engine, delivery, payload, None)
                assert engine.weight_version == version
            adapter = dict(lora.adapter_tensors(rank.lm.named_parameters()))
            for dtype, engine in engines.items():
                weights = dict(engine.model.named_parameters())
                for name in [n for n in adapter if n.endswith(".lora_A")]:
                    module = name[: -len(".lora_A")]
                    expected = lora.merge(base[dtype][module + ".weight"], adapter[module + ".lora_A"],
                                          adapter[module + ".lora_B"], rank.adapter.scaling)
                    assert torch.equal(weights[module + ".weight"], expected), (version, dtype, module)
            outs = engines[torch.float32].generate_window_sync(
                [sequence_input(p, seed, 8) for seed, p in enumerate(PROMPTS)], 8, params)
            rows = [(np.asarray(p), o.token_ids) for p, o in zip(PROMPTS, outs)]
            learner = response_logprobs(rank.lm, rows, 1.0)
            for out, expected in zip(outs, learner):
                np.testing.assert_allclose(out.logprobs, expected, atol=1e-4, rtol=0)
        base_lp = response_logprobs(build_engine(config.model)[0].model, rows, 1.0)
        assert max(np.abs(a - b).max() for a, b in zip(learner, base_lp)) > 0.05  # the adapter moved
    finally:
        sender.slots.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_learner_step_moves_the_adapter_alone_in_either_precision(precision):
    config = compose([*LORA, f"policy.compute.precision={precision}", "policy.optimizer.lr=0.01"])
    rank, _ = build_policy_rank(config.model, config.algorithm, config.policy, config.engine, config.sampling, 0)
    assert rank.objective.policy.compute.precision == precision
    before = {n: p.detach().clone() for n, p in rank.lm.named_parameters()}
    metrics = rank.step(synthetic_batch(4, 6, 6, rank.lm.config.vocab_size))
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    moved = {n for n, p in rank.lm.named_parameters() if not torch.equal(p, before[n])}
    assert moved and all(lora.is_adapter(n) for n in moved)  # the base weights never move
    assert {id(p) for group in rank.optimizer.param_groups for p in group["params"]} == {
        id(p) for n, p in rank.lm.named_parameters() if lora.is_adapter(n)}


def test_a_target_module_the_model_lacks_is_refused_at_start_up_naming_those_it_has(capsys):
    from asyncrl.cli import main

    with pytest.raises(ConfigError, match="no linear module named q_prj; the modules LoRA can adapt are "
                                          "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"):
        lora.check_targets(compose([*LORA, "model.target_modules=[q_prj]"]).model)
    assert main(["train", *LORA, "model.target_modules=[q_prj,v_proj]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no linear module named q_prj" in err[0], err
    assert lora.check_targets(compose([*LORA, "model.target_modules=[q_proj,v_proj]"]).model) == [
        f"model.layers.{i}.self_attn.{m}" for i in (0, 1) for m in ("q_proj", "v_proj")]
    assert "lm_head" not in lora.check_targets(compose(LORA).model)  # all-linear leaves the head


def test_a_head_tied_to_the_embedding_is_not_adaptable():
    from transformers import LlamaConfig, LlamaForCausalLM

    tied = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, tie_word_embeddings=True))
    with pytest.raises(ConfigError, match="no linear module named lm_head.*tied to the input embedding"):
        lora.resolve_targets(tied, ["q_proj", "lm_head"])


def test_resume_from_a_lora_checkpoint_gives_the_same_adapter_and_it_exports(tmp_path):
    from actors.policy_learner import CheckpointPolicy, build_policy_learner
    from asyncrl.cli import main
    from asyncrl.messages.mailbox import InProcessMailbox

    config = compose([*LORA, "policy.optimizer.lr=0.02"])

    def learner():
        return build_policy_learner(config.model, config.algorithm, config.policy, config.engine, config.sampling,
                                    0, InProcessMailbox(2), checkpoints=CheckpointPolicy(str(tmp_path)))

    first = learner()
    batch = synthetic_batch(4, 6, 6, first.model.config.vocab_size)
    first.policy.step(batch)
    first.step = first.weight_version = 1
    path = asyncio.run(first.save_checkpoint())
    policy_dir = os.path.join(path, "policy")
    assert lora.is_adapter_dir(policy_dir) and not any(f.startswith("model") for f in os.listdir(policy_dir))
    second = learner()
    asyncio.run(second.load_checkpoint(path))
    assert second.weight_version == 1
    for (name, a), (_, b) in zip(first.model.named_parameters(), second.model.named_parameters()):
        assert torch.equal(a, b), name
    # Adam's state: the adapter's alone, as it was.
    saved, loaded = (list(learner.policy.optimizer.state.values()) for learner in (first, second))
    assert len(loaded) == sum(1 for n, _ in first.model.named_parameters() if lora.is_adapter(n)) > 0
    for a, b in zip(saved, loaded):
        assert all(torch.equal(a[key], b[key]) for key in ("step", "exp_avg", "exp_avg_sq"))
    assert second.policy.optimizer_steps() == first.policy.optimizer_steps() > 0

    ids = torch.tensor([[3, 5, 7, 9, 11, 13]])
    with torch.no_grad():
        expected = first.model(input_ids=ids).logits
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert main(["export", str(tmp_path), str(tmp_path / "merged")]) == 0
    assert main(["export", "--adapter", str(tmp_path), str(tmp_path / "adapter")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    base, _ = load_policy(config.model)
    adapted = PeftModel.from_pretrained(base, tmp_path / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(adapted(input_ids=ids).logits, expected, atol=1e-5, rtol=0)


def test_dqo_offline_trains_the_adapter_alone(tmp_path):
    """The trajectory store's offline learning (DQO here, from labelled responses): the adapter
    trains, the base does not, and the checkpoint holds the adapter."""
    import json

    from asyncrl.storage.checkpoint_parts import policy_dir
    from asyncrl.offline import learn

    data = tmp_path / "labelled.jsonl"
    with open(data, "w") as f:
        for d in range(10):
            for good in (0, 1):
                answer = str((d + 1) % 10)
                f.write(json.dumps({"prompt": f"{d}:", "data_source": "tiny", "reward_model": {"ground_truth": answer},
                                    "response": answer if good else "a", "score": float(good)}) + "\n")
    summary = learn(compose([*LORA, "task=tiny", "algorithm=dqo", "mode=learn", f"offline.data={data}",
                             "trainer.total_steps=2", "policy.optimizer.lr=0.01", "policy.optimizer.warmup_steps=2",
                             f"trainer.run_dir={tmp_path / 'run'}"]), progress=False)
    assert summary["steps"] == 2
    # DQO's optimizer follows its schedule as the online learners' do: a warm-up of 2 steps.
    rates = [json.loads(line)["lr"] for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert rates == pytest.approx([0.005, 0.01])
    part = policy_dir(summary["last_checkpoint"])
    adapter = lora.read_adapter(part)
    assert adapter and any(float(t.abs().max()) > 0 for n, t in adapter.items() if ".lora_B." in n)
    merged, _ = lora.merged_model(part)
    base, _ = load_policy(compose(LORA).model)
    changed = {n for n, p in merged.named_parameters() if not torch.equal(p, dict(base.named_parameters())[n])}
    assert changed and all(n.rsplit(".", 2)[-2].endswith("proj") for n in changed)  # only adapted modules moved


@pytest.mark.slow
def test_the_tiny_task_reaches_0_9_with_lora(ray_session, tmp_path):
    """LoRA (rank 16 on every linear layer and the untied head; the random embeddings and the norms
    stay as they are) learns the tiny task through the real pipeline at the task's own learning rate,
    and every update carries the adapter's bytes. Without the head's adapter it cannot: the random
    head's logits stay below about 1.3 whatever the layers below it do (0.2 at best, measured)."""
    from asyncrl.driver import train

    config = compose([*LORA, "task=tiny", "algorithm=grpo", "policy.loss.clip_high=0.28", "policy.loss.agg=token-mean",
                      "model.lora_rank=16", "model.lora_alpha=32", f"model.target_modules=[{','.join(TARGETS_AND_HEAD)}]",
                      "trainer.total_steps=600", "trainer.target_reward=0.9", f"trainer.run_dir={tmp_path}",
                      "trainer.wandb_mode=disabled"])
    summary = train(config, progress=False)
    rewards = [r["reward_mean_generated"] for r in summary["records"]]
    assert summary["reached_target"], rewards[-20:]
    assert summary["eval_after"]["accuracy"] >= 0.9, summary["eval_after"]
    lm, _ = load_policy(config.model)
    adapted = set(lora.resolve_targets(lm, TARGETS_AND_HEAD))
    assert "lm_head" in adapted
    adapter_bytes = sum(4 * 16 * (m.in_features + m.out_features) for n, m in lm.named_modules() if n in adapted)
    assert summary["final_status"]["last_broadcast"]["bytes"] == adapter_bytes
