"""`asyncrl export` writes what users serve (issue 60): the weights in the dtype the model came in
(or `--dtype`), a LoRA run's merged model in that dtype too, with the tokenizer, the chat template
and the generation config; transformers loads the export and generates. A tiny random Llama
directory saved in bf16, as a model from a hub is, trained by a real run."""

import json
import os

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig

from asyncrl.cli import main
from asyncrl.config import compose
from asyncrl.models.loading import build_tiny_tokenizer

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}"


def bf16_model_dir(directory) -> str:
    """A model directory as users download one: bf16 weights (its config.json says so), its own
    chat template, a turn-end id ("#") in generation_config.json."""
    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, pad_token_id=0,
                         bos_token_id=2, eos_token_id=1, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(directory)
    GenerationConfig(eos_token_id=[1, tokenizer.convert_tokens_to_ids("#")], pad_token_id=0).save_pretrained(directory)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(directory)
    return str(directory)


def weight_dtypes(directory) -> set[str]:
    with safe_open(os.path.join(directory, "model.safetensors"), "pt") as f:
        return {f.get_slice(name).get_dtype() for name in f.keys()}


def size(directory) -> int:
    return os.path.getsize(os.path.join(directory, "model.safetensors"))


def loads_and_generates(directory, dtype: torch.dtype) -> AutoModelForCausalLM:
    """transformers loads the export in its dtype, with its tokenizer, template and turn-end ids, and generates."""
    model = AutoModelForCausalLM.from_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert tokenizer.chat_template == TEMPLATE
    assert model.generation_config.eos_token_id == [1, tokenizer.convert_tokens_to_ids("#")]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "3:"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    assert tokenizer.decode(prompt["input_ids"][0]) == "3:="
    out = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > prompt["input_ids"].shape[1]
    return model


