"""Where users look (issue 60): a run's step records in wandb and TensorBoard, one wandb run and one
TensorBoard run however many processes the run takes (a resume here), read back as their own tools
read them: real wandb (offline), real event files."""

import json
import os

import pytest

from asyncrl.config import ConfigError, compose
from asyncrl.run.loggers import STATE_FILE, TENSORBOARD_DIR, open_loggers
from logged_files import tensorboard_scalars, wandb_offline_parts


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")).read().splitlines()]


@pytest.mark.slow  # (CI's time: a step redone after a restart is logged once, below)
def test_a_resumed_run_logs_into_the_same_wandb_run_and_tensorboard_run(ray_session, tmp_path, monkeypatch):
    """Three steps, then `resume=true` to six: one wandb id (kept in the run directory) for both
    processes' offline parts, named and grouped as configured, the first part's steps 1-3 and the
    second's 4-6 with the values of metrics.jsonl; TensorBoard's scalars of both parts in one
    directory. verl's `trainer.logger` names the loggers."""
    from asyncrl.driver import train

    monkeypatch.setenv("WANDB_MODE", "offline")  # the suite's default is disabled (conftest)
    run = tmp_path / "run"
    common = ["model=tiny", "task=tiny", "algorithm=grpo", "trainer.prompts_per_step=2", "trainer.checkpoint_every=3",
              f"trainer.run_dir={run}", "trainer.logger=[console,wandb,tensorboard]",
              "trainer.experiment_name=tiny-grpo", "trainer.wandb_group=issue-60", "trainer.wandb_tags=[tiny,resume]"]
    first = train(compose([*common, "trainer.total_steps=3"]), progress=False, eval_prompts=2)
    assert first["steps"] == 3
    run_id = json.load(open(run / STATE_FILE))["wandb_id"]
    second = train(compose([*common, "trainer.total_steps=6", "resume=true"]), progress=False, eval_prompts=2)
    assert second["resumed"]["step"] == 3 and second["steps"] == 3
    assert json.load(open(run / STATE_FILE)) == {"wandb_id": run_id, "last_step": 6}
    records = {r["step"]: r for r in metrics(run)}
    assert sorted(records) == [1, 2, 3, 4, 5, 6]

    parts = wandb_offline_parts(run)
    # Offline, each process writes its part under the one id; `wandb sync` uploads them as one run.
    assert len(parts) == 2 and all(p["directory"].endswith(f"-{run_id}") for p in parts), parts
    for part in parts:
        assert (part["id"], part["name"], part["group"], part["tags"], part["project"]) == \
               (run_id, "tiny-grpo", "issue-60", ["tiny", "resume"], "asyncrl")
        assert "eval_accuracy_after" in part["summary"]  # each part's end
    assert [sorted(p["history"]) for p in parts] == [[1, 2, 3], [4, 5, 6]]
    for part in parts:
        for step, row in part["history"].items():
            assert json.loads(row["reward_mean_generated"]) == pytest.approx(records[step]["reward_mean_generated"])
            assert json.loads(row["samples_trained"]) == records[step]["samples_trained"]

    scalars = tensorboard_scalars(str(run / TENSORBOARD_DIR))
    assert len(os.listdir(run / TENSORBOARD_DIR)) == 2  # an event file per process, read as one run
    for tag in ("reward_mean_generated", "samples_trained", "weight_version"):
        assert [step for step, _ in scalars[tag]] == [1, 2, 3, 4, 5, 6], tag
        assert [value for _, value in scalars[tag]] == pytest.approx([records[s][tag] for s in range(1, 7)])


