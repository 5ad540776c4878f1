"""The `policy` application behind Serve, driven over HTTP by clients no one here wrote, as their
users drive them: the `openai` client (plain, streaming, tools, `max_completion_tokens`), the
OpenAI Agents SDK and LangChain's ChatOpenAI running a tool loop. Tiny models make poor agents, so
these check the protocol: every request a framework sends is answered without a 4xx, its tool calls
parse and reach the tool, and its loop ends. Then abuse: bodies over the limit (declared and
chunked) are 413s before they are read, a client that goes away frees its sequences, a request too
large for the KV bound is a 400. (A model with Qwen2.5's chat template, prompted through it:
tests/test_openai_api.py.)"""

import asyncio
import json
import time

import httpx
import openai
import pytest
from ray import serve

from asyncrl.serve.reward import deploy_declaratively
from asyncrl.weights.sync import free_port

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "the episode's digit",
                                           "parameters": {"type": "object", "properties": {}}}}]
NO_EOS = {"0": -100, "1": -100, "2": -100}  # the tiny vocabulary's <pad>, <eos>, <bos>
# The tiny tool policy (a turn that starts with a non-digit calls `lookup`), long contexts for the
# disconnect test, a 1 MiB body limit and a KV bound of 8 MiB (8192 positions of the tiny model).
TINY = ("model=tiny task=tiny_tool serve.follow_learner=false model.max_positions=4096 serve.max_body_mb=1 "
        "serve.max_kv_mb=8")


POLICY = {"name": "policy", "route_prefix": "/v1", "import_path": "asyncrl.serve.policy:build_policy",
          "args": {"overrides": TINY}}
API_KEY = "sk-asyncrl-test-7f3a"


@pytest.fixture(scope="module")
def url(ray_session):
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    deploy_declaratively([POLICY], timeout_s=300)
    yield f"http://127.0.0.1:{port}"
    serve.delete("policy")
    serve.shutdown()


@pytest.fixture(scope="module")
def keyed_url(url):
    """The same policy with `serve.api_key` set, as a second application beside the first."""
    keyed = {**POLICY, "name": "policy-keyed", "route_prefix": "/keyed/v1",
             "args": {"overrides": f"{TINY} serve.api_key={API_KEY}"}}
    deploy_declaratively([POLICY, keyed], timeout_s=300)
    yield f"{url}/keyed/v1"
    serve.delete("policy-keyed")


class Statuses:
    """Every HTTP status a client's requests got (an httpx event hook)."""

    def __init__(self):
        self.seen: list[tuple[str, int]] = []

    def record(self, response: httpx.Response) -> None:
        self.seen.append((response.request.url.path, response.status_code))

    async def record_async(self, response: httpx.Response) -> None:
        self.record(response)

    def all_ok(self) -> bool:
        return bool(self.seen) and all(status == 200 for _, status in self.seen)


def test_the_openai_client_plain_streaming_tools_and_max_completion_tokens(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "5:"}],
                                           max_completion_tokens=40, logit_bias=NO_EOS, seed=1)
    assert reply.usage.completion_tokens == 40 and reply.choices[0].finish_reason == "length"
    assert reply.model_extra["weight_version"] == 0
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "5:"}],
                                                 max_completion_tokens=40, logit_bias=NO_EOS, seed=1, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply.choices[0].message.content
    called = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "5:"}], tools=TOOLS,
                                            tool_choice="required", max_completion_tokens=3)
    (call,) = called.choices[0].message.tool_calls
    assert called.choices[0].finish_reason == "tool_calls" and call.function.name == "lookup"
    streamed = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "5:"}],
                                                   tools=TOOLS, tool_choice="required", stream=True))
    calls = [t for c in streamed for t in c.choices[0].delta.tool_calls or []]
    assert [(t.index, t.function.name, t.function.arguments) for t in calls] == [(0, "lookup", "{}")]
    health = httpx.get(f"{url}/v1/health", timeout=30).json()
    assert health["ok"] and health["engine"] == "torch" and health["running_sequences"] == 0


def test_with_an_api_key_every_route_but_health_wants_it(keyed_url):
    """As vLLM's --api-key: the official client with a wrong key, and a request with none, get
    OpenAI's 401; with the key, an answer; /health answers anyone."""
    messages = [{"role": "user", "content": "5:"}]
    with pytest.raises(openai.AuthenticationError) as refused:
        openai.OpenAI(base_url=keyed_url, api_key="sk-wrong", max_retries=0).chat.completions.create(
            model="tiny", messages=messages, max_completion_tokens=2)
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    for bare in (httpx.post(f"{keyed_url}/completions", json={"prompt": "1:", "max_tokens": 1}, timeout=60),
                 httpx.get(f"{keyed_url}/models", timeout=60)):
        assert bare.status_code == 401 and bare.json()["error"]["type"] == "invalid_request_error", bare.text
    client = openai.OpenAI(base_url=keyed_url, api_key=API_KEY)
    reply = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=2)
    assert reply.usage.completion_tokens >= 1 and reply.choices[0].message.content is not None
    assert client.models.list().data[0].id == "tiny"
    assert httpx.get(f"{keyed_url}/health", timeout=30).json()["ok"]


