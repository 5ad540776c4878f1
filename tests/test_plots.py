"""The run's plots as a reader sees them: whole learner steps on the x axis, titles inside the figure."""

import matplotlib.pyplot as plt
import pytest

from asyncrl.plots import curve_figure, write_plots

# The reward curve's title as the run monitor draws it: wider than the figure on one line.
REWARD_TITLE = "reward of generated samples (all groups, before dynamic sampling)"


@pytest.mark.parametrize("steps", [(1,), (1, 2), (1, 2, 3), tuple(range(1, 41))])
def test_reward_curve_ticks_whole_steps_and_its_title_fits_the_figure(steps):
    records = [{"step": step, "reward_mean_generated": 0.1 * step} for step in steps]
    fig = curve_figure(records, "reward_mean_generated", REWARD_TITLE)
    try:
        fig.canvas.draw()
        ax = fig.axes[0]
        low, high = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if low <= t <= high]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks  # not 1.25, 1.5, ...
        assert low <= min(steps) and max(steps) <= high
        title = ax.title.get_window_extent()
        figure = fig.bbox
        assert figure.x0 <= title.x0 and title.x1 <= figure.x1, (title, figure)
        assert figure.y0 <= title.y0 and title.y1 <= figure.y1, (title, figure)
        assert " ".join(ax.title.get_text().split()) == REWARD_TITLE  # wrapped, not shortened
        assert ax.title.get_window_extent().y0 >= ax.get_window_extent().y1  # above the plot, not over it
    finally:
        plt.close(fig)


def test_every_run_plot_is_written(tmp_path):
    records = [{"step": step, "entropy": 1.0 / step, "staleness_mean": step % 2} for step in range(1, 6)]
    paths = write_plots(records, str(tmp_path))
    assert sorted(p.rsplit("/", 1)[1] for p in paths) == ["entropy.png", "staleness_hist.png"]


def test_held_out_scores_are_drawn_by_the_weight_version_they_scored(tmp_path):
    """Evaluation beside training: a score lands on a later step record; the plot puts it at the
    version it scored (each once, however many records repeat it)."""
    records = [{"step": 1}, {"step": 5, "eval_accuracy": 0.2, "eval_weight_version": 3},
               {"step": 6, "eval_accuracy": 0.2, "eval_weight_version": 3},
               {"step": 9, "eval_accuracy": 0.7, "eval_weight_version": 6}]
    paths = write_plots(records, str(tmp_path))
    assert [p.rsplit("/", 1)[1] for p in paths] == ["eval_accuracy.png"]
    assert write_plots([{"step": 1}], str(tmp_path / "none")) == []
