"""Checkpoints of a running system: layout, atomic commit, checksums, retention, loading, export.

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

import contextlib
import errno
import glob
import hashlib
import json
import os
import re
import shutil
import time
from typing import Any

import msgspec
import torch

from asyncrl.messages.structs import Codec, TrainBatch

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


def _files(root: str) -> list[str]:
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
             for rel in _files(tmp)}
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


# --- parts ---------------------------------------------------------------------------------------


def tied_names(model) -> list[list[str]]:
    """Groups of parameter names that are one tensor in `model` (tied weights, e.g. SmolLM2's
    `model.embed_tokens.weight` and `lm_head.weight`), in declaration order."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def retie(model, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state_dict` with the names `model` ties pointing at one tensor again. Transformers stores a
    tied weight once only when its names share storage; gathered weights are a copy per name, so the
    embedded model's output embedding was saved a second time (0.65 GB on disk for 0.54 GB)."""
    out = dict(state_dict)
    for names in tied_names(model):
        present = [name for name in names if name in out]
        for name in present[1:]:
            if not torch.equal(out[name], out[present[0]]):
                raise ValueError(f"{name} is tied to {present[0]} in the model but differs from it in the weights to save")
            out[name] = out[present[0]]
    return out


def save_policy(model, tokenizer, directory: str, state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """A Hugging Face directory; `state_dict`: whole weights gathered from a sharded model (whose
    own parameters are shards), or a copy of the weights. Tied weights are stored once."""
    if state_dict is not None:
        state_dict = retie(model, state_dict)
    with _no_progress_bars():  # a bar per checkpoint buried a long run's log ("Writing model shards")
        model.save_pretrained(directory, safe_serialization=True, state_dict=state_dict)
    tokenizer.save_pretrained(directory)
    _default_modes(directory)


@contextlib.contextmanager
def _no_progress_bars():
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _default_modes(directory: str) -> None:
    """Give every file the mode a plain `open` would (0644 under the usual umask): the
    safetensors file is written through a temporary file that is 0600, unlike the rest."""
    umask = os.umask(0)
    os.umask(umask)
    for rel in _files(directory):
        os.chmod(os.path.join(directory, rel), 0o666 & ~umask)


def read_policy_weights(model, directory: str) -> dict[str, torch.Tensor]:
    """A saved policy's weights, checked against the names of `model` (built from the run's config;
    sharded or not): every one present (a tied head aside), none foreign."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for shard in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        state.update(load_file(shard))
    expected = set(model.state_dict())
    tied = getattr(model.config, "tie_word_embeddings", False)
    missing = sorted(k for k in expected - set(state) if not (tied and k == "lm_head.weight"))
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        raise CorruptCheckpoint(f"{directory}: weights do not fit the model (missing {missing[:5]}, "
                                f"unexpected {unexpected[:5]})")
    return state


def load_policy_weights(model, directory: str) -> None:
    """Load a saved policy's weights into a model built from the run's config (the reference model
    and everything else about it stay as built)."""
    model.load_state_dict(read_policy_weights(model, directory), strict=False)


VALUE_PART = "value"


def save_value_part(directory: str, value_model, optimizer, version: int, counters: dict) -> None:
    """The value model's part of a checkpoint: `value/model.safetensors` (trunk and head), its
    optimizer and version. `critic.init_path=<checkpoint>/value` starts a critic from it."""
    from safetensors.torch import save_file

    part = os.path.join(directory, VALUE_PART)
    os.makedirs(part, exist_ok=True)
    save_file({k: v.contiguous() for k, v in value_model.state_dict().items()}, os.path.join(part, "model.safetensors"))
    save_tensors({"optimizer": optimizer.state_dict()}, os.path.join(part, "optimizer.pt"))
    save_json({"version": version, "counters": counters}, os.path.join(part, "state.json"))


def is_value_part(path: str) -> bool:
    return os.path.exists(os.path.join(path, "model.safetensors")) and os.path.exists(os.path.join(path, "state.json"))


def save_tensors(obj: dict[str, Any], path: str) -> None:
    torch.save(obj, path)


def load_tensors(path: str) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=True)


def save_json(obj: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def load_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


_BATCHES = Codec(list[TrainBatch])


def save_batches(batches: list[TrainBatch], path: str) -> None:
    with open(path, "wb") as f:
        f.write(_BATCHES.encode(batches))


def load_batches(path: str) -> list[TrainBatch]:
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        return _BATCHES.decode(f.read())


def resumable_batches(batches: list[TrainBatch]) -> tuple[list[TrainBatch], set[str]]:
    """Saved batches, keeping only the rows of samples that end in them, and those samples' ids.

    A window row (T-PPO) whose sample's last window is not among the saved batches belongs to a
    sample that is regenerated whole on resume; training the old window too would train that
    sample's prefix twice."""
    held = {r.segment.sample_id for b in batches for r in b.samples if r.segment.finished}
    kept = []
    for batch in batches:
        rows = [r for r in batch.samples if r.segment.sample_id in held]
        if rows:
            kept.append(msgspec.structs.replace(batch, samples=rows))
    return kept, held


def policy_dir(path: str) -> str:
    """The Hugging Face directory of a policy given a run directory (its newest valid checkpoint),
    a checkpoint (verified), or a Hugging Face directory (as is)."""
    if os.path.isdir(checkpoints_dir(path)):
        latest, rejected = latest_valid(path)
        if latest is None:
            raise CorruptCheckpoint(f"{path}: no valid checkpoint ({'; '.join(rejected) or 'none written'})")
        return os.path.join(latest, "policy")
    if os.path.exists(os.path.join(path, MANIFEST)):
        verify(path)
        return os.path.join(path, "policy")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    raise FileNotFoundError(f"{path} is neither a run directory, a checkpoint, nor a Hugging Face directory")


def export_hf(path: str, out_dir: str, trust_remote_code: bool = False) -> str:
    """Copy the policy of a run or checkpoint (verified first) to a Hugging Face directory. A
    checkpoint written before tied weights were stored once is re-saved through transformers, so
    the export stores them once. `trust_remote_code`: the user's word, never the checkpoint's."""
    source = policy_dir(path)
    if _stores_a_tie_twice(source, trust_remote_code):
        from transformers import AutoModelForCausalLM

        shutil.copytree(source, out_dir, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
        AutoModelForCausalLM.from_pretrained(source, dtype="auto", trust_remote_code=trust_remote_code).save_pretrained(
            out_dir, safe_serialization=True)
    else:
        shutil.copytree(source, out_dir, dirs_exist_ok=True)
    _default_modes(out_dir)  # checkpoints written before the modes were set
    return out_dir


def _stores_a_tie_twice(directory: str, trust_remote_code: bool) -> bool:
    """Do the safetensors files of a Hugging Face directory hold two names of one tied weight? The
    ties are the architecture's (a weightless copy of the model on the meta device)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    stored: set[str] = set()
    for shard in glob.glob(os.path.join(directory, "*.safetensors")):
        with safe_open(shard, "pt") as f:
            stored.update(f.keys())
    with torch.device("meta"):
        config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return any(len(stored.intersection(names)) > 1 for names in tied_names(skeleton))
