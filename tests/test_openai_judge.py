"""The `openai` judge against a live OpenAI-compatible server: the project's own policy endpoint
serving the embedded SmolLM2 under Serve (a server no judge code here wrote). Pointwise and pairwise
verdicts arrive through the API; a server that is not there gives failed rewards at once, not a
stall; a call past its deadline sends no more requests; the key never reaches the records."""

import asyncio
import os
import socket
import time

import pytest
from ray import serve

from asyncrl.config import OpenAIJudgeEndpoint
from asyncrl.messages.structs import PairRequest, RewardRequest
from asyncrl.rewards.endpoint import RewardEndpoint, build_scorer
from asyncrl.serve.reward import deploy_declaratively
from asyncrl.weights.sync import free_port


@pytest.fixture(scope="module")
def policy_server(ray_session):
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    deploy_declaratively([{"name": "judge-policy", "route_prefix": "/v1", "import_path": "asyncrl.serve.policy:build_policy",
                           "args": {"overrides": "serve.follow_learner=false trainer.wandb_mode=disabled"}}],
                         timeout_s=300)
    yield f"http://127.0.0.1:{port}/v1"
    serve.delete("judge-policy")
    serve.shutdown()


def requests():
    return [RewardRequest(prompt_id="p", sample_idx=i, response_text=text, ground_truth="12", data_source="chat",
                          prompt_text="Sam has 5 apples and gets 7 more. How many apples does Sam have?")
            for i, text in enumerate(["Sam has 12 apples. The answer is 12.", "I like turtles."])]


def test_pointwise_and_pairwise_verdicts_arrive_from_a_live_server(policy_server, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "sk-not-a-real-key-123")
    judge = build_scorer(OpenAIJudgeEndpoint(base_url=policy_server, model="smollm2-135m", api_key_env="JUDGE_KEY",
                                             version="v1"), None, "zero_one")
    try:
        rewards = judge.score(requests())
        assert [r.failed for r in rewards] == [False, False], [r.details for r in rewards]
        assert all(0.0 <= r.score <= 1.0 and r.source == "openai" for r in rewards)
        assert all(r.details["mass"] > 1e-3 for r in rewards)  # read from the server's top log-probs
        (pair,) = judge.compare([PairRequest(prompt_text=requests()[0].prompt_text, first=requests()[0].response_text,
                                             second=requests()[1].response_text)])
        assert not pair["failed"] and 0.0 <= pair["p_first"] <= 1.0
        assert abs(pair["p_first_forward"] - pair["p_first_swapped"]) <= 1.0  # both orders were asked
        stats = judge.stats()
        assert stats["requests"] == 4 and stats["errors"] == 0
        assert "sk-not-a-real-key" not in repr(stats) and "sk-not-a-real-key" not in repr(rewards)
    finally:
        judge.close()


def test_a_server_that_is_not_there_gives_failed_rewards_not_a_stall():
    dead = f"http://127.0.0.1:{free_port()}/v1"
    judge = build_scorer(OpenAIJudgeEndpoint(base_url=dead, model="m", retries=1, request_timeout_s=2.0), None,
                         "zero_one")
    try:
        start = time.monotonic()
        rewards = judge.score(requests())
        assert time.monotonic() - start < 30
        assert all(r.failed and "answered none of 2 requests" in r.details["error"] for r in rewards)
        assert all("APIConnectionError" in r.details["error"] for r in rewards)
    finally:
        judge.close()
    with pytest.raises(ValueError, match="NOT_SET_ANYWHERE .api_key_env. is not set"):
        build_scorer(OpenAIJudgeEndpoint(base_url=dead, model="m", api_key_env="NOT_SET_ANYWHERE"), None, "zero_one")
    assert "NOT_SET_ANYWHERE" not in os.environ


def test_a_call_past_its_deadline_sends_none_of_its_remaining_requests():
    # A server that takes connections and never answers (wedged); one request at a time.
    wedged = socket.socket()
    wedged.bind(("127.0.0.1", 0))
    wedged.listen(64)
    url = f"http://127.0.0.1:{wedged.getsockname()[1]}/v1"
    endpoint = RewardEndpoint("judge", OpenAIJudgeEndpoint(base_url=url, model="m", retries=0, request_timeout_s=3.0,
                                                           max_concurrency=1))
    many = [RewardRequest(prompt_id="p", sample_idx=i, response_text=f"{i}", ground_truth="12", data_source="chat",
                          prompt_text="q") for i in range(6)]

    async def past_the_deadline():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(endpoint.score(many), timeout=1.0)

    try:
        start = time.monotonic()
        asyncio.run(past_the_deadline())  # returns once the call's thread is done
        # The request in flight ran to its own timeout; the five after it were never sent (one by
        # one, they would have held the endpoint for 6 x 3 s).
        assert time.monotonic() - start < 12
        sent = endpoint.scorer.stats()  # the judge's own counts (the endpoint's stats count calls)
        assert sent["requests"] == 1 and sent["requests_not_sent"] == 5, sent
        assert endpoint.stats()["cancelled"] == 1
    finally:
        endpoint.scorer.close()
        wedged.close()
