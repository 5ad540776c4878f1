"""Nothing foreign runs or resolves: what a checkpoint, a run directory or an endpoint says is data.

A crafted LoRA checkpoint whose saved model settings turn `trust_remote_code` on, over a base model
whose `config.json` maps its classes to a Python file of the directory, is exported without that
file ever running (or refused in one line) unless the user passes `model.trust_remote_code=true`;
a fake policy endpoint whose model id is an OmegaConf interpolation, and a run's `config.json`
holding one, never get an environment variable's value resolved into a request or the output.
Each runs `asyncrl` as a user does (a subprocess)."""

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from asyncrl.config import compose, to_dict
from asyncrl.models.loading import build_tiny_model, build_tiny_tokenizer
from asyncrl.storage import checkpoint, checkpoint_parts

SECRET = "probe-secret-5d41402abc4b2a76"
INTERPOLATION = "${oc.env:PROBE_SECRET}"
# The directory's own code: importing it leaves a marker (the test's proof that it ran).
PROBE_CODE = '''
import pathlib
pathlib.Path({marker!r}).write_text("ran")
from transformers import LlamaConfig, LlamaForCausalLM


class ProbeConfig(LlamaConfig):
    model_type = {model_type!r}


class ProbeModel(LlamaForCausalLM):
    config_class = ProbeConfig
'''


def asyncrl(*args, env=None):
    # No stdin: transformers asks on it whether to run a model's code when nobody said (a 15 s prompt).
    return subprocess.run([sys.executable, "-m", "asyncrl.cli", *args], capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})})


def crafted_model_dir(directory, marker, model_type: str) -> str:
    """The tiny model with a `config.json` whose `auto_map` names `probe.py` of the directory."""
    model_config = compose(["model=tiny"]).model
    tokenizer = build_tiny_tokenizer()
    build_tiny_model(model_config, len(tokenizer)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    (directory / "probe.py").write_text(PROBE_CODE.format(marker=str(marker), model_type=model_type))
    config = json.loads((directory / "config.json").read_text())
    config.update(model_type=model_type, auto_map={"AutoConfig": "probe.ProbeConfig",
                                                   "AutoModelForCausalLM": "probe.ProbeModel"})
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def crafted_lora_run(run_dir, base: str) -> None:
    """A committed LoRA checkpoint (an empty adapter) whose saved settings trust the base's code."""
    from safetensors.torch import save_file

    from asyncrl.weights import lora

    settings = to_dict(compose(["model=tiny"]))["model"]
    settings.update(source="hf", path=base, trust_remote_code=True, lora_rank=4)
    tmp = checkpoint.begin(str(run_dir), 1)
    policy = os.path.join(tmp, "policy")
    os.makedirs(policy)
    save_file({}, os.path.join(policy, lora.ADAPTER_WEIGHTS))
    checkpoint_parts.save_json(settings, os.path.join(policy, lora.MODEL_FILE))
    checkpoint.commit(tmp, 1, 1)


@pytest.mark.parametrize("model_type", ["llama", "asyncrl_probe"])
def test_a_checkpoint_never_runs_its_base_models_code_unless_the_user_says_so(tmp_path, model_type):
    """A model type transformers knows exports without the code; one it does not is refused in one line."""
    marker = tmp_path / "marker"
    base = crafted_model_dir(tmp_path / "base", marker, model_type)
    crafted_lora_run(tmp_path / "run", base)
    modules = {"HF_MODULES_CACHE": str(tmp_path / "hf-modules")}  # where transformers copies a model's code
    done = asyncrl("export", str(tmp_path / "run"), str(tmp_path / "out"), env=modules)
    assert not marker.exists(), "the checkpoint's base model ran its own code"
    if model_type == "llama":
        assert done.returncode == 0, done.stderr
        from transformers import AutoModelForCausalLM

        assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "out", trust_remote_code=False)).__name__ == \
            "LlamaForCausalLM"
    else:
        assert done.returncode == 2, done.stderr
        (line,) = done.stderr.strip().splitlines()
        assert line.startswith("asyncrl export: ") and "model.trust_remote_code=true" in line, line
        # The user's own word runs it.
        trusted = asyncrl("export", str(tmp_path / "run"), str(tmp_path / "out"), "model.trust_remote_code=true",
                          env=modules)
        assert marker.exists() and trusted.returncode == 0, trusted.stderr


