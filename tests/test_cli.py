"""The `asyncrl` command, run as a user runs it (a subprocess)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest


def asyncrl(*args, cwd):
    return subprocess.run([sys.executable, "-m", "asyncrl.cli", *args], capture_output=True, text=True, timeout=300, cwd=cwd)


def test_generate_on_tiny_model(tmp_path):
    out = asyncrl("generate", "-n", "2", "model=tiny", "task=tiny", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "### 0:" in out.stdout and "tokens/s" in out.stdout


@pytest.mark.slow  # (CI's time: its path is covered by the suite's other tests)
def test_bench_messages_quick_writes_json(tmp_path):
    out = asyncrl("bench", "messages", "--quick", "--run-dir", str(tmp_path), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads((tmp_path / "bench_messages.json").read_text())
    assert result["codec"]["4096_tokens"]["msgspec_roundtrip_us"] > 0 and "machine" in result
    # Segments through a mailbox across Ray processes, both codecs.
    assert result["mailbox"]["8192_tokens"]["ray_pickle_segments_per_s"] > 0
    assert "Ray msgspec" in out.stdout


def test_bad_override_fails_with_the_field_name(tmp_path):
    out = asyncrl("generate", "model=tiny", "engine.windw=3", cwd=tmp_path)
    assert out.returncode != 0 and "windw" in out.stderr
    out = asyncrl("bench", "nonsense", "--quick", cwd=tmp_path)
    assert out.returncode != 0 and "unknown benchmark" in out.stderr


def test_pass_at_k():
    from asyncrl.evaluation import pass_at_k, summarize

    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 2) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 − C(3,2)/C(4,2)
    assert summarize([[True, False], [False, False]], [1, 2]) == {"prompts": 2, "samples_per_prompt": 2,
                                                                 "pass@1": 0.25, "pass@2": 0.5}


def test_eval_command_on_the_tiny_model(tmp_path, capsys):
    from asyncrl.cli import main

    assert main(["eval", "model=tiny", "task=tiny", "--n", "4", "--k", "1,4", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "eval.json").read_text())
    assert result["prompts"] == 10 and result["samples_per_prompt"] == 4
    assert 0.0 <= result["pass@1"] <= result["pass@4"] <= 1.0
    assert "| pass@1 | pass@4 |" in (tmp_path / "eval.md").read_text()
    # It says where the files went (by default outputs/eval/ under the working directory).
    assert f"wrote {tmp_path / 'eval.json'} and {tmp_path / 'eval.md'}" in capsys.readouterr().out


def test_throughput_rates_between_polls():
    from asyncrl.run.records import samples_per_s

    assert samples_per_s(None, 10.0, 16) == 1.6  # the first poll: average since the start
    assert samples_per_s((10.0, 16), 20.0, 48) == 3.2  # then since the previous poll
    assert samples_per_s((20.0, 48), 25.0, 16) is None  # counters went back (a restart)


def interrupt_after(command: list[str], metrics, steps: int, cwd) -> tuple[int, str]:
    """Run `command`, and once `metrics` has `steps` records send Ctrl-C as a terminal does
    (SIGINT to the whole process group); its exit status and output."""
    # SIGINT back to its default in the child, as a terminal's foreground job has it: a suite started
    # in the background (`make test &`, a CI runner) passes SIGINT on ignored, and `asyncrl train`
    # rightly leaves an ignored SIGINT ignored.
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                               start_new_session=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            break
        time.sleep(0.3)
    os.killpg(process.pid, signal.SIGINT)
    output, _ = process.communicate(timeout=240)
    return process.returncode, output


@pytest.mark.slow
def test_train_ctrl_c_resume_export_eval_as_a_user_runs_them(tmp_path):
    """`asyncrl train` (evaluating every 3 steps, checkpointing every 4) stopped by Ctrl-C after 6
    steps, then `train resume=true` to a later step, `export` and `eval --checkpoint <run>`:
    subprocesses, as a user runs them."""
    run = tmp_path / "run"
    common = ["model=tiny", "task=tiny", "algorithm=grpo", "trainer.prompts_per_step=2", f"trainer.run_dir={run}",
              "trainer.checkpoint_every=4", "trainer.checkpoint_keep=2", "trainer.eval_every=3", "trainer.eval_samples=8"]
    code, output = interrupt_after([sys.executable, "-m", "asyncrl.cli", "train", *common, "trainer.total_steps=100000"],
                                   run / "metrics.jsonl", 6, tmp_path)
    # Stopped cleanly: no traceback, the last step checkpointed and evaluated, the summary written,
    # where to resume said; 130 as a shell reports Ctrl-C.
    summary = json.loads((run / "summary.json").read_text())
    stopped = summary["steps"]
    assert code == 130 and "Traceback" not in output and f"stopped after step {stopped}" in output, output[-3000:]
    assert summary["interrupted"] and summary["eval_after"] is not None and stopped >= 6
    assert summary["last_checkpoint"].endswith(f"step_{stopped:08d}")
    assert f"last checkpoint: {summary['last_checkpoint']}" in output and "resume=true" in output
    first = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in first] == list(range(1, stopped + 1))
    # Evaluated beside training (evals.jsonl): from step 3 on, each naming the version it scored.
    evals = [json.loads(line) for line in (run / "evals.jsonl").read_text().splitlines()]
    assert evals[0]["step"] == 3 and all(e["step"] % 3 == 0 and e["weight_version"] >= e["step"] for e in evals)
    steps = sorted(int(p.name.split("_")[1]) for p in (run / "checkpoints").iterdir())
    assert steps[-1] == stopped and len(steps) <= 2  # checkpoint_keep=2
    out = asyncrl("train", *common, f"trainer.total_steps={stopped + 4}", "resume=true", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"at step {stopped}" in out.stdout
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    resumed = [r["step"] for r in records[len(first):]]
    assert resumed[0] == stopped + 1 and resumed[-1] >= stopped + 4
    assert resumed == list(range(resumed[0], resumed[0] + len(resumed)))
    out = asyncrl("export", str(run), str(tmp_path / "hf"), cwd=tmp_path)
    assert out.returncode == 0 and (tmp_path / "hf" / "model.safetensors").exists(), out.stderr[-2000:]
    # No task on the command line: eval reads it from the run (the defaults are arithmetic).
    out = asyncrl("eval", "--checkpoint", str(run), "--n", "2", "--k", "1,2", "--out", str(tmp_path / "eval"),
                  cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert result["prompts"] == 10 and result["task"] == "tiny"
    assert "eval: " in out.stderr and "sample/s" in out.stderr  # the progress bar


@pytest.mark.slow  # (CI's time: a run's stop, checkpoint and evaluation run in the suite's other tests)
def test_train_stops_when_its_time_budget_is_spent_then_checkpoints_and_evaluates(tmp_path):
    """`trainer.max_train_s`: the run stops on time (not at its 100,000 steps), says why, and ends
    as after a last step: a checkpoint of the step it stopped at and the held-out evaluation."""
    run = tmp_path / "run"
    out = asyncrl("train", "model=tiny", "task=tiny", "algorithm=grpo", f"trainer.run_dir={run}", "trainer.max_train_s=3",
                  "trainer.total_steps=100000", "trainer.eval_samples=8", "trainer.wandb_mode=disabled", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert "trainer.max_train_s=3" in summary["stop_reason"] and "trainer.max_train_s=3" in out.stdout
    assert 0 < summary["steps"] < 100000 and 3 <= summary["train_wall_s"] < 60
    assert summary["eval_after"] is not None and not summary["interrupted"]
    assert summary["last_checkpoint"].endswith(f"step_{summary['steps']:08d}")
    assert f"stopped after step {summary['steps']}: the training time budget" in out.stdout
    from asyncrl.config import ConfigError, compose
    with pytest.raises(ConfigError, match="max_train_s"):
        compose(["mode=generate", "trainer.store_trajectories=true", "trainer.max_train_s=60"])


@pytest.mark.slow  # (CI's time: its path is covered by the suite's other tests)
def test_train_stops_when_its_sample_budget_is_spent(tmp_path):
    """`trainer.max_generated_samples`: the run stops at the first step after the generators have
    finished that many samples (how methods are compared at equal samples), says why, and evaluates."""
    run = tmp_path / "run"
    out = asyncrl("train", "model=tiny", "task=tiny", "algorithm=dapo", f"trainer.run_dir={run}",
                  "trainer.max_generated_samples=600", "trainer.total_steps=100000", "trainer.eval_samples=8",
                  "trainer.checkpoint_every=0", "trainer.wandb_mode=disabled", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert "trainer.max_generated_samples=600" in summary["stop_reason"] and summary["eval_after"] is not None
    assert 0 < summary["steps"] < 100000 and summary["final_status"]["samples_generated"] >= 600
    # it stopped at the poll that saw the budget spent: at most that poll's stamp and the stop's own
    over = {r["samples_generated"] for r in records if r["samples_generated"] >= 600}
    assert len(over) <= 2 and records[-1]["step"] == summary["steps"], over
    assert f"stopped after step {summary['steps']}: the sample budget" in out.stdout
    from asyncrl.config import ConfigError, compose
    with pytest.raises(ConfigError, match="max_generated_samples"):
        compose(["mode=generate", "trainer.store_trajectories=true", "trainer.max_generated_samples=100"])
    with pytest.raises(ConfigError, match="max_generated_samples"):
        compose(["trainer.max_generated_samples=-1"])


def test_a_ray_start_up_failure_is_one_line_and_exit_status_2(tmp_path):
    """A real failure of Ray's start (an object store larger than the machine): asyncrl says what
    happened and what to do in one line, with no traceback, and exits with 2."""
    out = subprocess.run([sys.executable, "-m", "asyncrl.cli", "train", "model=tiny", "task=tiny",
                          "cluster.object_store_mb=100000000", "trainer.wandb_mode=disabled",
                          f"trainer.run_dir={tmp_path}"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    ours = [line for line in out.stderr.splitlines() if line.startswith("asyncrl train:")]
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert len(ours) == 1 and "could not start a local Ray instance" in ours[0]
    assert "cluster.object_store_mb" in ours[0]


def test_train_help_lists_every_config_group_and_field_with_its_docstring(tmp_path):
    from asyncrl.config import Config, config_groups, schema

    out = asyncrl("train", "--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert not (tmp_path / "outputs").exists()  # help, not a run
    for group, options in config_groups().items():
        assert f"  {group}  " in text or f"  {group} " in text, group
        assert all(option in text for option in options), (group, options)
    # Every leaf of the schema, the variants of a union each with its own fields.
    missing = [leaf.path for leaf in schema.leaves(Config) if f"  {leaf.path}: " not in text]
    assert not missing, missing
    # Types with their ranges, the default config's values (the composed YAML, not the section's
    # default) and docstrings.
    assert "  policy.loss.clip_high: a number >= 0 = 0.28\n" in text
    assert "  policy.optimizer.lr: a number > 0 = 1e-05\n" in text  # dapo.yaml's; the section says 1e-6
    assert "  algorithm.advantage.lam: a number in [0, 1]  (type=gae)\n" in text
    assert "      Learner steps before `asyncrl train` exits (serve runs until stopped).\n" in text
    assert "      Bounded refill (verl's max_num_gen_batches): after this many generation rounds …\n" in text
    assert "  reward.endpoints.<name>.kind: one of verifier, genrm, bt, prm, python, openai\n" in text
    assert "  reward.routes[i].combine: one of first, mix\n" in text
    assert "docs/" in text


def test_data_example_writes_the_files_the_readme_trains_on(tmp_path, monkeypatch):
    """`asyncrl data example --out data` makes the README's `task=file task.path=data/train.parquet
    task.eval_path=data/test.parquet` work as written: the arithmetic task's prompts in verl's layout."""
    import pyarrow.parquet as pq

    from asyncrl.config import compose
    from asyncrl.evaluation import held_out
    from asyncrl.data.files import load_examples
    from asyncrl.data.tasks import arithmetic_examples

    out = asyncrl("data", "example", "--out", "data", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "wrote data/train.parquet: 512" in out.stdout and "wrote data/test.parquet: 64" in out.stdout
    # A reward file beside the data, in verl's signature, and the command that trains with it.
    assert "custom_reward_function.path=data/reward.py" in out.stdout
    from asyncrl.rewards.user_function import detect_signature, load_function

    compute_score = load_function(str(tmp_path / "data" / "reward.py"), "compute_score")
    assert detect_signature(compute_score, "auto") == "verl"
    assert compute_score("arithmetic", "so \\boxed{12}", "12", {})["score"] == 1.0
    assert compute_score("arithmetic", "so \\boxed{13}", "12", {})["score"] == 0.0
    table = pq.read_table(tmp_path / "data" / "train.parquet")
    assert set(table.column_names) == {"data_source", "prompt", "reward_model", "extra_info"}
    first = table.to_pylist()[0]
    assert first["prompt"][0]["role"] == "user" and first["reward_model"]["ground_truth"].isdigit()

    monkeypatch.chdir(tmp_path)  # the README's relative paths
    config = compose(["task=file", "task.path=data/train.parquet", "task.eval_path=data/test.parquet"])
    t = config.task
    train = load_examples(t, "train")
    builtin = arithmetic_examples("train", 512, 0)
    assert [(e.text, e.ground_truth, e.data_source) for e in train] == \
        [(e.text, e.ground_truth, e.data_source) for e in builtin]
    test = held_out(config)
    assert [e.text for e in test] == [e.text for e in arithmetic_examples("eval", 64, 0)]
    assert not {e.text for e in test} & {e.text for e in train}  # held out
    assert len({e.prompt_id for e in train}) == 512

    again = asyncrl("data", "example", "--out", "data", cwd=tmp_path)  # run twice: nothing to do
    assert again.returncode == 0 and "left as it is" in again.stdout
    other = asyncrl("data", "example", "--out", "data", "task.seed=1", cwd=tmp_path)  # never overwrites data silently
    assert other.returncode == 2 and "pass --force" in other.stderr
    jsonl = asyncrl("data", "example", "--out", "small", "--format", "jsonl", "task.num_train_prompts=8", cwd=tmp_path)
    assert jsonl.returncode == 0 and len((tmp_path / "small" / "train.jsonl").read_text().splitlines()) == 8


def test_help_into_a_pipe_that_closes_early_is_not_an_error(tmp_path):
    """`asyncrl train --help | head -3`: the reader leaves after three lines; no traceback, exit 0."""
    done = subprocess.run(["bash", "-o", "pipefail", "-c", f"'{sys.executable}' -m asyncrl.cli train --help | head -3"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert len(done.stdout.splitlines()) == 3


def test_a_verl_command_line_composes_with_one_notice_per_name(tmp_path):
    """verl's and TRL's names are taken, each with a one-line notice of ours; one whose meaning
    differs is refused naming our field. `--cfg` prints the composed config and exits."""
    import yaml

    out = asyncrl("train", "--cfg", "model=tiny", "task=tiny", "actor_rollout_ref.rollout.n=8",
                  "data.max_response_length=2", "algorithm.adv_estimator=rloo",
                  "actor_rollout_ref.actor.clip_ratio_high=0.3", "trainer.total_training_steps=7",
                  "trainer.save_freq=-1", "learning_rate=3e-3", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    config = yaml.safe_load(out.stdout)
    assert config["algorithm"]["group_size"] == 8 and config["engine"]["max_response_tokens"] == 2
    assert config["algorithm"]["advantage"] == {"type": "rloo"} and config["policy"]["loss"]["clip_high"] == 0.3
    assert config["trainer"]["total_steps"] == 7 and config["trainer"]["checkpoint_every"] == 0  # verl: -1 = never
    assert config["policy"]["optimizer"]["lr"] == 3e-3
    notices = out.stderr.strip().splitlines()
    assert len(notices) == 7 and notices[0] == ("asyncrl train: actor_rollout_ref.rollout.n (verl's name) is "
                                                "asyncrl's algorithm.group_size=8")
    assert "learning_rate (TRL's name) is asyncrl's policy.optimizer.lr=0.003" in notices[-1]
    assert not (tmp_path / "outputs").exists()  # printed, not run
    refused = asyncrl("train", "actor_rollout_ref.actor.ppo_mini_batch_size=4", cwd=tmp_path)
    assert refused.returncode == 2 and "policy.mini_batches" in refused.stderr and len(refused.stderr.splitlines()) == 1


def test_verls_rollout_name_picks_our_engine_and_its_preset():
    """`actor_rollout_ref.rollout.name` (hf, sglang, vllm) is our engine with its preset (KV cache,
    rollout correction), as `engine=` gives it; vLLM where it is not installed is refused naming
    the command that installs it."""
    import importlib.util

    from asyncrl.config import ConfigError, compose

    notices = []
    assert compose(["actor_rollout_ref.rollout.name=hf"], notices=notices).engine.name == "torch"
    assert notices == ["actor_rollout_ref.rollout.name (verl's name) is asyncrl's engine.name=torch"]
    sglang = compose(["actor_rollout_ref.rollout.name=sglang", "engine.device=cpu"], notices=[])
    assert sglang.engine.name == "sglang" and sglang.engine.sglang_max_total_tokens == 8192
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ConfigError, match="`make vllm` builds .venv-vllm"):
            compose(["actor_rollout_ref.rollout.name=vllm"], notices=[])
    else:
        vllm = compose(["actor_rollout_ref.rollout.name=vllm"], notices=[])
        assert (vllm.engine.name, vllm.engine.vllm_kv_cache_mb) == ("vllm", 512)
        assert vllm.policy.loss.rollout_correction == "token_tis"
    with pytest.raises(ConfigError, match="known: sglang, vllm, hf"):
        compose(["actor_rollout_ref.rollout.name=trtllm"], notices=[])


def test_a_recipe_of_ones_own_outside_the_repository_composes_with_the_packages_groups(tmp_path):
    """`--config-dir D --config-name X`: a recipe that starts from asyncrl's config, overrides a
    group with an option of its own and still picks the package's options (model=tiny)."""
    import yaml

    recipes = tmp_path / "recipes"
    (recipes / "algorithm").mkdir(parents=True)
    (recipes / "algorithm" / "my_rloo.yaml").write_text(
        "# @package _global_\nalgorithm:\n  name: my_rloo\n  advantage:\n    type: rloo\n  group_size: 6\n")
    (recipes / "my_run.yaml").write_text(
        "defaults:\n  - config\n  - override algorithm: my_rloo\n  - _self_\ntrainer:\n  total_steps: 7\n")
    out = asyncrl("train", "--config-dir", str(recipes), "--config-name", "my_run", "--cfg", "model=tiny",
                  "task=tiny", "trainer.seed=3", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    config = yaml.safe_load(out.stdout)
    assert config["algorithm"]["name"] == "my_rloo" and config["algorithm"]["advantage"] == {"type": "rloo"}
    assert config["trainer"]["total_steps"] == 7 and config["trainer"]["seed"] == 3
    assert config["model"]["source"] == "tiny" and config["algorithm"]["group_size"] == 32  # task=tiny's, applied later
    # What --cfg prints is a recipe itself: saved and composed again, the same config.
    (recipes / "printed.yaml").write_text(out.stdout)
    again = asyncrl("train", "--config-dir", str(recipes), "--config-name", "printed", "--cfg", cwd=tmp_path)
    assert again.returncode == 0 and yaml.safe_load(again.stdout) == config, again.stderr[-2000:]
