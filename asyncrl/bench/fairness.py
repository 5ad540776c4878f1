"""One client's sampling settings against everyone's latency on the policy endpoint.

The probe of the issue that found the starvation, as a benchmark: the `policy` application served
by Ray Serve on 127.0.0.1 (tiny model, embedded engine, the endpoint's default batching), a short
request's latency idle (median of five), then the same request sent while 60 requests of `n=4,
max_tokens=120` are in flight, first each with a temperature of its own, then all at one
temperature. Side by side in one run: the short request's latency under each load against idle,
and the wall time of the load. `--quick`: 20 requests in flight instead of 60.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import httpx

SHORT_TOKENS = 8


async def _ask(http: httpx.AsyncClient, url: str, body: dict) -> float:
    start = time.perf_counter()
    response = await http.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    response.raise_for_status()
    return time.perf_counter() - start


def _body(model: str, temperature: float, n: int, max_tokens: int) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "1+2="}], "temperature": temperature,
            "n": n, "max_tokens": max_tokens}


async def _under_load(url: str, model: str, jobs: int, own_temperatures: bool) -> dict:
    """The short request's latency while `jobs` long requests run, and the load's wall time."""
    limits = httpx.Limits(max_connections=jobs + 2, max_keepalive_connections=jobs + 2)
    async with httpx.AsyncClient(limits=limits) as http:
        start = time.perf_counter()
        load = [asyncio.create_task(_ask(http, url, _body(model, 0.5 + (i / 100 if own_temperatures else 0), 4, 120)))
                for i in range(jobs)]
        await asyncio.sleep(0.2)  # the load is in
        short = await _ask(http, url, _body(model, 1.0, 1, SHORT_TOKENS))
        await asyncio.gather(*load)
        return {"short_s": short, "load_wall_s": time.perf_counter() - start}


async def _idle(url: str, model: str) -> float:
    async with httpx.AsyncClient() as http:
        await _ask(http, url, _body(model, 1.0, 1, SHORT_TOKENS))  # warm-up
        return statistics.median([await _ask(http, url, _body(model, 1.0, 1, SHORT_TOKENS)) for _ in range(5)])


def run(quick: bool, overrides: list[str]) -> dict:
    import ray
    from ray import serve

    from asyncrl.bench.common import machine
    from asyncrl.config import compose
    from asyncrl.run.placement import init_ray
    from asyncrl.serve.policy import build_policy
    from asyncrl.weights.sync import free_port

    overrides = ["model=tiny", "task=tiny", "serve.follow_learner=false", "trainer.wandb_mode=disabled", *overrides]
    config = compose(overrides)
    jobs = 20 if quick else 60
    init_ray(config)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    try:
        serve.run(build_policy({"overrides": " ".join(overrides)}), name="policy", route_prefix="/v1")
        idle = asyncio.run(_idle(url, config.model.name))
        own = asyncio.run(_under_load(url, config.model.name, jobs, own_temperatures=True))
        one = asyncio.run(_under_load(url, config.model.name, jobs, own_temperatures=False))
        window = config.serve.batch_window_tokens
        return {"machine": machine(), "jobs": jobs, "idle_s": idle, "own_temperatures": own, "one_temperature": one,
                "window_tokens": window, "config": " ".join(overrides)}
    finally:
        try:
            serve.delete("policy")
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
        serve.shutdown()
        ray.shutdown()


def report(r: dict) -> str:
    idle = r["idle_s"]
    lines = [f"policy endpoint fairness ({r['machine']['cpu']}): a {SHORT_TOKENS}-token request idle and under "
             f"{r['jobs']} requests of n=4, max_tokens=120 ({r['config']})",
             f"  idle: {idle * 1000:.0f} ms",
             "  load                     | short request ms  x idle | load wall s"]
    for name, key in (("each its own temperature", "own_temperatures"), ("one temperature", "one_temperature")):
        row = r[key]
        lines.append(f"  {name:24s} | {row['short_s'] * 1000:16.0f} {row['short_s'] / idle:7.1f} | "
                     f"{row['load_wall_s']:11.2f}")
    return "\n".join(lines)
