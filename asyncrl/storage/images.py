"""Images of prompts as references: read once, kept in a content-addressed store, processed once.

A prompt's images never travel as pixels. An image (a file, bytes, a data URI, a PIL image, verl's
`{"bytes", "path"}` dict) is decoded once, checked, and written as PNG to the store
(`cache_root("images")`, named by the SHA-256 of its bytes: the same image is one file however
many rows hold it); its reference is that path. The model's image processor (`ImagePrep`, e.g.
transformers' `Qwen2VLImageProcessorPil` with the family's min/max pixels) resizes it once, and
the processed tensors (`pixel_values`, `image_grid_thw`) are written beside it, named by the image
and the processor's settings: what the messages carry (`PromptRequest.images`, `Segment.images`)
is the path of that file, and only the roles that run the vision tower (the engines, the learners)
read it (`load_processed`, cached per process).

A prompt's placeholders (verl's `<image>`, or the family's `<|vision_start|><|image_pad|><|vision_end|>`)
are expanded to as many image tokens as the processed image fills (`expand_image_tokens`).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import io
import json
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from asyncrl.config import ConfigError

# verl's placeholder in a prompt's text; TRL's is a `{"type": "image"}` content part.
IMAGE_PLACEHOLDER = "<image>"
# An image larger than this (either side, in pixels, before resizing) is refused where it is read.
MAX_IMAGE_SIDE = 8192


def store_root() -> str:
    """Where images and their processed tensors are kept (`~/.cache/asyncrl/images`)."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "asyncrl", "images")


def write_atomic(path: str, data: bytes) -> None:
    """`data` at `path` through a staging file in the same directory (a reader never sees a part);
    an existing file is kept (content-addressed: the same name holds the same bytes) and touched."""
    if os.path.exists(path):
        _touch(path)
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=".staging-", dir=os.path.dirname(path))
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(staging, path)


def decode_image(value: Any, where: str):
    """A PIL image (RGB) from what a dataset holds: a PIL image, bytes, a path, a data URI
    (`data:image/png;base64,...`) or verl's `{"bytes": ..., "path": ...}`. Refused naming `where`
    when it cannot be decoded or is larger than `MAX_IMAGE_SIDE` on a side."""
    from PIL import Image

    try:
        if isinstance(value, Image.Image):
            image = value
        else:
            image = Image.open(io.BytesIO(_image_bytes(value, where)))
            image.load()
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 -- PIL raises many kinds; each is an image that cannot be read
        raise ConfigError(f"{where}: the image cannot be decoded ({type(exc).__name__}: {exc})") from exc
    if max(image.size) > MAX_IMAGE_SIDE:
        raise ConfigError(f"{where}: the image is {image.size[0]}x{image.size[1]} pixels, more than "
                          f"{MAX_IMAGE_SIDE} on a side")
    return image.convert("RGB")


def _image_bytes(value: Any, where: str) -> bytes:
    if isinstance(value, dict):
        raw = value.get("bytes")
        if isinstance(raw, str) and not raw.startswith("data:"):
            raw = base64.b64decode(raw, validate=True)  # bytes written as base64 text (JSON has no bytes)
        value = raw or value.get("path") or value.get("image") or value.get("url") or ""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, str) and value.startswith("data:"):
        header, _, payload = value.partition(",")
        if ";base64" not in header:
            raise ConfigError(f"{where}: a data URI of an image must be base64")
        return base64.b64decode(payload)
    if isinstance(value, str) and "://" in value:
        raise ConfigError(f"{where}: image {value[:60]!r} is a URL; images are read from files or data URIs, "
                          f"never fetched from the network")
    if isinstance(value, str) and value:
        with open(value, "rb") as f:
            return f.read()
    raise ConfigError(f"{where}: no image in {type(value).__name__} {str(value)[:60]!r}")


def _touch(path: str) -> None:
    """Mark a stored file used now: its modification time is its last use (`StoreBudget`)."""
    try:
        os.utime(path)
    except FileNotFoundError:  # deleted meanwhile by a budget: its user writes it again
        pass


def store_image(value: Any, where: str, root: str = "") -> str:
    """The reference of an image: the path of its PNG in the store (`root`, else `store_root()`),
    written the first time."""
    image = decode_image(value, where)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    data = buffer.getvalue()
    path = os.path.join(root or store_root(), f"{hashlib.sha256(data).hexdigest()[:32]}.png")
    write_atomic(path, data)
    return path


# The attribute of a loaded vision-language model that holds the image processor it reads images
# with (`asyncrl.models.vision.with_image_processor`): what its checkpoints and exports save beside
# the weights (`save_image_processor`).
PROCESSOR_ATTRIBUTE = "asyncrl_image_processor"


def save_image_processor(model, directory: str) -> bool:
    """Write the image processor `model` was loaded with (`preprocessor_config.json`) into a model
    directory; False when it has none (a text model)."""
    processor = getattr(model, PROCESSOR_ATTRIBUTE, None)
    if processor is None:
        return False
    processor.save_pretrained(directory)
    return True


