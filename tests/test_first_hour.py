"""The first hour, round three: the mistakes every newcomer makes, each said at once and where.

verl's data names train the user's data (not the built-in task); dotted names in any order; verl's
machinery settings listed once; a reward function returning numpy or torch numbers scores; a
reward that raises stops the run at once with exit status 1 and the exception on the console; a
reward file, function, data file or column that is not there is one line before Ray starts;
`--cfg` loads neither torch nor Ray; defaults that do not fit the data are said. Each through the
real command line (`asyncrl ...` in a subprocess) or the real worker processes of a reward."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from asyncrl.config import ConfigError, PythonRewardEndpoint, compose
from asyncrl.config.names import IGNORED, ignored_reason
from asyncrl.config import Config
from asyncrl.messages.structs import RewardRequest
from asyncrl.rewards.endpoint import build_scorer
from asyncrl.run.status import reward_failure_lines

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def asyncrl(*args, cwd, timeout=600):
    """`asyncrl ...` as a user runs it: (exit status, stdout + stderr, seconds)."""
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "asyncrl.cli", *args], capture_output=True, text=True, cwd=cwd,
                         timeout=timeout, env={**os.environ, "WANDB_MODE": "disabled"})
    return out.returncode, out.stdout + out.stderr, time.monotonic() - start


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """`asyncrl data example` in a directory of the user's: probe/train.parquet, test.parquet, reward.py."""
    home = tmp_path_factory.mktemp("home")
    code, out, _ = asyncrl("data", "example", "--out", "probe", "task.num_train_prompts=16",
                           "task.num_eval_prompts=4", cwd=home)
    assert code == 0, out
    return home


def write(directory, name: str, text: str) -> str:
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        f.write(textwrap.dedent(text))
    return path


# --- the command line's names ----------------------------------------------------------------------

def test_verls_data_names_select_the_file_task_and_a_built_in_task_beside_them_is_refused():
    notices: list[str] = []
    config = compose(["data.train_files=a.parquet", "data.val_files=b.parquet"], notices=notices)
    assert (config.task.name, config.task.path, config.task.eval_path) == ("file", "a.parquet", "b.parquet")
    assert compose(["dataset_name=shards/"]).task.name == "file"  # TRL's
    assert compose(["task.path=a.parquet"]).task.name == "file"
    with pytest.raises(ConfigError, match=r"data.train_files names a data file.*task=arithmetic is a built-in"):
        compose(["task=arithmetic", "data.train_files=a.parquet"])
    assert compose(["task=file", "data.train_files=a.parquet"]).task.name == "file"
    # A built-in task's settings for the user's files: named so, it is the file task.
    both = compose(["task=tiny", "task.name=file", "task.path=a.parquet"])
    assert (both.task.name, both.task.path) == ("file", "a.parquet")


def test_dotted_names_are_order_free():
    first = compose(["custom_reward_function.name=score_it", "custom_reward_function.path=r.py"])
    second = compose(["custom_reward_function.path=r.py", "custom_reward_function.name=score_it"])
    assert first.reward.endpoints["custom"].function == second.reward.endpoints["custom"].function == "score_it"


