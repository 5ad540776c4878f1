"""Tools through the chat template: the prompt that lists them, an earlier call, the observation
turn, each rendered by the model's own template in pieces (`asyncrl.environments.templates`), for
Qwen2.5's template (a template with tools, its text in tests/chat_templates.py) and SmolLM2's own
(no tools: the documented fallback). The pieces' tokens are the tokens of the whole conversation
rendered at once, and a training episode and the policy endpoint make the same context."""

import asyncio
import copy
import json

import pytest

from asyncrl.api.requests import ChatCompletionRequest
from asyncrl.api.tools import conversation_ids
from asyncrl.config import EnvironmentConfig
from asyncrl.data.tasks import Example, encode_prompt
from asyncrl.environments.episodes import Episodes, LocalEnvironment
from asyncrl.environments.formats import ChatMLTools, ToolCall
from asyncrl.environments.templates import ChatTemplate, TemplateError, encode
from asyncrl.environments.tools import Episode, PythonTool, tool_specs
from chat_templates import QWEN25

PYTHON = tool_specs(EnvironmentConfig(name="python"))
QUESTION = [{"role": "user", "content": "What is 6 * 7? Use the tool."}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "python", "arguments": json.dumps({"code": "print(6 * 7)"})}}
# An agent's conversation: the question, the model's call, the tool's answer, the model's reply, a new question.
AGENT = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [CALL]},
         {"role": "tool", "tool_call_id": "call_1", "content": "42"},
         {"role": "assistant", "content": "It is 42."}, {"role": "user", "content": "And 6 * 8?"}]


@pytest.fixture(scope="module")
def qwen(smol_tokenizer):
    """A tokenizer with ChatML's special tokens carrying Qwen2.5's real chat template."""
    tokenizer = copy.deepcopy(smol_tokenizer)
    tokenizer.chat_template = QWEN25
    return tokenizer


def as_template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages as transformers' templates take them (a call's arguments as a mapping)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{"type": "function", "function": {"name": c["function"]["name"],
                                                                  "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
            m["content"] = m["content"] or ""
        out.append(m)
    return out


def whole(tokenizer, messages, tools):
    return list(tokenizer.apply_chat_template(as_template_messages(messages), tools=tools, add_generation_prompt=True,
                                              tokenize=True, return_dict=False))


def test_qwen25_pieces_are_the_whole_conversation_rendered_at_once(qwen):
    render = ChatTemplate(qwen, ChatMLTools())
    assert render.knows_tools
    prompt = render.prompt(QUESTION, PYTHON)
    assert encode(qwen, prompt) == whole(qwen, QUESTION, PYTHON)
    assert "# Tools" in prompt and '"name": "python"' in prompt  # the template's own tools section
    # The endpoint renders an agent's whole conversation in pieces: the same tokens as at once.
    body = ChatCompletionRequest(messages=AGENT, tools=PYTHON)
    assert conversation_ids(body, render, qwen) == whole(qwen, AGENT, PYTHON)
    # The observation: the turn's end, the template's tool turn, the next generation prompt.
    assert render.observation("42") == "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n" \
                                       "<|im_start|>assistant\n"


def test_an_episode_and_the_endpoint_make_the_same_context(qwen):
    """A training episode: the prompt with its tools, the policy's call as sampled (here the text the
    template writes for it), the environment's answer as observation. An agent replaying that
    exchange to the endpoint gets the same tokens, and the learner trains on exactly them."""
    render = ChatTemplate(qwen, ChatMLTools())
    environment = EnvironmentConfig(name="python", allow_unisolated=True)
    episodes = Episodes(ChatMLTools(), LocalEnvironment(PythonTool(allow_unisolated=True)), qwen, 2, 512, render)
    prompt = encode_prompt(Example("q", QUESTION, "42", "arithmetic_tool"), qwen, True, environment=environment)
    sampled = encode(qwen, render.assistant("", [ToolCall("python", {"code": "print(6 * 7)"})]))
    assert episodes.call_end([], sampled + encode(qwen, " and more")) == len(sampled)  # cut just after the call
    observation = asyncio.run(episodes.observe(sampled, Episode("q", 0)))
    assert observation.text == "42" and not observation.error
    episode = prompt + sampled + observation.token_ids
    replayed = ChatCompletionRequest(messages=AGENT[:3], tools=PYTHON)
    assert conversation_ids(replayed, render, qwen) == episode == whole(qwen, AGENT[:3], PYTHON)


def test_smollm2s_own_template_has_no_tools_and_gets_the_documented_fallback(smol_tokenizer):
    """SmolLM2's template ignores `tools`: the format's instructions go in the system turn, and a
    tool's answer is the user turn that carries it, both through the template itself."""
    render = ChatTemplate(smol_tokenizer, ChatMLTools())
    assert not render.knows_tools
    listed = ChatMLTools().tools_prompt([t["function"] for t in PYTHON])
    fallback = [{"role": "system", "content": listed}, *QUESTION,
                {"role": "assistant", "content": ChatMLTools().call_text(ToolCall("python", {"code": "print(6 * 7)"}))},
                {"role": "user", "content": ChatMLTools().response_message("42")},
                *AGENT[3:]]
    body = ChatCompletionRequest(messages=AGENT, tools=PYTHON)
    assert conversation_ids(body, render, smol_tokenizer) == whole(smol_tokenizer, fallback, None)
    assert render.observation("42").startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n42")
    environment = EnvironmentConfig(name="python")
    prompt = encode_prompt(Example("q", QUESTION, "42", "arithmetic_tool"), smol_tokenizer, True, environment=environment)
    assert prompt == whole(smol_tokenizer, fallback[:2], None)  # training lists the tools the same way


def test_a_template_that_does_not_write_content_as_it_is_is_refused(smol_tokenizer):
    tokenizer = copy.deepcopy(smol_tokenizer)
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}{% endfor %}"
    with pytest.raises(TemplateError, match="content"):
        ChatTemplate(tokenizer, ChatMLTools())
    tokenizer.chat_template = None
    with pytest.raises(TemplateError, match="no chat template"):
        ChatTemplate(tokenizer, ChatMLTools())


def test_an_environment_class_of_the_users_lists_its_spec_in_the_prompt(qwen, tmp_path):
    """`environment.class_path`: a class with a `spec` attribute has its tool listed through the
    template, as a built-in's is; one without lists none (its prompts say how to call it)."""
    (tmp_path / "env.py").write_text(
        "class Calculator:\n"
        "    spec = {'name': 'calculator', 'description': 'arithmetic',\n"
        "            'parameters': {'type': 'object', 'properties': {'expression': {'type': 'string'}}}}\n"
        "    def step(self, call, episode):\n        return '0', False\n\n"
        "class Silent:\n    def step(self, call, episode):\n        return '0', False\n")
    example = Example("q", QUESTION, "42", "arithmetic_tool")
    listed = tool_specs(EnvironmentConfig(class_path=f"{tmp_path}/env.py:Calculator"))
    assert [t["function"]["name"] for t in listed] == ["calculator"]
    prompt = encode_prompt(example, qwen, True, environment=EnvironmentConfig(class_path=f"{tmp_path}/env.py:Calculator"))
    assert prompt == whole(qwen, QUESTION, listed) and '"name": "calculator"' in qwen.decode(prompt)
    silent = EnvironmentConfig(class_path=f"{tmp_path}/env.py:Silent")
    assert tool_specs(silent) == [] and encode_prompt(example, qwen, True, environment=silent) == whole(qwen, QUESTION, None)
