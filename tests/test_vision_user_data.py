"""A vision-language user's own data (issue 58): `asyncrl data example --task shapes` writes the
image task as verl's files (`<image>` prompts, PNG bytes in `images`) with a reward function in
verl's signature, the run trains on them as on `task=shapes`, and a tiny_vl checkpoint is evaluated
and exported with its image processor (`preprocessor_config.json`) beside the weights."""

from __future__ import annotations

import asyncio
import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest

from asyncrl.cli import main
from asyncrl.config import ConfigError, compose
from asyncrl.config.compose import to_dict
from asyncrl.data.example import TASKS
from asyncrl.data.files import file_examples, fit_notices, load_examples

VL = ["model=tiny_vl", "task=shapes", "algorithm=grpo"]


@pytest.fixture
def store(tmp_path, monkeypatch):
    """Images kept under this test's directory, which is the working directory (relative paths)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _train_command(out: str) -> list[str]:
    """The overrides of the `asyncrl train ...` line `asyncrl data example` printed."""
    (line,) = [line for line in out.splitlines() if line.startswith("train on them: asyncrl train ")]
    return line.removeprefix("train on them: asyncrl train ").split()


def _flat(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else key
        out.update(_flat(value, path) if isinstance(value, dict) else {path: value})
    return out


def test_data_example_shapes_writes_verl_files_of_images_and_a_reward_that_scores_the_colour(store, capsys):
    from asyncrl.evaluation import held_out
    from asyncrl.models.loading import load_tokenizer
    from asyncrl.rewards.user_function import detect_signature, load_function

    assert main(["data", "example", "--task", "shapes", "--out", "data"]) == 0
    out = capsys.readouterr().out
    assert "wrote data/train.parquet: 512 images" in out and "wrote data/test.parquet: 64 images" in out
    command = _train_command(out)
    assert command[:5] == ["model=tiny_vl", "task=file", "task.path=data/train.parquet",
                           "task.eval_path=data/test.parquet", "custom_reward_function.path=data/reward.py"]
    # verl's layout: `<image>` in the prompt, the PNG bytes in `images`, the answer in reward_model.
    table = pq.read_table(store / "data" / "train.parquet")
    assert set(table.column_names) == {"data_source", "prompt", "reward_model", "extra_info", "images"}
    first = table.slice(0, 1).to_pylist()[0]
    assert first["prompt"] == [{"role": "user", "content": "<image>c?"}] and first["data_source"] == "shapes"
    assert first["images"][0]["bytes"].startswith(b"\x89PNG") and first["reward_model"]["ground_truth"] in "0123"

    # The command's config is task=shapes's but for the task and the reward; its prompts are
    # task=shapes's: the same texts, answers and images (the same references in the store).
    config, shapes = compose(command), compose(VL[:2])
    differ = {k for k, v in _flat(to_dict(config)).items() if _flat(to_dict(shapes)).get(k, v) != v}
    assert differ and all(k.startswith(("task.", "reward.")) for k in differ), differ
    for read, builtin in ((load_examples(config.task, "train"), load_examples(shapes.task, "train")),
                          (held_out(config), held_out(shapes))):
        assert [(e.text, e.ground_truth, e.images) for e in read] == [(e.text, e.ground_truth, e.images) for e in builtin]
    assert file_examples("data/test.parquet")[0].row["images"] == list(held_out(shapes)[0].images)  # paths, not pixels
    # A prompt's length counts its image tokens: start, 4 pads (56x56 pixels), end, "c?".
    assert fit_notices(config, load_tokenizer(config.model), 128) == []
    assert len(held_out(compose([*command, "task.max_prompt_length=8"]))) == 64
    with pytest.raises(ConfigError, match="task.max_prompt_length=7: every held-out prompt is longer"):
        held_out(compose([*command, "task.max_prompt_length=7"]))

    # The reward file: verl's signature, the first character against the colour's digit.
    compute_score = load_function(str(store / "data" / "reward.py"), "compute_score")
    assert detect_signature(compute_score, "auto") == "verl"
    assert compute_score("shapes", "2", "2", {"index": 0}) == {"score": 1.0, "acc": True, "colour": 1.0}
    assert compute_score("shapes", "1", "2")["score"] == 0.0 and compute_score("shapes", "", "2")["acc"] is False

    # Twice: nothing is rewritten. Another seed's prompts are refused without --force.
    written = {name: os.stat(store / "data" / name).st_mtime_ns for name in ("train.parquet", "test.parquet", "reward.py")}
    assert main(["data", "example", "--task", "shapes", "--out", "data"]) == 0
    assert capsys.readouterr().out.count("left as it is") == 3
    assert {name: os.stat(store / "data" / name).st_mtime_ns for name in written} == written
    assert main(["data", "example", "--task", "shapes", "--out", "data", "task.seed=1"]) == 2
    assert "pass --force" in capsys.readouterr().err

    # jsonl: the images as data URIs, read back into the same references; twice, nothing rewritten.
    for _ in range(2):
        assert main(["data", "example", "--task", "shapes", "--out", "small", "--format", "jsonl",
                     "task.num_train_prompts=4", "task.num_eval_prompts=2"]) == 0
    assert capsys.readouterr().out.count("left as it is") == 3
    assert [e.images for e in file_examples("small/train.jsonl")] == [e.images for e in load_examples(shapes.task, "train", 4)]

    # An unknown task is refused with the choices (the CLI's are the tasks asyncrl.data.example writes).
    with pytest.raises(SystemExit) as exit_:
        main(["data", "example", "--task", "nope"])
    assert exit_.value.code == 2
    assert f"invalid choice: 'nope' (choose from {', '.join(repr(t) for t in TASKS)})" in capsys.readouterr().err


def _one_step_checkpoint(run: str):
    """A tiny_vl policy learner after one optimizer step on shapes prompts, checkpointed into `run`."""
    from actors.policy_learner import CheckpointPolicy, build_policy_learner
    from asyncrl.data.tasks import encode_prompt
    from asyncrl.messages.mailbox import InProcessMailbox
    from asyncrl.messages.structs import FinishReason, Segment, TrainingRow, int32_array
    from asyncrl.models.vision import image_prep

    config = compose([*VL, "policy.optimizer.lr=0.02"])
    learner = build_policy_learner(config.model, config.algorithm, config.policy, config.engine, config.sampling, 0,
                                   InProcessMailbox(2), checkpoints=CheckpointPolicy(run))
    prep = image_prep(config.model, learner.tokenizer, learner.policy.lm)
    rows = []
    for ex, advantage in zip(load_examples(config.task, "train", 2), (1.0, -1.0)):
        segment = Segment(prompt_id=ex.prompt_id, sample_idx=0, window=0, group_id=ex.prompt_id,
                          prompt_token_ids=int32_array(encode_prompt(ex, learner.tokenizer, False, images=prep)),
                          prior_response_ids=int32_array([]), prior_versions=int32_array([]),
                          new_token_ids=int32_array([5, 1]), new_logprobs=np.full(2, -3.0, np.float32),
                          new_versions=int32_array([0, 0]), finished=True, finish_reason=FinishReason.EOS,
                          images=prep.processed(ex.images))
        rows.append(TrainingRow(segment=segment, score=advantage, advantages=np.full(2, advantage, np.float32)))
    learner.policy.step(rows)
    learner.step = learner.weight_version = 1
    return learner, asyncio.run(learner.save_checkpoint())


def test_a_tiny_vl_checkpoint_and_its_export_hold_the_image_processor_and_asyncrl_eval_reads_both(store, capsys):
    import torch
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from asyncrl.models.loading import load_tokenizer
    from asyncrl.models.vision import image_prep

    from asyncrl.config.compose import to_record

    learner, checkpoint = _one_step_checkpoint(str(store / "run"))
    tiny = image_prep(compose(VL).model, learner.tokenizer)
    assert os.path.exists(os.path.join(checkpoint, "policy", "preprocessor_config.json"))
    # The run was one on the user's files (its config.json says so: task=file, 2-token responses).
    assert main(["data", "example", "--task", "shapes", "--out", "data", "task.num_train_prompts=4",
                 "task.num_eval_prompts=4"]) == 0
    run = compose([*_train_command(capsys.readouterr().out), "algorithm=grpo", f"trainer.run_dir={store / 'run'}"])
    (store / "run" / "config.json").write_text(json.dumps(to_record(run)))
    # `asyncrl eval` of the run: its task and response budget from the run, the checkpoint's
    # processor reads the images (its tokenizer has no chat template: the text as it is, as the run had it).
    evaluate = ["--n", "2", "--k", "1", "--prompts", "4"]
    assert main(["eval", "--checkpoint", "run", "--out", "eval-run", *evaluate]) == 0
    result = json.load(open(store / "eval-run" / "eval.json"))
    assert result["task"] == "file" and result["prompts"] == 4 and result["rewards_failed"] == 0
    capsys.readouterr()

    assert main(["export", "run", "exported"]) == 0
    assert "AutoModelForImageTextToText" in capsys.readouterr().out
    exported = store / "exported"
    # transformers reads the processor; the project's image prep processes an image as tiny_vl's does.
    processor = AutoImageProcessor.from_pretrained(exported)
    assert type(processor).__name__ == "Qwen2VLImageProcessorPil" and processor.size["longest_edge"] == 56 * 56
    hf = compose(["model.source=hf", f"model.path={exported}", "model.use_chat_template=false", "task=shapes"])
    prep = image_prep(hf.model, load_tokenizer(hf.model))
    assert prep.settings_key == tiny.settings_key and prep.merge_size == 2
    # The exported model is the trained one.
    model = AutoModelForImageTextToText.from_pretrained(exported)
    trained = dict(learner.policy.lm.named_parameters())
    assert all(torch.equal(p, trained[name].detach()) for name, p in model.named_parameters())
    # `asyncrl eval` of the export (a Hugging Face directory): it prints the held-out accuracy.
    assert main(["eval", "--checkpoint", "exported", "--out", "eval-export", *evaluate, "task=shapes"]) == 0
    assert "| 4 | 2 |" in capsys.readouterr().out
    # Another dtype is re-saved through transformers' vision-language class, the processor kept.
    assert main(["export", "--dtype", "bfloat16", "run", "bf16"]) == 0
    assert os.path.exists(store / "bf16" / "preprocessor_config.json")
    assert {p.dtype for p in AutoModelForImageTextToText.from_pretrained(store / "bf16").parameters()} == {torch.bfloat16}


@pytest.mark.slow
def test_tiny_vl_learns_the_colour_of_the_square_from_the_user_s_own_files_to_0_9_held_out(ray_session, store, capsys):
    """`asyncrl data example --task shapes`, then the command it prints (task=file, the reward file
    in verl's signature) with the training settings of test_vision's slow shapes test."""
    from asyncrl.driver import train

    # Absolute paths: the session's Ray workers began in another directory.
    assert main(["data", "example", "--task", "shapes", "--out", str(store / "data")]) == 0
    command = _train_command(capsys.readouterr().out)
    config = compose([*command, "algorithm=grpo", "policy.loss.clip_high=0.28", "policy.loss.agg=token-mean",
                      "trainer.total_steps=500", f"trainer.run_dir={store / 'run'}", "trainer.wandb_mode=disabled"])
    assert config.task.name == "file" and config.reward.endpoints["custom"].kind == "python"
    summary = train(config, progress=False)
    assert summary["eval_before"]["accuracy"] < 0.4, summary["eval_before"]
    assert summary["eval_after"]["accuracy"] >= 0.9, summary["eval_after"]
    records = [json.loads(line) for line in open(store / "run" / "metrics.jsonl")]
    assert all(r["vision_s"] > 0 for r in records)  # the learner's forward ran the tower on the images


def test_generate_samples_image_prompts_with_their_images(store, capsys):
    """`asyncrl generate` on the image task: each prompt goes to the engine with its image (it once
    encoded the text alone and was refused as images on a text-only model)."""
    assert main(["generate", "-n", "2", "model=tiny_vl", "task=shapes"]) == 0
    out = capsys.readouterr().out
    assert out.count("### <image>c?") == 2 and "tokens/s" in out
