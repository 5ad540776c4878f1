"""What a run of days writes and holds stays bounded: the jsonl logs roll and keep a few files, the
records held in memory are thinned (the whole run still spans the plot), the trajectory store
keeps its newest files within a bound, and a diverged (NaN) loss is served as null, not a 500."""

import glob
import json
import math
import os

import pyarrow as pa

from asyncrl.run.records import RunRecords
from asyncrl.serve import train as train_app
from asyncrl.serve.guards import FiniteJSONResponse
from asyncrl.storage.trajectory_store import StoreWriter, store_files

STATUS = {"samples_trained": 0, "samples_dropped": 0, "samples_generated": 0, "tool_calls": 0,
          "generator_busy_fraction": 0.0, "generator_paused_for_weights_fraction": 0.0, "last_broadcast": {}}


def test_logs_roll_and_records_in_memory_are_thinned(tmp_path):
    log = RunRecords(str(tmp_path), history_limit=100, log_file_bytes=4000, log_files_kept=2)
    for step in range(1, 2001):
        log.add([{"step": step, "loss": 0.5, "reward_mean_generated": 0.1}], STATUS, resumed=False)
        log.pool_event({"event": "joined", "generator": f"g{step}"})
    for name in ("metrics.jsonl", "generators.jsonl"):
        files = sorted(glob.glob(str(tmp_path / f"{name}*")))
        assert [os.path.basename(f) for f in files] == [name, f"{name}.1", f"{name}.2"]
        assert sum(os.path.getsize(f) for f in files) < 3 * 4000 + 400  # (1 + kept) files of at most ~4000 bytes
        newest = json.loads(open(tmp_path / name).read().splitlines()[-1])
        assert newest.get("step", 2000) == 2000 or newest["generator"] == "g2000"
    steps = [r["step"] for r in log.records]
    assert len(steps) <= 100 and steps[0] == 1 and steps[-50:] == list(range(1951, 2001))
    assert steps == sorted(steps) and log.steps_recorded == 2000
    log.after_restart(1990)  # the ten steps after the checkpoint are redone
    assert log.steps_recorded == 1990 and log.records[-1]["step"] == 1990


def test_the_store_keeps_its_newest_files_within_the_bound(tmp_path):
    schema = pa.schema([("sample_id", pa.string()), ("blob", pa.binary())])
    rows = [{"sample_id": f"s{i}", "blob": os.urandom(20_000)} for i in range(10)]
    writer = StoreWriter(str(tmp_path), "trajectories", schema, max_file_bytes=1, keep_bytes=600_000)
    for _ in range(12):  # a file per flush (each ~200 KB, incompressible)
        writer.append(rows)
        writer.flush()
    files = store_files(str(tmp_path))
    assert writer.files_deleted > 0 and sum(os.path.getsize(f) for f in files) <= 600_000
    newest = files[-1]
    assert newest.endswith("trajectories-00011.parquet")
    # A resumed run continues after the highest number, never over a file still there.
    again = StoreWriter(str(tmp_path), "trajectories", schema, max_file_bytes=1, keep_bytes=600_000)
    again.append(rows)
    again.close()
    assert store_files(str(tmp_path))[-1].endswith("trajectories-00012.parquet")
    assert os.path.exists(newest)


def test_a_nan_loss_is_served_as_null_not_a_500():
    record = {"step": 3, "loss": math.nan, "grad_norm": math.inf, "reward_mean_generated": 0.5}
    assert json.loads(FiniteJSONResponse.encode([record])) == [{**record, "loss": None, "grad_norm": None}]
    # Every route of the train app answers through it (FastAPI's JSON refuses NaN with a 500).
    def walk(router):  # Serve's ingress re-mounts the class's routes under an included router
        for route in router.routes:
            yield from walk(route.original_router) if hasattr(route, "original_router") else [route]

    routes = [r for r in walk(train_app.train_api) if getattr(r, "path", "") in ("/status", "/metrics")]
    assert len(routes) == 2 and all(r.response_class is FiniteJSONResponse for r in routes)
    # The status page carries the data of the moment even then (it used to fall back to none).
    page = train_app.status_page({"step": 3}, [record])
    embedded = json.loads(page.split('<script id="initial-data" type="application/json">')[1].split("</script>")[0])
    assert embedded["metrics"][0]["loss"] is None and embedded["status"]["step"] == 3
