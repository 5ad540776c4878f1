"""`mode=learn` on a vision-language model (issue 58): the trajectory store keeps a copy of each
prompt's processed images, its records name them, and a replay through the online learners reads
them back, with the run's image cache gone."""

from __future__ import annotations

import asyncio
import json
import os
import shutil

import msgspec
import numpy as np
import pytest

from actors.recorder import TrajectoryRecorder
from asyncrl.config import compose
from asyncrl.data.files import load_examples
from asyncrl.data.tasks import encode_prompt, score_response
from asyncrl.engines.base import SamplingParams
from asyncrl.engines.generation import build_engine, sequence_input
from asyncrl.messages.structs import FinishReason, Reward, Segment, float32_array, int32_array
from asyncrl.models.loading import load_policy
from asyncrl.models.vision import image_prep
from asyncrl.offline import learn
from asyncrl.storage.images import store_root
from asyncrl.storage.trajectory_store import RECORDS_ENCODER, prune_store, read_trajectories, record_of, store_files

GROUP = 4
VL = ["model=tiny_vl", "task=shapes", f"algorithm.group_size={GROUP}", "trainer.prompts_per_step=2",
      "trainer.eval_samples=4", "trainer.wandb_mode=disabled"]


@pytest.fixture
def store(tmp_path, monkeypatch):
    """Images kept under this test's directory."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path


def _record_samples(config, directory: str, prompts: int, first: int = 0) -> list:
    """`prompts` x GROUP samples (of training prompts `first`...) of the initial tiny_vl with their
    images, scored by the task's verifier, written by the run's own recorder (as `mode=generate`
    records them: one closed file)."""
    lm, tokenizer = load_policy(config.model)
    prep = image_prep(config.model, tokenizer, lm)
    engine, _ = build_engine(config.model, (lm, tokenizer))
    records = []
    for p, example in enumerate(load_examples(config.task, "train", first + prompts)[first:]):
        ids, refs = encode_prompt(example, tokenizer, False, images=prep), prep.processed(example.images)
        seqs = [sequence_input(ids, 10 * p + j, 2, images=refs) for j in range(GROUP)]
        for j, out in enumerate(engine.generate_window_sync(seqs, 2, SamplingParams(temperature=1.0))):
            text = tokenizer.decode(out.token_ids)
            score, correct, _ = score_response(example.data_source, text, example.ground_truth, config.task.reward)
            segment = Segment(prompt_id=example.prompt_id, sample_idx=j, window=0, group_id=example.prompt_id,
                              group_size=GROUP, prompt_token_ids=int32_array(ids), prior_response_ids=int32_array([]),
                              prior_versions=int32_array([]), new_token_ids=int32_array(out.token_ids),
                              new_logprobs=float32_array(out.logprobs), new_versions=int32_array([0] * len(out.token_ids)),
                              finished=True, finish_reason=FinishReason.EOS, data_source=example.data_source,
                              ground_truth=example.ground_truth, images=refs)
            reward = Reward(prompt_id=example.prompt_id, sample_idx=j, score=score, source="verifier", correct=correct)
            records.append(record_of(segment, [len(out.token_ids)], reward, example.text, text, "recorded"))
    recorder = TrajectoryRecorder(directory)
    recorder.add_trajectories(RECORDS_ENCODER.encode(records))
    asyncio.run(recorder.close())
    return records


def test_a_store_keeps_its_images_and_mode_learn_replays_them_without_the_image_cache(store):
    config = compose(VL)
    directory = str(store / "recorded" / "trajectories")
    recorded = _record_samples(config, directory, prompts=4)
    # Each distinct image once in the store, named relative to it; read back as paths there.
    kept = sorted(os.listdir(os.path.join(directory, "images")))
    assert len(kept) == len({ref for r in recorded for ref in r.images}) == 4
    read = read_trajectories(directory)
    assert [r.images for r in read] == [[os.path.join(directory, "images", os.path.basename(ref)) for ref in r.images]
                                        for r in recorded]
    shutil.rmtree(store_root())  # the run's image cache: the store alone holds what replay reads

    run = store / "replay"
    summary = learn(compose([*VL, "algorithm=grpo", "mode=learn", f"offline.data={directory}", "trainer.total_steps=2",
                             f"trainer.run_dir={run}"]), progress=False)
    assert summary["steps"] == 2 and summary["assembler"]["groups_closed"] >= 2
    steps = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert len(steps) == 2 and all(s["vision_s"] > 0 for s in steps)  # the learner's forward ran the tower
    # The critic too, with its images: value pretraining on the same store.
    value = learn(compose([*VL, "algorithm=ppo", "mode=learn", "offline.train=value", f"offline.data={directory}",
                           "offline.batch_trajectories=8", "trainer.total_steps=2",
                           f"trainer.run_dir={store / 'value'}"]), progress=False)
    assert value["steps"] == 2 and np.isfinite(value["value_explained_variance_last"])


def test_a_record_whose_image_is_gone_is_refused_naming_the_sample(store):
    config = compose(VL)
    directory = str(store / "recorded")
    recorded = _record_samples(config, directory, prompts=1)
    shutil.rmtree(os.path.join(directory, "images"))
    with pytest.raises(FileNotFoundError, match=r"sample shapes-train-0/0's image images/\S+ is not in the store"):
        read_trajectories(directory)
    # An image already gone from this node when recorded keeps its path, and is refused by it.
    elsewhere = str(store / "elsewhere")
    recorder = TrajectoryRecorder(elsewhere)
    recorder.add_trajectories(RECORDS_ENCODER.encode([msgspec.structs.replace(recorded[0], images=["/gone/x.pt"])]))
    asyncio.run(recorder.close())
    with pytest.raises(FileNotFoundError, match="sample shapes-train-0/0's image /gone/x.pt is not in the store"):
        read_trajectories(elsewhere)


def test_pruning_the_store_counts_its_images_and_drops_those_no_file_left_names(store):
    config = compose(VL)
    directory = str(store / "pruned")
    old = {os.path.basename(ref) for r in _record_samples(config, directory, prompts=2) for ref in r.images}
    new = {os.path.basename(ref) for r in _record_samples(config, directory, prompts=2, first=2) for ref in r.images}
    assert len(store_files(directory)) == 2 and not old & new
    parquet = sum(os.path.getsize(f) for f in store_files(directory))
    # Under the bound with the images not counted, over it with them: the older file goes, and its images.
    assert prune_store(directory, keep_bytes=parquet, images=True) == 1
    assert set(os.listdir(os.path.join(directory, "images"))) == new
    assert {os.path.basename(ref) for r in read_trajectories(directory) for ref in r.images} == new
