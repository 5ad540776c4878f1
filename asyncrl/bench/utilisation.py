"""Generator utilisation per algorithm: the share of wall time the generator spends inside engine
windows, and where the rest goes (waiting for weight updates, for prompts, for mailbox space), on
the long-tailed tiny task (`task=tiny_tail`), one generator and one learner process each.

The counters are the generator's own (`Generator.timing`), read at the end of the run, so they
include the start (first prompts, the critic's warm-up for value-based algorithms).
"""

from __future__ import annotations

import tempfile

from asyncrl.config import compose

ALGORITHMS = {
    "grpo": [], "dapo": [], "ppo": [], "vcppo": [], "vapo": [], "tppo": [],
    # Pairwise judging costs G·(G−1) comparisons per group: the paper's small groups.
    "pairwise_ppo": ["algorithm.group_size=4", "trainer.prompts_per_step=16"],
}
WORKLOAD = ["model=tiny", "task=tiny_tail", "trainer.wandb_mode=disabled", "trainer.checkpoint_every=0",
            "trainer.stall_timeout_s=120"]


def one(algorithm: str, steps: int, overrides: list[str]) -> dict:
    from asyncrl.driver import train

    with tempfile.TemporaryDirectory() as run_dir:
        config = compose([*WORKLOAD, f"algorithm={algorithm}", *ALGORITHMS[algorithm], f"trainer.total_steps={steps}",
                          f"trainer.run_dir={run_dir}", *overrides])
        summary = train(config, progress=False, eval_prompts=10)
    status = summary["final_status"]
    gens = status["generators"]
    wall = sum(g["wall_s"] for g in gens)

    def share(key):
        return sum(g[key] for g in gens) / wall

    records = summary["records"]
    return {
        "steps": len(records), "wall_s": records[-1]["wall_time_s"],
        "samples_per_s": records[-1]["samples_trained"] / records[-1]["wall_time_s"],
        "generating": share("generate_s"), "waiting_for_weights": share("weight_update_s"),
        "waiting_for_prompts": share("wait_prompts_s"), "waiting_for_mailbox": share("wait_mailbox_s"),
        "taking_prompts": share("admit_s"), "preparing": share("prepare_s"),
        "other": 1 - sum(share(k) for k in ("generate_s", "weight_update_s", "wait_prompts_s", "wait_mailbox_s",
                                            "admit_s", "prepare_s")),
        "learner_busy": status["learner_busy_fraction"],
        "window_tokens": config.engine.window_tokens, "group_size": config.algorithm.group_size,
    }


def run(quick: bool = False, overrides: list[str] | None = None) -> dict:
    steps = 8 if quick else 40
    names = ("grpo", "tppo") if quick else tuple(ALGORITHMS)
    out = {}
    for name in names:
        out[name] = one(name, steps, overrides or [])
        print(name, out[name], flush=True)
    return out


def report(result: dict) -> str:
    lines = ["| algorithm | generating | waiting: weights | waiting: prompts | waiting: mailbox | taking prompts | "
             "preparing windows | other | learner busy | samples/s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in result.items():
        lines.append(f"| {name} | {r['generating']:.3f} | {r['waiting_for_weights']:.3f} | {r['waiting_for_prompts']:.3f} | "
                     f"{r['waiting_for_mailbox']:.3f} | {r['taking_prompts']:.3f} | {r['preparing']:.3f} | {r['other']:.3f} | "
                     f"{r['learner_busy']:.2f} | {r['samples_per_s']:.1f} |")
    return "\n".join(lines)
