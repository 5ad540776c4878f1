"""The run's status as Prometheus metrics (text exposition format), for `/train/metrics/prometheus`.

Built per scrape from `Run.status()` (`asyncrl.run`) with `prometheus_client`'s metric families, so
the numbers are the ones the status page shows, with no second set of counters to keep in step.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class _StatusCollector:
    def __init__(self, status: dict):
        self.status = status

    def collect(self):
        s = self.status

        def gauge(name, doc, value):
            return GaugeMetricFamily(f"asyncrl_{name}", doc, value=float(value))

        def counter(name, doc, value):
            return CounterMetricFamily(f"asyncrl_{name}", doc, value=float(value))

        yield counter("learner_steps", "Policy learner steps taken.", s["step"])
        yield gauge("weight_version", "Newest policy weight version.", s["weight_version"])
        yield counter("samples_generated", "Samples generated (all windows).", s["samples_generated"])
        yield counter("samples_trained", "Samples whose last row was trained.", s["samples_trained"])
        yield gauge("reward_mean", "Mean reward of every scored sample.", s["reward_mean"])
        yield gauge("generator_busy_fraction", "Fraction of wall time generators generate.", s["generator_busy_fraction"])
        yield gauge("learner_busy_fraction", "Fraction of wall time the policy learner trains.", s["learner_busy_fraction"])
        yield gauge("broadcast_seconds", "Duration of the latest weight broadcast.",
                    s["last_broadcast"].get("total_s", 0.0))
        dropped = CounterMetricFamily("asyncrl_samples_dropped", "Samples dropped, by reason.", labels=["reason"])
        for reason, n in sorted(s["dropped_by_reason"].items()):
            dropped.add_metric([reason], float(n))
        yield dropped
        queued = GaugeMetricFamily("asyncrl_mailbox_messages", "Messages in a mailbox.", labels=["mailbox", "state"])
        for name, q in sorted(s["queue_depths"].items()):
            queued.add_metric([name, "queued"], float(q["queued"]))
            queued.add_metric([name, "leased"], float(q["leased"]))
        yield queued
        ledger = s.get("ledger", {})
        states = GaugeMetricFamily("asyncrl_ledger_samples", "Admitted samples by ledger state.", labels=["state"])
        for state in ("admitted", "in_flight", "awaiting_reward", "awaiting_training", "trained", "dropped"):
            if state in ledger:
                states.add_metric([state], float(ledger[state]))
        yield states
        if "duplicates" in ledger:
            yield counter("ledger_duplicates", "Samples trained twice (must stay 0).", ledger["duplicates"])
        by_version = CounterMetricFamily("asyncrl_rewards", "Rewards scored, by endpoint version.", labels=["version"])
        for key, n in sorted(s["assembler"].items()):
            if key.startswith("rewards_by_version."):
                by_version.add_metric([key.removeprefix("rewards_by_version.")], float(n))
        yield by_version


def prometheus_text(status: dict) -> bytes:
    registry = CollectorRegistry()
    registry.register(_StatusCollector(status))
    return generate_latest(registry)
