"""Record the golden batches of `tests/test_store.py`: for a few algorithms, a short recorded run on
the tiny model (`trainer.store_trajectories=true`), whose first trained batch (trained from the
initial weights) and the loss and gradient norm the learner got on it are kept in `tests/data/golden/`.

A later learner given the same batch at the same weights must reproduce them: a change to the
maths of the policy step fails that test. Run this again only when a change of the maths is meant
(and say so in the commit).

    .venv/bin/python load_tests/golden_batches.py
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from asyncrl.config import compose, to_dict  # noqa: E402
from asyncrl.driver import train  # noqa: E402
from asyncrl.storage.trajectory_store import BATCH_RECORD_ENCODER, read_batches  # noqa: E402

GOLDEN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "golden")
# Each exercises other parts of the policy step: per-sequence means (GRPO); token mean, dual clip and
# two mini-batches around the proximal policy (DAPO); GAE rows, whitening and the NLL (VAPO).
RUNS = {
    "grpo": ["task=tiny", "algorithm=grpo"],
    "dapo": ["task=tiny", "algorithm=dapo"],
    "vapo": ["task=tiny_seq", "algorithm=vapo", "critic.warmup.steps=1"],
}


def record(name: str, overrides: list[str]) -> str:
    run_dir = tempfile.mkdtemp(prefix=f"golden-{name}-")
    config = compose(["model=tiny", *overrides, "trainer.total_steps=2", "trainer.store_trajectories=true",
                      "trainer.wandb_mode=disabled", f"trainer.run_dir={run_dir}"])
    train(config, progress=False, eval_prompts=1)
    first = read_batches(run_dir)[0]
    assert first.trained_from_version == 0, first.trained_from_version
    out = os.path.join(GOLDEN_DIR, name)
    os.makedirs(out, exist_ok=True)
    saved = to_dict(config)
    saved["trainer"]["run_dir"] = ""
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(saved, f, indent=1)
    with open(os.path.join(out, "batch.msgpack"), "wb") as f:
        f.write(BATCH_RECORD_ENCODER.encode(first))
    shutil.rmtree(run_dir)
    print(f"{name}: batch {first.batch_id}, {first.rows} rows, loss {first.loss:.6g}, grad norm {first.grad_norm:.6g}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", default=list(RUNS), help="which golden batches to record again")
    args = parser.parse_args()
    for name in args.only:
        record(name, RUNS[name])
    return 0


if __name__ == "__main__":
    sys.exit(main())
