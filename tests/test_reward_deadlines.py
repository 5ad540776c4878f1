"""The judge and the user's function within their deadlines (issue 63, item 4), against real servers
and real worker processes: a judge server that trickles bytes is cut off at the whole request's
deadline (not per read) or the call's, its connections closed, and the judge serves again once the
server recovers; a server that echoes the API key leaves it in no recorded text; a call past its
deadline keeps the rewards it had scored; the built-in verifier stops with its call (its sandbox
killed); a user's function that allocates past `worker_memory_mb` fails with the reason and its
worker is replaced, and workers are recycled after `worker_max_calls` calls.

Timings are generous bounds for a loaded 2-core machine, never speed claims."""

import asyncio
import json
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import psutil
import pyarrow.parquet as pq
import pytest

from asyncrl.assembly.rows import merge_segments
from asyncrl.config import OpenAIJudgeEndpoint, PythonRewardEndpoint, RouteConfig
from asyncrl.messages.structs import FinishReason, RewardRequest, Segment, float32_array, int32_array
from asyncrl.redaction import masked, register_secret_env
from asyncrl.rewards.endpoint import RewardEndpoint, build_scorer
from asyncrl.rewards.hybrid import RewardRouter
from asyncrl.storage.trajectory_store import TRAJECTORY_SCHEMA, StoreWriter, record_of, store_files

ANSWER = {"id": "c", "object": "chat.completion", "created": 0, "model": "m",
          "choices": [{"index": 0, "finish_reason": "length", "message": {"role": "assistant", "content": "Yes"},
                       "logprobs": {"content": [{"token": "Yes", "logprob": -0.05, "bytes": None, "top_logprobs": [
                           {"token": "Yes", "logprob": -0.05, "bytes": None},
                           {"token": "No", "logprob": -3.0, "bytes": None}]}]}}]}


class JudgeServer:
    """An OpenAI-compatible chat server on 127.0.0.1 in a thread. `mode`: `answer` (a Yes verdict at
    once), `trickle` (a whole answer's headers, then its body a byte every 0.2 s, for minutes: each
    read is quick, the request never ends) or `echo` (a 401 whose body repeats the Authorization
    header). `trickling` counts the connections it is trickling to right now."""

    def __init__(self, mode: str):
        self.mode, self.trickling, self.lock = mode, 0, threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if server.mode == "echo":
                    body = json.dumps({"error": {"message": f"Incorrect API key provided: "
                                                            f"{self.headers.get('Authorization')}"}}).encode()
                    self._send(401, body)
                elif server.mode == "trickle":
                    self._trickle(json.dumps(ANSWER).encode() + b" " * 2000)
                else:
                    self._send(200, json.dumps(ANSWER).encode())

            def _send(self, status, body):
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _trickle(self, body):
                with server.lock:
                    server.trickling += 1
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    for i in range(len(body)):
                        self.wfile.write(body[i:i + 1])
                        self.wfile.flush()
                        time.sleep(0.2)
                except OSError:  # the client closed the connection
                    self.close_connection = True
                finally:
                    with server.lock:
                        server.trickling -= 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def judge_server():
    servers = []

    def start(mode):
        servers.append(JudgeServer(mode))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def requests(n, text="12", truth="12", source="chat"):
    return [RewardRequest(prompt_id=f"p{i}", sample_idx=i, response_text=text if isinstance(text, str) else text[i],
                          ground_truth=truth, data_source=source, prompt_text="What is 5 + 7?") for i in range(n)]


def router_over(endpoint: RewardEndpoint, timeout_s: float) -> RewardRouter:
    async def call(name, batch, budget_s):
        return await endpoint.score(batch, budget_s)

    return RewardRouter([RouteConfig(endpoints=[endpoint.name])], call, timeout_s=timeout_s, retries=0)


def timed_score(router: RewardRouter, batch: list[RewardRequest]):
    start = time.monotonic()
    rewards = asyncio.run(router.score(batch))
    return rewards, time.monotonic() - start


