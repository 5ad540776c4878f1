"""The trajectory store: every finished trajectory of a run, and every batch its learner trained, as
Parquet files that `pyarrow`, `pandas` and Hugging Face `datasets` read without asyncrl.

Layout under `<run_dir>/trajectories/` (`trainer.store_trajectories=true`):

    trajectories-00000.parquet ...   one row per finished sample (`TrajectoryRecord`), kept or dropped
    batches-00000.parquet ...        one row per trained batch: the `TrainBatch` as msgspec bytes,
                                     the weight version it was trained from, loss and gradient norm
    images/<name>.pt                 a prompt's processed images (a vision-language model), each once:
                                     a record's `images` name them relative to the store, so the
                                     store replays (`mode=learn`) without the run's image cache

Append-only: a file is written under a `.inprogress` name and renamed when it is rolled (by size or
age) or the run stops, so every `*.parquet` a reader sees is whole and never changes again. The
schemas are explicit Arrow types (lists of int32/float32, strings), so a reader needs nothing of
asyncrl: `datasets.load_dataset("parquet", data_files="<run>/trajectories/trajectories-*.parquet")`.

`record_of` (pure) builds a record from what the assembler holds; `StoreWriter` writes files; the
`readers` turn files back into records and batches for `mode=learn` and the golden-batch test.
"""

from __future__ import annotations

import glob
import os
import time

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from asyncrl.messages.routes import routes_as_lists, routes_from_lists
from asyncrl.messages.structs import Codec, Reward, Segment, TrainBatch, ground_truth_text
from asyncrl.redaction import masked

STORE_DIRNAME = "trajectories"
INPROGRESS = ".inprogress"
SCHEMA_VERSION = 1


class TrajectoryRecord(msgspec.Struct, kw_only=True, frozen=True):
    """One finished sample as the run saw it. Token-aligned lists have one entry per response token."""

    schema_version: int = SCHEMA_VERSION
    sample_id: str
    prompt_id: str
    sample_idx: int
    group_id: str
    group_size: int
    data_source: str
    ground_truth: str
    prompt_text: str
    response_text: str
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    behaviour_logprobs: list[float]  # log π_behaviour of each response token, as sampled
    token_versions: list[int]  # the weight version that generated each response token
    window_ends: list[int]  # response offset where each generator window ended (T-PPO windows)
    finish_reason: str  # eos | max_length | max_turns
    seed: int
    generator_id: str
    score: float | None = None  # the reward endpoint's score (None: the reward failed)
    correct: bool | None = None
    reward_source: str = ""  # the endpoint (or route) that gave the reward
    reward_version: str = ""  # its version (bumped on a hot swap)
    reward_failed: bool = False
    token_rewards: list[float] | None = None  # process rewards, one per response token
    suspicious: list[str] = []
    values: list[float] | None = None  # V(s_t) used for the advantages (value-based algorithms)
    status: str = "kept"  # kept (sent to the learner) | dropped | recorded (mode=generate)
    drop_reason: str = ""
    policy_version: int = 0  # the learner's version the assembler knew at the sample's fate (kept: its batch left)
    recorded_at: float = 0.0
    # Per response token: 0 where the learner does not score it (FIRE's first token, a held-back
    # EOS, an observation); None: all scored.
    token_scored: list[int] | None = None
    # Per response token: 1 where it is an environment's observation (an episode); None: none is.
    token_observation: list[int] | None = None
    reward_error: str = ""  # why the reward failed (reward_failed): the endpoint's reason
    # A mixture-of-experts model's routes (routing replay): per response token, the experts of its
    # position, `sparse_layers x route_top_k` ids layer by layer (-1: not recorded); None: none.
    token_routes: list[list[int]] | None = None
    route_top_k: int = 0
    # The prompt's processed images (`asyncrl.storage.images`): as the run held them, and once
    # written, `images/<name>` in the store (`keep_images`); read back as paths (`read_trajectories`).
    images: list[str] = []


TRAJECTORY_SCHEMA = pa.schema([
    ("schema_version", pa.int16()), ("sample_id", pa.string()), ("prompt_id", pa.string()),
    ("sample_idx", pa.int32()), ("group_id", pa.string()), ("group_size", pa.int32()),
    ("data_source", pa.string()), ("ground_truth", pa.string()), ("prompt_text", pa.string()),
    ("response_text", pa.string()), ("prompt_token_ids", pa.list_(pa.int32())),
    ("response_token_ids", pa.list_(pa.int32())), ("behaviour_logprobs", pa.list_(pa.float32())),
    ("token_versions", pa.list_(pa.int32())), ("window_ends", pa.list_(pa.int32())),
    ("finish_reason", pa.string()), ("seed", pa.int64()), ("generator_id", pa.string()),
    ("score", pa.float64()), ("correct", pa.bool_()), ("reward_source", pa.string()),
    ("reward_version", pa.string()), ("reward_failed", pa.bool_()), ("token_rewards", pa.list_(pa.float32())),
    ("suspicious", pa.list_(pa.string())), ("values", pa.list_(pa.float32())), ("status", pa.string()),
    ("drop_reason", pa.string()), ("policy_version", pa.int64()), ("recorded_at", pa.float64()),
    ("token_scored", pa.list_(pa.uint8())), ("token_observation", pa.list_(pa.uint8())),
    ("reward_error", pa.string()), ("token_routes", pa.list_(pa.list_(pa.int16()))), ("route_top_k", pa.int16()),
    ("images", pa.list_(pa.string())),
])

