"""A long persistent run as a user runs it: the Serve applications (`train`, `policy`,
`reward-verifier`, deployed declaratively as `serve deploy configs/serve.yaml` does) train for
`--minutes`, the policy is queried throughout, and the reward endpoint is swapped once halfway.

    python load_tests/long_run.py --minutes 60                       # tiny model, DAPO (docs/reliability.md)
    python load_tests/long_run.py --minutes 30 --model embedded      # the embedded model, DAPO, arithmetic
    python load_tests/long_run.py --minutes 3 --quick-swap           # a check

Every `--sample-every` seconds it reads `/train/status` (step, samples, prompts retired, ledger)
and every actor's resident and private (anonymous) memory (the `ray::` processes by role). At the end it writes
`long_run.json` and PNG plots (step time, samples/s, memory per role, share of prompts retired)
to `--out`, and prints the memory slope of every role after `--warmup-minutes`, the policy
requests that failed, and the ledger (no sample lost or trained twice). Traffic stays on 127.0.0.1;
everything is bounded by `--minutes`.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import threading
import time

import httpx
import numpy as np
import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORKLOADS = {
    "tiny": "model=tiny task=tiny algorithm=dapo",
    "embedded": "algorithm=dapo",
}
PROMPTS = {"tiny": "3:", "embedded": "What is 12 plus 30? Put the answer in \\boxed{}."}


def private_mb(pid: int) -> float:
    """Anonymous resident memory (`RssAnon`): what the process itself allocated. RSS also counts
    the shared-memory pages it has touched, and a generator adopting each weight version from Ray's
    object store touches new shared pages (bounded by the store's size) without owning them."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return 0.0


def actor_memory() -> tuple[dict[str, float], dict[str, float]]:
    """Resident and private (anonymous) MB of this run's Ray worker processes (this process started
    Ray: they are its descendants), summed by role (the process title `ray::Role`)."""
    rss: dict[str, float] = collections.defaultdict(float)
    private: dict[str, float] = collections.defaultdict(float)
    for proc in psutil.Process(os.getpid()).children(recursive=True):
        try:
            cmdline = proc.cmdline()
            if cmdline and cmdline[0].startswith("ray::"):
                # `ray::GeneratorActor.run` -> GeneratorActor; `ray::ServeReplica:train:TrainController` -> ServeReplica:train
                role = ":".join(cmdline[0].removeprefix("ray::").split(".")[0].split(":")[:2]).strip()
                if role and role != "IDLE":
                    rss[role] += proc.memory_info().rss / 2**20
                    private[role] += private_mb(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, FileNotFoundError):
            continue
    return dict(rss), dict(private)


class PolicyLoad(threading.Thread):
    """Chat completions at a steady rate until stopped; every answer and failure is kept."""

    def __init__(self, base: str, model: str, prompt: str, rate: float):
        super().__init__(daemon=True)
        self.base, self.model, self.prompt, self.period = base, model, prompt, 1.0 / rate
        self.stop = threading.Event()
        self.results: list[dict] = []

    def run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self.stop.is_set():
                sent = time.time()
                try:
                    r = client.post(f"{self.base}/v1/chat/completions",
                                    json={"model": self.model, "max_tokens": 8, "temperature": 0.7,
                                          "messages": [{"role": "user", "content": self.prompt}]})
                    ok, version = r.status_code == 200, int(r.headers.get("x-asyncrl-weight-version", -1))
                    error = "" if ok else r.text[:200]
                except httpx.HTTPError as exc:
                    ok, version, error = False, -1, repr(exc)[:200]
                self.results.append({"t": sent, "ok": ok, "latency_s": time.time() - sent, "version": version,
                                     "error": error})
                self.stop.wait(max(0.0, self.period - (time.time() - sent)))


def slope(points: list[tuple[float, float]], after_s: float) -> float | None:
    kept = [(t, v) for t, v in points if t >= after_s]
    if len(kept) < 4:
        return None
    t, v = np.array(kept).T
    return float(np.polyfit(t / 60, v, 1)[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=60)
    parser.add_argument("--model", choices=sorted(WORKLOADS), default="tiny")
    parser.add_argument("--rate", type=float, default=1.0, help="policy requests per second")
    parser.add_argument("--sample-every", type=float, default=30.0, help="seconds between status/memory samples")
    parser.add_argument("--warmup-minutes", type=float, default=10.0, help="memory slopes are fitted after this")
    parser.add_argument("--quick-swap", action="store_true", help="swap the reward endpoint after 1 minute")
    parser.add_argument("--out", default=os.path.join("outputs", time.strftime("long_run-%Y%m%d-%H%M%S")))
    args = parser.parse_args()

    from ray import serve

    from asyncrl.config import compose
    from asyncrl.serve.reward import deploy_declaratively, reward_app_config
    from asyncrl.run.placement import init_ray
    from asyncrl.weights.sync import free_port

    os.makedirs(args.out, exist_ok=True)
    overrides = WORKLOADS[args.model] + " trainer.wandb_mode=disabled trainer.checkpoint_every=200"
    config = compose(overrides.split())
    init_ray(config)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    run_dir = os.path.abspath(os.path.join(args.out, "run"))

    def deploy(version: str) -> None:
        deploy_declaratively([
            {"name": "train", "route_prefix": "/train", "import_path": "asyncrl.serve.train:build_train",
             "args": {"overrides": overrides + " reward.use_serve=true", "trainer.run_dir": run_dir}},
            {"name": "policy", "route_prefix": "/v1", "import_path": "asyncrl.serve.policy:build_policy",
             "args": {"overrides": overrides}},
            reward_app_config("verifier", overrides, {"version": version}),
        ], timeout_s=900)

    deploy("1")
    started = time.time()
    load = PolicyLoad(base, config.model.name, PROMPTS[args.model], args.rate)
    load.start()
    samples, swapped_at = [], None
    swap_after = 60.0 if args.quick_swap else args.minutes * 30.0
    try:
        while time.time() - started < args.minutes * 60:
            now = time.time() - started
            if swapped_at is None and now >= swap_after:
                deploy("2")  # in place (user_config): the trainer's calls see version 2 from here on
                swapped_at = time.time() - started
                print(f"reward endpoint swapped to version 2 at {swapped_at:.0f}s", flush=True)
            status = httpx.get(f"{base}/train/status", timeout=60).json()
            prompts = status.get("prompt_source", {})
            samples.append({"t": now, "step": status["step"], "weight_version": status["weight_version"],
                            "samples_trained": status["samples_trained"], "samples_generated": status["samples_generated"],
                            "steps_skipped": status.get("steps_skipped", 0),
                            "prompts_retired_share": prompts.get("prompts_retired_share", 0.0),
                            "all_prompts_retired": prompts.get("all_prompts_retired", False),
                            "reward_versions": status["reward_endpoints"]["verifier"].get("versions", {}),
                            **dict(zip(("memory_mb", "private_mb"), actor_memory()))})
            print(json.dumps({k: v for k, v in samples[-1].items() if k not in ("memory_mb", "private_mb")}), flush=True)
            time.sleep(args.sample_every)
        final = httpx.get(f"{base}/train/status", timeout=60).json()
    finally:
        load.stop.set()
        load.join(timeout=120)
        for app in ("train", "policy", "reward-verifier"):
            serve.delete(app)
        serve.shutdown()
    result = summarize(samples, load.results, final, swapped_at, args)
    with open(os.path.join(args.out, "long_run.json"), "w") as f:
        json.dump({"args": vars(args), "overrides": overrides, **result, "samples": samples}, f, indent=1, default=str)
    plot(samples, args.out, args.warmup_minutes)
    print(json.dumps(result, indent=1, default=str))
    return 0 if result["policy_failures"] == 0 and result["ledger"]["balanced"] and not result["ledger"]["duplicates"] else 1


def summarize(samples: list[dict], requests: list[dict], final: dict, swapped_at: float | None, args) -> dict:
    warm = args.warmup_minutes * 60
    memory = {key: memory_summary(samples, key, warm) for key in ("memory_mb", "private_mb")}
    windows = []
    for a, b in zip(samples, samples[1:]):
        steps = b["step"] - a["step"]
        windows.append({"t": b["t"], "step_s": (b["t"] - a["t"]) / steps if steps else None,
                        "samples_per_s": (b["samples_trained"] - a["samples_trained"]) / (b["t"] - a["t"])})
    ledger = final["ledger"]
    latencies = np.array([r["latency_s"] for r in requests if r["ok"]]) if requests else np.zeros(1)
    return {
        "minutes": round(samples[-1]["t"] / 60, 1) if samples else 0, "final_step": final["step"],
        "samples_trained": final["samples_trained"], "steps_skipped": final.get("steps_skipped", 0),
        "reward_swapped_at_s": swapped_at, "reward_versions_seen": final["reward_endpoints"]["verifier"].get("versions"),
        "policy_requests": len(requests), "policy_failures": sum(not r["ok"] for r in requests),
        "policy_failure_examples": [r["error"] for r in requests if not r["ok"]][:5],
        "policy_latency_p50_s": float(np.percentile(latencies, 50)), "policy_latency_p99_s": float(np.percentile(latencies, 99)),
        "policy_versions_seen": len({r["version"] for r in requests if r["ok"]}),
        "prompts_retired_share_final": final.get("prompt_source", {}).get("prompts_retired_share"),
        "ledger": {"balanced": not ledger["problems"], "problems": ledger["problems"],
                   "duplicates": ledger.get("duplicates", 0), "trained": ledger["trained"], "dropped": ledger["dropped"],
                   "in_flight": ledger["in_flight"]},
        "memory": memory["memory_mb"], "private_memory": memory["private_mb"], "windows": windows,
    }


def memory_summary(samples: list[dict], key: str, warm: float) -> dict:
    roles = sorted({role for s in samples for role in s[key]})
    return {role: {"first_mb": next(s[key][role] for s in samples if role in s[key]),
                   "last_mb": next(s[key][role] for s in reversed(samples) if role in s[key]),
                   "slope_mb_per_min_after_warmup": slope([(s["t"], s[key][role]) for s in samples if role in s[key]], warm)}
            for role in roles}


def plot(samples: list[dict], out: str, warmup_minutes: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [s["t"] / 60 for s in samples]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    step_s, rate, mids = [], [], []
    for a, b in zip(samples, samples[1:]):
        mids.append(b["t"] / 60)
        steps = b["step"] - a["step"]
        step_s.append((b["t"] - a["t"]) / steps if steps else np.nan)
        rate.append((b["samples_trained"] - a["samples_trained"]) / (b["t"] - a["t"]))
    axes[0][0].plot(mids, step_s, marker=".")
    axes[0][0].set_title("seconds per learner step")
    axes[0][1].plot(mids, rate, marker=".")
    axes[0][1].set_title("samples trained per second")
    for role in sorted({r for s in samples for r in s["private_mb"]}):
        axes[1][0].plot([s["t"] / 60 for s in samples if role in s["private_mb"]],
                        [s["private_mb"][role] for s in samples if role in s["private_mb"]], label=role)
    axes[1][0].axvline(warmup_minutes, color="grey", linestyle=":")
    axes[1][0].set_title("private (anonymous) memory by role, MB")
    axes[1][0].legend(fontsize=6)
    axes[1][1].plot(minutes, [s["prompts_retired_share"] for s in samples], marker=".")
    axes[1][1].set_title("share of prompts retired")
    for ax in axes.flat:
        ax.set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "long_run.png"), dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
