"""Images at the policy endpoint (issue 58, item 5): OpenAI's `image_url` content parts on the tiny
Qwen2-VL (`model=tiny_vl`) behind Serve, driven by the official `openai` client. A data URL or a
file under `serve.image_files_from` reaches the model (its tokens counted in the usage, its pixels
changing the log-probs, the same image and seed giving the same answer); every limit and every
URL it does not read is a 400 naming the limit or the setting. A text-only model, and an engine
other than the embedded one, refuse images in one line (the application's class called directly)."""

import asyncio
import base64
import io
import json
import os
import random

import openai
import pytest
from PIL import Image, ImageDraw
from ray import serve

from asyncrl.api.requests import ChatCompletionRequest, OpenAIError
from asyncrl.config import compose
from asyncrl.data.tasks import SHAPE_COLOURS
from asyncrl.serve.policy import PolicyServer
from asyncrl.serve.policy_engine import ServerPolicy
from asyncrl.serve.reward import deploy_declaratively
from asyncrl.weights.sync import free_port

# 56x56 pixels: 4x4 patches of 14, merged 2x2 into 4 image tokens, between the start and the end.
IMAGE_TOKENS = 4 + 2
# Two images a request, 10 KiB an image: small limits, so the refusals cost small bodies.
LIMITS = "serve.max_images_per_request=2 serve.max_image_mb=0.01"


def shape_png(colour: int, side: int = 56) -> bytes:
    """A shapes task's image: a square of SHAPE_COLOURS[colour] on grey."""
    image = Image.new("RGB", (side, side), (128, 128, 128))
    ImageDraw.Draw(image).rectangle([12, 12, 40, 40], fill=SHAPE_COLOURS[colour])
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_part(url: str, detail: str = "auto") -> dict:
    return {"type": "image_url", "image_url": {"url": url, "detail": detail}}


def asking(*parts: dict) -> list[dict]:
    """A user turn of `parts` then the shapes task's question."""
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "c?"}]}]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The directory images may be read from, an image in it, one outside it and a link out."""
    inside, outside = tmp_path_factory.mktemp("image-files"), tmp_path_factory.mktemp("elsewhere")
    (inside / "red.png").write_bytes(shape_png(0))
    (outside / "blue.png").write_bytes(shape_png(2))
    os.symlink(outside / "blue.png", inside / "link.png")
    return inside, outside


@pytest.fixture(scope="module")
def client(ray_session, files, tmp_path_factory):
    """The `policy` application on tiny_vl, its image store in a directory of its own."""
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    overrides = f"model=tiny_vl task=shapes serve.follow_learner=false {LIMITS} serve.image_files_from={files[0]}"
    deploy_declaratively([{"name": "policy-vl", "route_prefix": "/v1", "import_path": "asyncrl.serve.policy:build_policy",
                           "args": {"overrides": overrides},
                           "runtime_env": {"env_vars": {"XDG_CACHE_HOME": str(tmp_path_factory.mktemp("cache"))}}}],
                         timeout_s=300)
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    serve.delete("policy-vl")
    serve.shutdown()


def ask(client, messages: list[dict], **fields):
    return client.chat.completions.create(model="tiny_vl", messages=messages, max_completion_tokens=2, seed=7,
                                          temperature=0, logprobs=True, top_logprobs=5, **fields)


def first_logprobs(reply) -> dict[str, float]:
    return {t.token: t.logprob for t in reply.choices[0].logprobs.content[0].top_logprobs}


def test_an_image_reaches_the_model_and_its_tokens_are_counted(client, files):
    red = ask(client, asking(image_part(data_url(shape_png(0)), "low")))
    text = ask(client, asking())
    assert red.choices[0].finish_reason == "length" and red.usage.completion_tokens == 2
    assert red.usage.prompt_tokens == text.usage.prompt_tokens + IMAGE_TOKENS
    # The same image again, and as a file (relative to the directory, and as a file:// URL): the same answer.
    again = ask(client, asking(image_part(data_url(shape_png(0)))))
    for url in ("red.png", f"file://{files[0] / 'red.png'}"):
        assert ask(client, asking(image_part(url))).choices[0].logprobs == red.choices[0].logprobs
    assert again.choices[0].message.content == red.choices[0].message.content
    assert again.choices[0].logprobs == red.choices[0].logprobs
    # Another image: other pixels, other log-probs for the first token; n choices share the image.
    blue = ask(client, asking(image_part(data_url(shape_png(2)))), n=2)
    assert first_logprobs(blue) != first_logprobs(red)
    assert blue.choices[0].logprobs == blue.choices[1].logprobs
    # A user's text "<image>" is text: seven characters, no image.
    literal = ask(client, [{"role": "user", "content": "<image>c?"}])
    assert literal.usage.prompt_tokens == text.usage.prompt_tokens + len("<image>")


def refusal(client, content, match: str) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, [{"role": "user", "content": content}])
    assert refused.value.status_code == 400 and match in refused.value.body["message"], refused.value.body
    return refused.value


def test_limits_and_urls_it_does_not_read_are_400s_naming_them(client, files):
    red = image_part(data_url(shape_png(0)))
    refusal(client, [red, red, red], "(serve.max_images_per_request)")
    noise = Image.frombytes("RGB", (96, 96), random.Random(0).randbytes(96 * 96 * 3))
    buffer = io.BytesIO()
    noise.save(buffer, format="PNG")  # noise does not compress: ~27 KB
    refusal(client, [image_part(data_url(buffer.getvalue()))], "(serve.max_image_mb)")
    wide = io.BytesIO()
    Image.new("RGB", (8193, 1)).save(wide, format="PNG")
    refusal(client, [image_part(data_url(wide.getvalue()))], "more than 8192 on a side")
    refusal(client, [image_part(data_url(b"not an image"))], "the image cannot be decoded")
    thin = io.BytesIO()
    Image.new("RGB", (300, 1)).save(thin, format="PNG")
    refusal(client, [image_part(data_url(thin.getvalue()))], "the model's image processor cannot take the image")
    refusal(client, [image_part("data:image/png;base64,@@@")], "cannot be decoded")
    refusal(client, [image_part("data:text/plain;base64,aGk=")], "data:image/<type>;base64")
    refusal(client, [image_part("https://example.com/red.png")], "never fetched from the network")
    for outside in (str(files[1] / "blue.png"), "../" + files[1].name + "/blue.png", "link.png"):
        refusal(client, [image_part(outside)], "outside the directory images are read from (serve.image_files_from)")
    refusal(client, [image_part("missing.png")], "no file 'missing.png' in serve.image_files_from")
    audio = refusal(client, [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}], "'input_audio'")
    assert audio.body["param"] == "messages[0].content[0]"
    refusal(client, [{"type": "text", "text": "<|image_pad|>c?"}], "image token <|image_pad|>")
    with pytest.raises(openai.BadRequestError) as refused:
        ask(client, [{"role": "system", "content": [red]}, {"role": "user", "content": "c?"}])
    assert "user messages only" in refused.value.body["message"]


def _direct(overrides: list[str], policy=None):
    """The application's class itself (Serve wraps it; its routes are its methods)."""
    config = compose(["serve.follow_learner=false", *overrides])
    return PolicyServer.func_or_class.__bases__[0](config, policy=policy)