BATCH_SCHEMA = pa.schema([
    ("batch_id", pa.string()), ("step", pa.int64()), ("trained_from_version", pa.int64()),
    ("loss", pa.float64()), ("grad_norm", pa.float64()), ("rows", pa.int32()), ("batch", pa.binary()),
    ("recorded_at", pa.float64()),
])


class BatchRecord(msgspec.Struct, kw_only=True, frozen=True):
    """A batch the learner trained, and what training it gave (the golden-batch seam)."""

    batch_id: str
    step: int
    trained_from_version: int  # the policy weights the batch was trained from
    loss: float
    grad_norm: float
    rows: int
    batch: bytes  # the TrainBatch, msgspec-encoded (asyncrl.messages.structs)
    recorded_at: float = 0.0


BATCH_CODEC = Codec(TrainBatch)
# Records cross to the recorder actor as msgspec bytes.
RECORDS_ENCODER = msgspec.msgpack.Encoder()
RECORDS_DECODER = msgspec.msgpack.Decoder(list[TrajectoryRecord])
BATCH_RECORD_ENCODER = msgspec.msgpack.Encoder()
BATCH_RECORD_DECODER = msgspec.msgpack.Decoder(BatchRecord)


class PendingRecord:
    """What a finished sample's record needs, gathered (by the assembler) until its fate is known."""

    __slots__ = ("merged", "window_ends", "prompt_text", "response_text", "reward", "values")

    def __init__(self, merged: Segment, window_ends: list[int], prompt_text: str, response_text: str):
        self.merged, self.window_ends = merged, window_ends
        self.prompt_text, self.response_text = prompt_text, response_text
        self.reward: Reward | None = None
        self.values: np.ndarray | None = None


def record_of(merged: Segment, window_ends: list[int], reward: Reward | None, prompt_text: str, response_text: str,
              status: str, drop_reason: str = "", values: np.ndarray | None = None,
              policy_version: int = 0) -> TrajectoryRecord:
    """The record of a finished sample (all windows merged) and its reward."""
    routes, top_k = routes_as_lists(merged.new_routes)
    return TrajectoryRecord(
        sample_id=merged.sample_id, prompt_id=merged.prompt_id, sample_idx=merged.sample_idx,
        group_id=merged.group_id, group_size=merged.group_size, data_source=merged.data_source,
        ground_truth=ground_truth_text(merged.ground_truth), prompt_text=prompt_text, response_text=response_text,
        prompt_token_ids=merged.prompt_token_ids.tolist(), response_token_ids=merged.new_token_ids.tolist(),
        behaviour_logprobs=merged.new_logprobs.tolist(), token_versions=merged.new_versions.tolist(),
        window_ends=list(window_ends), finish_reason=merged.finish_reason.value, seed=merged.seed,
        generator_id=merged.generator_id,
        score=None if reward is None or reward.failed else float(reward.score),
        correct=None if reward is None else reward.correct,
        reward_source=reward.source if reward is not None else "",
        reward_version=reward.source_version if reward is not None else "",
        reward_error=masked(reward.details.get("error", ""))[:500] if reward is not None and reward.failed else "",
        reward_failed=bool(reward is not None and reward.failed),
        token_rewards=None if reward is None or reward.token_rewards is None else reward.token_rewards.tolist(),
        suspicious=list(reward.suspicious) if reward is not None else [],
        values=None if values is None else np.asarray(values, dtype=np.float32).tolist(),
        status=status, drop_reason=drop_reason, policy_version=policy_version, recorded_at=time.time(),
        token_scored=None if merged.new_scored is None else merged.new_scored.tolist(),
        token_observation=None if merged.new_observation is None else merged.new_observation.tolist(),
        token_routes=routes, route_top_k=top_k, images=list(merged.images))


