"""Encode+decode throughput of a `Segment`: msgspec codec against pickle, paired rounds."""

from __future__ import annotations

import pickle

import numpy as np

from asyncrl.bench.common import make_segment, paired, time_per_call
from asyncrl.messages.structs import Codec, Segment


def run(quick: bool = False, overrides: list[str] | None = None) -> dict:
    """The codec alone, then segments through mailboxes (in-process and across Ray)."""
    from asyncrl.bench import mailbox

    return {"codec": run_codec(quick=quick), "mailbox": mailbox.run(quick=quick)}


def report(result: dict) -> str:
    from asyncrl.bench import mailbox

    return report_codec(result["codec"]) + "\n\n" + mailbox.report(result["mailbox"])


def run_codec(quick: bool = False, tokens: tuple[int, ...] = (256, 4096, 8192)) -> dict:
    codec = Codec(Segment)
    rounds = 3 if quick else 9
    seconds = 0.05 if quick else 0.25
    results = {}
    for n in tokens:
        seg = make_segment(n)
        data = codec.encode(seg)
        pickled = pickle.dumps(seg, protocol=5)
        assert np.array_equal(codec.decode(data).new_token_ids, seg.new_token_ids)

        def msgspec_rt():
            return time_per_call(lambda: codec.decode(codec.encode(seg)), seconds)

        def pickle_rt():
            return time_per_call(lambda: pickle.loads(pickle.dumps(seg, protocol=5)), seconds)

        pair = paired(msgspec_rt, pickle_rt, rounds)
        results[f"{n}_tokens"] = {
            "msgspec_bytes": len(data),
            "pickle_bytes": len(pickled),
            "msgspec_roundtrip_us": pair["a_median"] * 1e6,
            "pickle_roundtrip_us": pair["b_median"] * 1e6,
            "msgspec_segments_per_s": 1 / pair["a_median"],
            "msgspec_MB_per_s": len(data) / pair["a_median"] / 1e6,
            "pickle_over_msgspec_time_ratio": pair["ratio_b_over_a_median"],
            "rounds": rounds,
        }
    return results


def report_codec(results: dict) -> str:
    lines = ["| segment | msgspec bytes | pickle bytes | msgspec enc+dec | pickle enc+dec | pickle/msgspec |",
             "|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(
            f"| {name.replace('_', ' ')} | {r['msgspec_bytes']} | {r['pickle_bytes']} | "
            f"{r['msgspec_roundtrip_us']:.1f} µs ({r['msgspec_MB_per_s']:.0f} MB/s) | "
            f"{r['pickle_roundtrip_us']:.1f} µs | {r['pickle_over_msgspec_time_ratio']:.2f}x |"
        )
    return "\n".join(lines)