# The tiny policy calls its tool two times in three, whatever the answer: an agent loop would end by
# chance. So the first turn requires the call (the frameworks' own `tool_choice`, reset to auto once
# the tool ran), and the vocabulary's non-digits are biased away, so the turn after the tool's
# answer is an answer: every loop is call, tool, answer, and ends.
ANSWER_ONLY = {str(i): -100 for i in [0, 2, *range(13, 30)]}


def test_the_openai_agents_sdk_runs_its_tool_loop(url):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    statuses, looked_up = Statuses(), []

    @function_tool
    def lookup() -> str:
        """The episode's digit."""
        looked_up.append(1)
        return "7"

    async def loops() -> list:  # one event loop for the client's connections
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused",
                                    http_client=httpx.AsyncClient(event_hooks={"response": [statuses.record_async]}))
        outputs = []
        for seed, streamed in [(0, False), (1, True), (2, False), (3, True)]:
            settings = ModelSettings(max_tokens=3, temperature=1.0, tool_choice="required",
                                     extra_args={"seed": seed, "logit_bias": ANSWER_ONLY})
            agent = Agent(name="tiny", model=OpenAIChatCompletionsModel(model="tiny", openai_client=client),
                          tools=[lookup], model_settings=settings)
            if not streamed:
                outputs.append((await Runner.run(agent, "5:", max_turns=6)).final_output)
                continue
            result = Runner.run_streamed(agent, "5:", max_turns=6)
            async for _ in result.stream_events():
                pass
            outputs.append(result.final_output)
        await client.close()
        return outputs

    outputs = asyncio.run(loops())
    assert statuses.all_ok(), statuses.seen
    assert len(looked_up) == 4 and len(statuses.seen) == 8  # per loop: a call, the tool, an answer
    assert all(o[:1].isdigit() for o in outputs), outputs


def test_langchain_chatopenai_runs_its_tool_loop(url):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    statuses, looked_up = Statuses(), []

    @tool
    def lookup() -> str:
        """The episode's digit."""
        looked_up.append(1)
        return "7"

    for seed, choice in [(0, "lookup"), (1, "any"), (2, "lookup"), (3, "any")]:
        llm = ChatOpenAI(model="tiny", base_url=f"{url}/v1", api_key="unused", max_tokens=3, temperature=1.0,
                         seed=seed, streaming=seed % 2 == 1, logit_bias=ANSWER_ONLY,
                         http_client=httpx.Client(event_hooks={"response": [statuses.record]}))
        messages, reply = [HumanMessage("5:")], None
        for turn in range(6):
            bound = llm.bind_tools([lookup], tool_choice=choice if turn == 0 else "auto")
            reply = bound.invoke(messages)
            messages.append(reply)
            if not reply.tool_calls:
                break
            messages += [ToolMessage(lookup.invoke(call["args"]), tool_call_id=call["id"]) for call in reply.tool_calls]
        assert not reply.tool_calls and reply.content[:1].isdigit(), messages  # the loop ended with an answer
    assert statuses.all_ok(), statuses.seen
    assert len(looked_up) == 4 and len(statuses.seen) == 8


def test_a_body_over_the_limit_is_refused_before_it_is_read(url):
    big = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "1" * (2 << 20)}]}).encode()
    declared = httpx.post(f"{url}/v1/chat/completions", content=big, headers={"content-type": "application/json"},
                          timeout=60)
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "request_too_large"

    def chunks():  # no content-length: the limit is counted as the body arrives
        for start in range(0, len(big), 64 << 10):
            yield big[start:start + (64 << 10)]

    chunked = httpx.post(f"{url}/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"},
                         timeout=60)
    assert chunked.status_code == 413, chunked.text
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": "1:", "max_tokens": 1}, timeout=60)
    assert ok.status_code == 200


def wait_until_idle(url: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        health = httpx.get(f"{url}/v1/health", timeout=30).json()
        if health["running_sequences"] == 0 and health["waiting_requests"] == 0:
            return health
        assert time.monotonic() < deadline, f"sequences still running {timeout_s} s after their client left: {health}"
        time.sleep(0.1)


def test_a_client_that_goes_away_frees_its_sequences(url):
    """4,000 tokens take the tiny engine many seconds; a client gone after half a second leaves
    nothing running a moment later, streamed or not."""
    body = {"messages": [{"role": "user", "content": "5:"}], "max_completion_tokens": 4000, "logit_bias": NO_EOS}
    before = wait_until_idle(url, 30)
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as response:
        for n, _ in enumerate(response.iter_lines()):
            if n > 20:
                break
    wait_until_idle(url, 3.0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
    after = wait_until_idle(url, 3.0)
    assert after["jobs_left"] - before["jobs_left"] == 2
    assert after["tokens"] - before["tokens"] < 4000  # neither ran to its length


def test_a_request_over_the_kv_bound_is_refused_and_no_window_exceeds_it(url):
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "1:", "n": 16, "max_tokens": 1000}, timeout=60)
    assert r.status_code == 400 and "KV cache" in r.json()["error"]["message"], r.text
    health = httpx.get(f"{url}/v1/health", timeout=30).json()
    assert 0 < health["largest_kv_block_positions"] <= health["kv_bound_positions"] == 8192