def wait_until(condition, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def test_a_trickling_judge_is_cut_off_at_the_whole_request_deadline_and_its_connections_closed(judge_server):
    server = judge_server("trickle")
    endpoint = RewardEndpoint("judge", OpenAIJudgeEndpoint(base_url=server.url, model="m", request_timeout_s=2.0,
                                                           retries=0, max_concurrency=2))
    router = router_over(endpoint, timeout_s=60.0)
    try:
        rewards, took = timed_score(router, requests(2))
        # A timeout per read would wait out the body (~7 minutes); the router's deadline is 60 s.
        assert took < 2.0 + 10.0, took
        assert all(r.failed and "no whole answer within request_timeout_s=2 s" in r.details["error"] for r in rewards)
        assert wait_until(lambda: server.trickling == 0, 10.0), server.trickling  # the server sees them closed
        server.mode = "answer"
        rewards, took = timed_score(router, requests(2))
        assert [r.failed for r in rewards] == [False, False] and all(r.score > 0.9 for r in rewards), rewards
        assert took < 15.0, took
    finally:
        endpoint.scorer.close()


def test_a_call_past_its_deadline_frees_the_judge_for_the_next_once_the_server_recovers(judge_server):
    # One request at a time and a request bound past the call's deadline: only the call's deadline
    # ends it. A judge whose one thread stayed on the trickle could serve nobody after.
    server = judge_server("trickle")
    endpoint = RewardEndpoint("judge", OpenAIJudgeEndpoint(base_url=server.url, model="m", request_timeout_s=300.0,
                                                           retries=0, max_concurrency=1))
    router = router_over(endpoint, timeout_s=3.0)
    try:
        rewards, took = timed_score(router, requests(3))
        assert took < 3.0 + 5.0, took
        assert all(r.failed and "not scored within the call's deadline" in r.details["error"] for r in rewards), \
            [r.details for r in rewards]
        assert endpoint.stats()["stopped_at_deadline"] == 1
        stats = endpoint.scorer.stats()
        assert stats["requests_stopped"] == 1 and stats["requests_not_sent"] == 2, stats
        assert wait_until(lambda: server.trickling == 0, 10.0), server.trickling
        server.mode = "answer"
        rewards, took = timed_score(router, requests(3))
        assert [r.failed for r in rewards] == [False] * 3 and took < 3.0 + 5.0, (rewards, took)
    finally:
        endpoint.scorer.close()


def test_a_server_that_echoes_the_key_leaves_it_in_no_recorded_text(judge_server, monkeypatch, tmp_path):
    key = "sk-test-echoed-secret-4242"
    monkeypatch.setenv("JUDGE_CREDENTIALS", key)  # a name masked() would not guess: the key is registered
    server = judge_server("echo")
    endpoint = RewardEndpoint("judge", OpenAIJudgeEndpoint(base_url=server.url, model="m", retries=0,
                                                           api_key_env="JUDGE_CREDENTIALS"))
    router = router_over(endpoint, timeout_s=30.0)
    try:
        rewards, _ = timed_score(router, requests(2))
        assert all(r.failed and "AuthenticationError" in r.details["error"] for r in rewards)
        assert "Incorrect API key provided: Bearer ***" in rewards[0].details["error"]  # the server did echo it
        seen = [repr(rewards), repr(router.stats()), repr(router.failures()), repr(endpoint.stats())]
        # The trajectory store's file, as written.
        merged = merge_segments([Segment(
            prompt_id="p0", sample_idx=0, window=0, group_id="p0", group_size=1, prompt_token_ids=int32_array([1]),
            prior_response_ids=int32_array([]), prior_versions=int32_array([]), new_token_ids=int32_array([2]),
            new_logprobs=float32_array([-0.1]), new_versions=int32_array([0]), finished=True,
            finish_reason=FinishReason.EOS, data_source="chat", ground_truth="12", seed=1, generator_id="g")])
        writer = StoreWriter(str(tmp_path), "trajectories", TRAJECTORY_SCHEMA, max_file_bytes=1, max_file_age_s=1e9)
        writer.append([msgspec.structs.asdict(record_of(merged, [1], rewards[0], "q", "12", "dropped", "reward_failed"))])
        writer.flush()
        [path] = store_files(str(tmp_path))
        assert "Bearer ***" in pq.read_table(path).column("reward_error")[0].as_py()
        seen.append(open(path, "rb").read().decode("latin-1"))
        assert not any(key in text or key[3:] in text for text in seen)
    finally:
        endpoint.scorer.close()
    # A process that never read the key (the router's, with the endpoint in another) masks it too,
    # once it knows the variable's name from the config (build_reward_router registers it).
    other = "another-key-value-9876"
    monkeypatch.setenv("ROUTER_SIDE_CREDS", other)
    register_secret_env("ROUTER_SIDE_CREDS")
    assert masked(f"denied: {other}") == "denied: ***"


SCORES = '''
import os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "hang":
        time.sleep(600)
    if solution_str == "allocate":
        hoard = bytearray(4 << 30)  # 4 GiB, past any worker_memory_mb below it
        return float(len(hoard))
    if solution_str == "pid":
        return float(os.getpid())
    return 1.0
'''


def scores_file(tmp_path) -> str:
    path = tmp_path / "scores.py"
    path.write_text(textwrap.dedent(SCORES))
    return str(path)


def test_a_call_past_its_deadline_keeps_the_rewards_it_had_scored(tmp_path):
    endpoint = RewardEndpoint("mine", PythonRewardEndpoint(path=scores_file(tmp_path), workers=2, call_timeout_s=120.0))
    endpoint.scorer.score(requests(2, "ok"))  # both workers up: the deadline below is the call's alone
    router = router_over(endpoint, timeout_s=6.0)
    try:
        # One worker hangs on the first sample; the other scores the five after it.
        rewards, took = timed_score(router, requests(6, ["hang"] + ["ok"] * 5))
        assert took < 6.0 + 5.0, took
        assert [(r.failed, r.score) for r in rewards[1:]] == [(False, 1.0)] * 5, [r.details for r in rewards]
        assert rewards[0].failed and "not scored within the call's deadline" in rewards[0].details["error"]
        assert endpoint.stats()["samples_cancelled"] == 1  # the hung worker was killed, nothing else
    finally:
        endpoint.scorer.close()


def test_the_verifier_stops_with_its_call_and_kills_its_sandbox():
    endpoint = RewardEndpoint("verifier", {"kind": "verifier", "code_wall_s": 120.0})
    loop = "```python\nwhile True:\n    pass\n```"
    tests = json.dumps({"inputs": ["1\n"], "outputs": ["1\n"]})
    batch = requests(3, ["\\boxed{12}", loop, "\\boxed{12}"], truth="12", source="math")
    batch[1] = RewardRequest(prompt_id="p1", sample_idx=1, response_text=loop, ground_truth=tests, data_source="code",
                             prompt_text="echo")
    endpoint.scorer.score(batch[:1])  # the math workers up: the deadline below is the call's alone
    start = time.monotonic()
    rewards = asyncio.run(endpoint.score(batch, budget_s=5.0))
    took = time.monotonic() - start
    assert took < 5.0 + 6.0, took  # the program would have run for code_wall_s=120
    assert not rewards[0].failed and rewards[0].correct  # scored before the deadline: kept
    assert all(r.failed and "not scored within the call's deadline" in r.details["error"] for r in rewards[1:]), \
        [r.details for r in rewards]
    commands = [(p, " ".join(p.cmdline())) for p in psutil.Process().children(recursive=True)]
    sandboxes = [p for p, command in commands  # (not Ray's own processes, when the suite started Ray here)
                 if ("main.py" in command or "unshare" in command) and "/ray/" not in command]
    assert not sandboxes, sandboxes


def test_a_function_past_its_memory_limit_fails_and_its_worker_is_replaced(tmp_path):
    scorer = build_scorer(PythonRewardEndpoint(path=scores_file(tmp_path), workers=1, worker_memory_mb=1024,
                                               call_timeout_s=60.0), None, "zero_one")
    try:
        [before] = scorer.score(requests(1, "pid"))
        [hoarder] = scorer.score(requests(1, "allocate"))
        assert hoarder.failed, hoarder
        assert "ran out of memory" in hoarder.details["error"] and "worker_memory_mb=1024" in hoarder.details["error"]
        [after] = scorer.score(requests(1, "pid"))
        assert not after.failed and after.score != before.score  # a fresh worker
        assert scorer.stats()["out_of_memory"] == 1
    finally:
        scorer.close()


def test_workers_are_recycled_after_worker_max_calls(tmp_path):
    scorer = build_scorer(PythonRewardEndpoint(path=scores_file(tmp_path), workers=1, worker_max_calls=3), None,
                          "zero_one")
    try:
        pids = [r.score for call in range(6) for r in scorer.score(requests(1, "pid"))]
        assert len(set(pids[:3])) == 1 and len(set(pids[3:])) == 1 and pids[0] != pids[3], pids
    finally:
        scorer.close()

