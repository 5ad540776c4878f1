"""Assembler invariants with in-process mailboxes: grouping, dedup, DAPO drops, staleness drops."""

import asyncio

import numpy as np

from actors.assembler import Assembler
from asyncrl.algo.advantages import group_normalised
from asyncrl.assembly.groups import GroupStrategy
from asyncrl.config import DynamicSampling, OverlongShaping
from asyncrl.messages.mailbox import InProcessMailbox
from asyncrl.messages.structs import FinishReason, Reward, Segment, float32_array, int32_array

SETTINGS = DynamicSampling(enabled=True)


def seg(prompt, idx, turn, finished, tokens, version=0, G=2):
    return Segment(prompt_id=prompt, sample_idx=idx, window=turn, group_id=prompt, group_size=G,
                   prompt_token_ids=int32_array([1, 2]), prior_response_ids=int32_array(tokens[:0]),
                   prior_versions=int32_array([]), new_token_ids=int32_array(tokens),
                   new_logprobs=float32_array([-0.5] * len(tokens)), new_versions=int32_array([version] * len(tokens)),
                   finished=finished, finish_reason=FinishReason.EOS if finished else FinishReason.WINDOW,
                   ground_truth="7", data_source="tiny")


def make(settings=SETTINGS, prompts_per_batch=1, store_trajectories=None):
    segments, batches = InProcessMailbox(100), InProcessMailbox(100)
    events = []  # ledger events (ids, state, reason)

    async def score(requests):
        # The response is correct iff its first token id is 7 (decoded as the token string).
        return [Reward(prompt_id=r.prompt_id, sample_idx=r.sample_idx, score=float(r.response_text.startswith("7")),
                       correct=r.response_text.startswith("7"), source="test") for r in requests]

    asm = Assembler(segments, batches, score, lambda ids: "".join(str(i) for i in ids),
                    GroupStrategy(settings, prompts_per_batch, group_normalised), OverlongShaping(), 8,
                    max_staleness_versions=2, events=lambda evs, outcomes: events.extend(evs),
                    store_trajectories=store_trajectories)
    return asm, segments, batches, events


async def drain(asm, batches):
    for _ in range(3):
        await asm.step(timeout=0.01)
        await asyncio.sleep(0.01)
    return await batches.get(10, timeout=0.05)


def test_multi_window_sample_is_merged_and_group_emitted_once():
    async def main():
        asm, segments, batches, dropped = make()
        # Sample 0 spans two windows; sample 1 one window; the second window is delivered twice.
        await segments.put([seg("p", 0, 0, False, [7, 3]), seg("p", 1, 0, True, [5])])
        await asm.step(timeout=0.01)
        await segments.put([seg("p", 0, 1, True, [4])])
        await asm.step(timeout=0.01)
        out = await drain(asm, batches)
        assert len(out) == 1 and len(out[0].rows) == 2
        merged = {s.segment.sample_idx: s for s in out[0].rows}
        assert merged[0].segment.new_token_ids.tolist() == [7, 3, 4]
        assert merged[0].advantages.tolist() == [np.float32(0.70710576)] * 3
        assert merged[1].advantages[0] < 0
        assert all(state != "dropped" for _, state, _ in dropped)

    asyncio.run(main())


def test_redelivered_segment_is_counted_once():
    async def main():
        asm, segments, batches, _ = make()
        first = seg("q", 0, 0, True, [7])
        await segments.put([first, seg("q", 1, 0, True, [1])])
        await asm.step(timeout=0.01)
        asm._ingest([first])  # a redelivery after the mailbox forgot it (e.g. a restarted generator)
        out = await drain(asm, batches)
        assert len(out) == 1 and len(out[0].rows) == 2
        assert asm.stats()["duplicate_segments"] == 1

    asyncio.run(main())


