"""A mixture-of-experts model's routes travel with their tokens (`asyncrl.messages.routes`): from
the real generator and engine (and from SGLang's record), through the wire, the assembler's merge of a sample's windows and a
window row's context, the trajectory store and a checkpoint's saved batches, each token keeping the
route it was sampled with, under its own weights. Dense segments are as before (no routes)."""

import asyncio
import copy

import msgspec
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from actors.generator import Generator
from asyncrl.assembly.copies import SampleCopies
from asyncrl.assembly.rows import merge_segments, with_whole_response
from asyncrl.engines import llama_decoder, moe
from asyncrl.engines.base import SamplingParams
from asyncrl.engines.torch_engine import TorchEngine
from asyncrl.messages.mailbox import InProcessMailbox
from asyncrl.messages.routes import UNROUTED, joined_routes
from asyncrl.messages.structs import (Codec, FinishReason, PromptRequest, Segment, TrainBatch, TrainingRow,
                                      int32_array, response_routes)
from asyncrl.storage import checkpoint_parts
from asyncrl.storage.trajectory_store import (BATCH_CODEC, TRAJECTORY_SCHEMA, StoreWriter, read_trajectories,
                                              record_of, segments_of)
from engine_checks import NO_EOS
from test_engine_moe import moe_model, prefill

SEGMENTS = Codec(Segment)


def window(i: int, n: int, prior: list[int], routes: np.ndarray | None, finished: bool = False, **more) -> Segment:
    return Segment(prompt_id="p", sample_idx=0, window=i, group_id="p", prompt_token_ids=int32_array([3, 4]),
                   prior_response_ids=int32_array(prior), prior_versions=int32_array([i - 1] * len(prior)),
                   new_token_ids=int32_array(range(10 * i, 10 * i + n)), new_logprobs=np.zeros(n, np.float32),
                   new_versions=int32_array([i] * n), finished=finished,
                   finish_reason=FinishReason.EOS if finished else FinishReason.WINDOW, new_routes=routes, **more)


def routes_of(n: int, seed: int, dtype=np.uint8, experts: int = 8) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, experts, size=(n, 3, 2)).astype(dtype)


def test_routes_cross_the_wire_and_dense_segments_are_as_before():
    for dtype, experts in ((np.uint8, 8), (np.int16, 300)):
        seg = window(0, 4, [], routes_of(4, 0, dtype, experts))
        back = SEGMENTS.decode(SEGMENTS.encode(seg))
        assert back.new_routes.dtype == dtype and np.array_equal(back.new_routes, seg.new_routes)
    dense = window(0, 4, [], None)
    assert SEGMENTS.decode(SEGMENTS.encode(dense)).new_routes is None
    # A message written before routes existed (no such fields on the wire) decodes as a dense one.
    fields = msgspec.msgpack.decode(SEGMENTS.encode(dense))
    old = {k: v for k, v in fields.items() if k not in ("new_routes", "prior_routes")}
    decoded = SEGMENTS.decode(msgspec.msgpack.encode(old))
    assert decoded.new_routes is None and decoded.prior_routes is None
    assert SEGMENTS.encode(decoded) == SEGMENTS.encode(dense)
    # Routes that do not match their tokens are refused on decode, naming the field.
    forged = dict(fields, new_routes=msgspec.msgpack.decode(SEGMENTS.encode(window(0, 3, [], routes_of(3, 1))))[
        "new_routes"])
    with pytest.raises(msgspec.ValidationError, match="new_routes"):
        SEGMENTS.decode(msgspec.msgpack.encode(forged))
    with pytest.raises(TypeError, match="new_routes"):
        window(0, 4, [], routes_of(4, 0).astype(np.int32))


def test_routes_survive_the_merge_a_window_rows_context_and_the_whole_response():
    """Each window's routes as recorded (an episode's observation tokens, which the engine did not
    sample, are UNROUTED); a window row gets its copy's earlier windows' routes as its context's."""
    first, second, third = routes_of(3, 1), routes_of(2, 2), routes_of(2, 3)
    observed = joined_routes([(second, 2), (None, 2)])  # two observation tokens after the call
    assert (observed[2:] == UNROUTED[np.dtype(np.uint8)]).all() and np.array_equal(observed[:2], second)
    windows = [window(0, 3, [], first), window(1, 4, [0, 1, 2], observed,
                                              new_observation=np.array([0, 0, 1, 1], np.uint8),
                                              new_scored=np.array([1, 1, 0, 0], np.uint8)),
               window(2, 2, [0, 1, 2, 10, 11, 12, 13], third, finished=True)]
    merged = merge_segments(windows)
    assert np.array_equal(merged.new_routes, np.concatenate([first, observed, third]))
    assert merge_segments([window(0, 2, [], None), window(1, 1, [0, 1], None, finished=True)]).new_routes is None

    copies = SampleCopies()
    rows = []
    for seg in windows:
        _, parts = copies.add(seg)
        rows.append(copies.with_prior_routes(seg, parts))
    assert rows[0].prior_routes is None and np.array_equal(rows[1].prior_routes, first)
    assert np.array_equal(response_routes(rows[2]), merged.new_routes)
    whole = with_whole_response(TrainingRow(segment=rows[2], score=1.0, advantages=np.zeros(2, np.float32)))
    assert whole.segment.prior_routes is None and np.array_equal(whole.segment.new_routes, merged.new_routes)


