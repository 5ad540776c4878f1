"""A task the policy solves (issue 16): saturated prompts are retired and come back, a batch waits a
bounded number of generation rounds, and `asyncrl train` ends saying why instead of spinning."""

import asyncio
import json

import numpy as np
import pytest

from actors.assembler import Assembler
from actors.prompt_source import PromptSource
from asyncrl.algo.advantages import group_normalised
from asyncrl.algo.selection import group_outcome, retirement_reason
from asyncrl.assembly.groups import GroupStrategy
from asyncrl.config import DynamicSampling, OverlongShaping
from asyncrl.data.retirement import Retirements
from asyncrl.data.tasks import Example
from asyncrl.messages.mailbox import InProcessMailbox
from asyncrl.messages.structs import FinishReason, Reward, Segment, float32_array, int32_array


def test_group_outcomes_and_when_they_retire_a_prompt():
    assert group_outcome([True] * 4, [1.0] * 4, [False] * 4) == "solved"
    assert group_outcome([False] * 4, [0.0] * 4, [False] * 4) == "unsolved"
    assert group_outcome([True, False], [1.0, 0.0], [False] * 2) is None  # signal
    assert group_outcome([None, None], [0.3, 0.3], [False] * 2) == "no_signal"  # a BT model's equal scores
    assert group_outcome([True, True], [1.0, 0.0], [False, True]) is None  # a failed reward: no outcome
    assert retirement_reason(["solved"], 2) is None
    assert retirement_reason([None, "solved", "solved"], 2) == "solved"
    assert retirement_reason(["solved", "unsolved"], 2) is None
    assert retirement_reason(["unsolved", "unsolved"], 2, retire_unsolved=False) is None
    assert retirement_reason(["solved", "solved"], 0) is None


def source(n=3, after=2, epochs=1, retry_versions=4, max_retries=8):
    examples = [Example(prompt_id=f"q{i}", messages=[{"role": "user", "content": str(i)}], ground_truth="1",
                        data_source="d") for i in range(n)]
    return PromptSource(examples, [[5, i] for i in range(n)], 2, InProcessMailbox(100), seed=0,
                        retirements=Retirements(2, after_groups=after, epochs=epochs, retry_versions=retry_versions,
                                                max_retries=max_retries))


def group(source, request, correct):
    source.record_events([], [(request.prompt_id, i, c, float(c), False) for i, c in enumerate(correct)])


def test_a_solved_prompt_sits_out_a_dataset_of_issues_comes_back_and_all_retired_is_reported():
    src = source()  # 3 prompts, G = 2, retired after 2 groups without signal, for 1 dataset (3 issues)
    issued = [src.next_request() for _ in range(9)]
    q0 = [r for r in issued if r.prompt_id.startswith("q0@")]
    assert len(q0) == 3
    group(src, q0[1], [True, True])
    group(src, q0[2], [True, True])  # solved twice: retired at issue 9, back after 3 more issues
    assert set(src.retirements.retired) == {"q0"} and src.retirements.retired["q0"].reason == "solved"
    assert src.stats()["retirement_log"][-1]["event"] == "retired"
    group(src, q0[0], [True, False])  # an older issue with signal, scored late: says nothing newer
    assert "q0" in src.retirements.retired
    later = [src.next_request() for _ in range(6)]
    is_q0 = [r.prompt_id.startswith("q0@") for r in later]
    assert not any(is_q0[:3]) and any(is_q0[3:])  # issues 10-12 skip it, the next pass tries it again
    assert src.retirements.counts["skipped"] >= 1
    group(src, later[is_q0.index(True)], [True, False])  # the re-test has signal: back in the rotation
    assert "q0" not in src.retirements.retired and src.stats()["retirement_log"][-1]["event"] == "back"


def issue_until(src, prefix, limit=20):
    """Issue prompts until one of `prefix` comes (None if it does not within `limit`)."""
    for _ in range(limit):
        request = src.next_request()
        if request is not None and request.prompt_id.startswith(prefix):
            return request
    return None


