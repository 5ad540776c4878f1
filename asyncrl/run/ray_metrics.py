"""A run's live figures as Ray metrics (`trainer.loggers: [..., ray]`): `ray.util.metrics` gauges and
counters set from each step record as it is written (and the mailboxes' depths from the status read
with it), in the process that writes the records: the `asyncrl train` driver, or the Serve `train`
app's controller. Ray's metrics agent on each node serves them with Ray's own at
`http://<node>:<metrics_export_port>/metrics` (Prometheus text; Ray prefixes every name with
`ray_`), which the Ray dashboard's Grafana and any Prometheus that scrapes Ray read.

Every metric is tagged `run` (the run's name: `trainer.experiment_name`, else the run directory's
name), so the runs of one cluster stay apart. A gauge holds the newest record's value; a counter
holds the run's total from its first count on (Ray's counters take no 0): a resumed run's
counters start from the totals it resumed with, and a total that goes back, after a restart from
a checkpoint, holds until it passes its old value again. Ray sends
a process's metrics to the agent every few seconds (`metrics_report_interval_ms`, 10 s by default).
"""

from __future__ import annotations

import os

from asyncrl.config import Config

# (step record key, metric name, description): the newest record's value.
GAUGES = (
    ("step", "learner_step", "The policy learner's step of the newest step record."),
    ("weight_version", "weight_version", "The policy weight version the newest step produced."),
    ("reward_mean_generated", "reward_mean_generated",
     "Mean reward of the samples generated (before dynamic sampling)."),
    ("reward_mean", "reward_mean", "Mean reward of the batch trained at the newest step."),
    ("samples_per_s", "samples_per_s", "Samples trained per second since the previous poll with new steps."),
    ("staleness_mean", "staleness_mean", "Mean staleness (versions behind) of the tokens trained at the newest step."),
    ("staleness_max", "staleness_max", "Largest staleness of the tokens trained at the newest step."),
    ("generator_busy_fraction", "generator_busy_fraction", "Fraction of wall time the generators generate."),
    ("generator_paused_for_weights_fraction", "generator_paused_for_weights_fraction",
     "Fraction of wall time the generators wait for new weights."),
    ("broadcast_s", "broadcast_seconds", "Duration of the newest weight broadcast."),
    ("prompts_retired_share", "prompts_retired_share", "Share of the prompts retired (no learning signal left)."),
    ("loss", "loss", "The policy loss of the newest step."),
    ("entropy", "entropy", "The policy entropy of the newest step's tokens."),
    ("train_s", "train_seconds", "Seconds the newest learner step took."),
    ("eval_accuracy", "eval_accuracy", "Held-out greedy accuracy of the newest evaluation during training."),
    ("eval_weight_version", "eval_weight_version", "The weight version the newest held-out evaluation scored."),
)
# (step record key, metric name, description): the run's total so far.
COUNTERS = (
    ("samples_generated", "samples_generated", "Samples the generators finished."),
    ("samples_trained", "samples_trained", "Samples whose last row was trained."),
    ("samples_dropped", "samples_dropped", "Samples dropped (dynamic sampling, staleness, failures)."),
    ("reward_failed", "reward_failures", "Rewards that failed (an exception, a timeout, not a number)."),
)
PREFIX = "asyncrl_"


def run_name(config: Config, run_dir: str) -> str:
    """The `run` tag: the run's name in wandb too."""
    return config.trainer.experiment_name or os.path.basename(os.path.abspath(run_dir))


class RayMetrics:
    """The run's gauges and counters in this process (Ray must be up: `init_ray`)."""

    def __init__(self, run: str):
        from ray.util.metrics import Counter, Gauge

        self.tags = {"run": run}
        self.gauges = {key: Gauge(PREFIX + name, description=doc, tag_keys=("run",)) for key, name, doc in GAUGES}
        self.counters = {key: Counter(PREFIX + name, description=doc, tag_keys=("run",)) for key, name, doc in COUNTERS}
        self.totals = {key: 0.0 for key in self.counters}  # what each counter holds
        self.mailboxes = Gauge(PREFIX + "mailbox_messages", description="Messages in a mailbox, queued or leased.",
                               tag_keys=("run", "mailbox", "state"))

    def log(self, records: list[dict], status: dict | None = None) -> None:
        """Each record's figures (the newest wins), and the mailboxes' depths of `status`."""
        for record in records:
            for key, gauge in self.gauges.items():
                if _is_number(record.get(key)):
                    gauge.set(float(record[key]), tags=self.tags)
            for key, counter in self.counters.items():
                value = record.get(key)
                if _is_number(value) and value > self.totals[key]:
                    counter.inc(float(value) - self.totals[key], tags=self.tags)
                    self.totals[key] = float(value)
        for mailbox, depth in sorted((status or {}).get("queue_depths", {}).items()):
            for state in ("queued", "leased"):
                if _is_number(depth.get(state)):
                    self.mailboxes.set(float(depth[state]), tags={**self.tags, "mailbox": mailbox, "state": state})


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # not NaN


def export_address() -> str:
    """Where this node's metrics agent serves the Prometheus text ("" when Ray does not say)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id and node.get("MetricsExportPort"):
            return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    return ""