def test_routes_survive_the_trajectory_store_and_a_checkpoints_saved_batches(tmp_path):
    merged = merge_segments([window(0, 3, [], routes_of(3, 4, np.int16, 300)),
                             window(1, 2, [0, 1, 2], routes_of(2, 5, np.int16, 300), finished=True)])
    writer = StoreWriter(str(tmp_path / "trajectories"), "trajectories", TRAJECTORY_SCHEMA)
    writer.append([msgspec.structs.asdict(record_of(merged, [3, 5], None, "", "", "kept"))])
    writer.close()
    [record] = read_trajectories(str(tmp_path))
    assert record.route_top_k == 2 and len(record.token_routes) == 5 and len(record.token_routes[0]) == 6
    table = pq.read_table(next((tmp_path / "trajectories").glob("*.parquet")))  # no asyncrl needed to read it
    assert table.column("token_routes").to_pylist()[0] == merged.new_routes.reshape(5, 6).tolist()
    replayed = segments_of(record)
    assert [len(s.new_routes) for s in replayed] == [3, 2]
    assert np.array_equal(merge_segments(replayed).new_routes, merged.new_routes)

    rows = [TrainingRow(segment=merged, score=1.0, advantages=np.ones(5, np.float32)),
            TrainingRow(segment=window(0, 2, [], None, finished=True), score=0.0, advantages=np.zeros(2, np.float32))]
    batch = TrainBatch(batch_id="b-0", rows=rows)
    assert np.array_equal(BATCH_CODEC.decode(BATCH_CODEC.encode(batch)).rows[0].segment.new_routes, merged.new_routes)
    checkpoint_parts.save_batches([batch], str(tmp_path / "batches.bin"))
    kept, held = checkpoint_parts.resumable_batches(checkpoint_parts.load_batches(str(tmp_path / "batches.bin")))
    assert held == {"p/0"} and np.array_equal(kept[0].rows[0].segment.new_routes, merged.new_routes)
    assert kept[0].rows[0].segment.new_routes.dtype == np.int16 and kept[0].rows[1].segment.new_routes is None


def teacher_forced_routes(model, prompt: list[int], response: list[int]) -> np.ndarray:
    """The route of each response token under `model`: the experts of the position it is scored at."""
    recorded = moe.Routes()
    prefill(llama_decoder.LlamaDecoder(model), torch.tensor([prompt + response]), recorded)
    return recorded.chosen[0, len(prompt) - 1:len(prompt) - 1 + len(response)].numpy()


def test_a_generators_sample_keeps_each_tokens_route_across_a_weight_update():
    """The real generator and engine on a Qwen3-MoE: a sample's first window is sampled under
    version 0, new router weights land, its second window under version 1. Merged, each token's
    route is the one its own weights chose (teacher-forced under each version), not the other's."""
    model = moe_model("qwen3_moe")
    old = copy.deepcopy(model)
    engine = TorchEngine(model, NO_EOS)
    prompts, segments = InProcessMailbox(10, lease_s=60), InProcessMailbox(100, lease_s=60)
    generator = Generator(engine, prompts, segments, SamplingParams(temperature=1.0), 4, 8, 0, 4)

    async def run() -> list[Segment]:
        await prompts.put([PromptRequest(prompt_id="q", prompt_token_ids=int32_array([20, 21, 22, 23]), group_size=2,
                                         seed=5)])
        await generator.step()
        engine.update_weights([(f"model.layers.{i}.mlp.gate.weight", -old.model.layers[i].mlp.gate.weight)
                               for i in range(2)], version=1)
        await generator.step()
        return await segments.get(100, timeout=0.1)

    got = asyncio.run(run())
    assert sorted((s.sample_idx, s.window) for s in got) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for idx in (0, 1):
        merged = merge_segments([s for s in got if s.sample_idx == idx])
        assert merged.new_versions.tolist() == [0] * 4 + [1] * 4
        assert merged.new_routes.dtype == np.uint8 and merged.new_routes.shape == (8, 2, 2)
        response = merged.new_token_ids.tolist()
        under_old = teacher_forced_routes(old, [20, 21, 22, 23], response)
        under_new = teacher_forced_routes(model, [20, 21, 22, 23], response)
        assert np.array_equal(merged.new_routes[:4], under_old[:4])
        assert np.array_equal(merged.new_routes[4:], under_new[4:])
        assert not np.array_equal(under_old[4:], under_new[4:])  # the versions route differently


