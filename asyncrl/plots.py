"""Run plots as PNGs (matplotlib, no display): reward, accuracy, response length, entropy, KL,
clip fraction, throughput, and a histogram of staleness.

Every curve is drawn against the learner step, an integer: the x axis ticks whole steps only (a
run of 3 steps would otherwise be labelled 1.00, 1.25, ...). Titles wrap to the figure's width
(the reward curve's is longer than a 6-inch figure at the default font size)."""

from __future__ import annotations

import os

import numpy as np

CURVES = [
    ("reward_mean_generated", "reward (generated samples)"),
    ("accuracy_generated", "accuracy (generated samples)"),
    ("response_length_mean", "response length (tokens)"),
    ("entropy", "policy entropy"),
    ("approx_kl", "approx. KL to the behaviour policy"),
    ("clip_fraction", "clip fraction"),
    ("samples_per_s", "throughput (trained samples/s)"),
    ("value_loss", "value loss"),
    ("reward_suspicious_share_generated", "share of rewards with signs of reward hacking"),
    ("prompts_retired_share", "share of prompts retired (no signal in their last groups)"),
]


def _step_axis(ax, steps, title: str) -> None:
    """Integer step ticks and a title broken into lines that fit the figure's width. (Matplotlib's
    own `wrap=True` wraps only at draw time, after `tight_layout` made room for one line, so the
    second line was cut off at the top instead.)"""
    import textwrap

    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if max(steps) - min(steps) < 2:  # one or two steps: autoscaling spans no whole step but these
        ax.set_xlim(min(steps) - 1, max(steps) + 1)
    ax.set_xlabel("learner step")
    text = ax.set_title(title)
    renderer = ax.figure.canvas.get_renderer()
    usable = 0.95 * ax.figure.bbox.width
    chars = len(title)
    while text.get_window_extent(renderer).width > usable and chars > 10:
        chars = max(10, int(chars * usable / text.get_window_extent(renderer).width) - 1)
        text.set_text(textwrap.fill(title, chars))


def write_plots(records: list[dict], run_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, title in CURVES:
        points = [(r["step"], r[key]) for r in records if key in r and r[key] is not None]
        if not points:
            continue
        steps, values = zip(*points)
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.plot(steps, values, marker=".", linewidth=1)
        if len(values) >= 10:
            window = max(3, len(values) // 10)
            smooth = np.convolve(values, np.ones(window) / window, mode="valid")
            ax.plot(steps[window - 1:], smooth, linewidth=2, label=f"mean of {window}")
            ax.legend()
        _step_axis(ax, steps, title)
        fig.tight_layout()
        path = os.path.join(run_dir, f"{key}.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    evaluated = sorted({(r["eval_weight_version"], r["eval_accuracy"]) for r in records
                        if r.get("eval_weight_version") is not None and r.get("eval_accuracy") is not None})
    if evaluated:  # evaluation beside training: each score by the weight version it scored
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.plot(*zip(*evaluated), marker="o", linewidth=1)
        ax.set_xlabel("weight version")
        ax.set_title("held-out accuracy by weight version")
        fig.tight_layout()
        paths.append(os.path.join(run_dir, "eval_accuracy.png"))
        fig.savefig(paths[-1], dpi=90)
        plt.close(fig)
    staleness = [r["staleness_mean"] for r in records if "staleness_mean" in r]
    if staleness:
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.hist(staleness, bins=min(20, max(5, len(set(staleness)))))
        ax.set_xlabel("mean staleness of a batch (versions)")
        ax.set_title("staleness")
        fig.tight_layout()
        path = os.path.join(run_dir, "staleness_hist.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_curve(records: list[dict], path: str, key: str = "reward_mean", title: str = "reward") -> None:
    import matplotlib.pyplot as plt

    fig = curve_figure(records, key, title)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def curve_figure(records: list[dict], key: str, title: str):
    """The figure of one metric against the learner step (`plot_curve` saves it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records if key in r]
    values = [r[key] for r in records if key in r]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, values, marker=".", label=key)
    if len(values) >= 5:
        window = max(3, len(values) // 10)
        smooth = np.convolve(values, np.ones(window) / window, mode="valid")
        ax.plot(steps[window - 1:], smooth, label=f"{key} (mean of {window})")
    _step_axis(ax, steps, title)
    ax.legend()
    fig.tight_layout()
    return fig
