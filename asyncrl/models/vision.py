"""Vision-language models: the tiny random Qwen2-VL (`model=tiny_vl`), a model's image processor
over the image store (`image_prep`), and the vision tower's output for a batch of rows
(`VisionInputs`), computed once per distinct image.

The families are transformers' own: `Qwen2VLForConditionalGeneration`, Qwen2.5-VL's and Qwen3-VL's
(their vision towers, their `get_rope_index` for the multimodal rotary positions, their splicing
of image features into the prompt's embeddings through `mm_encoder_outputs`; Qwen3-VL's tower also
gives "deepstack" features that its first decoder layers add at the image tokens) and
`Qwen2VLImageProcessorPil` (min/max pixels as the family defines them; Qwen3-VL's processor is the
same with patches of 16). The learners' forwards (the policy's, the critic's) pass `vision_kwargs`
to the model or its trunk; the engine's own decoder takes `VisionInputs.features` and `rope_index`
(`asyncrl.engines.vision_prompts`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from asyncrl.config import ConfigError, ModelConfig
from asyncrl.storage.images import PROCESSOR_ATTRIBUTE, ImagePrep, ImageTokens, directory_has_vision, load_processed

# The tiny tokenizer's special tokens, then the Qwen2-VL family's image tokens.
TINY_VL_IMAGE_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def is_vision_model(model) -> bool:
    """A vision-language model: its config has a vision tower's (`vision_config`)."""
    return getattr(model.config, "vision_config", None) is not None


def image_token_ids(model) -> list[int]:
    """The family's image and video tokens (the pad, start and end of each): a prompt's, never a
    response's. The engine samples from logits without them and the learner scores under the same
    (`without_image_tokens`): a sampled image token would take the place of an image that is not there."""
    config = model.config
    return sorted({config.image_token_id, config.video_token_id, config.vision_start_token_id,
                   config.vision_end_token_id})


def without_image_tokens(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """`logits` `[..., vocab]` with the image tokens `ids` at -inf (a copy)."""
    return logits.index_fill(-1, torch.tensor(ids, device=logits.device), float("-inf"))


def text_config(config):
    """The language model's config of a vision-language model's (the config itself for text models)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def build_tiny_vl_tokenizer(alphabet: list[str], special: list[str]) -> PreTrainedTokenizerFast:
    """The tiny character tokenizer (`special` + `alphabet`) with the family's image tokens after them."""
    vocab = {tok: i for i, tok in enumerate(special + alphabet + TINY_VL_IMAGE_TOKENS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=special[0]))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=special[0], eos_token=special[1],
                                        bos_token=special[2])
    tokenizer.add_special_tokens({"additional_special_tokens": TINY_VL_IMAGE_TOKENS})
    return tokenizer


def build_tiny_vl_model(model_config: ModelConfig, tokenizer):
    """A random Qwen2-VL (or Qwen2.5-VL: `model.vision_family`) from transformers' config classes: the tiny Llama's sizes for the language
    model (mrope sections splitting its head), a vision tower of `model.vision_layers` blocks whose
    merger projects to the language model's width, the tokenizer's image token ids."""
    import transformers

    head_dim = model_config.hidden_size // model_config.num_heads
    half = head_dim // 2
    sections = [half - 2 * (half // 3), half // 3, half // 3]  # temporal, height, width: Qwen2-VL's 16/24/24 in kind
    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in TINY_VL_IMAGE_TOKENS}
    prefix = _FAMILY_CLASSES[model_config.vision_family]
    config_class = getattr(transformers, f"{prefix}Config")
    model_class = getattr(transformers, f"{prefix}ForConditionalGeneration")
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": sections}
    if model_config.vision_family == "qwen3_vl":  # its frequencies' axes interleave (t h w t h w ...)
        rope["mrope_interleaved"] = True
    config = config_class(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=model_config.hidden_size,
                         intermediate_size=model_config.hidden_size * 4, num_hidden_layers=model_config.num_layers,
                         num_attention_heads=model_config.num_heads, num_key_value_heads=model_config.num_heads,
                         head_dim=head_dim, max_position_embeddings=model_config.max_positions, pad_token_id=0,
                         eos_token_id=1, bos_token_id=2, rope_parameters=rope),
        vision_config=_tiny_tower(model_config),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False)
    state = torch.random.get_rng_state()
    torch.manual_seed(model_config.seed)
    try:
        return model_class(config)
    finally:
        torch.random.set_rng_state(state)


# transformers' class names of each `model.vision_family`.
_FAMILY_CLASSES = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL", "qwen3_vl": "Qwen3VL"}
# The side of tiny_vl's images after the processor: 2x2 merged patches of the family's patch size.
_TINY_PATCH = {"qwen2_vl": 14, "qwen2_5_vl": 14, "qwen3_vl": 16}