def _refused(server, content) -> OpenAIError:
    body = ChatCompletionRequest(messages=[{"role": "user", "content": content}], max_tokens=2)
    with pytest.raises(OpenAIError) as refused:
        asyncio.run(server.chat_completions(body))
    assert refused.value.status == 400
    return refused.value


def test_a_text_model_an_engine_server_and_files_without_the_setting_refuse_images():
    red = image_part(data_url(shape_png(0)))
    text_model = _direct(["model=tiny", "task=tiny"])
    assert "the model tiny is a text-only model: it takes no images" in _refused(text_model, [red]).message
    # SGLang's or vLLM's engine (its class; no server started: images are refused before any sequence).
    on_server = _direct(["model=tiny_vl", "task=shapes"], policy=ServerPolicy.__new__(ServerPolicy))
    assert "images are served by the embedded engine (engine=torch) only for now" in _refused(on_server, [red]).message
    vl = _direct(["model=tiny_vl", "task=shapes"])
    assert "serve.image_files_from, which is not set" in _refused(vl, [image_part("/etc/hostname")]).message



def _stored(part) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in part.iterdir()} if part.is_dir() else {}


def _ask_direct(server, colour: int, side: int) -> dict:
    body = ChatCompletionRequest(messages=asking(image_part(data_url(shape_png(colour, side)))), max_tokens=1,
                                 temperature=0, logprobs=True, top_logprobs=3)
    return json.loads(asyncio.run(server.chat_completions(body)).body)


def test_the_endpoints_images_are_kept_under_their_budget_least_recently_used_first(tmp_path, monkeypatch):
    """`serve.image_store_mb`: the requests' images and their processed tensors stay within the
    budget (give or take the last request's own), the least recently used go first, one used again
    is kept, and a deleted one sent again is stored again with the same answer. Within
    `serve.image_store_keep_s` nothing is deleted, whatever the budget."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    part = tmp_path / "asyncrl" / "images" / "endpoint"
    budget = 60_000
    server = _direct(["model=tiny_vl", "task=shapes", f"serve.image_store_mb={budget / (1 << 20)}",
                      "serve.image_store_keep_s=0"])
    first = _ask_direct(server, 0, 56)
    first_files = set(_stored(part))
    assert len(first_files) == 2  # the image and its processed tensors
    one_request = sum(_stored(part).values())
    totals = []
    for side in range(57, 71):
        _ask_direct(server, 1, side)
        _ask_direct(server, 0, 56)  # used again: the most recently used, never the one to go
        totals.append(sum(_stored(part).values()))
    assert first_files <= set(_stored(part))
    assert max(totals) <= budget + 2 * one_request and len(_stored(part)) < 2 * 15  # trimmed as it went
    second = _ask_direct(server, 1, 57)  # deleted long since: stored again, the same answer
    assert second["choices"][0]["logprobs"] == _ask_direct(server, 1, 57)["choices"][0]["logprobs"]
    assert first["choices"][0]["logprobs"] == _ask_direct(server, 0, 56)["choices"][0]["logprobs"]

    kept = _direct(["model=tiny_vl", "task=shapes", "serve.image_store_mb=0.001"])  # keep_s: 600 s
    before = len(_stored(part))
    for side in range(80, 84):
        _ask_direct(kept, 2, side)
    assert len(_stored(part)) == before + 2 * 4
