"""The `policy` application behind Serve, driven over HTTP by clients no one here wrote, as their
users drive them: the `openai` client (plain, streaming, tools, `max_completion_tokens`), the
OpenAI Agents SDK and LangChain's ChatOpenAI running a tool loop. Tiny models make poor agents, so
these check the protocol: every request a framework sends is answered without a 4xx, its tool calls
parse and reach the tool, and its loop ends. Then abuse: bodies over the limit (declared and
chunked) are 413s before they are read, a client that goes away frees its sequences, a request too
large for the KV bound is a 400. And a model with Qwen2.5's chat template is prompted through it."""

import asyncio
import copy
import json
import time

import httpx
import openai
import pytest
from ray import serve

from asyncrl.serve.reward import deploy_declaratively
from asyncrl.weight_sync import free_port
from chat_templates import QWEN25

TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "the episode's digit",
                                           "parameters": {"type": "object", "properties": {}}}}]
NO_EOS = {"0": -100, "1": -100, "2": -100}  # the tiny vocabulary's <pad>, <eos>, <bos>
# The tiny tool policy (a turn that starts with a non-digit calls `lookup`), long contexts for the
# disconnect test, a 1 MiB body limit and a KV bound of 8 MiB (8192 positions of the tiny model).
TINY = ("model=tiny task=tiny_tool serve.follow_learner=false model.max_positions=4096 serve.max_body_mb=1 "
        "serve.max_kv_mb=8")


def tiny_qwen_directory(tokenizer, directory) -> str:
    """A tiny random Llama over SmolLM2's vocabulary whose tokenizer carries Qwen2.5's chat template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = QWEN25
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=2048,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id or 0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def url(ray_session, smol_tokenizer, tmp_path_factory):
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    qwen = tiny_qwen_directory(smol_tokenizer, tmp_path_factory.mktemp("qwen-tiny"))
    deploy_declaratively([
        {"name": "policy", "route_prefix": "/v1", "import_path": "asyncrl.serve.policy:build_policy",
         "args": {"overrides": TINY}},
        {"name": "policy-qwen", "route_prefix": "/qwen/v1", "import_path": "asyncrl.serve.policy:build_policy",
         "args": {"overrides": f"model.source=hf model.path={qwen} model.name=qwen-tiny model.use_chat_template=true "
                               "environment.tool_format=chatml serve.follow_learner=false"}},
    ], timeout_s=300)
    yield f"http://127.0.0.1:{port}"
    for app in ("policy", "policy-qwen"):
        serve.delete(app)
    serve.shutdown()


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


def test_the_openai_agents_sdk_runs_its_tool_loop(url):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    statuses, looked_up = Statuses(), []

    @function_tool
    def lookup() -> str:
        """The episode's digit."""
        looked_up.append(1)
        return "7"

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused",
                                http_client=httpx.AsyncClient(event_hooks={"response": [statuses.record_async]}))
    outputs = []
    for seed, streamed in [(s, s % 2 == 1) for s in range(6)]:
        agent = Agent(name="tiny", model=OpenAIChatCompletionsModel(model="tiny", openai_client=client), tools=[lookup],
                      model_settings=ModelSettings(max_tokens=3, temperature=1.0, extra_args={"seed": seed}))

        async def run():
            if not streamed:
                return (await Runner.run(agent, "5:", max_turns=12)).final_output
            result = Runner.run_streamed(agent, "5:", max_turns=12)
            async for _ in result.stream_events():
                pass
            return result.final_output

        outputs.append(asyncio.run(run()))
    assert statuses.all_ok(), statuses.seen
    assert looked_up and all(isinstance(o, str) for o in outputs)  # calls reached the tool; every loop ended


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

    for seed in range(6):
        llm = ChatOpenAI(model="tiny", base_url=f"{url}/v1", api_key="unused", max_tokens=3, temperature=1.0,
                         seed=seed, streaming=seed % 2 == 1,
                         http_client=httpx.Client(event_hooks={"response": [statuses.record]}))
        bound = llm.bind_tools([lookup])
        messages = [HumanMessage("5:")]
        for _ in range(12):
            reply = bound.invoke(messages)
            messages.append(reply)
            if not reply.tool_calls:
                break
            messages += [ToolMessage(lookup.invoke(call["args"]), tool_call_id=call["id"]) for call in reply.tool_calls]
        assert not messages[-1].tool_calls, "the loop did not end"
    assert statuses.all_ok(), statuses.seen
    assert looked_up


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
    assert after["jobs_left"] - before.get("jobs_left", 0) == 2
    assert after["tokens"] - before["tokens"] < 4000  # neither ran to its length


def test_a_request_over_the_kv_bound_is_refused_and_no_window_exceeds_it(url):
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "1:", "n": 16, "max_tokens": 1000}, timeout=60)
    assert r.status_code == 400 and "KV cache" in r.json()["error"]["message"], r.text
    health = httpx.get(f"{url}/v1/health", timeout=30).json()
    assert 0 < health["largest_kv_block_positions"] <= health["kv_bound_positions"] == 8192


def test_a_model_with_qwen25s_template_is_prompted_through_it(url, smol_tokenizer):
    """The endpoint's prompt for a conversation with tools and an earlier call is the template's
    own rendering, token for token (the tools section, the call, the tool turn)."""
    tokenizer = copy.deepcopy(smol_tokenizer)
    tokenizer.chat_template = QWEN25
    messages = [{"role": "user", "content": "What is 6 * 7?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    client = openai.OpenAI(base_url=f"{url}/qwen/v1", api_key="unused")
    reply = client.chat.completions.create(model="qwen-tiny", messages=messages, tools=TOOLS, max_completion_tokens=2)
    rendered = [{**m, "tool_calls": [{"type": "function", "function": {"name": "lookup", "arguments": {}}}]}
                if m.get("tool_calls") else m for m in messages]
    expected = tokenizer.apply_chat_template(rendered, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    assert reply.usage.prompt_tokens == len(expected)
    assert reply.usage.completion_tokens <= 2
