"""A reward function of the user's (`kind: python`), called as verl and TRL call theirs, in the
endpoint's worker processes: what it returns becomes a reward; whatever goes wrong (it raises, hangs,
returns NaN, a string, a list of the wrong length) becomes a failed reward with the reason; a new
file and version swap in. verl's own scorers, from its published wheel, work as they are."""

import asyncio
import glob
import os
import textwrap
import time
import zipfile

import pytest

from asyncrl.config import ConfigError, PythonRewardEndpoint, compose
from asyncrl.messages.structs import RewardRequest
from asyncrl.rewards.endpoint import RewardEndpoint, build_scorer
from asyncrl.rewards.user_function import detect_signature, load_function

VERL_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the answer is right; the length and where it came from as extras (verl's dict form)."""
    if isinstance(ground_truth, dict):  # a dict of answers reaches the function as a dict
        ground_truth = ground_truth["answer"]
    right = solution_str.strip() == str(ground_truth)
    return {"score": 1.0 if right else 0.0, "acc": right, "length": len(solution_str),
            "index": extra_info["index"], "sample": extra_info["sample_index"], "note": "not a number"}
'''
TRL_REWARD = '''
def reward_len(prompts, completions, ground_truth, **columns):
    """TRL's batched form: None (not applicable) where the data has no answer."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [None if truth is None else float(t == truth) for t, truth in zip(texts, ground_truth)]
'''
FAULTS = '''
import math, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "raise":
        raise KeyError("no such key")
    if solution_str == "hang":
        time.sleep(60)
    if solution_str == "nan":
        return math.nan
    if solution_str == "string":
        return "0.5"
    if solution_str == "none":
        return None
    return 1.0


async def compute_async(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str))


def wrong_length(prompts, completions, **columns):
    return [1.0]
'''


def request(text, truth="4", idx=0, row=None, source="mine"):
    return RewardRequest(prompt_id=f"p{idx}", sample_idx=idx, response_text=text, ground_truth=truth,
                         data_source=source, prompt_text="2+2?", row=row)


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def scorer(path, function="compute_score", **settings):
    return build_scorer(PythonRewardEndpoint(path=path, function=function, **settings), None, "zero_one")


def test_a_verl_reward_file_scores_with_its_extras_and_the_rows_extra_info(tmp_path):
    s = scorer(write(tmp_path, "reward.py", VERL_REWARD))
    try:
        assert s.signature == "verl"
        row = {"prompt": [{"role": "user", "content": "2+2?"}], "extra_info": {"index": 7}}
        right, wrong, as_dict = s.score([request("4", row=row), request("5", idx=1, row=row),
                                         request("4", truth={"answer": "4"}, idx=2, row=row)])
        assert (right.score, right.correct, right.failed) == (1.0, True, False)
        assert (wrong.score, wrong.correct) == (0.0, False) and as_dict.score == 1.0
        # The other numbers go to the step records; the row's extra_info came with the sample's identity.
        assert right.details["extra"] == {"acc": 1.0, "length": 1.0, "index": 7.0, "sample": 0.0}
        assert wrong.details["extra"]["sample"] == 1.0
    finally:
        s.close()


def test_trl_reward_function_is_called_per_batch_and_none_falls_through(tmp_path):
    s = scorer(write(tmp_path, "trl_reward.py", TRL_REWARD), "reward_len")
    try:
        assert s.signature == "trl"
        chat = {"prompt": [{"role": "user", "content": "2+2?"}], "answer": "4"}
        out = s.score([request("4", row=chat), request("5", idx=1, row=chat), request("4", truth=None, idx=2)])
        assert [r.score for r in out[:2]] == [1.0, 0.0] and not any(r.failed for r in out[:2])
        assert out[2].failed and out[2].details["not_applicable"]  # None: the next endpoint of a hybrid route
    finally:
        s.close()


def test_every_fault_of_a_users_function_is_a_failed_reward_with_its_reason(tmp_path):
    path = write(tmp_path, "faults.py", FAULTS)
    s = scorer(path, call_timeout_s=2.0)
    try:
        out = s.score([request(text, idx=i) for i, text in enumerate(["raise", "hang", "nan", "string", "none", "ok"])])
        reasons = [r.details.get("error", "") for r in out]
        assert [r.failed for r in out] == [True] * 5 + [False]
        assert "KeyError" in reasons[0] and "ran past 2 s (killed)" in reasons[1]
        assert "nan, not a finite number" in reasons[2] and "'0.5', not a finite number" in reasons[3]
        assert "None, not a finite number" in reasons[4] and out[5].score == 1.0
        assert s.stats()["timed_out"] == 1 and s.stats()["failed"] == 5
        # The workers still serve after one was killed for hanging.
        assert s.score([request("ok")])[0].score == 1.0
    finally:
        s.close()
    asynchronous = scorer(path, "compute_async")
    try:
        assert asynchronous.score([request("abc")])[0].score == 3.0  # async def: awaited
    finally:
        asynchronous.close()
    batch = scorer(path, "wrong_length", signature="trl")
    try:
        out = batch.score([request("a"), request("b", idx=1)])
        assert all(r.failed and "returned 1 values for 2 completions" in r.details["error"] for r in out)
    finally:
        batch.close()


def test_a_call_past_its_deadline_stops_its_samples_in_the_workers(tmp_path):
    # The router's deadline cancels the endpoint's call: the workers hanging on its samples are
    # killed and the samples not begun never start, so the next call is served at once instead of
    # after the hung ones' call_timeout_s.
    endpoint = RewardEndpoint("custom", PythonRewardEndpoint(path=write(tmp_path, "faults.py", FAULTS), workers=2,
                                                             call_timeout_s=60.0))
    endpoint.scorer.score([request("ok")])  # the workers are up: the timing below is the call's alone

    async def late_then_next():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(endpoint.score([request("hang", idx=i) for i in range(4)]), timeout=1.0)
        start = time.monotonic()
        [reward] = await endpoint.score([request("ok", idx=9)])
        return reward, time.monotonic() - start

    try:
        reward, took = asyncio.run(late_then_next())
        assert reward.score == 1.0 and took < 20, took
        stats = endpoint.stats()
        assert stats["samples_cancelled"] == 4 and stats["cancelled"] == 1  # the call, at the endpoint
    finally:
        endpoint.scorer.close()


def test_an_endpoint_bound_past_the_call_deadline_is_refused():
    with pytest.raises(ConfigError, match=r"reward.endpoints.mine.call_timeout_s=120 must be below reward.timeout_s=60"):
        compose(["+reward.endpoints.mine={kind: python, path: r.py, call_timeout_s: 120}", "reward.timeout_s=60"])
    with pytest.raises(ConfigError, match=r"reward.endpoints.j.request_timeout_s=60 must be below reward.timeout_s=30"):
        compose(["+reward.endpoints.j={kind: openai, base_url: 'http://x/v1', model: m}", "reward.timeout_s=30"])
    compose(["+reward.endpoints.mine={kind: python, path: r.py, call_timeout_s: 10}", "reward.timeout_s=60"])


def test_signatures_and_files_that_cannot_work_are_refused_at_start_up(tmp_path):
    def unknown(x, y):
        return 0.0

    with pytest.raises(ValueError, match="cannot tell the signature of unknown"):
        detect_signature(unknown, "auto")
    with pytest.raises(ValueError, match="has no function 'score_it'.*compute_score"):
        load_function(write(tmp_path, "r.py", VERL_REWARD), "score_it")
    with pytest.raises(FileNotFoundError):
        load_function(str(tmp_path / "missing.py"), "compute_score")
    from asyncrl.data.files import check_prompts

    config = compose(["model=tiny", "task=tiny", f"+reward.endpoints.mine={{kind: python, path: {tmp_path}/missing.py}}",
                      "reward.routes=[{match: '*', endpoints: [mine]}]"])
    with pytest.raises(ConfigError, match=r"reward.endpoints.mine \(.*missing.py:compute_score\): FileNotFoundError"):
        check_prompts(config)


def test_a_new_file_and_version_swap_in_through_reconfigure(tmp_path):
    import asyncio

    path = write(tmp_path, "swap.py", "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                      "    return 1.0\n")
    endpoint = RewardEndpoint("mine", {"kind": "python", "path": path, "version": "1"})
    try:
        first = asyncio.run(endpoint.score([request("x")]))[0]
        write(tmp_path, "swap.py", "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                   "    return 0.25\n")
        endpoint.reconfigure({"version": "2"})  # the file is read again
        second = asyncio.run(endpoint.score([request("x")]))[0]
        assert (first.score, first.source_version) == (1.0, "mine:python:1")
        assert (second.score, second.source_version) == (0.25, "mine:python:2")
    finally:
        endpoint.scorer.close()


def test_a_swap_lets_the_calls_at_work_on_the_old_file_finish_then_closes_its_workers(tmp_path):
    """Serve reconfigures a replica while its calls run: they finish on the old file's workers with
    the old version (none is failed), and those workers stop when the last of them ends."""
    slow = "import time\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n" \
           "    time.sleep(2.0)\n    return 1.0\n"
    path = write(tmp_path, "swap.py", slow)
    endpoint = RewardEndpoint("mine", {"kind": "python", "path": path, "version": "1", "workers": 2})

    async def swap_during_calls():
        calls = asyncio.gather(endpoint.score([request("a", idx=0)]), endpoint.score([request("b", idx=1)]))
        await asyncio.sleep(1.0)  # both calls are in the old file's workers now
        old = endpoint.scorer
        write(tmp_path, "swap.py", "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                   "    return 0.25\n")
        endpoint.reconfigure({"version": "2"})
        still_open = old.workers.active
        during = await calls
        return old, still_open, during, await endpoint.score([request("c", idx=2)])

    try:
        old, still_open, during, after = asyncio.run(swap_during_calls())
        assert still_open  # not stopped under the calls at work on it
        assert [(r.failed, r.score, r.source_version) for group in during for r in group] == \
            [(False, 1.0, "mine:python:1")] * 2
        assert (after[0].score, after[0].source_version) == (0.25, "mine:python:2")
        assert not old.workers.active  # closed once its last call ended
    finally:
        endpoint.scorer.close()


def verl_wheel() -> str:
    """verl's published wheel (`make setup` downloads it, without its dependencies, into .cache/)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    wheels = sorted(glob.glob(os.path.join(root, ".cache", "wheels", "verl-*.whl")))
    if not wheels:
        pytest.fail("verl's wheel is missing: run `make setup` (it downloads it into .cache/wheels)")
    return wheels[-1]


@pytest.mark.parametrize("module, right, wrong", [
    ("gsm8k", "so the answer is #### 72", "#### 71"),  # verl's GSM8K scorer: the number after ####
    ("math_dapo", "Answer: 72", "Answer: 71"),  # verl's DAPO maths scorer
])
def test_verls_own_scorers_work_as_they_are(tmp_path, module, right, wrong):
    with zipfile.ZipFile(verl_wheel()) as wheel:
        source = wheel.read(f"verl/utils/reward_score/{module}.py").decode()
    s = scorer(write(tmp_path, f"{module}.py", source))
    try:
        assert s.signature == "verl"
        good, bad = s.score([request(right, truth="72", source="openai/gsm8k"),
                             request(wrong, truth="72", idx=1, source="openai/gsm8k")])
        assert not good.failed and not bad.failed and good.score > bad.score
    finally:
        s.close()
