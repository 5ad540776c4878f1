"""Delta weight updates (`policy.weight_delta`, `asyncrl.weights.delta`): what a delta holds, worked
by hand; the generator's weights rebuilt bit for bit over several versions through the learner's
own sender and both paths an update takes (shared memory, the distributed group); a delta refused
by an engine holding another version. Seconds."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from asyncrl.config import compose
from asyncrl.engines.generation import build_engine
from asyncrl.weights import transport, delta as weights_delta
from asyncrl.weights.delta import DeltaTracker
from asyncrl.weights.sync import WeightGroup, WeightTransferError, free_port, plan_buckets


def test_a_delta_holds_nothing_of_an_unchanged_tensor_indices_of_a_sparse_one_and_a_dense_one_whole():
    old = {"same": torch.zeros(8), "few": torch.zeros(8), "many": torch.zeros(4),
           "signed": torch.zeros(2, dtype=torch.bfloat16)}
    new = {"same": torch.zeros(8), "few": torch.tensor([0, 0, 0, 1.5, 0, 0, 0, 0]),
           "many": torch.tensor([1.0, 2.0, 0, 3.0]), "signed": torch.tensor([-0.0, 0.0], dtype=torch.bfloat16)}
    pieces, stats = weights_delta.encode(old, new)
    names = [name for name, _ in pieces]
    # few: 1 changed float32 of 8: 1 * (4 + 4) bytes < 8 * 4 -> index and value.
    # many: 3 of 4: 3 * 8 = 24 bytes, not < 16 -> the tensor whole.
    # signed: -0.0 equals 0.0 as a number, but not as bits: a change (1 * (4 + 2) < 2 * 2 is false: whole).
    assert names == ["few@index", "few@values", "many", "signed"]
    assert pieces[0][1].tolist() == [3] and pieces[0][1].dtype == torch.int32 and pieces[1][1].tolist() == [1.5]
    assert stats == {"elements": 22, "elements_changed": 5, "tensors": 4, "tensors_changed": 3, "tensors_sparse": 1,
                     "bytes": 4 + 4 + 16 + 4}
    rebuilt = {name: t.clone() for name, t in old.items()}
    weights_delta.apply(rebuilt, pieces)
    for name in new:
        assert torch.equal(rebuilt[name].view(torch.uint8), new[name].view(torch.uint8)), name
    with pytest.raises(ValueError, match="engine's own dtype"):
        weights_delta.apply({"many": torch.zeros(4, dtype=torch.bfloat16)}, [("many", torch.ones(4))])


def small_steps(weights: dict[str, torch.Tensor], seed: int) -> None:
    """An optimizer-like step: every fp32 weight moves by ~1e-4 of its size; in bf16 most do not move."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in weights.values():
            t.add_(t.abs() * 2e-4 * torch.randn(t.shape, generator=g))


def engine_and_weights(dtype):
    engine, _ = build_engine(compose(["model=tiny"]).model, dtype=dtype)
    learner = {n: p.detach().float().clone() for n, p in build_engine(compose(["model=tiny"]).model)[0].model.named_parameters()}
    return engine, learner


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_engines_weights_are_the_learners_cast_bit_for_bit_over_shared_memory(dtype):
    engine, learner = engine_and_weights(dtype)
    sender = transport.WeightSender(plan_buckets(learner.items(), 1 << 20), delta=DeltaTracker(dtype))
    sent = []
    try:
        for version in range(1, 6):
            small_steps(learner, version)
            staged = sender.stage(version, learner.items(), None, {"shm"})
            delivery, payload = sender.delivery(staged, "shm")
            transport.load(engine, delivery, payload, None)
            sent.append((delivery.delta_base, staged.delta))
            for name, p in engine.model.named_parameters():
                assert torch.equal(p.view(torch.uint8), learner[name].to(dtype).view(torch.uint8)), (version, name)
    finally:
        sender.slots.close()
    assert [base for base, _ in sent] == [-1, 1, 2, 3, 4]  # a whole version, then deltas from the last
    if dtype == torch.bfloat16:  # most bf16 values stay put: a delta is far smaller than the weights
        assert all(stats["bytes"] < 0.5 * sent[0][1]["bytes"] for _, stats in sent[1:]), sent
    with pytest.raises(WeightTransferError, match="delta from version 2, but the engine holds version 5"):
        engine.apply_delta([], 2, 6)