def test_verls_machinery_settings_are_listed_in_one_notice_with_what_asyncrl_does_instead():
    notices: list[str] = []
    compose(["trainer.val_before_train=false", "trainer.nnodes=1", "data.truncation=error",
             "actor_rollout_ref.actor.fsdp_config.param_offload=true",
             "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "trainer.n_gpus_per_node=8"], notices=notices)
    listed = [line for line in notices if "not applied" in line]
    assert len(listed) == 1 and listed[0].startswith("7 of verl's settings"), notices
    for key in ("trainer.val_before_train: ", "actor_rollout_ref.actor.fsdp_config.param_offload: the learner's sharding",
                "data.truncation: prompts longer than task.max_prompt_length"):
        assert key in listed[0]
    # None of our own fields is ever taken for one of verl's.
    ours = [path for path in _our_paths() if ignored_reason(path)]
    assert not ours and IGNORED


def _our_paths() -> list[str]:
    import msgspec

    def walk(node, prefix):
        if isinstance(node, dict):
            for key, value in node.items():
                yield from walk(value, f"{prefix}.{key}" if prefix else key)
        else:
            yield prefix

    return list(walk(msgspec.to_builtins(Config()), ""))


def test_cfg_imports_neither_torch_nor_ray_and_eval_and_generate_take_it(tmp_path):
    code = ("import sys; from asyncrl.cli import main; main(['train', '--cfg', 'model=tiny']); "
            "print('torch' in sys.modules, 'ray' in sys.modules, file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0 and "name: tiny" in out.stdout and out.stderr.strip().endswith("False False"), out.stderr
    recipes = tmp_path / "mine"
    recipes.mkdir()
    (recipes / "short.yaml").write_text("defaults:\n  - config\n  - _self_\nengine:\n  max_response_tokens: 24\n")
    for command in ("eval", "generate"):
        status, text, _ = asyncrl(command, "--cfg", "--config-dir", str(recipes), "--config-name", "short",
                                  "model=tiny", cwd=tmp_path)
        assert status == 0 and "max_response_tokens: 24" in text and "name: tiny" in text, text


# --- the user's reward function ---------------------------------------------------------------------

NUMERIC = '''
import numpy as np
import torch

def numpy_scalar(data_source, solution_str, ground_truth, extra_info=None):
    return np.float32(0.5)

def zero_d(data_source, solution_str, ground_truth, extra_info=None):
    return torch.tensor(0.25)

def boolean(data_source, solution_str, ground_truth, extra_info=None):
    return solution_str == ground_truth

def numpy_dict(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": np.float64(1.0), "acc": np.bool_(True), "length": np.int64(len(solution_str))}

def trl_array(prompts, completions, **columns):
    return np.array([0.75] * len(completions), dtype=np.float32)

def trl_tensor(prompts, completions, **columns):
    return torch.full((len(completions),), 0.125)
'''


@pytest.mark.parametrize("function,scores", [
    ("numpy_scalar", [0.5, 0.5]), ("zero_d", [0.25, 0.25]), ("boolean", [1.0, 0.0]), ("numpy_dict", [1.0, 1.0]),
    ("trl_array", [0.75, 0.75]), ("trl_tensor", [0.125, 0.125])])
def test_a_function_may_return_what_python_users_return(tmp_path, function, scores):
    path = write(tmp_path, "numeric.py", NUMERIC)
    scorer = build_scorer(PythonRewardEndpoint(path=path, function=function), None, "zero_one")
    try:
        requests = [RewardRequest(prompt_id=f"p{i}", sample_idx=i, response_text=text, ground_truth="4",
                                  data_source="mine", prompt_text="2+2?") for i, text in enumerate(["4", "5"])]
        rewards = scorer.score(requests)
        assert [r.failed for r in rewards] == [False, False], [r.details for r in rewards]
        assert [r.score for r in rewards] == scores
        if function == "numpy_dict":
            assert rewards[0].correct is True and rewards[0].details["extra"]["length"] == 1.0
    finally:
        scorer.close()


def test_the_console_says_each_endpoints_first_failure_once_and_stops_when_all_fail():
    health = {"samples_scored": 8, "reward_failures": 8, "endpoints": {"custom": {
        "rewards": 8, "failed": 8, "first_failure": {"error": "KeyError: 'answer' in compute_score (r.py)",
                                                     "prompt_id": "arithmetic-3", "sample_idx": 1}}}}
    announced: set[str] = set()
    notices, failing = reward_failure_lines(health, announced, fail_fast_samples=8)
    assert notices == ["reward endpoint 'custom' failed: KeyError: 'answer' in compute_score (r.py) (prompt "
                       "arithmetic-3, sample 1); failed rewards are counted in each step's reward_failed"]
    assert failing.startswith("every reward of the first 8 samples failed") and "KeyError: 'answer'" in failing
    again, _ = reward_failure_lines(health, announced, fail_fast_samples=8)
    assert again == []  # said once
    assert reward_failure_lines(health, set(), fail_fast_samples=9)[1] == ""  # not yet N samples
    assert reward_failure_lines({**health, "reward_failures": 7}, set(), fail_fast_samples=8)[1] == ""  # one scored
    assert reward_failure_lines(health, set(), fail_fast_samples=0)[1] == ""  # never


# --- the run, end to end ------------------------------------------------------------------------

RAISES = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(extra_info["answer"] == solution_str)
'''


def test_a_reward_that_raises_stops_the_run_at_once_with_exit_status_1_and_says_why(data):
    write(data, "probe/raises.py", RAISES)
    code, out, seconds = asyncrl("train", "model=tiny", "algorithm=grpo", "data.train_files=probe/train.parquet",
                                 "data.val_files=probe/test.parquet", "custom_reward_function.path=probe/raises.py",
                                 "trainer.total_steps=3", "trainer.run_dir=runs/raises", cwd=data)
    assert code == 1, out
    assert "held-out accuracy before training: 0.000 (n=4), 4 of 4 rewards failed: KeyError: 'answer' in " \
           "compute_score" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("asyncrl train: every reward of the held-out evaluation failed") and "KeyError" in last
    assert "Traceback" not in out and "starting the run's actors" not in out  # before a role starts
    print(f"stopped after {seconds:.1f} s")


TRAIN_ONLY = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if extra_info["split"] == "train":
        raise KeyError("answer")
    return 0.0
'''


def test_a_reward_that_fails_in_training_only_stops_the_run_within_its_first_samples(data):
    write(data, "probe/train_only.py", TRAIN_ONLY)
    code, out, seconds = asyncrl("train", "model=tiny", "algorithm=grpo", "data.train_files=probe/train.parquet",
                                 "data.val_files=probe/test.parquet", "custom_reward_function.path=probe/train_only.py",
                                 "trainer.total_steps=5", "trainer.run_dir=runs/train_only",
                                 "engine.max_response_tokens=8", "engine.window_tokens=8", cwd=data)
    assert code == 1, out
    assert "reward endpoint 'custom' failed: KeyError: 'answer' in compute_score" in out
    last = out.strip().splitlines()[-1]
    assert last.startswith("asyncrl train: every reward of the first") and "KeyError: 'answer'" in last, last
    assert "Traceback" not in out and "StallError" not in out
    print(f"stopped after {seconds:.1f} s")


@pytest.mark.parametrize("override,said", [
    ("custom_reward_function.path=probe/missing.py", "function file probe/missing.py does not exist"),
    ("custom_reward_function.path=probe/broken.py", "NameError: name 'undefined_name' is not defined"),
    ("custom_reward_function.name=score", "has no function 'score' (it has: compute_score)"),
    ("data.val_files=probe/nowhere.parquet", "'probe/nowhere.parquet' names no file or directory"),
    ("task.prompt_key=question", "has no `question` column (task.prompt_key)"),
])
def test_start_up_mistakes_are_one_line_before_ray_starts(data, override, said):
    write(data, "probe/broken.py", "undefined_name\n")
    args = ["train", "model=tiny", "data.train_files=probe/train.parquet", "data.val_files=probe/test.parquet",
            "custom_reward_function.path=probe/reward.py", override]
    code, out, _ = asyncrl(*args, cwd=data)
    assert code == 2 and said in out, out
    assert "Traceback" not in out and "Ray instance" not in out, out


def test_defaults_that_do_not_fit_the_data_are_said(data, tmp_path):
    from asyncrl.data.files import fit_notices
    from asyncrl.models.loading import load_tokenizer

    long_answers = write(tmp_path, "long.jsonl", "".join(
        f'{{"prompt": [{{"role": "user", "content": "q{i}"}}], "reward_model": {{"ground_truth": "{"7" * 40}"}}}}\n'
        for i in range(3)))
    config = compose(["model=tiny", "algorithm=grpo", f"data.train_files={long_answers}", "engine.max_response_tokens=16",
                      "engine.window_tokens=16"])
    notices = fit_notices(config, load_tokenizer(config.model), context_tokens=4096)
    assert any("3 of 3 answers (reward_model.ground_truth) are longer than engine.max_response_tokens=16" in n
               for n in notices), notices
    assert any("no task.eval_path: the held-out accuracy is measured on training prompts" in n for n in notices)
    crowded = fit_notices(config, load_tokenizer(config.model), context_tokens=12)
    assert any("3 of 3 prompts are longer than the model's 12-token context" in n for n in crowded), crowded
    assert fit_notices(compose(["model=tiny", "task=tiny"]), load_tokenizer(config.model), 4096) == []
