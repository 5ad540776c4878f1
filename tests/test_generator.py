"""Generator with in-process mailboxes and the tiny engine: windows, continuations, identity, acks."""

import asyncio
import threading

import numpy as np

from actors.generator import Generator
from asyncrl.config import ModelConfig
from asyncrl.engines.base import SamplingParams
from asyncrl.engines.torch_engine import TorchEngine
from asyncrl.messages.mailbox import InProcessMailbox
from asyncrl.messages.structs import FinishReason, PromptRequest, int32_array
from asyncrl.models.loading import build_tiny_model, build_tiny_tokenizer
from asyncrl.weights.shared_memory import SharedSlots
from asyncrl.weights.sync import Delivery


def make_generator(window=3, max_tokens=8, max_windows=0, max_inflight=4):
    tok = build_tiny_tokenizer()
    engine = TorchEngine(build_tiny_model(ModelConfig(source="tiny", seed=1), len(tok)), eos_token_ids=[10_000])
    prompts, segments = InProcessMailbox(100, lease_s=60), InProcessMailbox(1000, lease_s=60)
    gen = Generator(engine, prompts, segments, SamplingParams(), window, max_tokens, max_windows, max_inflight)
    return gen, prompts, segments


def request(i, G=2):
    return PromptRequest(prompt_id=f"p{i}", prompt_token_ids=int32_array([5 + i, 6]), group_size=G, seed=100 * i)


def test_windows_continue_with_same_identity_until_max_length():
    async def main():
        gen, prompts, segments = make_generator(window=3, max_tokens=8)
        await prompts.put([request(0), request(1), request(2)])
        for _ in range(12):
            await gen.step()
        got = await segments.get(1000, timeout=0.1)
        by_sample = {}
        for seg in got:
            by_sample.setdefault(seg.sample_id, []).append(seg)
        assert len(by_sample) == 6  # 3 prompts x G=2, all finished
        for sample_id, segs in by_sample.items():
            segs.sort(key=lambda s: s.window)
            assert [s.window for s in segs] == [0, 1, 2]
            assert [len(s.new_token_ids) for s in segs] == [3, 3, 2]  # 8 = 3 + 3 + 2
            assert [s.finish_reason for s in segs] == [FinishReason.WINDOW, FinishReason.WINDOW, FinishReason.MAX_LENGTH]
            for k in (1, 2):  # a continuation carries the earlier windows as context, same identity
                assert segs[k].prior_response_ids.tolist() == np.concatenate([s.new_token_ids for s in segs[:k]]).tolist()
                assert (segs[k].prompt_id, segs[k].sample_idx, segs[k].group_id) == (segs[0].prompt_id, segs[0].sample_idx, segs[0].group_id)
                assert segs[k].prompt_token_ids.tolist() == segs[0].prompt_token_ids.tolist()
        # Every prompt acknowledged once all its samples finished: nothing left leased.
        stats = await prompts.stats()
        assert stats.acked_total == 3 and stats.leased == 0

    asyncio.run(main())


def test_continuations_have_priority_and_inflight_is_capped():
    async def main():
        gen, prompts, segments = make_generator(window=2, max_tokens=6, max_inflight=4)
        await prompts.put([request(i) for i in range(4)])
        await gen.step()  # admits 2 prompts (4 sequences), generates window 0
        assert len(gen.inflight) == 4 and gen.counters["prompts_admitted"] == 2
        await gen.step()  # full: no admission; the same 4 sequences continue
        assert gen.counters["prompts_admitted"] == 2
        assert all(s.window == 2 for s in gen.inflight)

    asyncio.run(main())


def test_prompts_taken_together_that_do_not_fit_go_back_to_the_mailbox():
    """Admission asks for as many prompts as the last group size says fit, in one call; a prompt
    of another size that does not fit goes back (nacked, first in line), with every one after it."""

    async def main():
        gen, prompts, _ = make_generator(max_inflight=4)
        await prompts.put([request(0, G=1), request(1, G=3), request(2, G=3), request(3, G=1)])
        await gen._admit()  # asks for 1 (no group size known), then for 3 (1 + 3 + 3 > 4)
        assert sorted(gen.samples_left) == ["p0", "p1"] and gen.held == 4
        stats = await prompts.stats()
        assert stats.leased == 2 and stats.queued == 2
        assert [r.prompt_id for r in await prompts.get(5, timeout=0.1)] == ["p2", "p3"]  # order kept

    asyncio.run(main())