def _generator(port: int, inbox, outbox) -> None:
    """A generator's side in its own process: its engine, its group with the learner, each delivery loaded."""
    torch.set_num_threads(1)
    engine, _ = engine_and_weights(torch.bfloat16)
    group = WeightGroup("127.0.0.1", port, 2, 1, timeout_s=60, join_timeout_s=120)
    while (delivery := inbox.get(timeout=120)) is not None:
        transport.load(engine, delivery, None, group)
        outbox.put((engine.weight_version, {n: p.detach().view(torch.int16).clone() for n, p in
                                            engine.model.named_parameters()}))


def test_a_delta_over_the_distributed_group_rebuilds_the_weights_bit_for_bit():
    _, learner = engine_and_weights(torch.bfloat16)
    sender = transport.WeightSender(plan_buckets(learner.items(), 1 << 20), delta=DeltaTracker(torch.bfloat16),
                                    bucket_bytes=16 << 10)  # several buckets
    port = free_port()
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_generator, args=(port, inbox, outbox))
    proc.start()
    try:
        sender.groups["g"] = WeightGroup("127.0.0.1", port, 2, 0, timeout_s=60, join_timeout_s=120)
        for version in (1, 2, 3):
            small_steps(learner, version)
            staged = sender.stage(version, learner.items(), dict(learner), {"group"})
            delivery, _ = sender.delivery(staged, "group")
            assert delivery.delta_base == (version - 1 if version > 1 else -1)
            inbox.put(delivery)
            sender.send_group(staged, "g")
            held, weights = outbox.get(timeout=120)
            assert held == version
            for name, bits in weights.items():
                assert torch.equal(bits, learner[name].to(torch.bfloat16).view(torch.int16)), name
        assert len(delivery.plan.buckets) > 1
    finally:
        inbox.put(None)
        proc.join(timeout=60)
    sender.failed()  # a delivery failed somewhere: the next version is whole again
    assert sender.stage(4, learner.items(), dict(learner), {"group"}).delta_base == -1


def test_a_moe_engine_takes_deltas_into_its_experts_and_decodes_as_a_fresh_one(tmp_path):
    """A mixture-of-experts model (`asyncrl.bench.moe`'s tiny Qwen3-MoE, its experts as 3-D tensors)
    in the embedded engine, bf16: five versions of deltas rebuild every weight bit for bit, and the
    engine's decoder then samples exactly what a fresh engine on the learner's weights samples
    (no copy of an expert left behind at an older version)."""
    import numpy as np

    from asyncrl.bench.moe import NEVER, tiny_moe
    from asyncrl.engines.base import SamplingParams, SequenceInput
    from asyncrl.engines.torch_engine import TorchEngine
    from asyncrl.messages.structs import int32_array

    model = tiny_moe()
    engine = TorchEngine(model, NEVER, dtype=torch.bfloat16)
    assert engine.decoder is not None and engine.decoder.experts == 8
    learner = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    sender = transport.WeightSender(plan_buckets(learner.items(), 1 << 20), delta=DeltaTracker(torch.bfloat16))
    try:
        for version in range(1, 6):
            small_steps(learner, version * 10)
            staged = sender.stage(version, learner.items(), None, {"shm"})
            transport.load(engine, *sender.delivery(staged, "shm"), None)
    finally:
        sender.slots.close()
    for name, p in engine.model.named_parameters():
        assert torch.equal(p.view(torch.uint8), learner[name].to(torch.bfloat16).view(torch.uint8)), name
    model.load_state_dict(learner, strict=False)
    fresh = TorchEngine(model, NEVER, dtype=torch.bfloat16)
    sequences = [SequenceInput(prompt_ids=int32_array([1 + i, 5, 9]), response_ids=int32_array([]), seed=i,
                               max_response_tokens=12) for i in range(4)]
    params = SamplingParams(temperature=1.0)
    for a, b in zip(engine.generate_window_sync(sequences, 12, params), fresh.generate_window_sync(sequences, 12, params)):
        assert np.array_equal(a.token_ids, b.token_ids) and np.array_equal(a.routes, b.routes)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)