def test_dynamic_sampling_drops_and_stale_tokens_are_masked_as_the_batch_leaves():
    async def main():
        records = []  # what the trajectory store receives
        asm, segments, batches, dropped = make(store_trajectories=records.extend)
        await segments.put([seg("all-right", 0, 0, True, [7]), seg("all-right", 1, 0, True, [7])])
        await drain(asm, batches)
        asm.set_versions(5, 5)
        # Bound 2: sample 0 (version 2) is 3 behind, sample 1 (version 3) 2 behind. The group's
        # advantages use both outcomes; sample 0 has no token left to train and ends as stale.
        await segments.put([seg("part", 0, 0, True, [7], version=2), seg("part", 1, 0, True, [1], version=3)])
        out = await drain(asm, batches)
        assert len(out) == 1
        by_idx = {s.segment.sample_idx: s for s in out[0].rows}
        assert list(by_idx) == [1] and by_idx[1].loss_mask is None
        assert by_idx[1].advantages[0] < 0  # its sibling's outcome still sets it
        assert out[0].stats["staleness_max_assembled"] == 2 and out[0].stats["stale_tokens_masked_assembled"] == 1
        # Every token of the group too old: nothing left to train, nothing is sent.
        await segments.put([seg("stale", 0, 0, True, [7], version=1), seg("stale", 1, 0, True, [1], version=2)])
        assert await drain(asm, batches) == []
        drops = sorted((sid, reason) for ids, state, reason in dropped if state == "dropped" for sid in ids)
        assert drops == [("all-right/0", "no_signal"), ("all-right/1", "no_signal"), ("part/0", "stale"),
                         ("stale/0", "stale"), ("stale/1", "stale")]
        stats = asm.stats()
        assert stats["dropped_no_signal_samples"] == 2 and stats["dropped_stale_samples"] == 3
        # The store agrees with the ledger: kept by the group, then masked stale, is recorded as stale.
        await asm.step(timeout=0.01)
        recorded = sorted((f"{r.prompt_id}/{r.sample_idx}", r.status, r.drop_reason) for r in records)
        assert recorded == [("all-right/0", "dropped", "no_signal"), ("all-right/1", "dropped", "no_signal"),
                            ("part/0", "dropped", "stale"), ("part/1", "kept", ""),
                            ("stale/0", "dropped", "stale"), ("stale/1", "dropped", "stale")]

    asyncio.run(main())


def test_reward_to_go_is_length_safe():
    from asyncrl.assembly.rows import reward_to_go

    np.testing.assert_allclose(reward_to_go(np.array([0.0, 1.0, 0.5], dtype=np.float32), 3), [1.5, 1.5, 0.5])
    np.testing.assert_allclose(reward_to_go(np.array([1.0], dtype=np.float32), 3), [1.0, 0.0, 0.0])  # padded
    np.testing.assert_allclose(reward_to_go(np.array([1.0, 1.0, 1.0], dtype=np.float32), 2), [2.0, 1.0])  # cut


def test_a_group_with_a_failed_reward_is_dropped_not_trained_as_zero():
    async def main():
        asm, segments, batches, events = make()

        async def flaky(requests):  # sample 1 timed out at the endpoint
            return [Reward(prompt_id=r.prompt_id, sample_idx=r.sample_idx, score=0.0 if r.sample_idx else 1.0,
                           correct=not r.sample_idx, failed=bool(r.sample_idx), source="test") for r in requests]

        asm.score = flaky
        await segments.put([seg("f", 0, 0, True, [7]), seg("f", 1, 0, True, [1])])
        assert await drain(asm, batches) == []
        assert asm.stats()["dropped_reward_failed_samples"] == 2
        assert (["f/0", "f/1"], "dropped", "reward_failed") in [(sorted(i), s, r) for i, s, r in events]

    asyncio.run(main())


def window(prompt, idx, turn, finished, tokens, generator, G=2):
    """A window of one generator's copy of a sample (its earlier windows as context)."""
    import msgspec

    return msgspec.structs.replace(seg(prompt, idx, turn, finished, tokens, G=G), generator_id=generator)