def test_an_unsolved_prompt_comes_back_as_the_policy_moves_waiting_longer_each_time_then_is_given_up():
    """Issue 44 (9): a prompt all wrong twice was parked for the rest of the run once tried again;
    now it comes back after 2, 4, 8 policy versions (`retry_versions=2`, doubling) and is given up
    only after `max_retries=3` retries all wrong, counted apart. q3 always has a signal (so there
    is something else to issue); q1 and q2 are solved. The run is not done while q0 is parked."""
    src = source(n=4, retry_versions=2, max_retries=3)
    for request in [src.next_request() for _ in range(8)]:
        kind = request.prompt_id[:2]
        group(src, request, {"q0": [False, False], "q3": [True, False]}.get(kind, [True, True]))
    retired = src.retirements.retired
    assert sorted(retired) == ["q0", "q1", "q2"] and retired["q0"].reason == "unsolved"
    assert retired["q0"].until_version == 2 and not src.stats()["all_prompts_exhausted"]
    assert src.stats()["prompts_parked"] == 1 and src.stats()["prompts_given_up"] == 0
    waits, version = [], 0
    for due in (2, 6, 14):  # each retry all wrong again: the wait doubles (2, 4, 8 versions)
        for request in [src.next_request() for _ in range(6)]:  # the policy has not reached `due`
            assert request.prompt_id[:2] != "q0", (version, due)
            if request.prompt_id.startswith("q3"):
                group(src, request, [True, False])
        version = due
        src.set_versions(version, version)
        retry = issue_until(src, "q0@")
        assert retry is not None, f"q0 did not come back at version {version}"
        group(src, retry, [False, False])
        waits.append(None if retired["q0"].given_up else retired["q0"].until_version - version)
    assert waits == [4, 8, None]  # then given up: three retries all wrong
    stats = src.stats()
    assert stats["prompts_given_up"] == 1 and stats["retired_by_reason"] == {"solved": 2, "given_up": 1}
    assert stats["retirement_log"][-1]["event"] == "given_up" and stats["retirement_log"][-1]["retries"] == 3
    src.set_versions(10**6, 10**6)  # a given-up prompt is not issued again, however far the policy moves
    assert issue_until(src, "q0@", limit=30) is None


def test_when_every_prompt_sits_out_the_unsolved_are_retried_at_once_each_retry_counted():
    """A policy that no longer moves (nothing else can be issued): the unsolved prompt due soonest
    is tried at once, each retry counts towards the bound, so the run ends after the bound, not
    at the first retry; then nothing is generated for nothing."""
    src = source(max_retries=2)
    for request in [src.next_request() for _ in range(6)]:  # two groups of each prompt, all wrong
        group(src, request, [False, False])
    assert set(src.retirements.retired) == {"q0", "q1", "q2"} and src.stats()["all_prompts_retired"]
    assert src.stats()["retired_by_reason"] == {"unsolved": 3} and not src.stats()["all_prompts_exhausted"]
    position, tried = (src.epoch, src.index), []
    for _ in range(6):  # two retries each, all wrong again
        retest = src.next_request()
        tried.append(retest.prompt_id.split("@")[0])
        assert not src.stats()["all_prompts_exhausted"] or len(tried) == 6
        group(src, retest, [False, False])
    assert sorted(tried) == ["q0", "q0", "q1", "q1", "q2", "q2"] and (src.epoch, src.index) == position
    assert src.stats()["all_prompts_exhausted"] and src.stats()["retired_sources"] == ["d"]
    assert src.stats()["retired_by_reason"] == {"given_up": 3}
    src.retest_every_s = 3600.0
    assert src.next_request() is None and (src.epoch, src.index) == position
    src.retest_every_s = 0.0
    assert src.next_request() is not None and src.retirements.counts["retests"] == 7


def test_a_parked_prompt_has_one_retry_out_at_a_time():
    """Two retries issued before the first's outcome came would spend two retries on one look at
    the same policy (the prompt source issues several prompts per call)."""
    src = source(n=2)
    for request in [src.next_request() for _ in range(4)]:
        group(src, request, [False, False])
    first, second = src.next_request(), src.next_request()
    assert {first.prompt_id[:2], second.prompt_id[:2]} == {"q0", "q1"}
    assert src.next_request() is None  # both retries are out
    group(src, first, [False, False])
    assert src.next_request().prompt_id[:2] == first.prompt_id[:2]


