import msgspec
import numpy as np
import pytest

from asyncrl.messages.structs import (
                                      Codec,
                                      FinishReason,
                                      PromptRequest,
                                      Reward,
                                      Segment,
                                      TrainBatch,
                                      TrainingRow,
                                      float32_array,
                                      int32_array,
                                      )


def make_segment(n_new=5, n_prior=3, finished=False, window=1) -> Segment:
    rng = np.random.default_rng(0)
    return Segment(
        prompt_id="p7",
        sample_idx=2,
        window=window,
        group_id="p7",
        prompt_token_ids=int32_array(rng.integers(0, 50000, 11)),
        prior_response_ids=int32_array(rng.integers(0, 50000, n_prior)),
        prior_versions=int32_array([3] * n_prior),
        new_token_ids=int32_array(rng.integers(0, 50000, n_new)),
        new_logprobs=float32_array(-rng.random(n_new)),
        new_versions=int32_array([4] * n_new),
        finished=finished,
        finish_reason=FinishReason.EOS if finished else FinishReason.WINDOW,
        data_source="tiny",
        ground_truth="42",
        group_size=4,
    )


def assert_segments_equal(a: Segment, b: Segment):
    for field in a.__struct_fields__:
        x, y = getattr(a, field), getattr(b, field)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), field
        else:
            assert x == y, field


def test_segment_round_trip_is_exact():
    codec = Codec(Segment)
    seg = make_segment(n_new=4096)
    back = codec.decode(codec.encode(seg))
    assert_segments_equal(seg, back)
    assert back.msg_id == "p7/2/1@"  # (prompt/sample/turn, per generator: this one names none)
    assert np.array_equal(back.response_ids, np.concatenate([seg.prior_response_ids, seg.new_token_ids]))
    # Float bits survive exactly (no text round trip).
    assert back.new_logprobs.tobytes() == seg.new_logprobs.tobytes()


def test_arrays_are_compact_on_the_wire():
    seg = make_segment(n_new=4096, n_prior=0)
    size = len(Codec(Segment).encode(seg))
    # 4096 * (4 id + 4 logprob + 4 version) bytes plus small overhead.
    assert size < 4096 * 12 + 600


def test_other_messages_round_trip():
    prompt = PromptRequest(prompt_id="p1", prompt_token_ids=int32_array([1, 2, 3]), group_size=8)
    assert Codec(PromptRequest).decode(Codec(PromptRequest).encode(prompt)).group_size == 8
    reward = Reward(
        prompt_id="p1", sample_idx=0, score=1.0, source="math", token_rewards=float32_array([0, 0.5]),
        details={"pred": "7"},
    )
    back = Codec(Reward).decode(Codec(Reward).encode(reward))
    assert back.score == 1.0 and back.details == {"pred": "7"}
    assert np.array_equal(back.token_rewards, reward.token_rewards)
    seg = make_segment()
    batch = TrainBatch(
        batch_id="b0",
        rows=[TrainingRow(segment=seg, score=1.0, advantages=float32_array(np.ones(5)))],
    )
    back_batch = Codec(TrainBatch).decode(Codec(TrainBatch).encode(batch))
    assert_segments_equal(back_batch.rows[0].segment, seg)


def test_construction_validates_lengths_and_dtypes():
    with pytest.raises(ValueError, match="new_logprobs"):
        Segment(**{**_fields(make_segment()), "new_logprobs": float32_array([0.0])})
    with pytest.raises(TypeError, match="new_token_ids"):
        Segment(**{**_fields(make_segment()), "new_token_ids": np.arange(5, dtype=np.int64)})
    with pytest.raises(ValueError, match="finish_reason"):
        Segment(**{**_fields(make_segment()), "finished": True})


def _fields(seg):
    return {f: getattr(seg, f) for f in seg.__struct_fields__}


def test_malformed_bytes_raise_errors_naming_the_field():
    codec = Codec(Segment)
    good = msgspec.msgpack.decode(codec.encode(make_segment()), ext_hook=lambda c, d: msgspec.msgpack.Ext(c, bytes(d)))
    # A wrong type in one field.
    bad = dict(good, turn="one")
    with pytest.raises(msgspec.ValidationError, match="turn"):
        codec.decode(msgspec.msgpack.encode(bad))
    # A missing field.
    missing = {k: v for k, v in good.items() if k != "group_id"}
    with pytest.raises(msgspec.ValidationError, match="group_id"):
        codec.decode(msgspec.msgpack.encode(missing))
    # Arrays of inconsistent length are caught on decode, naming the field.
    short = dict(good, new_versions=good["prior_versions"])
    with pytest.raises(msgspec.ValidationError, match="new_versions"):
        codec.decode(msgspec.msgpack.encode(short))
    # A list of floats where a packed array belongs.
    as_list = dict(good, new_logprobs=[0.1, 0.2])
    with pytest.raises(msgspec.ValidationError, match="new_logprobs"):
        codec.decode(msgspec.msgpack.encode(as_list))
    # Truncated bytes and garbage.
    data = codec.encode(make_segment())
    with pytest.raises(msgspec.DecodeError):
        codec.decode(data[: len(data) // 2])
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        codec.decode(b"\xc1\x00garbage")


def test_corrupt_array_payload_is_a_decode_error():
    codec = Codec(Segment)
    good = msgspec.msgpack.decode(codec.encode(make_segment()), ext_hook=lambda c, d: msgspec.msgpack.Ext(c, bytes(d)))
    ext = good["new_token_ids"]
    good["new_token_ids"] = msgspec.msgpack.Ext(ext.code, ext.data[:-2])
    with pytest.raises(msgspec.DecodeError, match="payload"):
        codec.decode(msgspec.msgpack.encode(good))
    good["new_token_ids"] = msgspec.msgpack.Ext(99, ext.data)
    with pytest.raises(msgspec.DecodeError, match="extension code 99"):
        codec.decode(msgspec.msgpack.encode(good))
