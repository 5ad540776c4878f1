"""Reading back what a run's loggers wrote, as their own tools read it: TensorBoard's event files
through TensorBoard's `EventAccumulator`, wandb's offline run files (`run-<id>.wandb`: wandb's
records, protobuf, in LevelDB's log format, which wandb's Python package no longer reads itself)."""

import glob
import os
import struct

_BLOCK = 32768  # LevelDB's log: records in 32 KiB blocks, each record cut into FULL, or FIRST ... LAST
_HEADER = 7  # checksum (4), length (2), type (1); the file opens with ":W&B", a magic (2) and a version (1)


def tensorboard_scalars(directory: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the event files in `directory` (all of them, one run), as (step, value)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(directory, size_guidance={"scalars": 0})  # 0: keep every point
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def wandb_records(path: str):
    """The records of an offline wandb run file (`wandb_internal_pb2.Record`), in order."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", path
    pos, pieces = 7, b""
    while pos + _HEADER <= len(data):
        if _BLOCK - pos % _BLOCK < _HEADER:  # a block's tail too short for a header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        pieces += data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind in (1, 4):  # FULL, LAST: a record is whole
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            pieces = b""
            yield record


def wandb_offline_parts(run_dir: str) -> list[dict]:
    """Each offline wandb run directory under `run_dir/wandb/`, oldest first: its id, name, group,
    tags, project, history rows ({key: value} by step) and last summary values."""
    parts = []
    for directory in sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*"))):
        (path,) = glob.glob(os.path.join(directory, "run-*.wandb"))
        part = {"directory": os.path.basename(directory), "history": {}, "summary": {}}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run = record.run
                part.update(id=run.run_id, name=run.display_name, group=run.run_group, tags=list(run.tags),
                            project=run.project)
            elif kind == "history":
                row = {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
                part["history"][int(row["_step"])] = row
            elif kind == "summary":
                part["summary"].update({item.key: item.value_json for item in record.summary.update if item.key})
        parts.append(part)
    return parts
