"""Where users look (issue 60): a run's live figures as Ray metrics (`trainer.loggers: [ray]`), read
back as Prometheus reads them: the Prometheus text that Ray's metrics agent serves on this node
(the suite's own Ray; its export port is the one Ray picked, as `ray.nodes()` says)."""

import json
import time
import urllib.request

import pytest

from asyncrl.config import compose
from asyncrl.run.ray_metrics import COUNTERS, GAUGES, PREFIX


def scrape(address: str, run: str) -> dict[str, dict[tuple, float]]:
    """`name -> {labels other than Ray's own: value}` of the run's samples at `address`."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(address, timeout=10).read().decode()
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("ray_" + PREFIX) and sample.labels.get("run") == run:
                labels = tuple(sorted((k, v) for k, v in sample.labels.items()
                                      if k in ("mailbox", "state")))
                out.setdefault(sample.name.removeprefix("ray_").removesuffix("_total"), {})[labels] = sample.value
    return out


@pytest.mark.slow  # (CI's time: the same gauges under `serve run` in tests/test_serve.py)
def test_a_runs_step_figures_are_on_rays_prometheus_endpoint(ray_session, tmp_path, capsys):
    """Three steps with `trainer.loggers=[ray]`: Ray's metrics agent serves the run's gauges with the
    last step record's values (metrics.jsonl), its counters with the run's totals, and the
    mailboxes' depths; the run says where at start-up."""
    from asyncrl.driver import train
    from asyncrl.run.ray_metrics import export_address

    run = tmp_path / "ray-metrics-run"
    summary = train(compose(["model=tiny", "task=tiny", "algorithm=grpo", "trainer.prompts_per_step=2",
                             "trainer.total_steps=3", f"trainer.run_dir={run}", "trainer.loggers=[ray]"]),
                    progress=False, eval_prompts=2)
    assert summary["steps"] == 3
    address = export_address()
    assert address.startswith("http://") and address.endswith("/metrics")
    assert f"Ray metrics of run 'ray-metrics-run' (asyncrl_*): {address}" in capsys.readouterr().out
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["step"] == 3
    # A counter appears at its first count (Ray's counters take no 0): the run's totals of 0 are not there.
    expected = {name: last[key] for key, name, _ in GAUGES + COUNTERS
                if last.get(key) is not None and (last[key] or (key, name, _) in GAUGES)}
    # Ray sends a process's metrics to its agent every 10 s: wait until the last step's are there.
    deadline, seen = time.time() + 90, {}
    while time.time() < deadline:
        seen = scrape(address, "ray-metrics-run")
        if all(PREFIX + name in seen for name in expected) and seen[PREFIX + "learner_step"][()] == 3:
            break
        time.sleep(2)
    assert seen, urllib.request.urlopen(address, timeout=10).read().decode()[-3000:]
    print(f"metrics on the endpoint after {time.time() - deadline + 90:.1f}s")
    for name, value in expected.items():
        assert seen[PREFIX + name][()] == pytest.approx(float(value)), name
    assert {"learner_step", "weight_version", "reward_mean_generated", "samples_per_s", "staleness_mean",
            "samples_trained", "samples_generated"} <= set(expected)
    mailboxes = seen[PREFIX + "mailbox_messages"]
    assert {(("mailbox", "batches"), ("state", "queued")), (("mailbox", "batches"), ("state", "leased"))} <= set(mailboxes)
    assert all(value >= 0 for value in mailboxes.values())
