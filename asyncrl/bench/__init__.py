"""Benchmarks: each prints its figures and writes them as JSON under the run directory."""

from __future__ import annotations


BENCHMARKS = ("async", "trl", "utilisation", "broadcast", "messages", "endpoint", "engine")


def run_benchmark(name: str, quick: bool, run_dir: str, overrides: list[str]) -> int:
    from asyncrl.bench.common import write_result

    if name == "messages":
        from asyncrl.bench import messages

        from asyncrl.bench import mailbox

        result = {"codec": messages.run(quick=quick), "mailbox": mailbox.run(quick=quick)}
        print(messages.report(result["codec"]))
        print(mailbox.report(result["mailbox"]))
    elif name == "engine":
        from asyncrl.bench import engine

        result = engine.run(quick=quick, overrides=overrides)
        print(engine.report(result))
    elif name == "endpoint":
        from asyncrl.bench import endpoint

        result = endpoint.run(quick=quick, overrides=overrides)
        print(endpoint.report(result))
    elif name == "broadcast":
        from asyncrl.bench import broadcast

        result = broadcast.run(quick=quick)
        print(broadcast.report(result))
    elif name == "utilisation":
        from asyncrl.bench import utilisation

        result = utilisation.run(quick=quick, overrides=overrides)
        print(utilisation.report(result))
    elif name == "trl":
        import os

        from asyncrl.bench import trl

        result = trl.run(quick=quick, overrides=overrides)
        print(trl.report(result))
        os.makedirs(run_dir, exist_ok=True)
        trl.plot(result, os.path.join(run_dir, "bench_trl_reward.png"))
    elif name == "async":
        from asyncrl.bench import async_sync

        result = async_sync.run(quick=quick, overrides=overrides)
        print(async_sync.report(result))
    else:
        raise SystemExit(f"unknown benchmark {name!r}; available: {', '.join(BENCHMARKS)}")
    print(f"wrote {write_result(run_dir, name, result)}")
    return 0
