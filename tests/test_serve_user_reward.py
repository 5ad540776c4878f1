"""A reward file of the user's under `serve run`, as the README shows it: the `train` application
refuses to start when a reward endpoint its routes call has no application of its own (naming the
entry to add to the config file), and with that entry (`reward-custom`) it trains, every reward of
the user's function answered by its own application. Real Serve applications on a local Ray."""

import time

import httpx
import pytest
from ray import serve

from asyncrl.cli import main as asyncrl_main
from asyncrl.serve.reward import deploy_declaratively, reward_app_config
from asyncrl.weights.sync import free_port


@pytest.fixture(scope="module")
def example_data(tmp_path_factory):
    """`asyncrl data example`'s files: the prompts in verl's layout and `reward.py` beside them."""
    out = tmp_path_factory.mktemp("data")
    assert asyncrl_main(["data", "example", "--out", str(out), "task.num_train_prompts=32",
                         "task.num_eval_prompts=8"]) == 0
    return out


@pytest.mark.slow  # (CI's time: the same file trains under `asyncrl train` in tests/test_pipeline_user_reward.py)
def test_a_reward_file_under_serve_needs_its_application_and_then_scores_every_sample(ray_session, example_data,
                                                                                    tmp_path):
    overrides = (f"model=tiny algorithm=grpo data.train_files={example_data}/train.parquet "
                 f"data.val_files={example_data}/test.parquet custom_reward_function.path={example_data}/reward.py "
                 f"reward.use_serve=true trainer.wandb_mode=disabled trainer.checkpoint_every=0 "
                 f"engine.max_response_tokens=16 engine.window_tokens=16")
    train_app = {"name": "train", "route_prefix": "/train", "import_path": "asyncrl.serve.train:build_train",
                 "args": {"overrides": overrides, "trainer.run_dir": str(tmp_path / "run")}}
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        started = time.monotonic()
        with pytest.raises(RuntimeError) as refused:
            deploy_declaratively([train_app], timeout_s=120)
        message = str(refused.value)
        assert "reward-custom is not deployed" in message and "asyncrl.serve.reward:build_reward" in message, message
        # Refused as the application is built (Ray retries a builder three times: ~30 s on a quiet
        # machine), where today's code trained on with every reward failing.
        print(f"refused after {time.monotonic() - started:.0f} s")
        assert time.monotonic() - started < 240

        deploy_declaratively([train_app, reward_app_config("custom", overrides)], timeout_s=300)
        deadline, custom = time.monotonic() + 240, {}
        while time.monotonic() < deadline:
            reply = httpx.get(f"http://127.0.0.1:{port}/train/status", timeout=30)
            if reply.status_code == 200:
                custom = reply.json()["reward_endpoints"]["custom"]
                if custom["rewards"] >= 16:
                    break
            time.sleep(2)
        assert custom.get("rewards", 0) >= 16 and custom["failed"] == 0, custom
        assert custom["where"] == "serve app reward-custom"
        assert reply.json()["rewards_failing"] == ""
    finally:
        for app in ("train", "reward-custom"):
            serve.delete(app)
        serve.shutdown()