def test_a_step_redone_after_a_restart_is_logged_once(tmp_path):
    """A restart from an earlier checkpoint redoes steps; another process of the run (a resume, a
    Serve controller) logs on from the last step any of them logged, as wandb takes steps."""
    config = compose(["model=tiny", "trainer.loggers=[tensorboard]", f"trainer.run_dir={tmp_path}"])
    first = open_loggers(config, str(tmp_path))
    first.log([{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0, "ok": True, "note": "text", "none": None}])
    first.log([{"step": 2, "loss": 20.0}, {"step": 3, "loss": 3.0}])  # restarted from step 1 in this process
    first.finish()
    resumed = compose(["model=tiny", "trainer.loggers=[tensorboard]", f"trainer.run_dir={tmp_path}", "resume=true"])
    second = open_loggers(resumed, str(tmp_path))  # resumed from a checkpoint at step 2
    second.log([{"step": 3, "loss": 30.0}, {"step": 4, "loss": float("nan")}])
    second.finish()
    scalars = tensorboard_scalars(str(tmp_path / TENSORBOARD_DIR))
    assert scalars["loss"][:3] == [(1, 1.0), (2, 2.0), (3, 3.0)] and scalars["loss"][3][0] == 4
    assert scalars["ok"] == [(2, 1.0)] and "note" not in scalars and "none" not in scalars
    assert json.load(open(tmp_path / STATE_FILE)) == {"last_step": 4}  # no wandb: no id
    # Started again without resuming: a new run, logged from step 1, the old run's points gone.
    third = open_loggers(config, str(tmp_path))
    third.log([{"step": 1, "loss": 100.0}])
    third.finish()
    assert tensorboard_scalars(str(tmp_path / TENSORBOARD_DIR))["loss"] == [(1, 100.0)]
    assert json.load(open(tmp_path / STATE_FILE)) == {"last_step": 1}


def test_an_unknown_logger_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^trainer.loggers=\[console,tensorbord\]: trainer.loggers: 'tensorbord' is "
                                          r"not one of console, wandb, tensorboard, ray; did you mean 'tensorboard'\?$"):
        compose(["trainer.loggers=[console,tensorbord]"])
    # verl's name, with one of verl's loggers that asyncrl does not have.
    with pytest.raises(ConfigError, match="^trainer.logger=\\[console,mlflow\\]: trainer.loggers: 'mlflow' is not one"):
        compose(["trainer.logger=[console,mlflow]"])
    notices: list[str] = []
    assert compose(["trainer.logger=tensorboard"], notices=notices).trainer.loggers == ["tensorboard"]
    assert notices == ["trainer.logger (verl's name) is asyncrl's trainer.loggers=['tensorboard']"]
    assert compose([]).trainer.loggers == ["console", "wandb"] and compose([]).trainer.wandb_mode == "offline"
    from asyncrl.cli import main

    assert main(["train", "model=tiny", "trainer.loggers=[mlflow]", f"trainer.run_dir={tmp_path}"]) == 2
    assert not os.listdir(tmp_path)  # refused before anything starts


@pytest.mark.slow
def test_the_serve_train_app_logs_into_the_run_s_wandb_run_across_controllers(ray_session, tmp_path):
    """The Serve `train` app logs its records to wandb from its controller; a redeploy (a new
    controller, resuming the run from its checkpoint) logs on into the same wandb run, each step once."""
    import time

    from ray import serve

    from asyncrl.serve.reward import deploy_declaratively
    from asyncrl.weights.sync import free_port

    app = {"name": "train", "route_prefix": "/train", "import_path": "asyncrl.serve.train:build_train",
           "args": {"overrides": "model=tiny task=tiny algorithm=grpo trainer.checkpoint_every=2 "
                                 "trainer.loggers=[wandb] trainer.experiment_name=served",
                    "trainer.run_dir": str(tmp_path)},
           # The suite's Ray turns wandb off in every worker; this controller's process turns it on.
           "deployments": [{"name": "TrainController",
                            "ray_actor_options": {"runtime_env": {"env_vars": {"WANDB_MODE": "offline"}}}}]}

    def serve_until(steps: int) -> None:
        deploy_declaratively([app], timeout_s=300)
        deadline = time.time() + 300
        while not (tmp_path / "metrics.jsonl").exists() or len(metrics(tmp_path)) < steps:
            assert time.time() < deadline, f"no {steps} steps"
            time.sleep(1.0)
        serve.delete("train")  # the controller ends (Serve calls its __del__, which finishes the wandb run)

    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    try:
        serve_until(3)
        serve_until(len(metrics(tmp_path)) + 3)
    finally:
        serve.shutdown()
    run_id = json.load(open(tmp_path / STATE_FILE))["wandb_id"]
    parts = wandb_offline_parts(tmp_path)
    assert [(p["id"], p["name"]) for p in parts] == [(run_id, "served")] * 2
    logged = [step for p in parts for step in sorted(p["history"])]
    assert logged == sorted(set(logged)) == sorted({r["step"] for r in metrics(tmp_path)})