def seg(prompt, idx, first_token):
    return Segment(prompt_id=prompt, sample_idx=idx, window=0, group_id=prompt, group_size=2,
                   prompt_token_ids=int32_array([5]), prior_response_ids=int32_array([]), prior_versions=int32_array([]),
                   new_token_ids=int32_array([first_token]), new_logprobs=float32_array([-1.0]),
                   new_versions=int32_array([0]), finished=True, finish_reason=FinishReason.EOS)


def test_bounded_refill_trains_on_what_has_signal_or_skips_saying_why():
    settings = DynamicSampling(enabled=True, max_refill_rounds=2)

    async def score(requests):  # token 7 is correct
        return [Reward(prompt_id=r.prompt_id, sample_idx=r.sample_idx, score=float(r.response_text == "7"),
                       correct=r.response_text == "7", source="t") for r in requests]

    async def main():
        segments, batches = InProcessMailbox(100), InProcessMailbox(100)
        asm = Assembler(segments, batches, score, lambda ids: "".join(map(str, ids)),
                        GroupStrategy(settings, 2, group_normalised), OverlongShaping(), 8, max_staleness_versions=4)
        # Two rounds of two groups (a batch is two groups with signal): one group with signal, three solved.
        for i, tokens in enumerate([(7, 7), (7, 3), (7, 7), (7, 7)]):
            await segments.put([seg(f"p{i}", 0, tokens[0]), seg(f"p{i}", 1, tokens[1])])
            for _ in range(2):
                await asm.step(timeout=0.01)
                await asyncio.sleep(0.01)
        partial = await batches.get(10, timeout=0.1)
        # Then two more rounds with nothing to learn: a batch with no rows and the reason.
        for i in range(4, 8):
            await segments.put([seg(f"p{i}", 0, 7), seg(f"p{i}", 1, 7)])
            for _ in range(2):
                await asm.step(timeout=0.01)
                await asyncio.sleep(0.01)
        skip = await batches.get(10, timeout=0.1)
        return partial, skip, asm.counters

    partial, skip, counters = asyncio.run(main())
    assert len(partial) == 1 and len(partial[0].rows) == 2 and partial[0].stats["groups_in_batch"] == 1.0
    assert partial[0].stats["refill_rounds"] == 2.0 and not partial[0].skip_reason
    assert len(skip) == 1 and skip[0].rows == [] and "no group with a learning signal" in skip[0].skip_reason
    assert counters["batches_partial"] == 1 and counters["steps_skipped_no_signal"] == 1


@pytest.mark.slow
def test_dapo_on_a_task_it_solves_ends_saying_why_with_bounded_steps(solved_dapo_run):
    """The issue's run (DAPO, tiny task, 400 steps): before, dynamic sampling dropped almost every
    group once the task was solved and each step needed ever more generation (57 s a step by 214)."""
    config, summary, run_dir = solved_dapo_run
    assert config.algorithm.name == "dapo" and config.algorithm.dynamic_sampling.max_refill_rounds > 0
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    # Ended by retirement (everything solved), well before 400 steps, not by the stall timeout.
    # Ended when nothing was left to learn (every prompt solved, or all wrong again when tried once
    # more), or at 400 steps of bounded length; never by the stall timeout.
    assert summary["stop_reason"].startswith("every prompt is retired") or len(records) == 400
    assert summary["eval_after"]["accuracy"] >= 0.5
    # No step waited more than the bound of generation rounds; a skipped step says why.
    bound = config.algorithm.dynamic_sampling.max_refill_rounds
    assert max(r.get("refill_rounds", 0) for r in records) <= bound + 1e-9
    assert all(r["skip_reason"] for r in records if r.get("skipped"))
    # The log says which prompts were retired and why; the share rose to 1.
    retirements = [json.loads(line) for line in open(run_dir / "retirements.jsonl")]
    assert {e["reason"] for e in retirements if e["event"] == "retired"} >= {"solved"}
    assert records[-1]["prompts_retired_share"] >= 0.7 and np.isfinite(records[-1]["reward_mean_generated"])
    ledger = summary["final_status"]["ledger"]
    assert ledger["problems"] == [] and ledger["duplicates"] == 0
