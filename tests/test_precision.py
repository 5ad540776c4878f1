"""bf16 or fp32 by a probe of the model's own matmul shapes on this machine (`asyncrl.models.precision`),
the one rule behind `engine.dtype=auto`, `policy.compute.precision=auto` and
`critic.compute.precision=auto`, and how each role reports it."""

import logging

import pytest
import torch

from asyncrl.config import ModelConfig, compose
from asyncrl.engines.torch_engine import engine_precision
from asyncrl.learning.rank import learner_precision
from asyncrl.messages.mailbox import InProcessMailbox
from asyncrl.models.loading import build_tiny_model, build_tiny_tokenizer
from asyncrl.models.precision import (
                                      BF16_MIN_PARAMETERS,
                                      BF16_MIN_SPEEDUP,
                                      choose_precision,
                                      device_name,
                                      linear_shapes,
                                      probe_seconds,
                                      )

VOCAB = len(build_tiny_tokenizer())


@pytest.fixture(scope="module")
def models():
    small = build_tiny_model(ModelConfig(source="tiny"), VOCAB)
    large = build_tiny_model(ModelConfig(source="tiny", hidden_size=512, num_layers=4, num_heads=8), VOCAB)
    assert sum(p.numel() for p in small.parameters()) < BF16_MIN_PARAMETERS <= sum(p.numel() for p in large.parameters())
    return small, large


def test_a_set_dtype_is_kept_and_a_small_model_stays_fp32_without_a_probe(models):
    small, _ = models
    for setting, bf16 in (("bfloat16", True), ("bf16", True), ("float32", False), ("fp32", False)):
        chosen = choose_precision(setting, small, "cpu", 16, "test")
        assert chosen.bf16 is bf16 and chosen.reason == f"set to {setting}" and chosen.fp32_ms is None
    auto = choose_precision("auto", small, "cpu", 16, "test")
    assert not auto.bf16 and auto.dtype == torch.float32 and "under 10M" in auto.reason and auto.bf16_ms is None
    assert engine_precision("bfloat16", "cpu", small, 16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        engine_precision("float16", "cpu", small, 16)


def test_auto_takes_bf16_by_the_measured_speed_of_the_models_matmuls(models):
    """The decision follows the figures the probe hands it (`combine` is how a sharded learner's
    ranks agree: here it states the figures), from `BF16_MIN_SPEEDUP` up."""
    _, large = models
    for fp32_s, bf16_s, bf16 in ((3.0, 1.0, True), (BF16_MIN_SPEEDUP, 1.0, True), (1.2, 1.0, False), (1.0, 8.0, False)):
        chosen = choose_precision("auto", large, "cpu", 16, "test", combine=lambda f, b: (fp32_s, bf16_s))
        assert chosen.bf16 is bf16 and f"{fp32_s / bf16_s:.2f}x" in chosen.reason, chosen
    measured = choose_precision("auto", large, "cpu", 16, "test")
    assert measured.fp32_ms > 0 and measured.bf16_ms > 0
    assert measured.bf16 is (measured.fp32_ms / measured.bf16_ms >= BF16_MIN_SPEEDUP)
    assert device_name("cpu") in measured.reason


def test_the_probe_covers_every_linear_shape_of_the_model():
    model = build_tiny_model(ModelConfig(source="tiny"), VOCAB)  # hidden 64, 2 layers, MLP 256
    assert linear_shapes(model) == ((64, VOCAB, 1), (64, 64, 8), (64, 256, 4), (256, 64, 2))
    fp32_s, bf16_s = probe_seconds(linear_shapes(model), 8, "cpu")
    assert fp32_s > 0 and bf16_s > 0


def test_each_role_logs_and_reports_its_choice(models, caplog):
    from actors.generator import build_generator

    small, _ = models
    with caplog.at_level(logging.INFO, logger="asyncrl.models.precision"):
        chosen = learner_precision("auto", small, "cpu", "policy learner")
    assert chosen.name == "fp32" and caplog.records[-1].getMessage().startswith("policy learner precision: fp32 (auto:")
    config = compose(["model=tiny", "task=tiny"])
    generator = build_generator(config.model, config.engine, config.sampling, InProcessMailbox(4), InProcessMailbox(4),
                                "gen-0")
    report = generator.stats()["engine_precision"]
    assert report["precision"] == "fp32" and "under 10M" in report["reason"]
