"""Checkpoints of a running system: layout, atomic commit, checksums, retention (what each part
holds, and export, is `asyncrl.storage.checkpoint_parts`).

A checkpoint is a directory `<run_dir>/checkpoints/step_<k>/`, written by several actors into
`step_<k>.tmp/` and renamed into place once every part is there, so a reader never sees half a
checkpoint. `manifest.json` (written last) holds the SHA-256 and size of every file; a checkpoint
whose files do not match is skipped for the previous one. Every file and directory is fsynced
before the rename, and an older checkpoint is deleted only after the new one is committed (one of
the same step too: it is set aside, not deleted, until its replacement is in place). A disk that
cannot take a checkpoint (full, over quota, read-only) raises `CheckpointWriteError`: restarting
would only meet the same disk, so the run stops with that one error.

    policy/                 the policy as a Hugging Face directory (safetensors, config, tokenizer):
                            `transformers` loads it as is; `asyncrl export` copies it out. Tied
                            weights (an output embedding that is the input one) are stored once.
                            LoRA (model.lora_rank): the adapter in peft's format instead (`asyncrl.weights.lora`)
    learner.pt              optimizer and LR-scheduler state (tensors and numbers only)
    learner.json            step, weight version, counters, incarnation
    batches.msgpack         assembled batches not yet trained (msgspec)
    prompt_source.msgpack   the prompt cursor and the sample ledger (msgspec)
    value/                  the value learner's model, optimizer and version (value-based runs)

Nothing here is unpickled: tensors are read with `torch.load(weights_only=True)` or safetensors.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import json
import os
import re
import shutil
import time



MANIFEST = "manifest.json"
REPLACED = ".replaced"  # a checkpoint set aside while one of the same step takes its place
_STEP_DIR = re.compile(r"^step_(\d+)(\.replaced)?$")
# A disk that cannot take the checkpoint: no space, no quota, read-only. Another attempt meets it again.
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


class CorruptCheckpoint(RuntimeError):
    """A checkpoint whose files are missing or do not match its manifest."""


class DiskRefused(RuntimeError):
    """The run's disk refused a write (full, over quota, read-only). Not worth a restart, which
    would meet the same disk: the run stops with this one error, and `resume=true` continues once
    there is room."""


class CheckpointWriteError(DiskRefused):
    """The disk refused a checkpoint (every committed checkpoint is untouched)."""


def disk_refusal(exc: BaseException, directory: str, what: str, note: str = "",
                 kind: type[DiskRefused] = DiskRefused) -> DiskRefused | None:
    """`exc` as a `kind` saying what to do, when it is the disk's refusal; else None."""
    if not isinstance(exc, OSError) or exc.errno not in DISK_ERRNOS:
        return None
    try:
        usage = shutil.disk_usage(directory)
        room = f"{usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB"
    except OSError:
        room = "free space unknown"
    return kind(f"{what} could not be written to {directory}: {os.strerror(exc.errno)} ({room}){note}. "
                f"Make room there (or set trainer.run_dir elsewhere), then continue with resume=true")


def disk_error(exc: BaseException, directory: str, step: int, root: str | None = None) -> CheckpointWriteError | None:
    """A checkpoint's `disk_refusal`; `root`: the checkpoints directory, whose newest checkpoint
    the message names."""
    note = ""
    if root is not None:
        previous = committed(root)
        note = (f"; the newest checkpoint, {os.path.basename(previous[-1][1])}, is untouched" if previous
                else "; there is no earlier checkpoint")
    return disk_refusal(exc, directory, f"the checkpoint of step {step}", note, CheckpointWriteError)


def checkpoints_dir(run_dir: str) -> str:
    return os.path.join(run_dir, "checkpoints")


def step_dirname(step: int) -> str:
    return f"step_{step:08d}"


def step_of(path: str) -> int:
    """The step of a checkpoint directory (`step_<k>`, `step_<k>.tmp`, `step_<k>.replaced`)."""
    return int(os.path.basename(path.rstrip("/")).split(".")[0].removeprefix("step_"))


def begin(run_dir: str, step: int) -> str:
    """A fresh temporary directory for the checkpoint of `step` (a stale one is removed)."""
    tmp = os.path.join(checkpoints_dir(run_dir), step_dirname(step) + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def files_of(root: str) -> list[str]:
    return sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "**", "*"), recursive=True)
                  if os.path.isfile(p) and os.path.basename(p) != MANIFEST)


def commit(tmp: str, step: int, keep_last: int) -> str:
    """Checksum every file, write the manifest, fsync every file and directory, rename into place,
    prune old checkpoints. A disk that refuses raises `CheckpointWriteError` (the partial
    directory removed, every committed checkpoint untouched)."""
    root = os.path.dirname(tmp)
    try:
        return _commit(tmp, step, keep_last)
    except OSError as exc:
        refused = disk_error(exc, root, step, root)
        if refused is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # give back what the partial checkpoint took
        raise refused from exc