def test_two_copies_of_a_sample_are_kept_as_one_never_mixed():
    """Issue 44 (2): a prompt whose lease ran out while g1 worked on it is generated by g2 too. The
    windows of both copies reach the assembler in any order; the first copy to finish is the
    sample, whole (never windows of one copy merged with the other's), once; the other is dropped."""
    async def main():
        asm, segments, batches, events = make()
        g1 = [window("p", 0, 0, False, [7, 3], "g1"), window("p", 0, 1, False, [4], "g1"),
              window("p", 0, 2, True, [5], "g1")]
        g2 = [window("p", 0, 0, False, [1, 1], "g2"), window("p", 0, 1, False, [1], "g2"),
              window("p", 0, 2, True, [1], "g2")]
        for part in ([g1[0]], [g2[0], g2[1]], [g1[1]], [g1[2], g2[2]], [window("p", 1, 0, True, [2], "g1")]):
            await segments.put(part)
            await asm.step(timeout=0.01)
        out = await drain(asm, batches)
        assert len(out) == 1 and len(out[0].rows) == 2
        merged = {s.segment.sample_idx: s.segment for s in out[0].rows}
        assert merged[0].new_token_ids.tolist() == [7, 3, 4, 5] and merged[0].generator_id == "g1"
        assert [ids for ids, state, _ in events if state == "awaiting_reward"].count(["p/0"]) == 1
        assert asm.stats()["copies_discarded"] == 1 and asm.stats()["partial_samples"] == 0

    asyncio.run(main())


def test_a_retired_generators_finished_samples_still_count():
    """Issue 44 (3): a generator that left the pool (healed or drained) may have finished samples
    of prompts it acknowledged, still on their way: nobody makes them again, so they are taken,
    and so is the rest of a sample it was sending when it was retired."""
    async def main():
        asm, segments, batches, events = make()
        await segments.put([window("r", 0, 0, False, [7], "g1")])
        await asm.step(timeout=0.01)
        assert asm.retire_generator("g1") == 1  # one partial copy left to finish (or be replaced)
        await segments.put([window("r", 0, 1, True, [7], "g1"), window("r", 1, 0, True, [3], "g1")])
        out = await drain(asm, batches)
        assert len(out) == 1 and sorted(s.segment.sample_id for s in out[0].rows) == ["r/0", "r/1"]
        assert {s.segment.sample_id: s.segment.new_token_ids.tolist() for s in out[0].rows}["r/0"] == [7, 7]
        kept = [sid for ids, state, _ in events if state == "awaiting_training" for sid in ids]
        assert sorted(kept) == ["r/0", "r/1"] and asm.stats()["partial_samples"] == 0

    asyncio.run(main())


def test_reinforce_plus_plus_advantages_are_whitened_over_the_batch_as_it_leaves():
    """Two prompts' groups make one batch: the 2-token correct response (outcome on its last token,
    returns [1, 1]), its 1-token wrong neighbour (returns [0]) and the other prompt's pair. The
    advantages are the returns whitened over every trained token of the batch, not per group:
    tokens [1, 1, 0, 1, 0] -> mean .6, unbiased std sqrt(1.2/4) = .547723."""
    import functools

    from asyncrl.algo.advantages import reinforce_plus_plus
    from asyncrl.assembly.groups import BatchReturnsStrategy

    async def main():
        segments, batches = InProcessMailbox(100), InProcessMailbox(100)

        async def score(requests):  # a response starting with token 7 is right
            return [Reward(prompt_id=r.prompt_id, sample_idx=r.sample_idx, score=float(r.response_text.startswith("7")),
                           correct=r.response_text.startswith("7"), source="test") for r in requests]

        strategy = BatchReturnsStrategy(DynamicSampling(enabled=False), 2,
                                        functools.partial(reinforce_plus_plus, gamma=1.0))
        asm = Assembler(segments, batches, score, lambda ids: "".join(str(i) for i in ids), strategy,
                        OverlongShaping(), 8)
        await segments.put([seg("a", 0, 0, True, [7, 3]), seg("a", 1, 0, True, [5]),
                            seg("b", 0, 0, True, [7]), seg("b", 1, 0, True, [4])])
        out = await drain(asm, batches)
        assert len(out) == 1 and len(out[0].rows) == 4
        rows = {(s.segment.prompt_id, s.segment.sample_idx): s.advantages.tolist() for s in out[0].rows}
        std = (1.2 / 4) ** 0.5
        np.testing.assert_allclose(rows["a", 0], [0.4 / std] * 2, rtol=1e-5)
        np.testing.assert_allclose(rows["a", 1] + rows["b", 1], [-0.6 / std] * 2, rtol=1e-5)
        np.testing.assert_allclose(rows["b", 0], [0.4 / std], rtol=1e-5)

    asyncio.run(main())
