"""A model directory as users have it: tiny random Qwen2 and Qwen3 models saved with transformers,
with a chat template of their own (using a template option, as Qwen3's `enable_thinking`) and a
turn-end id in `generation_config.json`; trained, served and exported with `model.source=hf`, the
export loading in transformers."""

import json
import shlex

import httpx
import pytest
from ray import serve
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen2Config, Qwen3Config

from asyncrl.config import ConfigError, compose
from asyncrl.data.tasks import encode_prompt, tiny_examples
from asyncrl.models.loading import build_tiny_tokenizer, eos_token_ids, load_policy, load_tokenizer

# Written in the tiny alphabet, so that every rendered character is a token of the tiny vocabulary:
# the user's text, then "=" as the assistant's turn; "#" first when thinking is off.
TEMPLATE = ("{% if enable_thinking is defined and not enable_thinking %}#{% endif %}"
            "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}={% endif %}")


def save_model(directory, family: str) -> str:
    tokenizer = build_tiny_tokenizer()
    common = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                  bos_token_id=2, eos_token_id=1, tie_word_embeddings=False)
    config = Qwen2Config(**common) if family == "qwen2" else Qwen3Config(head_dim=8, **common)
    import torch

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    # The turn-end token is listed only in generation_config.json ("#", as an instruct model's <|im_end|>).
    GenerationConfig(eos_token_id=[1, tokenizer.convert_tokens_to_ids("#")], pad_token_id=0).save_pretrained(directory)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_a_model_directory_loads_with_its_template_its_options_and_its_turn_end(tmp_path, family):
    directory = save_model(tmp_path / f"tiny-{family}", family)
    config = compose(["model=tiny", "task=tiny", "model.source=hf", f"model.path={directory}",
                      "model.use_chat_template=true", "task.chat_template_kwargs={enable_thinking: false}"])
    assert config.model.name == f"tiny-{family}"  # the directory's name, not the group's default
    model, tokenizer = load_policy(config.model)
    assert type(model).__name__ == ("Qwen2ForCausalLM" if family == "qwen2" else "Qwen3ForCausalLM")
    assert eos_token_ids(model, tokenizer) == [1, tokenizer.convert_tokens_to_ids("#")]
    example = tiny_examples("train")[3]
    rendered = tokenizer.decode(encode_prompt(example, tokenizer, True, config.task.chat_template_kwargs))
    assert rendered == "#3:=" and tokenizer.decode(encode_prompt(example, tokenizer, True)) == "3:="
    # A template of one's own, as a file, replaces the tokenizer's.
    (tmp_path / "mine.jinja").write_text("{% for m in messages %}{{ m['content'] }}?{% endfor %}")
    mine = compose(["model=tiny", "model.source=hf", f"model.path={directory}", f"model.chat_template={tmp_path}/mine.jinja"])
    assert load_tokenizer(mine.model).decode(encode_prompt(example, load_tokenizer(mine.model), True)) == "3:?"


def test_a_model_source_without_its_directory_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="^model.source=hf needs model.path: the Hugging Face directory to load$"):
        compose(["model.source=hf"])


@pytest.mark.slow
def test_a_qwen3_directory_trains_serves_and_exports(ray_session, tmp_path):
    from asyncrl.storage.checkpoint_parts import export_hf
    from asyncrl.driver import train
    from asyncrl.serve.reward import deploy_declaratively
    from asyncrl.weights.sync import free_port

    directory = save_model(tmp_path / "tiny-qwen3", "qwen3")
    overrides = ["model=tiny", "task=tiny", "algorithm=grpo", "model.source=hf", f"model.path={directory}",
                 "model.use_chat_template=true", "task.chat_template_kwargs={enable_thinking: false}",
                 "trainer.wandb_mode=disabled"]
    summary = train(compose([*overrides, "trainer.total_steps=3", f"trainer.run_dir={tmp_path}/run"]), progress=False,
                    eval_prompts=2)
    assert summary["steps"] == 3 and summary["final_status"]["ledger"]["problems"] == []
    assert json.load(open(tmp_path / "run" / "config.json"))["model"]["name"] == "tiny-qwen3"

    out = export_hf(str(tmp_path / "run"), str(tmp_path / "export"))
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert type(exported).__name__ == "Qwen3ForCausalLM" and AutoTokenizer.from_pretrained(out).chat_template == TEMPLATE

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        deploy_declaratively([{"name": "qwen-policy", "route_prefix": "/v1", "import_path": "asyncrl.serve.policy:build_policy",
                               "args": {"overrides": shlex.join([*overrides, f"model.path={out}", "serve.follow_learner=false"])}}],
                             timeout_s=300)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()
        assert models["data"][0]["id"] == "export"  # the exported directory's name
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                           json={"model": "export", "messages": [{"role": "user", "content": "3:"}], "max_tokens": 2})
        assert reply.status_code == 200, reply.text
    finally:
        serve.delete("qwen-policy")
        serve.shutdown()