def test_a_prompt_leased_again_by_the_generator_that_holds_it_is_not_started_twice():
    """Issue 44 (2): a prompt whose lease ran out came back to the generator still working on it:
    it keeps its sequences and counts (the count of samples left was overwritten, and the generator
    died on a KeyError when the second copy finished), and acknowledges the prompt once."""

    async def main():
        gen, prompts, segments = make_generator(window=2, max_tokens=6, max_inflight=4)
        prompts._core.lease_s = 0.05
        await prompts.put([request(0)])
        await gen.step()  # p0's two samples: first window
        await asyncio.sleep(0.1)  # the lease runs out (no renewal: no run loop here)
        await gen._admit()  # the mailbox hands p0 back to the same generator
        assert gen.counters["prompts_held_again"] == 1 and gen.held == 2 and gen.samples_left == {"p0": 2}
        prompts._core.lease_s = 60
        for _ in range(4):
            await gen.step()
        finished = [s for s in await segments.get(1000, timeout=0.1) if s.finished]
        assert sorted(s.sample_id for s in finished) == ["p0/0", "p0/1"] and gen.samples_left == {}
        stats = await prompts.stats()
        assert stats.acked_total == 1 and stats.leased == 0 and stats.queued == 0

    asyncio.run(main())


def test_the_run_loop_renews_the_leases_of_the_prompts_it_works_on():
    """A window longer than the prompt's lease (here a hung one): the lease is renewed beside it,
    so the prompt is never delivered again while the generator works on it."""

    async def main():
        gen, prompts, segments = make_generator(window=2, max_tokens=4, max_inflight=4)
        prompts._core.lease_s = 0.4
        gen.renew_every_s = 0.1
        await prompts.put([request(0)])
        gen.engine_calls.inject(window_hang_s=1.5)  # each window takes 1.5 s: almost four leases
        loop = asyncio.ensure_future(gen.run())
        await asyncio.sleep(1.0)
        assert await prompts.get(5, timeout=0.5, consumer="other") == []  # still leased to gen-0
        assert gen.stats()["engine_call_s"] > 0.5  # the window's age, what the pool's liveness reads
        gen.engine_calls.inject(window_hang_s=0.0)
        while gen.samples_left or not gen.counters["samples_finished"]:
            await asyncio.sleep(0.05)
        gen.stop()
        await asyncio.wait_for(loop, 10.0)
        stats = await prompts.stats()
        assert gen.counters["leases_renewed"] >= 3 and stats.redelivered_total == 0 and stats.acked_total == 1

    asyncio.run(main())


def test_a_generator_drained_while_it_holds_sequences_finishes_them_and_its_loop_ends():
    """drain() while the run loop holds sequences: they finish, every sample is sent and every
    prompt acknowledged, nothing is handed back, and the loop ends. (A drained loop with nothing
    left to run once spun without yielding and starved drain() itself: under load each scale-down
    hung until the pool's timeout.) In a thread, so a starved event loop fails the test, not the suite."""
    seen = {}

    async def main():
        gen, prompts, segments = make_generator(window=3, max_tokens=24, max_inflight=4)
        await prompts.put([request(0), request(1)])
        loop = asyncio.ensure_future(gen.run())
        while not gen.held:
            await asyncio.sleep(0.001)
        seen["held_at_drain"] = gen.held
        seen["drained"] = await gen.drain(30.0)
        seen["loop_done_at_return"] = loop.done()  # its last segments were sent before drain() returned
        await asyncio.wait_for(loop, 10.0)
        seen["finished"] = {s.sample_id for s in await segments.get(1000, timeout=0.1) if s.finished}
        seen["prompts"] = await prompts.stats()

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), f"drain() did not return: {seen}"
    assert seen["held_at_drain"] == 4 and seen["drained"]["prompts_handed_back"] == 0 and seen["loop_done_at_return"]
    assert len(seen["finished"]) == 4  # 2 prompts x G=2, each finished once
    assert seen["prompts"].acked_total == 2 and seen["prompts"].leased == 0