def directory_has_vision(path: str) -> bool:
    """Whether a model directory holds a vision-language model (its config.json has a vision tower's)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            return "vision_config" in json.load(f)
    except (OSError, ValueError, TypeError):
        return False


@functools.lru_cache(maxsize=4096)
def load_processed(ref: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`(pixel_values [patches, channels x patch area], image_grid_thw [3])` of a processed image
    reference (kept per process: a group's rows and every window read one copy)."""
    saved = torch.load(ref, weights_only=True)
    return saved["pixel_values"], saved["image_grid_thw"]


def image_tokens(ref: str, merge_size: int) -> int:
    """Tokens a processed image fills in the prompt: its patches, merged `merge_size` x `merge_size`."""
    return int(load_processed(ref)[1].prod()) // merge_size ** 2


@dataclass(frozen=True)
class ImageTokens:
    """A family's image tokens: the text that opens, fills and closes an image in a prompt."""

    start: str = "<|vision_start|>"
    pad: str = "<|image_pad|>"
    end: str = "<|vision_end|>"


class ImagePrep:
    """A model's image processor over the store: `processed(refs)` gives the references of the
    processed tensors (processing each image once per setting), `expand(ids, refs)` the prompt's
    image tokens expanded to what each image fills."""

    def __init__(self, processor, pad_token_id: int, merge_size: int, tokens: ImageTokens = ImageTokens()):
        self.processor, self.pad_token_id, self.merge_size, self.tokens = processor, pad_token_id, merge_size, tokens
        settings = json.dumps(processor.to_dict(), sort_keys=True, default=str)
        self.settings_key = hashlib.sha256(settings.encode()).hexdigest()[:12]
        self._done: dict[str, str] = {}

    def processed(self, refs: tuple[str, ...], where: str = "") -> tuple[str, ...]:
        return tuple(self._processed(ref, where) for ref in refs)

    def _processed(self, ref: str, where: str) -> str:
        if ref in self._done and os.path.exists(self._done[ref]):
            _touch(self._done[ref])
            return self._done[ref]
        if ref.endswith(f"-{self.settings_key}.pt"):  # processed already, with these settings
            return ref
        out = f"{os.path.splitext(ref)[0]}-{self.settings_key}.pt"
        if not os.path.exists(out):
            batch = self.processor(images=[decode_image(ref, where or ref)], return_tensors="pt")
            buffer = io.BytesIO()
            torch.save({"pixel_values": batch["pixel_values"], "image_grid_thw": batch["image_grid_thw"][0]}, buffer)
            write_atomic(out, buffer.getvalue())
        self._done[ref] = out
        return out

    def placeholder_text(self, text: str) -> str:
        """verl's `<image>` as the family's image tokens (one pad each, expanded after tokenizing)."""
        return text.replace(IMAGE_PLACEHOLDER, self.tokens.start + self.tokens.pad + self.tokens.end)

    def expand(self, ids: list[int], processed: tuple[str, ...], where: str) -> list[int]:
        """`ids` with the k-th image pad token repeated as many times as the k-th image fills.
        A count of placeholders that is not the count of images is refused naming `where`."""
        pads = [i for i, token in enumerate(ids) if token == self.pad_token_id]
        if len(pads) != len(processed):
            raise ConfigError(f"{where}: the prompt has {len(pads)} image placeholders for {len(processed)} images")
        out, last = [], 0
        for index, ref in zip(pads, processed):
            out += ids[last:index] + [self.pad_token_id] * image_tokens(ref, self.merge_size)
            last = index + 1
        return out + ids[last:]


class StoreBudget:
    """A part of the image store (the endpoint's: `serve.image_store_mb`) kept under `max_bytes`:
    once this process has written a twentieth of it since it last looked, the least recently used
    files (modification time: `_touch` on every use) are deleted until the part fits, never one
    used within `keep_s` (the requests in flight keep theirs). Several processes may share the part:
    each deletes what is old enough, and a file deleted under another is written again by its user."""

    def __init__(self, root: str, max_bytes: int, keep_s: float):
        self.root, self.max_bytes, self.keep_s = root, max_bytes, keep_s
        self._written, self._lock = 0, threading.Lock()

    def used(self, paths: Iterable[str]) -> None:
        """Count the files a request stored or read; trim the part when enough was written (never
        deleting these: the request reads them next)."""
        if not self.max_bytes:
            return
        paths = set(paths)
        with self._lock:
            self._written += sum(os.path.getsize(p) for p in paths if os.path.exists(p))
            if self._written * 20 >= self.max_bytes:
                self.trim(keep=paths)

    def trim(self, keep: set[str] = frozenset()) -> int:
        """Delete the least recently used files until the part holds at most `max_bytes` (or only
        files used within `keep_s`, or named in `keep`, are left); the bytes it holds after."""
        self._written = 0
        entries = _stored_files(self.root)
        total, oldest_kept = sum(size for _, size, _ in entries), time.time() - self.keep_s
        for mtime, size, path in entries:
            if total <= self.max_bytes or mtime > oldest_kept:
                break
            if path in keep:
                continue
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            total -= size
        return total


def _stored_files(root: str) -> list[tuple[float, int, str]]:
    """(last use, bytes, path) of the files of a part of the store, least recently used first."""
    out = []
    for entry in os.scandir(root) if os.path.isdir(root) else ():
        if entry.name.startswith(".staging-"):
            continue
        try:
            stat = entry.stat()
        except FileNotFoundError:  # deleted by another process meanwhile
            continue
        out.append((stat.st_mtime, stat.st_size, entry.path))
    return sorted(out)
