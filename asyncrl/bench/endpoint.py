"""The policy endpoint under load: tokens/s and latency with 1, 4, 16 and 64 concurrent clients,
alone and while training, and training throughput with and without queries.

The full run serves the embedded model (the default); `--quick` the tiny model with a tiny task.
Both Serve applications run as a user runs them (`train` and `policy`, HTTP on 127.0.0.1), on the
engine the overrides name (`engine=sglang_cpu` runs both on SGLang, from .venv-sglang). Clients
are closed-loop: each sends a chat completion, waits for it, sends the next, for a fixed time.
Every answer is `max_tokens` long (EOS is biased away with `logit_bias`), so tokens/s counts the
same work at every concurrency. Then the training phases: paired rounds A (no queries) and B (a
steady open-loop load), training samples/s read from `/train/status` at the phase boundaries.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np

CONCURRENCY = (1, 4, 16, 64)


def _percentiles(latencies: list[float]) -> dict:
    if not latencies:
        return {"n": 0}
    ms = np.array(latencies) * 1000
    return {"n": len(ms), "p50_ms": float(np.percentile(ms, 50)), "p95_ms": float(np.percentile(ms, 95)),
            "p99_ms": float(np.percentile(ms, 99))}


def concurrent_load(url: str, model: str, clients: int, seconds: float, max_tokens: int, no_eos: dict) -> dict:
    """`clients` closed-loop clients for `seconds`: completion tokens/s over the phase, latencies."""
    body = {"model": model, "messages": [{"role": "user", "content": "1+2="}], "max_tokens": max_tokens,
            "temperature": 1.0, "logit_bias": no_eos}
    latencies, tokens, failures = [], [0], [0]

    async def client(http: httpx.AsyncClient, deadline: float) -> None:
        while time.perf_counter() < deadline:
            start = time.perf_counter()
            try:
                r = await http.post(f"{url}/v1/chat/completions", json=body, timeout=300)
                ok = r.status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                latencies.append(time.perf_counter() - start)
                tokens[0] += r.json()["usage"]["completion_tokens"]
            else:
                failures[0] += 1

    async def run() -> float:
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        async with httpx.AsyncClient(limits=limits) as http:
            start = time.perf_counter()
            await asyncio.gather(*(client(http, start + seconds) for _ in range(clients)))
            return time.perf_counter() - start

    wall = asyncio.run(run())
    return {"clients": clients, "tokens": tokens[0], "wall_s": wall, "tokens_per_s": tokens[0] / wall,
            "failed": failures[0], **_percentiles(latencies)}


def concurrency_table(url: str, model: str, seconds: float, max_tokens: int, no_eos: dict) -> list[dict]:
    concurrent_load(url, model, 4, 2.0, max_tokens, no_eos)  # warm-up
    return [concurrent_load(url, model, c, seconds, max_tokens, no_eos) for c in CONCURRENCY]


def steady_load(url: str, model: str, rate: float, seconds: float, max_tokens: int) -> dict:
    """Short chat completions at `rate` per second for `seconds`; latencies and failures."""
    latencies, failures, lock = [], [], threading.Lock()
    body = {"model": model, "messages": [{"role": "user", "content": "1+2="}], "max_tokens": max_tokens,
            "temperature": 0.7}

    def one(client: httpx.Client) -> None:
        start = time.perf_counter()
        try:
            r = client.post(f"{url}/v1/chat/completions", json=body, timeout=60)
            ok = r.status_code == 200
        except httpx.HTTPError:
            ok = False
        with lock:
            (latencies if ok else failures).append(time.perf_counter() - start)

    with httpx.Client() as client, ThreadPoolExecutor(max_workers=32) as workers:
        start, sent = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            workers.submit(one, client)
            sent += 1
            time.sleep(max(0.0, start + sent / rate - time.perf_counter()))
    return {"sent": sent, "failed": len(failures), **_percentiles(latencies)}


def _trained(url: str) -> tuple[float, int]:
    status = httpx.get(f"{url}/train/status", timeout=60).json()
    return time.perf_counter(), int(status["samples_trained"])


def _training_rounds(url: str, model: str, rounds: int, phase_s: float, rate: float, max_tokens: int) -> dict:
    no_load, with_load, ratios, during = [], [], [], []
    for _ in range(rounds):
        t0, n0 = _trained(url)
        time.sleep(phase_s)
        t1, n1 = _trained(url)
        load = steady_load(url, model, rate, phase_s, max_tokens)
        t2, n2 = _trained(url)
        a, b = (n1 - n0) / (t1 - t0), (n2 - n1) / (t2 - t1)
        no_load.append(a)
        with_load.append(b)
        ratios.append(b / a if a else float("nan"))
        during.append(load)
    return {"latency_during_training": {"p50_ms": statistics.median(d["p50_ms"] for d in during),
                                        "p95_ms": statistics.median(d["p95_ms"] for d in during),
                                        "p99_ms": max(d["p99_ms"] for d in during),
                                        "n": sum(d["n"] for d in during), "failed": sum(d["failed"] for d in during)},
            "samples_per_s_no_load": no_load, "samples_per_s_with_load": with_load,
            "samples_per_s_no_load_median": statistics.median(no_load),
            "samples_per_s_with_load_median": statistics.median(with_load),
            "with_over_without_median": statistics.median(ratios)}


def run(quick: bool, overrides: list[str]) -> dict:
    import ray
    from ray import serve

    from asyncrl.config import compose
    from asyncrl.models.loading import eos_token_ids, load_policy
    from asyncrl.run.placement import init_ray
    from asyncrl.serve.policy import build_policy
    from asyncrl.serve.train import build_train
    from asyncrl.weights.sync import free_port

    # The full run measures the model a user serves (the embedded one; a decode step there is model
    # work, where the tiny model's 2 ms step is interpreter work); --quick the tiny model. A learner
    # step of the embedded model takes about half a minute on two cores, hence the longer phases.
    model = ["model=tiny", "task=tiny"] if quick else []
    overrides = [*model, "algorithm=grpo", "trainer.wandb_mode=disabled", "trainer.checkpoint_every=0", *overrides]
    config = compose(overrides)
    level_s, phase_s, rounds, rate, max_tokens = (4.0, 8.0, 1, 2.0, 32) if quick else (20.0, 90.0, 2, 0.5, 32)
    no_eos = {str(i): -100 for i in eos_token_ids(*load_policy(config.model))}
    init_ray(config)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url, text, name = f"http://127.0.0.1:{port}", " ".join(overrides), config.model.name
    try:
        serve.run(build_policy({"overrides": text}), name="policy", route_prefix="/v1")
        alone = concurrency_table(url, name, level_s, max_tokens, no_eos)
        idle = steady_load(url, name, rate, phase_s, 16)
        serve.run(build_train({"overrides": text}), name="train", route_prefix="/train")
        while _trained(url)[1] == 0:  # past start-up: the learner has stepped
            time.sleep(1.0)
        training = concurrency_table(url, name, level_s, max_tokens, no_eos)
        rounds_result = _training_rounds(url, name, rounds, phase_s, rate, 16)
        return {"config": text, "engine": config.engine.name, "max_tokens": max_tokens, "level_s": level_s,
                "concurrency_alone": alone, "concurrency_training": training,
                "phase_s": phase_s, "rounds": rounds, "request_rate_per_s": rate, "latency_idle": idle,
                **rounds_result}
    finally:
        for app in ("train", "policy"):
            try:
                serve.delete(app)
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        serve.shutdown()
        ray.shutdown()


def report(r: dict) -> str:
    idle, busy = r["latency_idle"], r["latency_during_training"]
    one = {row["clients"]: row for row in r["concurrency_alone"]}[1]["tokens_per_s"]
    lines = [f"policy endpoint ({r['engine']} engine), closed-loop clients, chat completions of {r['max_tokens']} "
             f"tokens, {r['level_s']:.0f} s a level ({r['config']})",
             "  clients | alone: tokens/s  x1   p50 ms  p99 ms | while training: tokens/s  p50 ms  p99 ms"]
    for a, t in zip(r["concurrency_alone"], r["concurrency_training"]):
        lines.append(f"  {a['clients']:7d} | {a['tokens_per_s']:15.0f} {a['tokens_per_s'] / one:4.1f} "
                     f"{a.get('p50_ms', 0):8.0f} {a.get('p99_ms', 0):7.0f} | {t['tokens_per_s']:24.0f} "
                     f"{t.get('p50_ms', 0):7.0f} {t.get('p99_ms', 0):7.0f}")
    lines += [
        f"  steady {r['request_rate_per_s']:g} requests/s of 16 tokens, {r['rounds']} paired rounds of {r['phase_s']:.0f} s:",
        f"  latency idle:            p50 {idle['p50_ms']:.0f} ms  p95 {idle['p95_ms']:.0f} ms  p99 {idle['p99_ms']:.0f} ms "
        f"({idle['n']} ok, {idle['failed']} failed)",
        f"  latency during training: p50 {busy['p50_ms']:.0f} ms  p95 {busy['p95_ms']:.0f} ms  p99 {busy['p99_ms']:.0f} ms "
        f"({busy['n']} ok, {busy['failed']} failed)",
        f"  training samples/s: {r['samples_per_s_no_load_median']:.1f} without load, "
        f"{r['samples_per_s_with_load_median']:.1f} with load (median ratio {r['with_over_without_median']:.2f})",
    ]
    return "\n".join(lines)