def segments_of(record: TrajectoryRecord) -> list[Segment]:
    """The record as the generator's windows were (one `Segment` per window), for replay."""
    from asyncrl.messages.structs import FinishReason

    ids = np.asarray(record.response_token_ids, dtype=np.int32)
    logp = np.asarray(record.behaviour_logprobs, dtype=np.float32)
    versions = np.asarray(record.token_versions, dtype=np.int32)
    scored = None if record.token_scored is None else np.asarray(record.token_scored, dtype=np.uint8)
    observed = None if record.token_observation is None else np.asarray(record.token_observation, dtype=np.uint8)
    routes = routes_from_lists(record.token_routes, record.route_top_k)
    ends = list(record.window_ends) or [len(ids)]
    out, start = [], 0
    for window, end in enumerate(ends):
        last = window == len(ends) - 1
        out.append(Segment(
            prompt_id=record.prompt_id, sample_idx=record.sample_idx, window=window, group_id=record.group_id,
            group_size=record.group_size, prompt_token_ids=np.asarray(record.prompt_token_ids, dtype=np.int32),
            prior_response_ids=ids[:start], prior_versions=versions[:start], new_token_ids=ids[start:end],
            new_logprobs=logp[start:end], new_versions=versions[start:end],
            new_scored=None if scored is None else scored[start:end],
            new_observation=None if observed is None else observed[start:end],
            prior_observation=None if observed is None else observed[:start], finished=last,
            new_routes=None if routes is None else routes[start:end],
            finish_reason=FinishReason(record.finish_reason) if last else
            FinishReason.TOOL_CALL if observed is not None and observed[start:end].any() else FinishReason.WINDOW,
            data_source=record.data_source, ground_truth=record.ground_truth, seed=record.seed,
            generator_id=record.generator_id, images=tuple(record.images)))
        start = end
    return out


def reward_of(record: TrajectoryRecord) -> Reward:
    """The recorded reward of a sample, as its endpoint gave it."""
    return Reward(prompt_id=record.prompt_id, sample_idx=record.sample_idx,
                  score=0.0 if record.score is None else record.score, source=record.reward_source,
                  source_version=record.reward_version, correct=record.correct, failed=record.reward_failed,
                  token_rewards=None if record.token_rewards is None else np.asarray(record.token_rewards, dtype=np.float32),
                  suspicious=list(record.suspicious))


# --- writing -----------------------------------------------------------------------------------------


class StoreWriter:
    """Append-only Parquet files of one kind (`trajectories` or `batches`) in a directory.

    Rows are buffered and written as a row group per `flush()`; the file is closed and renamed
    into place when it passes `max_file_bytes` or `max_file_age_s`, and by `close()`.
    """

    def __init__(self, directory: str, kind: str, schema: pa.Schema, max_file_bytes: int = 64 << 20,
                 max_file_age_s: float = 600.0, keep_bytes: int = 0, prepare=None):
        """`keep_bytes` > 0: after each roll the store's oldest closed files (both kinds) are
        deleted until the rest fit in it. `prepare(rows, directory)`: run on the rows in the writing
        thread before they are written (`keep_images`)."""
        self.directory, self.kind, self.schema, self.prepare = directory, kind, schema, prepare
        self.max_file_bytes, self.max_file_age_s, self.keep_bytes = max_file_bytes, max_file_age_s, keep_bytes
        os.makedirs(directory, exist_ok=True)
        self._rows: list[dict] = []
        self._writer: pq.ParquetWriter | None = None
        self._path = ""
        self._opened_at = 0.0
        # Continue numbering after files of an earlier incarnation (a resumed run appends; the
        # oldest may have been deleted by the retention bound, so after the highest number).
        numbers = [int(os.path.basename(p).split("-")[-1].split(".")[0])
                   for p in glob.glob(os.path.join(directory, f"{kind}-*.parquet"))]
        self._index = max(numbers, default=-1) + 1
        self.files_deleted = 0
        self.files_closed = 0
        self.rows_written = 0

    def append(self, rows: list[dict]) -> None:
        self._rows.extend(rows)

    def flush(self) -> None:
        """Write the buffered rows as one row group; roll the file if it is big or old enough."""
        # Take the buffer first: rows appended meanwhile (the recorder appends on its event loop
        # while this runs in a thread) go to the next flush, not lost.
        rows, self._rows = self._rows, []
        if rows and self.prepare is not None:
            rows = self.prepare(rows, self.directory)
        if rows:
            if self._writer is None:
                self._open()
            self._writer.write_table(pa.Table.from_pylist(rows, schema=self.schema))
            self.rows_written += len(rows)
        if self._writer is not None and (os.path.getsize(self._path) >= self.max_file_bytes
                                         or time.monotonic() - self._opened_at >= self.max_file_age_s):
            self._roll()

    def close(self) -> None:
        self.flush()
        if self._writer is not None:
            self._roll()

    def _open(self) -> None:
        self._path = os.path.join(self.directory, f"{self.kind}-{self._index:05d}.parquet{INPROGRESS}")
        self._writer = pq.ParquetWriter(self._path, self.schema, compression="zstd")
        self._opened_at = time.monotonic()

    def _roll(self) -> None:
        self._writer.close()
        os.replace(self._path, self._path.removesuffix(INPROGRESS))
        self._writer, self._index = None, self._index + 1
        self.files_closed += 1
        if self.keep_bytes:
            self.files_deleted += prune_store(self.directory, self.keep_bytes, images=self.kind == "trajectories")


