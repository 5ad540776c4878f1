"""Evaluation during training, by version (issue 60): `trainer.eval_every` scores the held-out set on
the weights of one version, pinned, on a thread beside the run: the driver keeps recording steps
while it runs, and the result names the step that asked for it and the weight version it scored,
which a checkpoint of that version scores the same."""

import json
import os

import pytest

from asyncrl.config import compose

EVAL_ROWS = 3000  # the tiny task's prompts, many times over: an evaluation that lasts several polls


def write_tiny_files(directory) -> tuple[str, str]:
    """The tiny task ("d:" -> the next digit, data source "tiny": its verifier) as the user's files:
    its ten training prompts, and a held-out file of EVAL_ROWS rows."""
    def rows(n):
        return [{"data_source": "tiny", "prompt": [{"role": "user", "content": f"{i % 10}:"}],
                 "reward_model": {"ground_truth": str((i % 10 + 1) % 10)}, "extra_info": {"index": i}} for i in range(n)]

    paths = []
    for name, n in (("train.jsonl", 10), ("eval.jsonl", EVAL_ROWS)):
        paths.append(os.path.join(directory, name))
        with open(paths[-1], "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows(n))
    return paths[0], paths[1]


@pytest.mark.slow  # (minutes of CI; `make test-slow`)
def test_an_evaluation_runs_beside_training_and_names_the_version_it_scored(ray_session, tmp_path):
    from asyncrl.driver import train
    from asyncrl.engines.generation import build_engine
    from asyncrl.evaluation import greedy_accuracy
    from asyncrl.storage import checkpoint_parts

    train_path, eval_path = write_tiny_files(tmp_path)
    run = tmp_path / "run"
    config = compose(["model=tiny", "task=tiny", "task.name=file", f"task.path={train_path}",
                      f"task.eval_path={eval_path}", "algorithm=grpo", "trainer.total_steps=16", "trainer.eval_every=4",
                      f"trainer.eval_samples={EVAL_ROWS}", "trainer.checkpoint_every=1", "trainer.checkpoint_keep=100",
                      f"trainer.run_dir={run}"])
    summary = train(config, progress=False, eval_prompts=EVAL_ROWS)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [json.loads(line) for line in (run / "evals.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 17))
    # Due at 4, 8, 12 (16 is the final evaluation's); one due while another ran waits for it.
    assert evals and evals == summary["evals"] and {e["step"] for e in evals} <= {4, 8, 12} and evals[0]["step"] == 4
    for e in evals:
        assert e["n"] == EVAL_ROWS and e["step"] <= e["weight_version"] <= 16
    # The driver went on recording steps while an evaluation ran.
    during = [r["step"] for e in evals for r in records if e["started_s"] < r["wall_time_s"] < e["finished_s"]]
    assert during, [(e["started_s"], e["finished_s"]) for e in evals]
    # Each result is on a later step record, named by its step and version.
    on_records = [(r["eval_step"], r["eval_weight_version"], r["eval_accuracy"]) for r in records if "eval_step" in r]
    assert on_records == [(e["step"], e["weight_version"], e["accuracy"]) for e in evals][:len(on_records)]
    assert all(r["step"] > r["eval_step"] for r in records if "eval_step" in r)
    # The version named is the version scored: the checkpoint of that version scores the same.
    by_version = {json.loads((c / "learner.json").read_text())["weight_version"]: c
                  for c in (run / "checkpoints").iterdir() if (c / "learner.json").exists()}
    engine, tokenizer = build_engine(config.model)
    for e in evals:
        checkpoint_parts.load_policy_weights(engine.model, str(by_version[e["weight_version"]] / "policy"))
        again = greedy_accuracy(config, engine, tokenizer, EVAL_ROWS)
        assert (again["accuracy"], again["response_length_mean"]) == (e["accuracy"], e["response_length_mean"]), e
