"""The SGLang presets compose, and settings SGLang cannot run with are refused at start-up with the
field named (runs in .venv: no SGLang needed; the engine itself: tests/test_sglang_real.py)."""

import pytest

from asyncrl.config import ConfigError, compose


def test_the_cpu_preset_runs_sglang_on_cpu_with_a_capped_kv_cache_and_the_learner_on_cpu():
    config = compose(["engine=sglang_cpu", "model=tiny", "task=tiny"])
    e, p = config.engine, config.policy
    assert (e.name, e.device) == ("sglang", "cpu") and e.sglang_max_total_tokens > 0
    assert e.gpus == 0 and p.compute.gpus == 0 and p.compute.device == "cpu"
    assert p.loss.rollout_correction == "token_tis"


def test_the_gpu_preset_leaves_the_kv_cache_to_sglangs_memory_fraction():
    config = compose(["engine=sglang", "engine.device=cuda"])
    assert config.engine.device == "cuda" and config.engine.sglang_max_total_tokens == 0
    assert config.engine.gpus > 0 and config.policy.compute.device == "cuda" and config.policy.compute.precision == "bf16"


def test_engine_sglang_picks_the_device_torch_sees_and_follows_an_explicit_one():
    import torch

    detected = "cuda" if torch.cuda.is_available() else "cpu"
    assert compose(["engine=sglang"]).engine.device == detected
    # engine.device=cpu, engine=sglang_cpu and (here) plain engine=sglang are one configuration.
    on_cpu = [compose(overrides) for overrides in (["engine=sglang", "engine.device=cpu"], ["engine=sglang_cpu"])]
    assert on_cpu[0] == on_cpu[1]
    e, p = on_cpu[0].engine, on_cpu[0].policy.compute
    assert (e.gpus, e.sglang_max_total_tokens, p.device, p.gpus, p.precision) == (0, 8192, "cpu", 0, "fp32")
    # The preset leaves the response length to the task.
    assert compose(["engine=sglang", "task=tiny"]).engine.max_response_tokens == compose(["task=tiny"]).engine.max_response_tokens


@pytest.mark.parametrize("overrides, message", [
    (["engine=sglang", "engine.device=cpu", "engine.gpus=0.5"], "SGLang on CPU takes no GPU"),
    (["engine=sglang_cpu", "engine.sglang_max_total_tokens=0"], "needs engine.sglang_max_total_tokens > 0"),
    (["engine=sglang_cpu", "engine.sglang_max_total_tokens=100", "engine.max_response_tokens=128"],
     "cannot hold one response"),
    (["engine=sglang_cpu", "engine.sglang_mem_fraction=0"], "engine.sglang_mem_fraction=0 is out of range"),
    (["engine=sglang_cpu", "engine.sglang_max_running_requests=-1"], "engine.sglang_max_running_requests=-1 is out of range"),
    (["engine=sglang_cpu", "engine.sglang_chunked_prefill_tokens=-8"], "engine.sglang_chunked_prefill_tokens=-8 is out of range"),
])
def test_settings_sglang_cannot_run_with_are_refused_with_the_field_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose(overrides)


def test_the_sglang_serve_file_runs_every_application_on_the_cpu_preset():
    import os

    import yaml

    from asyncrl.config import config_dir

    spec = yaml.safe_load(open(os.path.join(config_dir(), "serve_sglang.yaml")))
    assert [a["name"] for a in spec["applications"]] == ["train", "policy", "reward-verifier"]
    assert spec["http_options"]["host"] == "127.0.0.1"
    for app in spec["applications"]:
        config = compose(app["args"]["overrides"].split())
        assert (config.engine.name, config.engine.device) == ("sglang", "cpu")


def test_the_readmes_sglang_commands_parse_and_compose():
    """`tests/test_readme.py` checks the `.venv/bin/asyncrl` lines; these are the `.venv-sglang` ones."""
    import os
    import shlex
    import sys

    from asyncrl.bench import BENCHMARKS
    from asyncrl.cli import parse

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "load_tests"))
    from readme_commands import readme_commands

    lines = [c for c in readme_commands() if ".venv-sglang/bin/asyncrl " in c]
    assert len(lines) >= 5
    for line in lines:
        args = parse(shlex.split(line.split(".venv-sglang/bin/asyncrl ", 1)[1]))
        if args.command == "bench":
            assert args.name in BENCHMARKS
        compose(args.overrides)
