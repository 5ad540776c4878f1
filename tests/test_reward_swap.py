"""Hot-swapping a reward endpoint (its own Serve application) while training runs."""

import time

import httpx
import pytest
from ray import serve

from asyncrl.config import compose
from asyncrl.run import Run
from asyncrl.serve.reward import deploy_declaratively, reward_app_config
from asyncrl.weights.sync import free_port

OVERRIDES = "model=tiny task=tiny algorithm=grpo trainer.wandb_mode=disabled reward.use_serve=true"
REWARD_TOKEN = "swap-test-token"  # POST /score needs one (`asyncrl.serve.guards`)
REWARD_OVERRIDES = f"model=tiny task=tiny algorithm=grpo serve.reward_token={REWARD_TOKEN}"


def versions(status):
    return {k.removeprefix("rewards_by_version."): v for k, v in status.assembler.items()
            if k.startswith("rewards_by_version.")}


def replica_pids() -> set[int]:
    handle = serve.get_app_handle("reward-verifier")
    return {handle.pid.remote().result() for _ in range(16)}  # two replicas, requests spread over both


def wait_for(predicate, run, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        run.check_alive()
        status = run.status()
        if predicate(status):
            return status
        time.sleep(1.0)
    raise AssertionError(f"timed out; last status: {versions(status)} step {status.step}")


@pytest.mark.slow
def test_reward_endpoint_swaps_while_training_with_no_failed_request(ray_session, tmp_path):
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    # Deployed as `serve deploy configs/serve.yaml` deploys it (serve.run would restart replicas on
    # every redeploy, user_config-only changes included).
    deploy_declaratively([reward_app_config("verifier", REWARD_OVERRIDES, {"version": "1"})])
    run = Run(compose([*OVERRIDES.split(), f"trainer.run_dir={tmp_path}"]), "", name_learner=False).start()
    try:
        wait_for(lambda s: s.step >= 3, run)
        pids = replica_pids()
        assert len(pids) == 2

        # 1. Settings swap through user_config: reconfigure in place, the same replicas; the version changes.
        deploy_declaratively([reward_app_config("verifier", REWARD_OVERRIDES, {"version": "2"})])
        assert replica_pids() == pids
        wait_for(lambda s: versions(s).get("verifier:verifier:2", 0) > 0, run)

        # 2. A code/model swap: new constructor arguments roll the replicas (two: one always serves).
        deploy_declaratively([reward_app_config("verifier", REWARD_OVERRIDES + " reward.endpoints.verifier.code_wall_s=3.0",
                                                {"version": "3"})])
        assert not replica_pids() & pids
        status = wait_for(lambda s: versions(s).get("verifier:verifier:3", 0) > 0, run)
        step_at_swap = status.step
        status = wait_for(lambda s: s.step >= step_at_swap + 3, run)

        assembler = status.assembler
        assert assembler["reward_failures"] == 0, assembler["last_reward_failure"]
        assert set(versions(status)) >= {"verifier:verifier:1", "verifier:verifier:2", "verifier:verifier:3"}
        # The status's endpoint table shows the swap (the endpoint is a Serve app, not an actor of the run).
        row = status.reward_endpoints["verifier"]
        assert row["where"] == "serve app reward-verifier" and row["version"] == "verifier:verifier:3"
        assert set(row["versions"]) >= {"verifier:verifier:1", "verifier:verifier:3"} and row["failed"] == 0
        # Nothing lost: every scored sample is in a group that is open, emitted or dropped.
        assert assembler["samples_scored"] == sum(versions(status).values())
        assert assembler.get("duplicate_segments", 0) == 0

        # The endpoint also answers HTTP; bad input is a 4xx with a reason, not a crash.
        url = f"http://127.0.0.1:{port}/reward/verifier/score"
        auth = {"authorization": f"Bearer {REWARD_TOKEN}"}
        ok = httpx.post(url, json={"requests": [{"prompt_id": "p", "sample_idx": 0, "response_text": "4",
                                                 "ground_truth": "4", "data_source": "tiny"}]}, headers=auth,
                        timeout=30)
        assert ok.status_code == 200 and ok.json()["rewards"][0]["score"] == 1.0
        bad = httpx.post(url, json={"requests": [{"prompt_id": "p"}]}, headers=auth, timeout=30)
        assert bad.status_code == 400 and "invalid request" in bad.json()["error"]["message"]
        assert httpx.post(url, json={"requests": []}, headers=auth, timeout=30).status_code == 400
        # A chunked body (no Content-Length) is read through the guard whole when small, refused as
        # it streams when not; and a caller on this machine without the token is refused.
        chunked = httpx.post(url, content=iter([b'{"requests": [{"prompt_id": "p", "sample_idx": 0, ',
                                               b'"response_text": "4", "ground_truth": "4", "data_source": "tiny"}]}']),
                             headers={**auth, "content-type": "application/json"}, timeout=30)
        assert chunked.status_code == 200 and chunked.json()["rewards"][0]["score"] == 1.0
        huge = httpx.post(url, content=(b"x" * (1 << 20) for _ in range(17)),
                          headers={**auth, "content-type": "application/json"}, timeout=60)
        assert huge.status_code == 413
        assert httpx.post(url, json={"requests": []}, timeout=30).status_code == 401  # no token sent
    finally:
        run.stop()
        serve.delete("reward-verifier")
        serve.shutdown()


@pytest.mark.slow  # (CI's time: its path is covered by the suite's other tests)
def test_a_reward_function_of_ones_own_swaps_with_its_file_and_version(ray_session, tmp_path):
    """A `kind: python` endpoint as its own Serve application (verl's `custom_reward_function.path`):
    a new file with a new `version` (a user_config change) is read again while training runs, and
    later rewards carry the new version."""
    from asyncrl.messages.structs import RewardRequest

    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return float(solution_str[:1] == ground_truth)\n")
    mine = f"custom_reward_function.path={reward}"
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    deploy_declaratively([reward_app_config("custom", f"{REWARD_OVERRIDES} {mine}", {"version": "1"})])
    run = Run(compose([*OVERRIDES.split(), mine, f"trainer.run_dir={tmp_path}/run"]), "", name_learner=False).start()
    try:
        wait_for(lambda s: versions(s).get("custom:python:1", 0) > 0, run)
        reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                          "    return 0.25\n")
        deploy_declaratively([reward_app_config("custom", f"{REWARD_OVERRIDES} {mine}", {"version": "2"})])
        status = wait_for(lambda s: versions(s).get("custom:python:2", 0) > 0, run)
        assert status.assembler["reward_failures"] == 0, status.assembler["last_reward_failure"]
        handle = serve.get_app_handle("reward-custom")
        probe = RewardRequest(prompt_id="p", sample_idx=0, response_text="7", ground_truth="7", data_source="tiny")
        for _ in range(4):  # both replicas read the new file
            (answer,) = handle.score.remote([probe]).result()
            assert (answer.score, answer.source_version) == (0.25, "custom:python:2")
    finally:
        run.stop()
        serve.delete("reward-custom")
        serve.shutdown()
