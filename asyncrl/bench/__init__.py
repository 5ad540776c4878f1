"""Benchmarks: each prints its figures and writes them as JSON under the run directory.

Each module has `run(quick, overrides) -> dict` and `report(result) -> str`, and optionally
`write_extras(result, run_dir)` for files beside the JSON (plots)."""

from __future__ import annotations

import importlib
import os

MODULES = {
    "async": "async_sync", "trl": "trl", "utilisation": "utilisation", "broadcast": "broadcast",
    "messages": "messages", "endpoint": "endpoint", "engine": "engine", "verifier": "verifier",
    "record": "trajectory_store", "controlplane": "controlplane", "learner": "learner", "lora": "lora_broadcast",
    "fairness": "fairness", "moe": "moe",
}
BENCHMARKS = tuple(MODULES)


def run_benchmark(name: str, quick: bool, run_dir: str, overrides: list[str]) -> int:
    from asyncrl.bench.common import write_result

    if name not in MODULES:
        raise SystemExit(f"unknown benchmark {name!r}; available: {', '.join(BENCHMARKS)}")
    module = importlib.import_module(f"asyncrl.bench.{MODULES[name]}")
    result = module.run(quick=quick, overrides=overrides)
    print(module.report(result))
    if hasattr(module, "write_extras"):
        os.makedirs(run_dir, exist_ok=True)
        module.write_extras(result, run_dir)
    print(f"wrote {write_result(run_dir, name, result)}")
    return 0
