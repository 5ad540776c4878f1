"""Every HTTP route of the three Serve applications, fuzzed from its OpenAPI schema (schemathesis):
valid and invalid bodies, queries and headers. No answer may be a 5xx, and no replica may restart."""

import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from ray import serve
from schemathesis import GenerationMode

from asyncrl.serve_app import build_policy, build_reward, build_train
from asyncrl.weight_sync import free_port

OVERRIDES = "model=tiny task=tiny algorithm=grpo trainer.wandb_mode=disabled trainer.checkpoint_every=0"
APPS = {"train": "/train", "policy": "/v1", "reward-verifier": "/reward/verifier"}
EXAMPLES = 8  # per operation and generation mode (CI time); raise it for a deeper run


@pytest.fixture(scope="module")
def deployed(ray_session, tmp_path_factory):
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    run_dir = tmp_path_factory.mktemp("fuzz")
    serve.run(build_train({"overrides": OVERRIDES, "trainer.run_dir": str(run_dir), "serve.admin_token": "secret"}),
              name="train", route_prefix="/train")
    serve.run(build_policy({"overrides": OVERRIDES}), name="policy", route_prefix="/v1")
    serve.run(build_reward({"overrides": OVERRIDES, "name": "verifier"}), name="reward-verifier",
              route_prefix="/reward/verifier")
    yield f"http://127.0.0.1:{port}"
    for app in APPS:
        serve.delete(app)
    serve.shutdown()  # the next module starts Serve on its own port


def replica_identities(url: str) -> dict:
    """What changes when a replica restarts: the train controller's start time, the policy
    server's and the reward replicas' ids."""
    status = httpx.get(f"{url}/train/status", timeout=60).json()
    models = httpx.get(f"{url}/v1/models", timeout=60).json()
    return {"train_started_at": status["started_at"], "policy_started_at": models["data"][0]["started_at"]}


def operations(url: str, prefix: str):
    schema = schemathesis.openapi.from_url(f"{url}{prefix}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.slow
@pytest.mark.parametrize("app", list(APPS))
def test_fuzzed_routes_never_answer_5xx(deployed, app):
    url = deployed
    before = replica_identities(url)
    ops = operations(url, APPS[app])
    assert ops, f"{app} publishes no operations"
    seen: dict[str, set[int]] = {}
    with httpx.Client(timeout=120) as client:
        for op in ops:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

                @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                          suppress_health_check=list(HealthCheck))
                @given(case=op.as_strategy(generation_mode=mode))
                def check(case):
                    kwargs = case.as_transport_kwargs(base_url=f"{url}{APPS[app]}")
                    kwargs.pop("verify", None)
                    kwargs.pop("cookies", None)
                    response = client.request(**kwargs)
                    seen.setdefault(f"{op.method.upper()} {op.path}", set()).add(response.status_code)
                    assert response.status_code < 500, (case.as_curl_command(), response.text[:500])

                try:
                    check()
                except Unsatisfiable:  # no invalid input exists (e.g. a GET without parameters)
                    assert mode == GenerationMode.NEGATIVE
    assert len(seen) == len(ops)
    # The replicas that answered are the ones that started: nothing crashed and restarted.
    time.sleep(1.0)
    assert replica_identities(url) == before
    assert httpx.get(f"{url}/train/healthz", timeout=60).json() == {"ok": True, "restarts": 0}
