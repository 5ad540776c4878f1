"""Documented check of the status page: start the `train` app on the tiny model, let it train,
open the page in headless Chromium (Debian's `chromium`), and save a screenshot.

    python load_tests/status_page_screenshot.py [--out docs/status_page.png] [--seconds 60]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import time

import httpx
import ray
from ray import serve

from asyncrl.serve.train import build_train
from asyncrl.weights.sync import free_port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/status_page.png")
    parser.add_argument("--seconds", type=float, default=60.0, help="training time before the screenshot")
    args = parser.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        raise SystemExit("no Chromium found: apt-get install chromium")
    ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    run_dir = tempfile.mkdtemp(prefix="asyncrl-status-")
    serve.run(build_train({"overrides": "model=tiny task=tiny algorithm=grpo policy.loss.clip_high=0.28 "
                                        "trainer.wandb_mode=disabled", "trainer.run_dir": run_dir}),
              name="train", route_prefix="/train")
    url = f"http://127.0.0.1:{port}/train/"
    time.sleep(args.seconds)
    deadline = time.monotonic() + 300  # a slow machine: wait (bounded) for steps to draw
    while (status := httpx.get(url + "status", timeout=30).json())["step"] < 2 and time.monotonic() < deadline:
        time.sleep(2.0)
    print(f"step {status['step']}, weight version {status['weight_version']}")
    # The page carries the data of the moment (drawn at first paint); --virtual-time-budget also
    # lets its first refresh finish before the capture.
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1400,1300", "--virtual-time-budget=5000", f"--screenshot={args.out}", url],
                   check=True, capture_output=True, timeout=120)
    print(f"screenshot: {args.out}")
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