def test_an_idle_generator_loads_a_delivered_version_at_once():
    """A generator waiting for prompts loads a version delivered to it at once, not when its wait
    ends: the prompts it waits for are admitted only once every generator holds the newest version
    (the admission budget), so holding the version until a prompt came stalled the run (the tiny
    task waited for the end of each 0.2 s wait). The next window runs on the loaded version."""
    seen = {}

    async def main():
        gen, prompts, segments = make_generator(window=3, max_tokens=6)
        gen.idle_wait_s = 600.0  # its wait for a prompt outlasts the test
        loop = asyncio.ensure_future(gen.run())
        while not gen._running:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)  # in its wait for a prompt
        version = gen.engine.weight_version + 1
        newer = build_tiny_model(ModelConfig(source="tiny", seed=2), len(build_tiny_tokenizer()))
        slots = SharedSlots()
        delivery = gen.receive_weights(Delivery(version, "shm"), slots.write(newer.named_parameters()))
        try:
            await asyncio.wait_for(delivery, 30.0)
        except asyncio.TimeoutError:
            seen["timed_out"] = True
        finally:
            slots.close()
        seen["version"] = (gen.engine.weight_version, version)
        seen["waits_ended"] = gen.timing["wait_prompts_s"]  # 0 while the first wait has not ended
        await prompts.put([request(0)])
        got = await segments.get(10, timeout=30.0)
        seen["token_versions"] = {int(v) for seg in got for v in seg.new_versions}
        loop.cancel()

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive() and "timed_out" not in seen, f"the version was not loaded while idle: {seen}"
    version = seen["version"][1]
    assert seen["version"] == (version, version) and seen["waits_ended"] == 0.0
    assert seen["token_versions"] == {version}


def test_max_windows_finishes_a_response():
    async def main():
        gen, prompts, segments = make_generator(window=2, max_tokens=100, max_windows=2)
        await prompts.put([request(0, G=1)])
        for _ in range(3):
            await gen.step()
        got = sorted(await segments.get(100, timeout=0.1), key=lambda s: s.window)
        assert [s.window for s in got] == [0, 1]
        assert got[-1].finished and got[-1].finish_reason is FinishReason.MAX_LENGTH
        assert sum(len(s.new_token_ids) for s in got) == 4

    asyncio.run(main())


def test_long_windows_respect_the_response_budget():
    async def main():
        gen, prompts, segments = make_generator(window=32, max_tokens=64, max_windows=2, max_inflight=16)
        await prompts.put([request(i, G=4) for i in range(8)])
        for _ in range(12):
            await gen.step()
        got = await segments.get(10_000, timeout=0.1)
        lengths = {}
        for seg in got:
            lengths[seg.sample_id] = lengths.get(seg.sample_id, 0) + len(seg.new_token_ids)
            assert len(seg.prior_response_ids) + len(seg.new_token_ids) <= 64
        assert len(lengths) == 32 and max(lengths.values()) == 64

    asyncio.run(main())


def test_generator_to_assembler_merges_whole_responses():
    from actors.assembler import Assembler
    from asyncrl.algo.advantages import group_normalised
    from asyncrl.assembly.groups import GroupStrategy
    from asyncrl.config import DynamicSampling, OverlongShaping
    from asyncrl.messages.structs import Reward

    async def main():
        gen, prompts, segments = make_generator(window=32, max_tokens=64, max_windows=2, max_inflight=16)
        batches = InProcessMailbox(100)

        async def score(requests):
            return [Reward(prompt_id=r.prompt_id, sample_idx=r.sample_idx, score=float(r.sample_idx % 2),
                           correct=bool(r.sample_idx % 2), source="test") for r in requests]

        asm = Assembler(segments, batches, score, lambda ids: str(ids),
                        GroupStrategy(DynamicSampling(enabled=True), 2, group_normalised), OverlongShaping(), 64,
                        max_staleness_versions=4)
        await prompts.put([request(i, G=4) for i in range(8)])
        for _ in range(12):
            await gen.step()
            await asm.step(timeout=0.01)
        await asyncio.sleep(0.05)
        out = await batches.get(100, timeout=0.1)
        assert len(out) == 4
        for batch in out:
            assert all(len(s.segment.new_token_ids) == 64 for s in batch.rows)

    asyncio.run(main())
