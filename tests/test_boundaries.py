"""Boundaries that hold in a real deployment: a reward endpoint serves no caller without a token
unless a development machine opts in, request bodies are capped as they stream, code rewards
need a memory cgroup (or an opt-in said loudly), a sandbox dies with the process that started it,
`asyncrl eval --endpoint` sends no key it was not given, and tokens stay out of the records."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from fastapi.testclient import TestClient

from asyncrl.bench.hostile import ADD_ASSERTS
from asyncrl.config import compose
from asyncrl.rewards.sandbox import probe_isolation, project_root
from asyncrl.serve import guards, reward as reward_app, train as train_app

ISOLATION = probe_isolation()
LOOPBACK = ("127.0.0.1", 50000)
MALFORMED = {"content": b"{not json", "headers": {"content-type": "application/json"}}


def reward_client(**kwargs) -> TestClient:
    return TestClient(reward_app.reward_api, raise_server_exceptions=False, **kwargs)


def test_no_token_serves_no_caller_unless_a_development_machine_opts_in(monkeypatch):
    monkeypatch.setitem(guards.REWARD_TOKEN, "value", "")
    monkeypatch.setitem(guards.REWARD_LOCAL_WITHOUT_TOKEN, "value", False)
    # A caller on this machine (a same-host proxy, a sidecar, a browser page look the same) is refused.
    refused = reward_client(client=LOOPBACK).post("/score", **MALFORMED)
    assert refused.status_code == 403 and "needs a token" in refused.json()["detail"]
    assert reward_client().post("/score", **MALFORMED).status_code == 403
    # The opt-in serves loopback callers (the guard lets them through to the route), no one else.
    monkeypatch.setitem(guards.REWARD_LOCAL_WITHOUT_TOKEN, "value", True)
    assert reward_client(client=LOOPBACK).post("/score", **MALFORMED).status_code not in (401, 403, 413)
    assert reward_client().post("/score", **MALFORMED).status_code == 403
    # A token set: every caller needs it, loopback or not.
    monkeypatch.setitem(guards.REWARD_TOKEN, "value", "tok")
    assert reward_client(client=LOOPBACK).post("/score", **MALFORMED).status_code == 401


def chunks(total: int, size: int = 1 << 20):
    """A request body sent chunked (no Content-Length): `total` bytes."""
    sent = 0
    while sent < total:
        piece = min(size, total - sent)
        sent += piece
        yield b"x" * piece


def test_bodies_are_capped_as_they_stream(monkeypatch):
    monkeypatch.setitem(guards.REWARD_TOKEN, "value", "tok")
    over = reward_client().post("/score", content=chunks(guards.MAX_SCORE_BODY_BYTES + 1),
                                headers={"authorization": "Bearer tok", "content-type": "application/json"})
    assert over.status_code == 413 and "over" in over.json()["detail"]
    monkeypatch.setitem(guards.ADMIN_TOKEN, "value", "adm")
    admin = TestClient(train_app.train_api, raise_server_exceptions=False)
    over = admin.post("/admin/reward_routes", content=chunks(guards.MAX_ADMIN_BODY_BYTES + 1),
                      headers={"authorization": "Bearer adm", "content-type": "application/json"})
    assert over.status_code == 413
    # Under the cap, the body read by the guard reaches the route whole (its own error, not the guard's).
    under = admin.post("/admin/reward_routes", content=chunks(100, 7),
                       headers={"authorization": "Bearer adm", "content-type": "application/json"})
    assert under.status_code not in (401, 403, 413)


NO_CGROUP_SCRIPT = f"""
import json
from asyncrl.config import VerifierEndpoint
from asyncrl.messages.structs import RewardRequest
from asyncrl.rewards.verifier import Verifier
req = RewardRequest(prompt_id='p', sample_idx=0, response_text='def add(a, b):\\n    return a + b\\n',
                    ground_truth={ADD_ASSERTS!r}, data_source='code')