def test_t_ppo_window_rows_carry_their_contexts_routes_through_the_assembler():
    """The real assembler with windows trained as they stream (T-PPO): the second window's row
    holds the first window's routes as its context's, the value learner is asked with each row's
    routes, and the critic's trajectory and the whole-response row carry the sample's."""
    from actors.assembler import Assembler
    from asyncrl.assembly.values import ValueEdges, ValueStrategy
    from asyncrl.config import GAEAdvantage, OverlongShaping
    from asyncrl.messages.structs import Reward

    first, second = routes_of(2, 6), routes_of(2, 7)
    windows = [window(0, 2, [], first), window(1, 2, [0, 1], second, finished=True)]
    asked = []

    async def values(rows, images=None):
        asked.extend(rows)
        return [np.zeros(len(row[1]) + 1, dtype=np.float32) for row in rows], 1

    async def ready():
        return True

    async def score(requests):
        return [Reward(prompt_id=r.prompt_id, sample_idx=r.sample_idx, score=1.0, correct=True, source="t")
                for r in requests]

    async def main():
        segments, batches, trajectories = InProcessMailbox(100), InProcessMailbox(100), InProcessMailbox(100)
        strategy = ValueStrategy(edges=ValueEdges(values=values, ready=ready, reference_logprobs=None),
                                 gae=GAEAdvantage(gamma=1.0, lam=1.0, window_training=True), window_tokens=2,
                                 rows_per_batch=1, nll_whole_response=True)
        assembler = Assembler(segments, batches, score, str, strategy, OverlongShaping(), 4,
                              trajectories=trajectories)
        for seg in windows:
            await segments.put([seg])
            for _ in range(3):
                await assembler.step(timeout=0.01)
                await asyncio.sleep(0.01)
        return await batches.get(100, timeout=0.05), await trajectories.get(100, timeout=0.05)

    batches, trajectories = asyncio.run(main())
    whole = np.concatenate([first, second])
    assert [len(row) for row in asked] == [3, 3]
    assert np.array_equal(asked[0][2], first) and np.array_equal(asked[1][2], whole)
    rows = [row for batch in batches for row in batch.rows]
    assert rows[0].segment.prior_routes is None and np.array_equal(rows[0].segment.new_routes, first)
    assert np.array_equal(response_routes(rows[1].segment), whole)  # the whole response, for the NLL
    assert np.array_equal(trajectories[0].segment.new_routes, whole)


def sglang_result(tokens: int, routes: np.ndarray | None, finish: str = "length") -> dict:
    """What SGLang's `async_generate` returns for a request (the fields the engine reads)."""
    import base64

    return {"output_ids": list(range(tokens)), "meta_info": {
        "id": "r", "output_token_logprobs": [[-1.0, t] for t in range(tokens)], "finish_reason": {"type": finish},
        "weight_versions": [{"version": "0", "start": 0, "end": tokens}],
        "routed_experts": None if routes is None else base64.b64encode(routes.astype(np.int32).tobytes()).decode()}}


def test_sglangs_routes_become_each_tokens_route_of_the_sparse_layers(tmp_path):
    """SGLang's routes (`--enable-return-routed-experts`: base64 int32 `[tokens, every layer, top_k]`
    from a request's last input token on) as the embedded engine records them
    (`asyncrl.engines.sglang_routes`): the layers transformers makes sparse, in order, uint8; each
    request of a window its own tokens'; a request back without them unrouted, a count that is not
    its tokens' refused. SGLang itself: tests/test_sglang_real.py."""
    from asyncrl.engines.server_engine import WindowTokens
    from asyncrl.engines.sglang_engine import take_output
    from asyncrl.engines.sglang_routes import RouteLayout, route_layout
    from test_engine_moe import MODELS

    for name, build in MODELS.items():  # a dense first layer, a dense second one, Mixtral's all sparse
        model = build()
        model.config.save_pretrained(tmp_path / name)
        layout = route_layout(str(tmp_path / name))
        assert layout.sparse == tuple(i for i, layer in enumerate(model.model.layers) if moe.is_sparse(layer))
        assert (layout.layers, layout.top_k, layout.dtype) == (2, 2, np.uint8)
    assert RouteLayout.request_fields(5) == {"return_routed_experts": True, "routed_experts_start_len": 4}
    layout = route_layout(str(tmp_path / "qwen3_moe_step2"))  # layer 0 dense, layer 1 sparse
    recorded = np.random.default_rng(0).integers(0, 8, size=(3, 2, 2))
    out = WindowTokens()
    take_output(out, sglang_result(3, recorded), 0, layout)
    take_output(out, sglang_result(2, None, "abort"), 0, layout)  # cut by an update, returned without them
    routes = joined_routes(out.routes)
    assert routes.dtype == np.uint8 and routes.shape == (5, 1, 2)
    assert routes[:3].tolist() == recorded[:, 1:].tolist() and (routes[3:] == UNROUTED[routes.dtype]).all()
    with pytest.raises(RuntimeError, match="3 tokens and 2 routes"):
        take_output(WindowTokens(), sglang_result(3, recorded[:2]), 0, layout)
