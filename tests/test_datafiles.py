"""Data as users have it: several files and globs, a directory written by `datasets`, TRL's column
names, a prompt-length filter, ground truths that are not strings, and the rows that cannot be trained
on, refused at start-up naming where they are."""

import json

import pytest

from asyncrl.config import ConfigError, compose
from asyncrl.data.files import DataKeys, check_prompts, drop_overlong, file_examples, load_examples

ROWS = [{"data_source": "gsm8k", "prompt": [{"role": "user", "content": f"{i}+1?"}],
         "reward_model": {"ground_truth": str(i + 1)}, "extra_info": {"index": i, "split": "train"}} for i in range(4)]


def jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return str(path)


def parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_a_list_of_files_and_globs_in_order_with_each_rows_columns(tmp_path):
    first = parquet(tmp_path / "part-0.parquet", ROWS[:2])
    jsonl(tmp_path / "part-1.jsonl", ROWS[2:])
    examples = file_examples([first, str(tmp_path / "part-1*.jsonl")])
    assert [e.prompt_id for e in examples] == ["gsm8k-0", "gsm8k-1", "gsm8k-2", "gsm8k-3"]
    assert examples[3].ground_truth == "4" and examples[3].row["extra_info"] == {"index": 3, "split": "train"}
    assert examples[0].where == f"{first}: row 0"
    config = compose(["task=file", f"task.path=[{first},{tmp_path}/part-1*.jsonl]", "model=tiny"])
    assert len(load_examples(config.task, "train")) == 4
    with pytest.raises(FileNotFoundError, match="nothing-*"):
        file_examples(str(tmp_path / "nothing-*.parquet"))


def test_a_datasets_directory_and_trls_columns(tmp_path):
    import datasets

    rows = [{"prompt": f"{i}+1?", "answer": i + 1, "level": i % 2} for i in range(5)]  # TRL's layout, an int answer
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    examples = file_examples(str(tmp_path / "saved"), keys=DataKeys(prompt="prompt", answer="answer"))
    assert [e.ground_truth for e in examples] == [1, 2, 3, 4, 5]  # not its repr: the value the data holds
    assert examples[0].messages == [{"role": "user", "content": "0+1?"}] and examples[2].row["level"] == 0
    assert [e.prompt_id for e in examples] == ["file-0", "file-1", "file-2", "file-3", "file-4"]
    config = compose(["task=file", f"task.path={tmp_path}/saved", "task.answer_key=answer", "model=tiny"])
    assert load_examples(config.task, "train")[4].ground_truth == 5
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "splits"))
    with pytest.raises(ValueError, match="holds several splits \\(train\\); name one"):
        file_examples(str(tmp_path / "splits"))
    assert len(file_examples(str(tmp_path / "splits" / "train"), keys=DataKeys(answer="answer"))) == 5


def test_a_ground_truth_that_is_not_a_string_reaches_the_reward_as_it_is(tmp_path):
    tests = {"inputs": ["1"], "outputs": ["2"]}
    rows = [{"data_source": "mine", "prompt": "x", "reward_model": {"ground_truth": tests}}]
    (example,) = file_examples(jsonl(tmp_path / "d.jsonl", rows))
    assert example.ground_truth == tests
    import numpy as np

    from asyncrl.messages.structs import Codec, FinishReason, RewardRequest, Segment

    # Through the messages a sample crosses, the dict stays a dict.
    decoded = Codec(RewardRequest).decode(Codec(RewardRequest).encode(
        RewardRequest(prompt_id="p", sample_idx=0, response_text="y", ground_truth=tests, data_source="mine",
                      row=example.row)))
    assert decoded.ground_truth == tests and decoded.row["reward_model"]["ground_truth"] == tests
    segment = Segment(prompt_id="p", sample_idx=0, window=0, group_id="p", prompt_token_ids=np.array([1], np.int32),
                      prior_response_ids=np.zeros(0, np.int32), prior_versions=np.zeros(0, np.int32),
                      new_token_ids=np.array([2], np.int32), new_logprobs=np.zeros(1, np.float32),
                      new_versions=np.zeros(1, np.int32), finished=True, finish_reason=FinishReason.EOS,
                      ground_truth=tests)
    assert Codec(Segment).decode(Codec(Segment).encode(segment)).ground_truth == tests


def test_rows_that_cannot_be_trained_on_are_refused_naming_them(tmp_path):
    # Two files whose rows share ids (each numbered from 0): refused, naming both places.
    a, b = jsonl(tmp_path / "a.jsonl", ROWS[:2]), jsonl(tmp_path / "b.jsonl", ROWS[:1])
    with pytest.raises(ConfigError, match=f"prompt id 'gsm8k-0' is on {a}: row 0 and on {b}: row 0"):
        file_examples([a, b])
    # No prompt column.
    with pytest.raises(ConfigError, match="row 0 has no `question` column \\(task.prompt_key\\)"):
        check_prompts(compose(["task=file", f"task.path={a}", "task.prompt_key=question", "model=tiny"]))
    # No ground truth where the route's verifier needs one (a maths source): refused with the rows...
    unanswered = [{**r, "reward_model": {}} for r in ROWS[:3]]
    path = jsonl(tmp_path / "unanswered.jsonl", unanswered)
    with pytest.raises(ConfigError, match=f"3 prompts have no ground truth and their reward needs one \\({path}: row 0;"):
        check_prompts(compose(["task=file", f"task.path={path}", "model=tiny"]))
    # ...but not where the route's reward needs none (a reward model here; a function of the user's too).
    check_prompts(compose(["task=file", f"task.path={path}", "model=tiny", "+reward.endpoints.rm={kind: bt, model_path: /m}",
                           "reward.routes=[{match: '*', endpoints: [rm]}]"]))


def test_prompts_longer_than_the_limit_are_dropped_and_counted(tmp_path, capsys):
    examples = file_examples(jsonl(tmp_path / "d.jsonl", ROWS))
    kept, tokens = drop_overlong(examples, [[1] * n for n in (3, 9, 4, 10)], 5, "train")
    assert [e.prompt_id for e in kept] == ["gsm8k-0", "gsm8k-2"] and tokens == [[1] * 3, [1] * 4]
    assert "task.max_prompt_length=5: dropped 2 of 4 train prompts longer than that" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="every train prompt is longer"):
        drop_overlong(examples, [[1] * 9] * 4, 5, "train")
    assert drop_overlong(examples, [[1] * 9] * 4, 0, "train")[0] == examples  # 0: no limit
    # Through the prompt source's builder, with the tiny model's tokenizer (a character a token).
    from actors.prompt_source import build_prompt_source
    from asyncrl.messages.mailbox import InProcessMailbox

    varied = [{**ROWS[0], "prompt": text, "extra_info": {"index": i}} for i, text in enumerate(["1?", "12+1?", "123+45+6?"])]
    jsonl(tmp_path / "varied.jsonl", varied)
    config = compose(["task=file", f"task.path={tmp_path}/varied.jsonl", "model=tiny", "task.max_prompt_length=5"])
    source = build_prompt_source(config.model, config.task, config.algorithm, 1, 0, InProcessMailbox(8))
    assert [e.prompt_id for e in source.examples] == ["gsm8k-0", "gsm8k-1"]
    assert "dropped 1 of 3 train prompts" in capsys.readouterr().out
