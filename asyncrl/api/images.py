"""Images in chat requests to the policy endpoint (issue 58): OpenAI's `image_url` content parts on
a vision-language model, read into the image store as training's images are
(`asyncrl.storage.images`).

A part's `url` is a base64 data URL (`data:image/png;base64,...`, any image type PIL reads) or,
where `serve.image_files_from` names a directory, a file in it (a path, absolute or relative to
that directory, or a `file://` URL), read only where its real path (links resolved) is inside it.
A URL of the network (`http(s)://`) is never fetched: `asyncrl.api.requests` refuses it with the
other parts it does not read. `detail` (auto, low, high) is accepted and ignored: the model's
image processor sizes every image alike (`model.image_min_pixels` / `model.image_max_pixels`).

Each image is checked before its pixels are decoded (its bytes against `serve.max_image_mb`, its
sides against `MAX_IMAGE_SIDE` from its header), decoded and stored once (`store_image`, in the
endpoint's own part of the store, kept under `serve.image_store_mb` by `StoreBudget`), and
processed by the model's `ImagePrep`. Its place in the conversation becomes the family's image
tokens (`<|vision_start|><|image_pad|><|vision_end|>`), written for the part itself: a user's
text `<image>` stays text, and text that holds the image tokens themselves is refused. The prompt's
ids are expanded to the tokens each image fills (`ImagePrep.expand`, counted in the usage's
`prompt_tokens`), and every choice of the request carries the processed references. Everything
here runs in the worker thread that builds the prompt, off the event loop.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.parse
from dataclasses import dataclass

from asyncrl.api.requests import OpenAIError
from asyncrl.config import ConfigError
from asyncrl.storage.images import IMAGE_PLACEHOLDER, MAX_IMAGE_SIDE, ImagePrep, StoreBudget, store_image, store_root


def image_parts(body) -> list[tuple[str, str]]:
    """(param, url) of each image part of a chat request, in the conversation's order."""
    return [(f"messages[{i}].content[{j}].image_url", part.image_url.url)
            for i, message in enumerate(body.messages) if isinstance(message.content, list)
            for j, part in enumerate(message.content) if part.type == "image_url" and part.image_url is not None]


@dataclass(frozen=True)
class RequestImages:
    """What the endpoint reads images with: the model's `ImagePrep` (None: a text-only model),
    whether its engine takes images, and the `serve` limits."""

    model: str
    engine: str
    prep: ImagePrep | None
    engine_takes_images: bool
    max_images: int
    max_bytes: int
    files_from: str
    store: StoreBudget  # the endpoint's part of the image store, kept under serve.image_store_mb

    @classmethod
    def of(cls, config, prep: ImagePrep | None, engine_takes_images: bool) -> "RequestImages":
        s = config.serve
        store = StoreBudget(os.path.join(store_root(), "endpoint"), int(s.image_store_mb * (1 << 20)),
                            s.image_store_keep_s)
        return cls(config.model.name, config.engine.name, prep, engine_takes_images, s.max_images_per_request,
                   int(s.max_image_mb * (1 << 20)), s.image_files_from, store)

    def read(self, body) -> tuple[object, tuple[str, ...]]:
        """The request with each image part as the model's image tokens, and the processed
        references of its images in order; a request without images as it is, and ()."""
        parts = image_parts(body)
        if not parts:
            return body, ()
        self._refuse(parts)
        processed = tuple(self._processed(url, param) for param, url in parts)
        return with_image_tokens(body, self.prep.placeholder_text(IMAGE_PLACEHOLDER)), processed

    def _refuse(self, parts: list[tuple[str, str]]) -> None:
        param = parts[0][0]
        if self.prep is None:
            raise OpenAIError(400, f"the model {self.model} is a text-only model: it takes no images "
                                   f"(image_url parts)", param)
        if not self.engine_takes_images:
            raise OpenAIError(400, f"images are served by the embedded engine (engine=torch) only for now; this "
                                   f"endpoint runs engine={self.engine}", param)
        if len(parts) > self.max_images:
            raise OpenAIError(400, f"{len(parts)} images in one request; at most {self.max_images} "
                                   f"(serve.max_images_per_request)", param)

    def _processed(self, url: str, param: str) -> str:
        data = self._bytes(url, param)
        check_header(data, param)
        try:
            ref = store_image(data, param, self.store.root)
        except ConfigError as exc:  # cannot be decoded, or too large on a side
            raise OpenAIError(400, str(exc), param) from exc
        try:
            processed = self.prep.processed((ref,), param)[0]
        except ValueError as exc:  # the processor's own bounds (Qwen2-VL's: an aspect ratio under 200)
            raise OpenAIError(400, f"{param}: the model's image processor cannot take the image ({exc})",
                              param) from exc
        self.store.used((ref, processed))
        return processed

    def _bytes(self, url: str, param: str) -> bytes:
        if url.startswith("data:"):
            return data_url_bytes(url, param, self.max_bytes)
        return file_bytes(url, param, self.files_from, self.max_bytes)

    def expand(self, ids: list[int], processed: tuple[str, ...], tokenizer) -> list[int]:
        """A prompt's ids with each image's pad token repeated as many times as the image fills. A
        prompt whose text holds the image tokens itself (a count that is not the images') is a 400."""
        if self.prep is None:
            return ids
        for token in (self.prep.tokens.start, self.prep.tokens.pad, self.prep.tokens.end):
            token_id = tokenizer.convert_tokens_to_ids(token)
            if token_id is not None and ids.count(token_id) != len(processed):
                raise OpenAIError(400, f"the messages' text holds the model's image token {token}: an image is "
                                       f"sent as an image_url part, never as its tokens", "messages")
        return self.prep.expand(ids, processed, "messages") if processed else ids


