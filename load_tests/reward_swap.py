"""Load test: swap a reward endpoint while sending reward requests at a steady rate.

    python load_tests/reward_swap.py [--rate 20] [--seconds 45] [--out outputs/reward_swap]

Starts Ray and Serve locally, deploys the `reward-verifier` application (two replicas), and sends
requests through the same `RewardRouter` the trainer uses (handle calls, timeout, retries). At 1/3
of the run it swaps settings through `user_config` (in place), at 2/3 it swaps code (new constructor
arguments: a rolling update). It prints and writes the failures and the latency percentiles
before, during and after the swaps. Target: no failed reward.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import threading
import time

import numpy as np
import ray
from ray import serve

from asyncrl.config import RouteConfig
from asyncrl.messages.structs import RewardRequest
from asyncrl.rewards.hybrid import RewardRouter, ServeRewardEndpoints
from asyncrl.serve.reward import deploy_declaratively, reward_app_config
from asyncrl.weights.sync import free_port


def deploy(version: str, code_wall_s: float) -> None:
    """As `serve deploy` with the application's entry in a config file: `version` sits under
    user_config (in place), `code_wall_s` in the args (a rolling update)."""
    overrides = f"model=tiny task=tiny algorithm=grpo reward.endpoints.verifier.code_wall_s={code_wall_s}"
    deploy_declaratively([reward_app_config("verifier", overrides, {"version": version})])


async def load(rate: float, seconds: float, events: list) -> list[dict]:
    router = RewardRouter([RouteConfig()], ServeRewardEndpoints().score, timeout_s=10.0, retries=3)
    results, tasks = [], []
    start = time.monotonic()

    async def one(i: int) -> None:
        sent = time.monotonic()
        request = RewardRequest(prompt_id=f"p{i}", sample_idx=0, response_text="The answer is \\boxed{42}.",
                                ground_truth="42", data_source="math")
        [reward] = await router.score([request])
        results.append({"t": sent - start, "latency_s": time.monotonic() - sent, "failed": reward.failed,
                        "version": reward.source_version, "error": reward.details.get("error", "")})

    i = 0
    while time.monotonic() - start < seconds:
        tasks.append(asyncio.create_task(one(i)))
        i += 1
        await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
    await asyncio.gather(*tasks)
    events.append(("router", router.counters))
    return results


def summarize(results: list[dict], lo: float, hi: float) -> dict:
    window = [r for r in results if lo <= r["t"] < hi]
    lat = np.array([r["latency_s"] for r in window]) * 1000 if window else np.zeros(1)
    return {"requests": len(window), "failed": sum(r["failed"] for r in window),
            "p50_ms": float(np.percentile(lat, 50)), "p95_ms": float(np.percentile(lat, 95)),
            "p99_ms": float(np.percentile(lat, 99)), "versions": sorted({r["version"] for r in window})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second")
    parser.add_argument("--seconds", type=float, default=45.0)
    parser.add_argument("--out", default=os.path.join("outputs", time.strftime("reward_swap-%Y%m%d-%H%M%S")))
    args = parser.parse_args()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
    deploy("1", 5.0)
    events: list = []
    swap_times: dict[str, float] = {}
    t0 = time.monotonic()

    replicas: dict[str, list[int]] = {}

    def replica_pids() -> list[int]:
        handle = serve.get_app_handle("reward-verifier")
        return sorted({handle.pid.remote().result() for _ in range(16)})

    def swapper() -> None:
        replicas["before"] = replica_pids()
        time.sleep(args.seconds / 3)
        swap_times["settings_start"] = time.monotonic() - t0
        deploy("2", 5.0)  # user_config only: reconfigure in place
        swap_times["settings_done"] = time.monotonic() - t0
        replicas["after_settings_swap"] = replica_pids()
        time.sleep(max(0.0, 2 * args.seconds / 3 - (time.monotonic() - t0)))
        swap_times["code_start"] = time.monotonic() - t0
        deploy("3", 4.0)  # new constructor arguments: rolling replacement of the replicas
        swap_times["code_done"] = time.monotonic() - t0
        replicas["after_code_swap"] = replica_pids()

    thread = threading.Thread(target=swapper)
    thread.start()
    results = asyncio.run(load(args.rate, args.seconds, events))
    thread.join()
    offset = 0.0  # the load loop started right after t0
    first_swap, last_done = swap_times["settings_start"] - offset, swap_times["code_done"] - offset
    report = {
        "rate_per_s": args.rate, "seconds": args.seconds, "swaps": swap_times, "replica_pids": replicas,
        "total": summarize(results, 0, 1e9),
        "before": summarize(results, 0, first_swap),
        "during": summarize(results, first_swap, last_done),
        "after": summarize(results, last_done, 1e9),
        "router": dict(events[0][1]) if events else {},
        "errors": sorted({r["error"] for r in results if r["failed"]})[:5],
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "reward_swap.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
