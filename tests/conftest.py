import os

import pytest

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole test session (starting Ray costs seconds)."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local",  # a new instance of our own, whatever else runs on the machine
            num_cpus=16,  # logical CPUs: actors reserve little; real threads are budgeted per actor
            include_dashboard=False,
            object_store_memory=256 * 2**20,
            log_to_driver=False,
            # Workers import test modules (remote functions defined in tests pickle by reference).
            runtime_env={
                "env_vars": {
                    "PYTHONPATH": os.pathsep.join([TESTS_DIR, os.environ.get("PYTHONPATH", "")]),
                    "TOKENIZERS_PARALLELISM": "false",
                    "WANDB_MODE": "disabled",
                }
            },
        )
    yield ray
    from ray import serve

    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="session")
def embedded_policy():
    """The embedded SmolLM2-135M-Instruct `(model, tokenizer)`, loaded once for the session:
    the first load in a fresh cache reads the GGUF file (~30 s), later ones its cached directory
    (~3 s). Tests only run it forward or copy it."""
    from asyncrl.config import compose
    from asyncrl.models.loading import load_policy

    return load_policy(compose([]).model)


@pytest.fixture(scope="session")
def smol_tokenizer():
    """The embedded model's tokenizer (SmolLM2: ChatML special tokens, its own chat template), read
    from the GGUF file once for the session (~10 s)."""
    from asyncrl.config import compose
    from asyncrl.models.loading import load_tokenizer

    return load_tokenizer(compose([]).model)


@pytest.fixture(scope="session")
def solved_dapo_run(ray_session, tmp_path_factory):
    """DAPO on the tiny task until it is solved (issue 16's run), recording its trajectory store:
    one run that the saturation tests and the store tests both read. Returns (config, summary, run dir)."""
    from asyncrl.config import compose
    from asyncrl.driver import train

    run_dir = tmp_path_factory.mktemp("solved-dapo")
    config = compose(["model=tiny", "task=tiny", "trainer.total_steps=400", "trainer.wandb_mode=disabled",
                      "trainer.store_trajectories=true", f"trainer.run_dir={run_dir}", "trainer.stall_timeout_s=120",
                      "task.unsolved_max_retries=4"])  # a hopeless prompt given up after 4 tries, not 64: a test of minutes
    return config, train(config, progress=False, eval_prompts=10), run_dir


@pytest.fixture
def venv_over_this_one(tmp_path):
    """A fresh venv (`tmp_path/venv`) that sees this environment's packages as plain path entries:
    pip counts them as installed and adds nothing, no .pth of theirs runs (so the checkout's editable
    asyncrl stays out), and its `pip` is this environment's pip installing into the fresh venv (a
    venv's own bundled setuptools would shadow the newer one torch requires). Returns its bin/."""
    import subprocess
    import sys
    import sysconfig
    from pathlib import Path

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "this-environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = venv / "bin" / "pip"
    pip.write_text('#!/bin/sh\nexec "$(dirname "$0")/python" -m pip "$@"\n')
    pip.chmod(0o755)
    return venv / "bin"
