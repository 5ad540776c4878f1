"""Benchmarks: each prints its figures and writes them as JSON under the run directory."""

from __future__ import annotations


def run_benchmark(name: str, quick: bool, run_dir: str, overrides: list[str]) -> int:
    from asyncrl.bench.common import write_result

    if name == "messages":
        from asyncrl.bench import messages

        result = messages.run(quick=quick)
        print(messages.report(result))
    elif name == "engine":
        from asyncrl.bench import engine

        result = engine.run(quick=quick, overrides=overrides)
        print(engine.report(result))
    elif name == "endpoint":
        from asyncrl.bench import endpoint

        result = endpoint.run(quick=quick, overrides=overrides)
        print(endpoint.report(result))
    else:
        raise SystemExit(f"unknown benchmark {name!r}; available: messages, engine, endpoint")
    print(f"wrote {write_result(run_dir, name, result)}")
    return 0