def _commit(tmp: str, step: int, keep_last: int) -> str:
    files = {rel: {"sha256": _sha256(os.path.join(tmp, rel)), "bytes": os.path.getsize(os.path.join(tmp, rel))}
             for rel in files_of(tmp)}
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump({"step": step, "created_at": time.time(), "files": files}, f, indent=1)
    # Durable before it is visible: a rename can reach the disk before the data it names, and a
    # crash then leaves a committed checkpoint of empty files (and, with checkpoint_keep=1, none other).
    _fsync_tree(tmp)
    final = tmp.removesuffix(".tmp")
    aside = None
    if os.path.exists(final):  # the same step saved again (a resumed run's last step): the only copy so far
        aside = final + REPLACED
        shutil.rmtree(aside, ignore_errors=True)  # (a copy of `final`, set aside by an interrupted commit)
        os.rename(final, aside)
    os.rename(tmp, final)
    _fsync_dir(os.path.dirname(final))
    if aside is not None:
        shutil.rmtree(aside)
    prune(os.path.dirname(final), keep_last)
    return final


def _fsync_tree(root: str) -> None:
    for directory, _, names in os.walk(root):
        for name in names:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(directory)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def committed(root: str) -> list[tuple[int, str]]:
    """(step, path) of every committed checkpoint under `root`, oldest first. A checkpoint set aside
    (`.replaced`) counts only where its replacement never took its place (a commit interrupted
    between the two renames)."""
    found: dict[int, str] = {}
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        match = _STEP_DIR.match(name)
        if match and (not match.group(2) or int(match.group(1)) not in found):
            found[int(match.group(1))] = os.path.join(root, name)
    return sorted(found.items())


def prune(root: str, keep_last: int) -> None:
    for _, path in committed(root)[: -keep_last or None] if keep_last > 0 else []:
        shutil.rmtree(path, ignore_errors=True)
    newest = committed(root)[-1][0] if committed(root) else None
    for stale in glob.glob(os.path.join(root, "step_*.tmp")):  # an interrupted write of an older step
        match = _STEP_DIR.match(os.path.basename(stale).removesuffix(".tmp"))
        if match and newest is not None and int(match.group(1)) < newest:
            shutil.rmtree(stale, ignore_errors=True)
    for aside in glob.glob(os.path.join(root, "step_*" + REPLACED)):  # its replacement is in place
        if os.path.isdir(aside.removesuffix(REPLACED)):
            shutil.rmtree(aside, ignore_errors=True)


def verify(path: str) -> dict:
    """The manifest, if every file it names is there with its size and checksum."""
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.exists(manifest_path):
        raise CorruptCheckpoint(f"{path}: no {MANIFEST}")
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
    except ValueError as exc:
        raise CorruptCheckpoint(f"{path}: unreadable {MANIFEST}: {exc}") from None
    for rel, meta in manifest["files"].items():
        file = os.path.join(path, rel)
        if not os.path.exists(file):
            raise CorruptCheckpoint(f"{path}: {rel} is missing")
        if os.path.getsize(file) != meta["bytes"]:
            raise CorruptCheckpoint(f"{path}: {rel} has {os.path.getsize(file)} bytes, expected {meta['bytes']}")
        if _sha256(file) != meta["sha256"]:
            raise CorruptCheckpoint(f"{path}: {rel} does not match its checksum")
    return manifest


def latest_valid(run_dir: str) -> tuple[str | None, list[str]]:
    """The newest checkpoint that verifies, and the reasons the newer ones were rejected."""
    rejected = []
    for _, path in reversed(committed(checkpoints_dir(run_dir))):
        try:
            verify(path)
            return path, rejected
        except CorruptCheckpoint as exc:
            rejected.append(str(exc))
    return None, rejected


def resolve_run_dir(run_dir: str, resume: bool, outputs: str = "outputs", prefix: str = "") -> str:
    """The run directory: the configured one; on resume without one, the newest run under
    `outputs/` that has a checkpoint; otherwise a new timestamped one."""
    if run_dir:
        return run_dir
    if resume:
        runs = [d for d in glob.glob(os.path.join(outputs, "*")) if committed(checkpoints_dir(d))]
        if not runs:
            raise FileNotFoundError(f"resume=true but no run under {outputs}/ has a checkpoint; "
                                    f"set trainer.run_dir to the run to resume")
        return max(runs, key=lambda d: committed(checkpoints_dir(d))[-1][1] and os.path.getmtime(d))
    return os.path.join(outputs, prefix + time.strftime("%Y%m%d-%H%M%S"))
