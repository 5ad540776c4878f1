"""Load test: `serve run <config>` as a user starts it, the policy queried with the `openai` client
while it trains, then stopped with Ctrl-C (SIGINT).

    python load_tests/serve_run.py configs/serve.yaml [--seconds 120] [--out outputs/serve_run.json]
    .venv-sglang/bin/python load_tests/serve_run.py configs/serve_sglang.yaml   # SGLang generating

`serve` is the one beside this Python (the same venv). Waits for the train application's first
step (bounded by --start-timeout), then sends one chat completion a second until --seconds have
passed (Serve's log: <tmp>/serve_run.log), each answer's weight version read from the `x-asyncrl-weight-version` header beside the
learner's step from /train/status. Prints and writes the figures; exits 1 when a request failed or
the answering weight version never rose while the learner trained.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx

BASE = "http://127.0.0.1:8000"


def wait_for_training(proc: subprocess.Popen, timeout_s: float) -> float:
    """Seconds until /train/status reports a learner step (the whole app deployed and training)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise SystemExit(f"serve run exited with {proc.returncode} before training started")
        try:
            if httpx.get(f"{BASE}/train/status", timeout=5).json().get("step", 0) > 0:
                return time.monotonic() - start
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(2)
    raise SystemExit(f"no learner step within {timeout_s:.0f} s")


def query_while_training(seconds: float) -> list[dict]:
    from openai import OpenAI

    client = OpenAI(base_url=f"{BASE}/v1", api_key="unused", max_retries=0, timeout=30)
    model = client.models.list().data[0].id
    answers, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.monotonic()
        try:
            raw = client.chat.completions.with_raw_response.create(
                model=model, messages=[{"role": "user", "content": "3:"}], max_tokens=2)
            answer = {"ok": True, "weight_version": int(raw.headers["x-asyncrl-weight-version"]),
                      "text": raw.parse().choices[0].message.content}
        except Exception as exc:  # counted: the target is none
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:200]}
        answer["latency_s"] = round(time.monotonic() - t0, 3)
        try:
            answer["learner_step"] = httpx.get(f"{BASE}/train/status", timeout=10).json().get("step")
        except (httpx.HTTPError, ValueError):
            answer["learner_step"] = None
        answers.append(answer)
        time.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))
    return answers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a Serve config file, e.g. configs/serve_sglang.yaml")
    parser.add_argument("--seconds", type=float, default=120.0, help="how long to query once training runs")
    parser.add_argument("--start-timeout", type=float, default=420.0, help="bound on start-up to the first step")
    parser.add_argument("--out", default="", help="write the figures here as JSON")
    args = parser.parse_args(argv)
    serve_bin = os.path.join(os.path.dirname(sys.executable), "serve")
    started = time.monotonic()
    # Serve's own log goes to a file (a pipe nobody reads would fill and block it).
    log = open(os.path.join(tempfile.gettempdir(), "serve_run.log"), "w")
    proc = subprocess.Popen([serve_bin, "run", args.config], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        to_first_step = wait_for_training(proc, args.start_timeout)
        answers = query_while_training(args.seconds)
        status = httpx.get(f"{BASE}/train/status", timeout=10).json()
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C, as a user stops it
        try:
            stopped_rc = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stopped_rc = "killed after 120 s"
        log.close()
    ok = [a for a in answers if a["ok"]]
    versions = [a["weight_version"] for a in ok]
    figures = {
        "config": args.config, "seconds_to_first_step": round(to_first_step, 1),
        "requests": len(answers), "failed": len(answers) - len(ok),
        "distinct_weight_versions": len(set(versions)), "first_version": versions[0] if versions else None,
        "last_version": versions[-1] if versions else None,
        "latency_p50_s": sorted(a["latency_s"] for a in ok)[len(ok) // 2] if ok else None,
        "learner_steps": [answers[0]["learner_step"], answers[-1]["learner_step"]] if answers else None,
        "ledger": status.get("ledger"), "serve_run_exit": stopped_rc,
        "wall_s": round(time.monotonic() - started, 1), "sample_answers": [a.get("text") for a in ok[:3]],
        "errors": [a["error"] for a in answers if not a["ok"]][:5],
    }
    print(json.dumps(figures, indent=2))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(figures, fh, indent=2)
    return 0 if figures["failed"] == 0 and len(set(versions)) > 1 else 1


if __name__ == "__main__":
    sys.exit(main())