def _tiny_tower(model_config: ModelConfig) -> dict:
    """tiny_vl's vision tower settings in its family's names: Qwen2-VL's `embed_dim` is the tower's
    width and `hidden_size` the language model's; Qwen2.5-VL's `hidden_size` is the tower's and
    `out_hidden_size` the language model's, and its blocks attend in windows except the last one;
    Qwen3-VL's names are Qwen2.5-VL's, its patch embedding has learned positions (a 4x4 grid,
    interpolated) and every block's output feeds one decoder layer (deepstack)."""
    common = dict(depth=model_config.vision_layers, num_heads=2, patch_size=_TINY_PATCH[model_config.vision_family],
                  spatial_merge_size=2, temporal_patch_size=2)
    if model_config.vision_family == "qwen3_vl":
        layers = min(model_config.vision_layers, model_config.num_layers)
        return common | dict(hidden_size=model_config.vision_width, intermediate_size=2 * model_config.vision_width,
                             out_hidden_size=model_config.hidden_size, num_position_embeddings=16,
                             deepstack_visual_indexes=list(range(layers)))
    if model_config.vision_family == "qwen2_5_vl":
        return common | dict(hidden_size=model_config.vision_width, intermediate_size=2 * model_config.vision_width,
                             out_hidden_size=model_config.hidden_size, window_size=56,
                             fullatt_block_indexes=[model_config.vision_layers - 1])
    return common | dict(embed_dim=model_config.vision_width, hidden_size=model_config.hidden_size)


