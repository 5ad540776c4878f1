"""What a checkpoint holds, part by part: the policy as a Hugging Face directory (tied weights kept
tied), the value learner's part, the learners' tensors and JSON, the batches saved for a resume;
and a checkpoint's policy exported as a directory users serve. Where and how a checkpoint is
written and committed is `asyncrl.storage.checkpoint`."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
from typing import Any

import msgspec
import torch

from asyncrl.messages.structs import Codec, TrainBatch
from asyncrl.storage.checkpoint import CorruptCheckpoint, MANIFEST, checkpoints_dir, latest_valid, verify, files_of


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
    from asyncrl.storage.images import save_image_processor

    save_image_processor(model, directory)  # a vision-language model's: how the run read images
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
    for rel in files_of(directory):
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
    held = {r.segment.sample_id for b in batches for r in b.rows if r.segment.finished}
    kept = []
    for batch in batches:
        rows = [r for r in batch.rows if r.segment.sample_id in held]
        if rows:
            kept.append(msgspec.structs.replace(batch, rows=rows))
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


EXPORT_DTYPES = ("bfloat16", "float16", "float32")
_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def export_hf(path: str, out_dir: str, trust_remote_code: bool = False, dtype: str = "") -> str:
    """Copy the policy of a run or checkpoint (verified first) to a Hugging Face directory, its
    weights in `dtype` (default `source_dtype`: a checkpoint holds the learner's fp32 master
    weights, served in the dtype the model came in), with the tokenizer, chat template and
    generation config the checkpoint holds, and a vision-language model's image processor
    (`preprocessor_config.json`). Weights of another dtype, or a checkpoint written before tied
    weights were stored once, are re-saved through transformers (a tie stored once).
    `trust_remote_code`: the user's word, never the checkpoint's."""
    source = policy_dir(path)
    dtype = dtype or source_dtype(path)
    if stored_dtypes(source) != {dtype} or _stores_a_tie_twice(source, trust_remote_code):
        shutil.copytree(source, out_dir, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
        with _no_progress_bars():
            model = _auto_model_class(source).from_pretrained(source, dtype=getattr(torch, dtype),
                                                              trust_remote_code=trust_remote_code)
            model.save_pretrained(out_dir, safe_serialization=True)
    else:
        shutil.copytree(source, out_dir, dirs_exist_ok=True)
    _default_modes(out_dir)  # checkpoints written before the modes were set
    return out_dir


def _auto_model_class(directory: str):
    """transformers' class for a model directory: a vision-language model's conditional-generation
    class (its config has a vision tower's), else a causal language model's."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from asyncrl.storage.images import directory_has_vision

    return AutoModelForImageTextToText if directory_has_vision(directory) else AutoModelForCausalLM


def saved_dtype(directory: str) -> str | None:
    """The dtype a Hugging Face directory's config.json names (`dtype`; `torch_dtype` before
    transformers 5) when it is one of `EXPORT_DTYPES`; None when it names none."""
    try:
        with open(os.path.join(directory, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    named = config.get("dtype") or config.get("torch_dtype") if isinstance(config, dict) else None
    return named if named in EXPORT_DTYPES else None


def source_dtype(path: str) -> str:
    """The dtype `asyncrl export` writes unless told: that of the model directory the run trained
    from (`model.path` with `model.source=hf` in the run's config.json), or of a Hugging Face
    directory given as is; float32 otherwise (the tiny model, the embedded model's cached fp32
    directory, a model directory that is gone or names no dtype)."""
    path = os.path.abspath(path)
    is_checkpoint = os.path.exists(os.path.join(path, MANIFEST))  # run/checkpoints/step_k: the run's is two up
    for candidate in [path] + ([os.path.dirname(os.path.dirname(path))] if is_checkpoint else []):
        try:
            saved = load_json(os.path.join(candidate, "config.json"))
        except (OSError, ValueError):
            continue
        if isinstance(saved, dict) and "trainer" in saved and "model" in saved:  # a run's, not a model's
            model = saved["model"] if isinstance(saved["model"], dict) else {}
            found = saved_dtype(model.get("path", "")) if model.get("source") == "hf" else None
            return found or "float32"
    return saved_dtype(path) or "float32"


def stored_dtypes(directory: str) -> set[str]:
    """The dtypes of the floating-point weights in a directory's safetensors files (by their headers)."""
    from safetensors import safe_open

    found = set()
    for shard in glob.glob(os.path.join(directory, "*.safetensors")):
        with safe_open(shard, "pt") as f:
            found.update(f.get_slice(name).get_dtype() for name in f.keys())
    return {_SAFETENSORS_DTYPES[d] for d in found if d in _SAFETENSORS_DTYPES}


def _stores_a_tie_twice(directory: str, trust_remote_code: bool) -> bool:
    """Do the safetensors files of a Hugging Face directory hold two names of one tied weight? The
    ties are the architecture's (a weightless copy of the model on the meta device)."""
    from safetensors import safe_open
    from transformers import AutoConfig

    stored: set[str] = set()
    for shard in glob.glob(os.path.join(directory, "*.safetensors")):
        with safe_open(shard, "pt") as f:
            stored.update(f.keys())
    with torch.device("meta"):
        config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
        skeleton = _auto_model_class(directory).from_config(config, trust_remote_code=trust_remote_code)
    return any(len(stored.intersection(names)) > 1 for names in tied_names(skeleton))
