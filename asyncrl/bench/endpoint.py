"""The policy endpoint under training: chat-completion latency when idle and while training runs,
and training throughput with and without a steady query load (paired phases A, B, A, B...).

Both Serve applications run as a user runs them (`train` and `policy`, HTTP on 127.0.0.1); the
load is open-loop (a request every 1/rate s, whatever the previous ones are doing), so a slow
endpoint shows up as latency rather than as a lower request rate.
"""

from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np


def _percentiles(latencies: list[float]) -> dict:
    if not latencies:
        return {"n": 0}
    ms = np.array(latencies) * 1000
    return {"n": len(ms), "p50_ms": float(np.percentile(ms, 50)), "p95_ms": float(np.percentile(ms, 95)),
            "p99_ms": float(np.percentile(ms, 99))}


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

    with httpx.Client() as client, ThreadPoolExecutor(max_workers=32) as pool:
        start, sent = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            pool.submit(one, client)
            sent += 1
            time.sleep(max(0.0, start + sent / rate - time.perf_counter()))
    return {"sent": sent, "failed": len(failures), **_percentiles(latencies)}


def _trained(url: str) -> tuple[float, int]:
    status = httpx.get(f"{url}/train/status", timeout=60).json()
    return time.perf_counter(), int(status["samples_trained"])


def run(quick: bool, overrides: list[str]) -> dict:
    import ray
    from ray import serve

    from asyncrl.config import compose
    from asyncrl.run.placement import init_ray
    from asyncrl.serve.policy import build_policy
    from asyncrl.serve.train import build_train
    from asyncrl.weight_sync import free_port

    overrides = ["model=tiny", "task=tiny", "algorithm=grpo", "trainer.wandb_mode=disabled",
                 "trainer.checkpoint_every=0", *overrides]
    config = compose(overrides)
    phase_s, rounds, rate, max_tokens = (8.0, 2, 2.0, 8) if quick else (30.0, 4, 2.0, 16)
    init_ray(config)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    text = " ".join(overrides)
    try:
        serve.run(build_policy({"overrides": text}), name="policy", route_prefix="/v1")
        steady_load(url, config.model.name, rate, 2.0, max_tokens)  # warm-up
        idle = steady_load(url, config.model.name, rate, phase_s, max_tokens)
        serve.run(build_train({"overrides": text}), name="train", route_prefix="/train")
        while _trained(url)[1] == 0:  # past start-up: the learner has stepped
            time.sleep(1.0)
        no_load, with_load, ratios, during = [], [], [], []
        for _ in range(rounds):
            t0, n0 = _trained(url)
            time.sleep(phase_s)
            t1, n1 = _trained(url)
            load = steady_load(url, config.model.name, rate, phase_s, max_tokens)
            t2, n2 = _trained(url)
            a, b = (n1 - n0) / (t1 - t0), (n2 - n1) / (t2 - t1)
            no_load.append(a)
            with_load.append(b)
            ratios.append(b / a if a else float("nan"))
            during.append(load)
        latencies_ok = sum(d["n"] for d in during)
        return {
            "config": text, "phase_s": phase_s, "rounds": rounds, "request_rate_per_s": rate, "max_tokens": max_tokens,
            "latency_idle": idle,
            "latency_during_training": {"p50_ms": statistics.median(d["p50_ms"] for d in during),
                                        "p95_ms": statistics.median(d["p95_ms"] for d in during),
                                        "p99_ms": max(d["p99_ms"] for d in during),
                                        "n": latencies_ok, "failed": sum(d["failed"] for d in during)},
            "samples_per_s_no_load": no_load, "samples_per_s_with_load": with_load,
            "samples_per_s_no_load_median": statistics.median(no_load),
            "samples_per_s_with_load_median": statistics.median(with_load),
            "with_over_without_median": statistics.median(ratios),
        }
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
    return "\n".join([
        f"policy endpoint, {r['request_rate_per_s']:.0f} chat completions/s of {r['max_tokens']} tokens, "
        f"{r['rounds']} paired rounds of {r['phase_s']:.0f} s ({r['config']})",
        f"  latency idle:            p50 {idle['p50_ms']:.0f} ms  p95 {idle['p95_ms']:.0f} ms  p99 {idle['p99_ms']:.0f} ms "
        f"({idle['n']} ok, {idle['failed']} failed)",
        f"  latency during training: p50 {busy['p50_ms']:.0f} ms  p95 {busy['p95_ms']:.0f} ms  p99 {busy['p99_ms']:.0f} ms "
        f"({busy['n']} ok, {busy['failed']} failed)",
        f"  training samples/s: {r['samples_per_s_no_load_median']:.1f} without load, "
        f"{r['samples_per_s_with_load_median']:.1f} with load (median ratio {r['with_over_without_median']:.2f})",
    ])