IMAGES_DIRNAME = "images"


def keep_images(rows: list[dict], directory: str) -> list[dict]:
    """Trajectory rows whose processed images are copied into the store (`images/`, each file once:
    its name is content-addressed) and named relative to it. An image no longer on this node keeps
    its path (replay says which one is missing)."""
    from asyncrl.storage.images import write_atomic  # torch: only a store with images needs it

    for row in rows:
        kept = []
        for ref in row.get("images") or ():
            name = os.path.join(IMAGES_DIRNAME, os.path.basename(ref))
            target = os.path.join(directory, name)
            if not os.path.exists(target) and os.path.exists(ref):
                with open(ref, "rb") as f:
                    write_atomic(target, f.read())
            kept.append(name if os.path.exists(target) else ref)
        row["images"] = kept
    return rows


def prune_store(directory: str, keep_bytes: int, images: bool = False) -> int:
    """Delete the oldest closed files of a store (by when they were closed) until the rest, its
    images counted, fit in `keep_bytes`; how many were deleted. The newest file is always kept.
    `images` (the trajectories' writer, between two of its files): then also the images that no
    trajectory file left names."""
    files = sorted(glob.glob(os.path.join(directory, "*.parquet")), key=os.path.getmtime)
    sizes = [os.path.getsize(f) for f in files]
    kept_images = glob.glob(os.path.join(directory, IMAGES_DIRNAME, "*.pt"))
    deleted, total = 0, sum(sizes) + sum(os.path.getsize(f) for f in kept_images)
    for path, size in zip(files[:-1], sizes):
        if total <= keep_bytes:
            break
        os.remove(path)
        total -= size
        deleted += 1
    if deleted and images:
        named = {name for f in glob.glob(os.path.join(directory, "trajectories-*.parquet"))
                 if "images" in pq.read_schema(f).names
                 for row in pq.read_table(f, columns=["images"]).column("images").to_pylist() for name in row or ()}
        for path in kept_images:
            if os.path.join(IMAGES_DIRNAME, os.path.basename(path)) not in named:
                os.remove(path)
    return deleted


# --- reading -----------------------------------------------------------------------------------------


def store_dir(path: str) -> str:
    """A run directory's store, or the store directory itself."""
    inner = os.path.join(path, STORE_DIRNAME)
    return inner if os.path.isdir(inner) else path


def store_files(path: str, kind: str = "trajectories") -> list[str]:
    """The closed files of one kind, in write order (files still being written are not read)."""
    return sorted(glob.glob(os.path.join(store_dir(path), f"{kind}-*.parquet")))


def read_trajectories(path: str, statuses: tuple[str, ...] = ("kept", "dropped", "recorded")) -> list[TrajectoryRecord]:
    """Every record of a store (a run directory or its `trajectories/`) with one of `statuses`."""
    files = store_files(path)
    if not files:
        raise FileNotFoundError(f"no trajectory files (trajectories-*.parquet) in {store_dir(path)}")
    records, directory = [], store_dir(path)
    for file in files:
        for row in pq.read_table(file).to_pylist():
            if row["status"] in statuses:
                row["images"] = [_stored_image(directory, ref, row["sample_id"]) for ref in row.get("images") or ()]
                records.append(msgspec.convert(row, TrajectoryRecord))
    return records


def _stored_image(directory: str, ref: str, sample_id: str) -> str:
    """The path of a record's image: in the store (`images/<name>`), else where the run held it."""
    path = os.path.abspath(os.path.join(directory, ref))  # read in other processes, from other directories
    if not os.path.exists(path):
        raise FileNotFoundError(f"{directory}: sample {sample_id}'s image {ref} is not in the store, nor on this "
                                f"machine (the store keeps a copy of each image it records)")
    return path


def read_batches(path: str) -> list[BatchRecord]:
    """Every recorded batch, in training order."""
    files = store_files(path, "batches")
    if not files:
        raise FileNotFoundError(f"no batch files (batches-*.parquet) in {store_dir(path)}")
    rows = [row for file in files for row in pq.read_table(file).to_pylist()]
    return [msgspec.convert(row, BatchRecord) for row in sorted(rows, key=lambda r: r["step"])]