def test_a_run_exports_in_its_model_s_dtype_or_the_one_asked(ray_session, tmp_path, capsys):
    from asyncrl.driver import train

    source = bf16_model_dir(tmp_path / "tiny-bf16")
    run = tmp_path / "run"
    summary = train(compose(["model=tiny", "task=tiny", "algorithm=grpo", "model.source=hf", f"model.path={source}",
                             "trainer.prompts_per_step=2", "trainer.total_steps=2", f"trainer.run_dir={run}",
                             "trainer.wandb_mode=disabled"]), progress=False, eval_prompts=2)
    assert summary["steps"] == 2
    policy = os.path.join(summary["last_checkpoint"], "policy")
    assert weight_dtypes(policy) == {"F32"}  # the learner's master weights

    # Default: the dtype of the model directory the run trained from (its config.json).
    assert main(["export", str(run), str(tmp_path / "default")]) == 0
    assert "weights in bfloat16" in capsys.readouterr().out
    assert weight_dtypes(tmp_path / "default") == {"BF16"}
    served = loads_and_generates(tmp_path / "default", torch.bfloat16)
    assert main(["export", "--dtype", "float32", str(run), str(tmp_path / "f32")]) == 0
    assert weight_dtypes(tmp_path / "f32") == {"F32"}
    master = loads_and_generates(tmp_path / "f32", torch.float32)
    # The bf16 export is the master weights rounded once; half the bytes.
    masters = dict(master.named_parameters())
    assert all(torch.equal(p, masters[n].to(torch.bfloat16)) for n, p in served.named_parameters())
    assert 0.45 < size(tmp_path / "default") / size(tmp_path / "f32") < 0.55
    assert main(["export", "--dtype", "float16", summary["last_checkpoint"], str(tmp_path / "f16")]) == 0
    assert weight_dtypes(tmp_path / "f16") == {"F16"}
    loads_and_generates(tmp_path / "f16", torch.float16)
    assert json.load(open(tmp_path / "f16" / "config.json"))["dtype"] == "float16"

    # A dtype asyncrl does not write: one line, before anything is read.
    capsys.readouterr()
    assert main(["export", "--dtype", "float8", str(run), str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert err == "asyncrl export: --dtype float8: must be one of bfloat16, float16, float32\n"
    assert not (tmp_path / "bad").exists()


def test_a_lora_run_exports_its_merged_model_in_the_base_s_dtype(tmp_path, capsys):
    """The LoRA learner's real checkpoint (the adapter alone): merged into the base in fp32, written
    in the base directory's bf16 unless told; the merge is the same as the fp32 export's, rounded."""
    import asyncio

    from actors.policy_learner import CheckpointPolicy, build_policy_learner
    from asyncrl.bench.learner import synthetic_batch
    from asyncrl.messages.mailbox import InProcessMailbox

    source = bf16_model_dir(tmp_path / "tiny-bf16")
    config = compose(["model=tiny", "model.source=hf", f"model.path={source}", "model.lora_rank=4",
                      "model.lora_alpha=8", "policy.optimizer.lr=0.02"])
    learner = build_policy_learner(config.model, config.algorithm, config.policy, config.engine, config.sampling, 0,
                                   InProcessMailbox(2), checkpoints=CheckpointPolicy(str(tmp_path / "run")))
    learner.policy.step(synthetic_batch(4, 6, 6, learner.model.config.vocab_size))
    learner.step = learner.weight_version = 1
    asyncio.run(learner.save_checkpoint())

    assert main(["export", str(tmp_path / "run"), str(tmp_path / "merged")]) == 0
    assert "weights in bfloat16" in capsys.readouterr().out
    assert weight_dtypes(tmp_path / "merged") == {"BF16"}
    merged = loads_and_generates(tmp_path / "merged", torch.bfloat16)
    assert main(["export", "--dtype", "float32", str(tmp_path / "run"), str(tmp_path / "merged-f32")]) == 0
    master = dict(loads_and_generates(tmp_path / "merged-f32", torch.float32).named_parameters())
    base = dict(AutoModelForCausalLM.from_pretrained(source).named_parameters())
    assert any(not torch.equal(master[n].to(torch.bfloat16), base[n]) for n in master)  # the adapter moved them
    assert all(torch.equal(p, master[n].to(torch.bfloat16)) for n, p in merged.named_parameters())
    assert main(["export", "--adapter", "--dtype", "bfloat16", str(tmp_path / "run"), str(tmp_path / "a")]) == 2
    assert "--adapter copies the adapter as it was trained" in capsys.readouterr().err


@pytest.mark.parametrize("named", ["torch_dtype", "dtype", None])
def test_the_default_dtype_is_the_model_directory_s(tmp_path, named):
    from asyncrl.storage.checkpoint_parts import source_dtype

    config = {"model_type": "llama", **({named: "bfloat16"} if named else {})}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert source_dtype(str(tmp_path)) == ("bfloat16" if named else "float32")


def test_a_moe_runs_checkpoint_exports_as_its_own_family_with_the_trained_experts(tmp_path, capsys):
    """A mixture-of-experts learner's checkpoint (a tiny Qwen3-MoE directory, one optimizer step)
    exports as a Qwen3-MoE directory transformers loads: every weight, the experts' 3-D tensors
    among them, the learner's own."""
    import asyncio

    from actors.policy_learner import CheckpointPolicy, build_policy_learner
    from asyncrl.bench.learner import synthetic_batch
    from asyncrl.bench.moe import write_tiny_moe
    from asyncrl.messages.mailbox import InProcessMailbox

    source = write_tiny_moe(str(tmp_path / "tiny-moe"))
    config = compose(["model=tiny", "model.source=hf", f"model.path={source}", "policy.optimizer.lr=0.02"])
    learner = build_policy_learner(config.model, config.algorithm, config.policy, config.engine, config.sampling, 0,
                                   InProcessMailbox(2), checkpoints=CheckpointPolicy(str(tmp_path / "run")))
    learner.policy.step(synthetic_batch(4, 6, 6, learner.model.config.vocab_size))
    learner.step = learner.weight_version = 1
    asyncio.run(learner.save_checkpoint())
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "exported")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    assert type(exported).__name__ == "Qwen3MoeForCausalLM"
    trained = dict(learner.model.named_parameters())
    base = dict(AutoModelForCausalLM.from_pretrained(source).named_parameters())
    for name, p in exported.named_parameters():
        assert torch.equal(p, trained[name].detach().to(p.dtype)), name
    assert not torch.equal(base["model.layers.0.mlp.experts.gate_up_proj"],
                           dict(exported.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"])
