"""What `mode=learn` learns from (`asyncrl.offline`): a trajectory store's records, or a file of
labelled responses in verl's layout (scored by the task's verifier where the file gives no score),
with the behaviour log-probs a labelled response lacks (the reference policy's), and each record as
the critic and DQO see it (its shaped score)."""

from __future__ import annotations

import os

import msgspec
import numpy as np

from asyncrl.algo.shaping import shaped_score
from asyncrl.assembly.rows import merge_segments
from asyncrl.config import Config
from asyncrl.data.files import file_examples, read_rows
from asyncrl.data.tasks import encode_prompt, score_response
from asyncrl.learning.scoring import response_logprobs
from asyncrl.messages.structs import ScoredTrajectory, float32_array, ground_truth_text, int32_array
from asyncrl.models.loading import load_model, load_tokenizer
from asyncrl.storage.trajectory_store import TrajectoryRecord, read_trajectories, segments_of


def offline_records(config: Config) -> list[TrajectoryRecord]:
    """The records to learn from: a trajectory store, or a file of labelled responses in verl's layout
    (scored by the task's verifier when it has no `score`; sampled from the reference policy, so the
    behaviour log-probs are the reference's: filled in by `with_behaviour`)."""
    data = config.offline.data
    if os.path.isdir(data):
        records = read_trajectories(data, tuple(config.offline.statuses))
    else:
        records = labelled_records(data, config)
    records = [r for r in records if not r.reward_failed and r.score is not None]
    if not records:
        raise ValueError(f"offline.data={data}: no scored trajectory to learn from")
    return records


def labelled_records(path: str, config: Config) -> list[TrajectoryRecord]:
    """Rows of a jsonl/parquet file: verl's prompt layout plus `response` (text) and an optional
    `score` (else the task's verifier scores the response against the ground truth)."""
    rows = read_rows(path)
    examples = file_examples(path, distinct_ids=False)
    tokenizer = load_tokenizer(config.model)
    out = []
    for i, (row, example) in enumerate(zip(rows, examples)):
        if "response" not in row:
            raise ValueError(f"{path}: row {i} has no `response` field (a labelled response)")
        prompt_ids = encode_prompt(example, tokenizer, config.model.use_chat_template,
                                   config.task.chat_template_kwargs)
        response_ids = tokenizer.encode(row["response"], add_special_tokens=False) + [tokenizer.eos_token_id]
        if "score" in row:
            score, correct = float(row["score"]), row.get("correct")
        else:
            score, correct, _ = score_response(example.data_source, row["response"], example.ground_truth,
                                               config.task.reward)
        out.append(TrajectoryRecord(
            sample_id=f"{example.prompt_id}/{i}", prompt_id=example.prompt_id, sample_idx=0,
            group_id=f"{example.prompt_id}/{i}", group_size=1, data_source=example.data_source,
            ground_truth=ground_truth_text(example.ground_truth), prompt_text=example.text, response_text=row["response"],
            prompt_token_ids=prompt_ids, response_token_ids=response_ids,
            behaviour_logprobs=[], token_versions=[0] * len(response_ids), window_ends=[len(response_ids)],
            finish_reason="eos", seed=0, generator_id="file", score=score, correct=correct,
            reward_source="file" if "score" in row else "verifier", status="recorded"))
    return out


def reference_logprobs(records: list[TrajectoryRecord], config: Config, reference=None) -> list[np.ndarray]:
    """log π_ref of every record's response tokens under the data's sampling settings (the initial
    policy of `config.model` unless `reference` is given)."""
    tokenizer = load_tokenizer(config.model)
    if reference is None:
        reference = load_model(config.model, tokenizer).requires_grad_(False)
    sampling = config.sampling
    rows = [(int32_array(r.prompt_token_ids), int32_array(r.response_token_ids)) for r in records]
    return response_logprobs(reference, rows, sampling.temperature, sampling.top_k, sampling.top_p,
                             tokenizer.pad_token_id or 0, config.policy.compute.micro_batch_tokens)


def with_behaviour(records: list[TrajectoryRecord], reference: list[np.ndarray] | None,
                   config: Config) -> list[TrajectoryRecord]:
    """Records of labelled responses carry no behaviour log-probs: they were sampled from the
    reference policy, so its log-probs stand in (computed when not given)."""
    missing = [i for i, r in enumerate(records) if not r.behaviour_logprobs]
    if not missing:
        return records
    if reference is None:
        reference = reference_logprobs([records[i] for i in missing], config)
        reference = dict(zip(missing, reference))
    out = list(records)
    for i in missing:
        out[i] = msgspec.structs.replace(records[i], behaviour_logprobs=np.asarray(reference[i], dtype=np.float32).tolist())
    return out


def scored_trajectory(record: TrajectoryRecord, config: Config) -> ScoredTrajectory:
    """A record as the critic and DQO see it: the whole response, its shaped score (the reward the
    online run trained with) and process rewards."""
    merged = merge_segments(segments_of(record))
    n = len(record.response_token_ids)
    overlong = config.algorithm.overlong
    score = shaped_score(record.score, n, config.engine.max_response_tokens, overlong.buffer_tokens,
                         overlong.penalty_factor)
    token_rewards = None if record.token_rewards is None else float32_array(record.token_rewards)
    return ScoredTrajectory(segment=merged, score=score, token_rewards=token_rewards, correct=record.correct)