def test_a_full_checkpoint_whose_model_needs_its_own_code_is_refused_in_one_line(tmp_path):
    marker = tmp_path / "marker"
    policy = crafted_model_dir(tmp_path / "policy", marker, "asyncrl_probe")
    tmp = checkpoint.begin(str(tmp_path / "run"), 1)
    os.rename(policy, os.path.join(tmp, "policy"))
    checkpoint.commit(tmp, 1, 1)
    done = asyncrl("export", str(tmp_path / "run"), str(tmp_path / "out"), "model.trust_remote_code=false",
                   env={"HF_MODULES_CACHE": str(tmp_path / "hf-modules")})
    assert not marker.exists()
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "model.trust_remote_code=true" in done.stderr
    refused = asyncrl("export", str(tmp_path / "run"), str(tmp_path / "out"), "model.path=elsewhere")
    assert refused.returncode == 2 and "model.trust_remote_code" in refused.stderr, refused.stderr


class FakeEndpoint(BaseHTTPRequestHandler):
    """A policy endpoint that names its model with an interpolation and records every request."""

    seen: list[str] = []

    def log_message(self, *args):
        pass

    def _send(self, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.seen.append(f"GET {self.path} {self.headers}")
        self._send({"object": "list", "data": [{"id": INTERPOLATION, "object": "model", "max_response_tokens": 2,
                                                "task": {"name": "tiny", "seed": 0, "num_eval_prompts": 2}}]})

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", 0))).decode()
        self.seen.append(f"POST {self.path} {self.headers} {body}")
        request = json.loads(body)
        self._send({"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": request["model"],
                    "choices": [{"index": i, "message": {"role": "assistant", "content": "1"}, "finish_reason": "stop"}
                                for i in range(request.get("n", 1))]})


@pytest.fixture
def fake_endpoint():
    FakeEndpoint.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeEndpoint)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1", FakeEndpoint.seen
    server.shutdown()
    server.server_close()


def test_an_endpoints_model_id_is_sent_back_as_it_is_never_resolved(fake_endpoint, tmp_path):
    url, seen = fake_endpoint
    done = asyncrl("eval", "--endpoint", url, "--n", "1", "--k", "1", "--prompts", "2", "--out", str(tmp_path),
                   env={"PROBE_SECRET": SECRET})
    assert not [s for s in seen if SECRET in s], "the secret was sent to the endpoint"
    assert SECRET not in done.stdout + done.stderr
    assert done.returncode == 0, done.stderr
    posts = [s for s in seen if s.startswith("POST /v1/chat/completions")]
    assert len(posts) == 2 and all(json.dumps(INTERPOLATION) in s for s in posts), seen  # the id, as it came


def test_a_runs_config_json_is_read_as_data(tmp_path):
    """An interpolation in a run's `config.json` reaches the user as the text it is, not resolved."""
    run_dir = tmp_path / "run"
    tokenizer = build_tiny_tokenizer()
    tmp = checkpoint.begin(str(run_dir), 1)
    build_tiny_model(compose(["model=tiny"]).model, len(tokenizer)).save_pretrained(os.path.join(tmp, "policy"))
    tokenizer.save_pretrained(os.path.join(tmp, "policy"))
    checkpoint.commit(tmp, 1, 1)
    saved = to_dict(compose(["model=tiny"]))
    saved["task"].update(name="file", eval_path=INTERPOLATION)
    checkpoint_parts.save_json(saved, str(run_dir / "config.json"))
    done = asyncrl("eval", "--checkpoint", str(run_dir), "--n", "1", "--k", "1", "--out", str(tmp_path / "eval"),
                   env={"PROBE_SECRET": SECRET})
    assert SECRET not in done.stdout + done.stderr
    assert done.returncode == 2 and INTERPOLATION in done.stderr, done.stderr
