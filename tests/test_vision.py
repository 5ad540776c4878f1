"""Vision-language models (issue 58): the tiny random Qwen2-VL, prompts with images as references,
the embedded engine's own decoder against transformers' `Qwen2VLForConditionalGeneration`, the
learner's forward with the same images, and bad input refused at start-up."""

from __future__ import annotations

import base64
import io
import json
import os

import msgspec
import numpy as np
import pytest
import torch
from PIL import Image

from asyncrl.config import ConfigError, compose
from asyncrl.data.files import load_examples
from asyncrl.storage.images import ImagePrep, decode_image, store_image
from asyncrl.data.tasks import Example, encode_prompt
from asyncrl.engines.base import SamplingParams
from asyncrl.engines.generation import build_engine, sequence_input
from asyncrl.learning.rank import build_policy_rank
from asyncrl.learning.scoring import PolicyForward, token_logprobs
from asyncrl.messages.structs import FinishReason, Segment, TrainingRow, encode, int32_array
from asyncrl.models.loading import load_policy
from asyncrl.models.vision import image_prep, image_token_ids, without_image_tokens

VL = ["model=tiny_vl", "task=shapes", "algorithm=grpo"]


@pytest.fixture
def store(tmp_path, monkeypatch):
    """Images kept under this test's directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path


def _prompts(config, n: int):
    lm, tokenizer = load_policy(config.model)
    prep = image_prep(config.model, tokenizer, lm)
    examples = load_examples(config.task, "train", n)
    return lm, tokenizer, prep, [(encode_prompt(ex, tokenizer, False, images=prep), prep.processed(ex.images))
                                 for ex in examples]


def _transformers_logprobs(lm, prompt_ids, images, tokens) -> np.ndarray:
    """log π(token | prefix) from transformers' own forward (pixels through its own vision tower, its
    own rope index), over the distribution without image tokens the engine samples from."""
    from asyncrl.storage.images import load_processed

    ids = torch.tensor(np.concatenate([prompt_ids, tokens]).astype(np.int64))[None]
    pixels = torch.cat([load_processed(r)[0] for r in images])
    grid = torch.stack([load_processed(r)[1] for r in images])
    with torch.no_grad():
        logits = lm(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels, image_grid_thw=grid,
                    mm_token_type_ids=(ids == lm.config.image_token_id).int()).logits[0].float()
    logp = torch.log_softmax(without_image_tokens(logits, image_token_ids(lm)), -1)
    start = len(prompt_ids) - 1
    return logp[start:start + len(tokens)].gather(-1, torch.tensor(tokens, dtype=torch.long)[:, None]).squeeze(-1).numpy()


def test_shapes_prompts_carry_image_tokens_and_references_not_pixels(store):
    config = compose(VL)
    _, tokenizer, prep, prompts = _prompts(config, 3)
    ids, refs = prompts[0]
    # "<image>c?": start, 4 image pads (56x56 pixels: 4x4 patches merged 2x2), end, then the text.
    assert tokenizer.convert_ids_to_tokens(ids) == ["<|vision_start|>"] + ["<|image_pad|>"] * 4 + [
        "<|vision_end|>", "c", "?"]
    assert len(refs) == 1 and os.path.dirname(refs[0]) == str(store / "cache" / "asyncrl" / "images")
    # The same image is one file; the held-out images are others.
    again = load_examples(config.task, "train", 3)
    assert again[0].images == load_examples(config.task, "train", 3)[0].images
    assert not set(e.images for e in again) & set(e.images for e in load_examples(config.task, "eval", 3))
    # A segment with an image carries its reference: the same bytes as without one, plus the path.
    segment = Segment(prompt_id="p", sample_idx=0, window=0, group_id="p", prompt_token_ids=int32_array(ids),
                      prior_response_ids=int32_array([]), prior_versions=int32_array([]),
                      new_token_ids=int32_array([3, 1]), new_logprobs=np.zeros(2, np.float32),
                      new_versions=int32_array([0, 0]), finished=True, finish_reason=FinishReason.EOS, images=refs)
    extra = len(encode(segment)) - len(encode(msgspec.structs.replace(segment, images=())))
    assert extra < len(refs[0]) + 16, extra  # a 56x56 image's pixels would be 9408 bytes, processed 75 KB


FAMILIES = pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])


@FAMILIES
def test_engine_logprobs_match_transformers_qwen2vl_forward_across_windows_and_shared_prompts(store, family):
    """Qwen2-VL and Qwen2.5-VL (its tower's windowed attention, the same language model)."""
    config = compose([*VL, f"model.vision_family={family}"])
    lm, _, _, prompts = _prompts(config, 3)
    assert lm.config.model_type == family
    engine, _ = build_engine(config.model, (lm, load_policy(config.model)[1]))
    # Three prompts of the same text and different images, three samples each: their prefixes are
    # shared up to the first image token, and never across images.
    seqs = [sequence_input(ids, 10 * i + j, 6, key=f"{i}/{j}", images=refs)
            for i, (ids, refs) in enumerate(prompts) for j in range(3)]
    first = engine.generate_window_sync(seqs, 3, SamplingParams(temperature=1.0))
    assert engine.kept.stats["prefill_tokens_shared"] > 0
    later = [sequence_input(s.prompt_ids, s.seed, 6, o.token_ids, key=s.key, images=s.images)
             for s, o in zip(seqs, first) if not o.finished]
    second = dict(zip([s.key for s in later], engine.generate_window_sync(later, 3, SamplingParams(temperature=1.0))))
    assert later and engine.kept.stats["reused"] == len(later)  # continued from kept caches
    image_ids = set(image_token_ids(lm))
    for seq, out in zip(seqs, first):
        tokens, logprobs = out.token_ids, out.logprobs
        if seq.key in second:
            tokens = np.concatenate([tokens, second[seq.key].token_ids])
            logprobs = np.concatenate([logprobs, second[seq.key].logprobs])
        assert not image_ids & set(tokens.tolist())  # never sampled
        np.testing.assert_allclose(logprobs, _transformers_logprobs(lm, seq.prompt_ids, seq.images, tokens), atol=2e-5)


@FAMILIES
def test_learner_forward_scores_the_engine_samples_as_the_engine_with_images(store, family):
    config = compose([*VL, f"model.vision_family={family}"])
    lm, _, _, prompts = _prompts(config, 2)
    engine, _ = build_engine(config.model, (lm, load_policy(config.model)[1]))
    seqs = [sequence_input(ids, j, 2, images=refs) for ids, refs in prompts for j in range(2)]
    outs = engine.generate_window_sync(seqs, 2, SamplingParams(temperature=1.0))
    length = max(len(s.prompt_ids) + len(o.token_ids) for s, o in zip(seqs, outs))
    ids = torch.zeros((len(seqs), length), dtype=torch.long)
    mask, targets, trained = torch.zeros_like(ids), torch.zeros_like(ids), torch.zeros_like(ids, dtype=torch.bool)
    for i, (s, o) in enumerate(zip(seqs, outs)):
        row = np.concatenate([s.prompt_ids, o.token_ids])
        ids[i, :len(row)], mask[i, :len(row)] = torch.from_numpy(row.astype(np.int64)), 1
        start = len(s.prompt_ids) - 1
        targets[i, start:start + len(o.token_ids)] = torch.from_numpy(o.token_ids.astype(np.int64))
        trained[i, start:start + len(o.token_ids)] = True
    forward = PolicyForward(lm)
    with torch.no_grad():
        logp, _ = token_logprobs(forward, ids, mask, targets, 1.0, positions=trained, images=[s.images for s in seqs])
    np.testing.assert_allclose(logp[trained].numpy(), np.concatenate([o.logprobs for o in outs]), atol=2e-5)
    assert forward.vision.seconds > 0  # the tower ran (once per distinct image: two, for four rows)


def _row(ids, refs, tokens, advantage: float) -> TrainingRow:
    segment = Segment(prompt_id="p", sample_idx=0, window=0, group_id="p", prompt_token_ids=int32_array(ids),
                      prior_response_ids=int32_array([]), prior_versions=int32_array([]),
                      new_token_ids=int32_array(tokens), new_logprobs=np.full(len(tokens), -3.0, np.float32),
                      new_versions=int32_array([0] * len(tokens)), finished=True, finish_reason=FinishReason.EOS, images=refs)
    return TrainingRow(segment=segment, score=advantage, advantages=np.full(len(tokens), advantage, np.float32))


@pytest.mark.parametrize("frozen", [True, False])
def test_the_vision_tower_is_frozen_by_default_and_trained_when_asked(store, frozen):
    config = compose([*VL, f"model.freeze_vision_tower={str(frozen).lower()}", "policy.compute.precision=fp32"])
    _, _, _, prompts = _prompts(config, 2)
    rank, _ = build_policy_rank(config.model, config.algorithm, config.policy, config.engine, config.sampling, 0)
    before = {n: p.detach().clone() for n, p in rank.lm.named_parameters()}
    metrics = rank.step([_row(ids, refs, [5, 1], a) for (ids, refs), a in zip(prompts, (1.0, -1.0))])
    moved = {n for n, p in rank.lm.named_parameters() if not torch.equal(p, before[n])}
    assert any(n.startswith("model.language_model.") for n in moved)
    assert any(n.startswith("model.visual.") for n in moved) != frozen
    assert metrics["vision_s"] > 0


def test_images_on_a_text_model_and_engines_without_images_are_refused_at_start_up(store):
    with pytest.raises(ConfigError, match="task=shapes gives every prompt an image, and model.source=tiny is a "
                                          "text-only model"):
        compose(["model=tiny", "task=shapes"])
    with pytest.raises(ConfigError, match="engine=sglang is not given the images yet"):
        compose([*VL, "engine=sglang_cpu"])
    with pytest.raises(ConfigError, match="engine=vllm is not given the images yet"):
        compose([*VL, "engine=vllm"])
    assert compose([*VL, "model.lora_rank=8"]).model.lora_rank == 8  # the language model's adapter (test_lora_vision)
    with pytest.raises(ConfigError, match="model.freeze_vision_tower=false .* needs model.lora_rank=0"):
        compose([*VL, "model.lora_rank=8", "model.freeze_vision_tower=false"])
    assert compose([*VL, "algorithm=ppo"]).algorithm.name == "ppo"  # the critic takes the images (test_vision_value)
    # mode=learn replays a store with its images (test_vision_offline); DQO's step and labelled files take none.
    with pytest.raises(ConfigError, match="algorithm=dqo's offline step does not take images yet"):
        compose(["model=tiny_vl", "task=shapes", "algorithm=dqo", "mode=learn", f"offline.data={store}"])
    with pytest.raises(ConfigError, match="is a file of labelled responses, whose images are not read yet"):
        compose([*VL, "mode=learn", f"offline.data={store / 'labelled.jsonl'}"])
    text = compose(["model=tiny", "task=tiny"])
    _, tokenizer = load_policy(text.model)
    example = load_examples(compose(VL).task, "train", 1)[0]
    with pytest.raises(ConfigError, match="shapes-train-0: the prompt has images, and the model is a text-only one"):
        encode_prompt(example, tokenizer, False, images=image_prep(text.model, tokenizer))


def test_bad_images_and_placeholder_counts_are_refused_naming_where(store):
    with pytest.raises(ConfigError, match="train.parquet: row 3: the image cannot be decoded"):
        decode_image(b"not an image", "train.parquet: row 3")
    big = io.BytesIO()
    Image.new("RGB", (9000, 2), (0, 0, 0)).save(big, format="PNG")
    with pytest.raises(ConfigError, match="row 4: the image is 9000x2 pixels, more than 8192 on a side"):
        store_image({"bytes": big.getvalue()}, "row 4")
    with pytest.raises(ConfigError, match="row 5: .* is a URL; .* never fetched"):
        store_image("https://example.com/a.png", "row 5")
    png = io.BytesIO()
    Image.new("RGB", (30, 20), (200, 0, 0)).save(png, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    ref = store_image(uri, "row 6")
    assert ref == store_image({"bytes": png.getvalue(), "path": None}, "row 6")  # one image, one file
    config = compose(VL)
    _, tokenizer = load_policy(config.model)
    two = Example("x", [{"role": "user", "content": "<image>c?"}], "0", "shapes", where="data.parquet: row 7",
                  images=(ref, ref))
    with pytest.raises(ConfigError, match="data.parquet: row 7: the prompt has 1 image placeholders for 2 images"):
        encode_prompt(two, tokenizer, False, images=image_prep(config.model, tokenizer))


def test_a_vision_directory_without_its_processor_says_which_file_it_needs(store):
    config = compose(VL)
    lm, tokenizer = load_policy(config.model)
    directory = store / "vl"
    lm.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    hf = compose(["model.source=hf", f"model.path={directory}", "model.use_chat_template=false", "task=shapes"])
    with pytest.raises(ConfigError, match="has no preprocessor_config.json"):
        image_prep(hf.model, tokenizer)
    image_prep(config.model, tokenizer).processor.save_pretrained(directory)
    assert isinstance(image_prep(hf.model, tokenizer), ImagePrep)
    assert json.load(open(directory / "preprocessor_config.json"))["merge_size"] == 2


def test_a_qwen3_vl_directory_loads_with_its_processor_and_the_engine_reads_its_deepstack(store):
    """Qwen3-VL as a user brings it: a Hugging Face directory (weights, tokenizer, processor of
    16-pixel patches normalised to [-1, 1]) through `model.source=hf`; the engine's log-probs equal
    transformers' forward, whose first layers add the tower's deepstack features."""
    tiny = compose([*VL, "model.vision_family=qwen3_vl"])
    lm, tokenizer = load_policy(tiny.model)
    assert lm.config.model_type == "qwen3_vl" and lm.config.vision_config.deepstack_visual_indexes == [0, 1]
    directory = store / "qwen3vl"
    lm.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    image_prep(tiny.model, tokenizer).processor.save_pretrained(directory)
    config = compose(["model.source=hf", f"model.path={directory}", "model.use_chat_template=false", "task=shapes",
                      "algorithm=grpo", "model.dtype=float32"])
    loaded, _, prep, prompts = _prompts(config, 2)
    assert type(loaded).__name__ == "Qwen3VLForConditionalGeneration"
    assert (prep.processor.patch_size, list(prep.processor.image_mean)) == (16, [0.5, 0.5, 0.5])
    engine, _ = build_engine(config.model, (loaded, load_policy(config.model)[1]))
    seqs = [sequence_input(ids, j, 3, images=refs) for ids, refs in prompts for j in range(2)]
    for seq, out in zip(seqs, engine.generate_window_sync(seqs, 3, SamplingParams(temperature=1.0))):
        np.testing.assert_allclose(out.logprobs, _transformers_logprobs(loaded, seq.prompt_ids, seq.images,
                                                                        out.token_ids), atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])  # Qwen3-VL: its deepstack features in engine and learner
def test_tiny_vl_learns_the_colour_of_the_square_from_chance_to_0_9_held_out(ray_session, tmp_path, monkeypatch, family):
    from asyncrl.driver import train

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    config = compose([*VL, f"model.vision_family={family}", "policy.loss.clip_high=0.28", "policy.loss.agg=token-mean",
                      "trainer.total_steps=500", f"trainer.run_dir={tmp_path}", "trainer.wandb_mode=disabled"])
    summary = train(config, progress=False)
    # Chance: a digit of the four colours, among the ~35 tokens a random model draws from.
    assert summary["eval_before"]["accuracy"] < 0.4, summary["eval_before"]
    assert summary["eval_after"]["accuracy"] >= 0.9, summary["eval_after"]
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    # The first step trains tokens of the weights it holds: learner and engine agree as for text.
    assert records[0]["staleness_max"] == 0 and records[0]["rollout_kl_k3"] < 1e-4, records[0]
    assert all(r["vision_s"] > 0 for r in records)  # the learner's forward ran the tower on the images


def test_verl_and_trl_rows_with_images_read_into_references_and_rows_keep_paths(store):
    from asyncrl.data.files import DataKeys, file_examples, verl_rows, write_examples
    from asyncrl.data.tasks import shapes_examples

    shapes = shapes_examples("train", 3)
    write_examples(shapes, str(store / "train.parquet"), "train")
    read = file_examples(str(store / "train.parquet"))
    # verl's layout: `<image>` in the prompt, the PNG bytes in `images`: the same images, the same references.
    assert [ex.images for ex in read] == [ex.images for ex in shapes]
    assert read[0].messages[0]["content"] == "<image>c?" and read[0].ground_truth == shapes[0].ground_truth
    assert read[0].row["images"] == list(shapes[0].images)  # a reward function gets paths, not pixels
    assert verl_rows(shapes, "train")[0]["images"][0]["bytes"] == open(shapes[0].images[0], "rb").read()
    # TRL's layout: an `image` column and a `{"type": "image"}` part.
    import pyarrow as pa
    import pyarrow.parquet as pq

    trl = [{"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "c?"}]}],
            "image": {"bytes": open(shapes[1].images[0], "rb").read(), "path": None}, "answer": "1"}]
    pq.write_table(pa.Table.from_pylist(trl), store / "trl.parquet")
    (example,) = file_examples(str(store / "trl.parquet"), DataKeys(answer="answer"))
    assert example.images == shapes[1].images and example.messages[0]["content"] == "<image>c?"
    # An image that cannot be decoded is refused at start-up, naming file and row.
    bad = [{**verl_rows(shapes, "train")[0], "images": [{"bytes": b"\x89PNG broken", "path": None}]}]
    pq.write_table(pa.Table.from_pylist(bad), store / "bad.parquet")
    with pytest.raises(ConfigError, match=r"bad.parquet: row 0: images\[0\]: the image cannot be decoded"):
        file_examples(str(store / "bad.parquet"))
    # Images on a text-only model are refused naming the row and the model.
    from asyncrl.data.files import check_prompts

    with pytest.raises(ConfigError, match="train.parquet: row 0: the prompt has images, and model.source=tiny is a "
                                          "text-only model"):
        check_prompts(compose(["model=tiny", "task=file", f"task.path={store / 'train.parquet'}"]))