def image_processor(model_config: ModelConfig):
    """The model's image processor: for `tiny_vl`, transformers' `Qwen2VLImageProcessorPil` with
    the model's patching and `model.image_min_pixels`/`image_max_pixels`; for a directory, its own
    (`preprocessor_config.json`, refused naming the file when it is missing), those settings
    replacing its pixel bounds where set."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    bounds = {key: value for key, value in (("min_pixels", model_config.image_min_pixels),
                                            ("max_pixels", model_config.image_max_pixels)) if value}
    if model_config.source == "tiny_vl":
        side = 4 * _TINY_PATCH[model_config.vision_family]  # 16 patches, 4 image tokens
        # Qwen3-VL normalises pixels to [-1, 1] (mean and std 0.5); Qwen2-VL's are CLIP's, the class default.
        norm = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3} if model_config.vision_family == "qwen3_vl" else {}
        return Qwen2VLImageProcessorPil(patch_size=side // 4, merge_size=2, temporal_patch_size=2, **norm,
                                        **{"min_pixels": side * side, "max_pixels": side * side, **bounds})
    if not os.path.exists(os.path.join(model_config.path, "preprocessor_config.json")):
        raise ConfigError(f"{model_config.path} is a vision-language model but has no preprocessor_config.json: "
                          f"its image processor's settings are needed to read images (save the processor with "
                          f"the model: processor.save_pretrained({model_config.path!r}))")
    return Qwen2VLImageProcessorPil.from_pretrained(model_config.path, **bounds)


def image_prep(model_config: ModelConfig, tokenizer, model=None) -> ImagePrep | None:
    """The model's `ImagePrep`, or None for a text-only model (`model`: the loaded model, else its
    kind is read from the `model` section)."""
    if model is not None and not is_vision_model(model):
        return None
    if model is None and model_config.source != "tiny_vl" and not directory_has_vision(model_config.path):
        return None
    processor = image_processor(model_config)
    tokens = ImageTokens()
    return ImagePrep(processor, tokenizer.convert_tokens_to_ids(tokens.pad), processor.merge_size, tokens)


def freeze_vision_tower(model) -> None:
    """No gradient for the vision tower of `model` (the conditional-generation model, or its trunk:
    a critic's backbone), its patch merger too, as verl freezes it."""
    model.base_model.visual.requires_grad_(False)


def with_image_processor(model, model_config: ModelConfig):
    """`model` with the image processor of `model_config` attached (a vision-language model; a
    directory without preprocessor_config.json has none to attach: it is refused where images are
    read), so that a checkpoint of it holds the processor the run read images with (tiny_vl's is
    built in code; `model.image_min_pixels`/`image_max_pixels` change a directory's)."""
    has_file = model_config.source == "hf" and os.path.exists(os.path.join(model_config.path, "preprocessor_config.json"))
    if is_vision_model(model) and (model_config.source == "tiny_vl" or has_file):
        setattr(model, PROCESSOR_ATTRIBUTE, image_processor(model_config))
    return model


@dataclass
class ImageFeatures:
    """One image through the tower: `embeds` `[tokens, hidden]` replace its image tokens' embeddings;
    `deepstack` (Qwen3-VL) holds one `[tokens, hidden]` per decoder layer it is added after."""

    embeds: torch.Tensor
    deepstack: tuple[torch.Tensor, ...] = ()


def _deepstack_output(**fields):
    from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

    return BaseModelOutputWithDeepstackFeatures(**fields)


class VisionInputs:
    """The vision tower of `model` (a Qwen2-VL, or its trunk: a critic's backbone) over processed
    image references: `features` runs it once per distinct image of a batch (no gradient while the
    tower is frozen) and times it (`seconds`)."""

    def __init__(self, model):
        self.model = model
        self.config = model.config
        self.seconds = 0.0  # in the vision tower, since built

    @property
    def inner(self):
        """The trunk (vision tower, language model, rope index): the model's `model`, or the trunk itself."""
        return self.model.base_model

    def features(self, refs: list[str]) -> dict[str, ImageFeatures]:
        """The tower's output for each distinct reference: merged features `[tokens, hidden]`, and
        the deepstack features of a family that has them."""
        distinct = list(dict.fromkeys(refs))
        if not distinct:
            return {}
        start = time.perf_counter()
        loaded = [load_processed(ref) for ref in distinct]
        visual = self.inner.visual
        device = next(visual.parameters()).device
        pixels = torch.cat([p for p, _ in loaded]).to(device)
        grid = torch.stack([g for _, g in loaded]).to(device)
        trainable = any(p.requires_grad for p in visual.parameters())
        with torch.set_grad_enabled(trainable and torch.is_grad_enabled()):
            out = self.inner.get_image_features(pixels, grid, return_dict=True)
        self.seconds += time.perf_counter() - start
        # deepstack_features: per feeding layer, the images' features; here each image's across layers.
        stacks = list(zip(*out.deepstack_features)) if self.deepstack else [()] * len(distinct)
        return {ref: ImageFeatures(embeds, tuple(stack))
                for ref, embeds, stack in zip(distinct, out.pooler_output, stacks)}

    @property
    def deepstack(self) -> bool:
        """Whether the family's first decoder layers also take image features (Qwen3-VL)."""
        return bool(getattr(self.config.vision_config, "deepstack_visual_indexes", None))

    def grids(self, refs: list[str]) -> torch.Tensor:
        """`[images, 3]`: the (t, h, w) patch grid of each reference, in order."""
        return torch.stack([load_processed(ref)[1] for ref in refs]) if refs else torch.zeros((0, 3), dtype=torch.long)

    def rope_index(self, ids: torch.Tensor, refs: list[str]) -> tuple[torch.Tensor, int]:
        """The multimodal rotary positions `[3, P]` of one prompt `ids` `[P]` and its delta (a
        response token at index j has position j + delta on every axis): the family's `get_rope_index`."""
        types = (ids == self.config.image_token_id).int()[None]
        positions, delta = self.inner.get_rope_index(ids[None], types, self.grids(refs).to(ids.device))
        return positions[:, 0], int(delta.reshape(-1)[0])

    def model_kwargs(self, input_ids: torch.Tensor, images: list[tuple[str, ...]]) -> dict:
        """What the model's forward takes beside `input_ids` for right-padded rows with these images:
        the features as precomputed encoder outputs (each distinct image through the tower once),
        the grids and the token types (its rope index places the image tokens)."""
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        refs = [ref for row in images for ref in row]
        if not refs:
            return {}
        features = self.features(refs)
        encoded = BaseModelOutputWithPooling(pooler_output=[features[r].embeds for r in refs])
        if self.deepstack:  # the family's own output type, whose forward reads `deepstack_features`
            encoded = _deepstack_output(pooler_output=encoded.pooler_output,
                                        deepstack_features=list(zip(*(features[r].deepstack for r in refs))))
        return {"mm_encoder_outputs": {"image": encoded},
                "image_grid_thw": self.grids(refs).to(input_ids.device),
                "mm_token_type_ids": (input_ids == self.config.image_token_id).int()}


def vision_kwargs(vision: VisionInputs | None, input_ids: torch.Tensor, images: list[tuple[str, ...]] | None,
                  model) -> dict:
    """What a learner's forward of `model` takes beside `input_ids` for rows with these `images`
    (each row's processed references): `VisionInputs.model_kwargs`, {} when no row has any. Rows with
    images on a text-only model (`vision` None) are refused naming it."""
    if not images or not any(images):
        return {}
    if vision is None:
        raise ValueError(f"rows with images, but {type(model).__name__} is a text-only model")
    return vision.model_kwargs(input_ids, images)
