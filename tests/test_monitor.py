"""One run monitor (`asyncrl.monitor`) behind `asyncrl train` and the Serve `train` application: a
value-based run (PPO, so value-learner metrics exist) writes records with the same fields through
both entry points, and both show the same status fields."""

import json
import time

import httpx
import pytest
from ray import serve

from asyncrl.config import compose
from asyncrl.driver import train
from asyncrl.monitor import RUN_FIELDS
from asyncrl.serve_app import deploy_declaratively
from asyncrl.weight_sync import free_port

OVERRIDES = ["model=tiny", "task=tiny", "algorithm=ppo", "trainer.wandb_mode=disabled", "trainer.checkpoint_every=0"]
STEPS = 4


def records_with_value_metrics(path) -> list[dict]:
    try:
        lines = open(path).read().splitlines()
    except FileNotFoundError:
        return []
    return [r for r in map(json.loads, lines) if "value_loss" in r]


@pytest.mark.slow
def test_serve_train_app_and_asyncrl_train_write_the_same_records(ray_session, tmp_path):
    summary = train(compose([*OVERRIDES, f"trainer.total_steps={STEPS}", f"trainer.run_dir={tmp_path / 'cli'}"]),
                    progress=False, eval_prompts=2)
    cli = records_with_value_metrics(tmp_path / "cli" / "metrics.jsonl")
    assert cli, "asyncrl train wrote no record with value-learner metrics"

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        deploy_declaratively([{"name": "train", "route_prefix": "/train", "import_path": "asyncrl.serve_app:build_train",
                               "args": {"overrides": " ".join(OVERRIDES), "trainer.run_dir": str(tmp_path / "serve")}}],
                             timeout_s=300)
        deadline = time.time() + 240
        while not (served := records_with_value_metrics(tmp_path / "serve" / "metrics.jsonl")):
            assert time.time() < deadline, "the Serve train app wrote no record with value-learner metrics"
            time.sleep(1.0)
        status = httpx.get(f"http://127.0.0.1:{port}/train/status", timeout=30).json()
        plotted = httpx.get(f"http://127.0.0.1:{port}/train/metrics", timeout=30).json()
    finally:
        serve.delete("train")
        serve.shutdown()

    assert set(served[-1]) == set(cli[-1]), set(served[-1]) ^ set(cli[-1])
    assert set(RUN_FIELDS) <= set(served[-1])
    assert {"value_loss", "value_explained_variance", "value_step"} <= set(served[-1])
    # The status page shows what `asyncrl train`'s summary holds (less the per-generator list).
    final = {k for k in summary["final_status"] if k != "generators"}
    assert final <= set(status), final - set(status)
    assert status["reward_curve"] and "samples_per_s" in plotted[-1]