refused = Verifier().score([req])[0]
opted = Verifier(VerifierEndpoint(code_allow_no_cgroup=True)).score([req])[0]
print(json.dumps([refused.failed, refused.details.get('error', ''), opted.correct]))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not ISOLATION["namespaces"], reason="unmounts cgroups in a mount namespace")
def test_without_a_memory_cgroup_code_rewards_are_refused_unless_opted_in():
    # A machine whose cgroups this process cannot use (a container without them): none mounted.
    out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c",
                          f"umount -R /sys/fs/cgroup && exec {sys.executable} -c \"$0\"", NO_CGROUP_SCRIPT],
                         capture_output=True, text=True, timeout=180, cwd=project_root())
    assert out.returncode == 0, out.stderr[-2000:]
    refused_failed, reason, opted_correct = json.loads(out.stdout.strip().splitlines()[-1])
    assert refused_failed and "no memory cgroup" in reason and "code_allow_no_cgroup" in reason
    assert opted_correct
    assert "WITHOUT A MEMORY CGROUP" in out.stderr  # said loudly


ORPHAN_SCRIPT = """
import sys
from asyncrl.rewards.sandbox import SandboxLimits, run_program
run_program({"main.py": "import time\\ntime.sleep(120)  # MARKER"}, ["python", "main.py", sys.argv[1]],
            limits=SandboxLimits(wall_s=120, cpu_s=130, isolation=sys.argv[2], allow_unisolated=True))
"""


def processes_with(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker in open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace"):
                found.append(int(pid))
        except OSError:
            pass
    return found


@pytest.mark.parametrize("mode", ISOLATION["modes"] + ["unisolated"])
def test_a_sandboxed_program_dies_with_the_process_that_started_it(mode):
    marker = f"asyncrl-orphan-{uuid.uuid4().hex}"
    caller = subprocess.Popen([sys.executable, "-c", ORPHAN_SCRIPT, marker, mode], cwd=project_root(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while not [p for p in processes_with(marker) if p != caller.pid]:  # the program runs
            assert caller.poll() is None and time.time() < deadline, "the sandbox did not start"
            time.sleep(0.1)
        caller.send_signal(signal.SIGKILL)  # the reward endpoint is killed mid-call
        caller.wait()
        deadline = time.time() + 10
        while processes_with(marker) and time.time() < deadline:
            time.sleep(0.1)
        survivors = processes_with(marker)
        assert survivors == [], f"{len(survivors)} processes outlived their caller"
    finally:
        for pid in processes_with(marker):
            os.kill(pid, signal.SIGKILL)


class _Recorder(BaseHTTPRequestHandler):
    """Some URL a user was given: it records what it is sent and answers as a chat endpoint would."""

    seen: list[dict] = []

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        _Recorder.seen.append(dict(self.headers))
        body = json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                           "choices": [{"index": 0, "finish_reason": "stop",
                                        "message": {"role": "assistant", "content": "42"}}]}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_eval_against_an_endpoint_sends_no_key_it_was_not_given(monkeypatch):
    from asyncrl.evaluation import held_out, sample_endpoint

    monkeypatch.setenv("OPENAI_API_KEY", "sk-a-secret-for-openai-only")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    examples = held_out(compose(["model=tiny", "task=tiny"]), 1)
    try:
        _Recorder.seen.clear()
        texts, _ = sample_endpoint(url, "m", examples, 1, 0.0, 8, progress=False)
        assert texts == [["42"]]
        assert not any("sk-a-secret" in value for headers in _Recorder.seen for value in headers.values())
        _Recorder.seen.clear()
        sample_endpoint(url, "m", examples, 1, 0.0, 8, progress=False, api_key="meant-for-this-endpoint")
        assert {k.lower(): v for k, v in _Recorder.seen[0].items()}["authorization"] == "Bearer meant-for-this-endpoint"
    finally:
        server.shutdown()


def test_tokens_stay_out_of_config_json_and_the_wandb_config(tmp_path, monkeypatch):
    from asyncrl.driver import write_config
    from asyncrl.run.loggers import open_loggers

    config = compose(["model=tiny", "task=tiny", "serve.admin_token=adm-secret-1", "serve.reward_token=rwd-secret-2",
                      "trainer.wandb_mode=offline"])
    written = open(write_config(config, str(tmp_path))).read()
    assert "adm-secret-1" not in written and "rwd-secret-2" not in written
    assert json.loads(written)["serve"]["admin_token"] == "<redacted>"
    monkeypatch.setenv("WANDB_MODE", "offline")
    open_loggers(config, str(tmp_path)).finish()
    files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "wandb") for f in fs]
    assert files and not any(b"secret" in open(f, "rb").read() for f in files)