def with_image_tokens(body, image_text: str):
    """A copy of the request whose image parts are text parts of the model's image tokens."""
    messages = []
    for message in body.messages:
        if isinstance(message.content, list) and any(p.type == "image_url" for p in message.content):
            parts = [p.model_copy(update={"type": "text", "text": image_text, "image_url": None})
                     if p.type == "image_url" else p for p in message.content]
            message = message.model_copy(update={"content": parts})
        messages.append(message)
    return body.model_copy(update={"messages": messages})


def _too_large(size: int, max_bytes: int, param: str) -> OpenAIError:
    return OpenAIError(400, f"image_url: the image is {size / (1 << 20):.2f} MB, more than {max_bytes / (1 << 20):g} "
                            f"MB (serve.max_image_mb)", param)


def data_url_bytes(url: str, param: str, max_bytes: int) -> bytes:
    """The decoded payload of `data:image/<type>;base64,<payload>`, refused (400) when it is not
    one or over `max_bytes` (estimated from its length before it is decoded)."""
    header, comma, payload = url.partition(",")
    if not comma or ";base64" not in header.lower() or not header[5:].lower().startswith("image/"):
        raise OpenAIError(400, "image_url: a data URL of an image is data:image/<type>;base64,<payload>", param)
    if len(payload) * 3 // 4 > max_bytes + 3:
        raise _too_large(len(payload) * 3 // 4, max_bytes, param)
    try:
        data = base64.b64decode(payload)
    except (binascii.Error, ValueError) as exc:
        raise OpenAIError(400, f"image_url: the data URL's payload is not base64, the image cannot be decoded "
                               f"({exc})", param) from exc
    if len(data) > max_bytes:
        raise _too_large(len(data), max_bytes, param)
    return data


def file_bytes(url: str, param: str, files_from: str, max_bytes: int) -> bytes:
    """The bytes of a file an image part names (a path, or a `file://` URL), read only from inside
    `serve.image_files_from` (its real path, links resolved); else a 400 naming the setting."""
    if not files_from:
        raise OpenAIError(400, "image_url: a file path is read only from the directory serve.image_files_from, "
                               "which is not set; send the image as a data URL (data:image/png;base64,...)", param)
    path = url
    if url[:7].lower() == "file://":
        split = urllib.parse.urlsplit(url)
        if split.netloc not in ("", "localhost"):
            raise OpenAIError(400, f"image_url: a file:// URL of another host ({split.netloc}) is not read", param)
        path = urllib.parse.unquote(split.path)
    root = os.path.realpath(files_from)
    real = os.path.realpath(os.path.join(root, path))
    if os.path.commonpath([root, real]) != root:
        raise OpenAIError(400, f"image_url: {path[:200]!r} is outside the directory images are read from "
                               f"(serve.image_files_from)", param)
    if not os.path.isfile(real):
        raise OpenAIError(400, f"image_url: no file {path[:200]!r} in serve.image_files_from", param)
    size = os.path.getsize(real)
    if size > max_bytes:
        raise _too_large(size, max_bytes, param)
    with open(real, "rb") as f:
        return f.read(max_bytes + 1)


def check_header(data: bytes, param: str) -> None:
    """Refuse (400) bytes that are no image PIL reads, or an image over `MAX_IMAGE_SIDE` on a side,
    from its header alone: before its pixels are decoded (a small file can hold a huge image)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
    except Exception as exc:  # noqa: BLE001 -- PIL raises many kinds; each is an image that cannot be read
        raise OpenAIError(400, f"image_url: the image cannot be decoded ({type(exc).__name__}: {exc})", param) from exc
    if max(width, height) > MAX_IMAGE_SIDE:
        raise OpenAIError(400, f"image_url: the image is {width}x{height} pixels, more than {MAX_IMAGE_SIDE} on a "
                               f"side", param)
