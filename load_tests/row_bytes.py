"""What a large data row costs a run: samples/s and the bytes the mailboxes held, rows of 1 MB
against rows of a few bytes, side by side in one run.

    python load_tests/row_bytes.py                # 20 steps each, about 4 minutes on 2 cores

The tiny task as a user's verl parquet (10 prompts, G=32), trained by a verl reward function that
reads its answer from the row's `extra_info`; the large case adds a 1 MB reference text to every
row. Prints, per case: training samples/s, the peak bytes each mailbox held, and the peak resident
memory of the run's processes (the Ray workers on this machine, sampled every half second). Bounded: each run
stops at its step count.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading

import psutil

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str[:1] == extra_info["next"])
'''


def write_data(directory: str, reference_bytes: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "mine", "prompt": [{"role": "user", "content": f"{d}:"}], "reward_model": {"ground_truth": ""},
             "extra_info": {"next": str((d + 1) % 10), "reference": "r" * reference_bytes}} for d in range(10)]
    for split in ("train", "test"):
        pq.write_table(pa.Table.from_pylist(rows), os.path.join(directory, f"{split}.parquet"))
    with open(os.path.join(directory, "reward.py"), "w") as f:
        f.write(REWARD)


def workers_rss_mb() -> float:
    """Resident memory of this run's Ray workers: the `ray::` processes below this one (the Ray
    that `train` starts is this process's child), so other jobs' Ray workers are not counted."""
    total = 0
    for child in psutil.Process().children(recursive=True):
        try:
            if child.cmdline()[:1] and child.cmdline()[0].startswith("ray::"):
                total += child.memory_info().rss
        except psutil.Error:
            continue
    return total / 2**20


def one_run(reference_bytes: int, steps: int) -> dict:
    import ray

    from asyncrl.config import compose
    from asyncrl.driver import train

    directory = tempfile.mkdtemp(prefix="row_bytes_")
    write_data(directory, reference_bytes)
    config = compose(["model=tiny", "task=tiny", "task.name=file", "algorithm=grpo", "trainer.wandb_mode=disabled",
                      "trainer.checkpoint_every=0", f"task.path={directory}/train.parquet",
                      f"task.eval_path={directory}/test.parquet", f"custom_reward_function.path={directory}/reward.py",
                      f"trainer.total_steps={steps}", f"trainer.run_dir={directory}/run"])
    peak, done = [0.0], threading.Event()

    def sample_rss() -> None:  # the run's workers' memory, every half second while it runs
        while not done.wait(0.5):
            peak[0] = max(peak[0], workers_rss_mb())

    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    try:
        summary = train(config, progress=False, eval_prompts=2)
    finally:
        done.set()
        sampler.join()
    ray.shutdown()
    status = summary["final_status"]
    trained = status.get("samples_trained", 0)
    return {"row_bytes": reference_bytes, "steps": summary["steps"], "train_wall_s": summary["train_wall_s"],
            "samples_per_s": trained / max(summary["train_wall_s"], 1e-9),
            "mailbox_bytes_peak": {name: box.get("bytes_peak", 0) for name, box in status["queue_depths"].items()},
            "workers_rss_mb_peak": peak[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    from asyncrl.bench.common import cpu_description

    results = [one_run(size, args.steps) for size in (16, 1 << 20)]
    print(f"rows of 16 B and of 1 MB, {args.steps} steps of the tiny task from a verl parquet ({cpu_description()})")
    print("  row      | samples/s | mailbox peak bytes (prompts, segments, batches) | Ray workers RSS MB, peak")
    for r in results:
        peaks = r["mailbox_bytes_peak"]
        print(f"  {r['row_bytes']:>8} | {r['samples_per_s']:9.1f} | {peaks.get('prompts', 0):>12} "
              f"{peaks.get('segments', 0):>12} {peaks.get('batches', 0):>12} | {r['workers_rss_mb_peak']:8.0f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
