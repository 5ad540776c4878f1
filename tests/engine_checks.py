"""What the engine family tests share (dense and mixture-of-experts): the prompts, the sequences
and a teacher-forced transformers pass to hold the engine's log-probs to."""

import torch

from asyncrl.algo.sampling import filtered_logprobs
from asyncrl.engines.base import SequenceInput
from asyncrl.messages.structs import int32_array

NO_EOS = (10_000,)  # outside the vocabulary: never sampled, every window full
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [4], [20, 21, 22, 23, 24, 25, 26, 27, 28]]


def seq(i, response=(), keyed=False):
    return SequenceInput(prompt_ids=int32_array(PROMPTS[i]), response_ids=int32_array(list(response)), seed=10 + i,
                         max_response_tokens=64, key=f"s{i}" if keyed else None)


def teacher_forced(model, prompt, response, params):
    """log π(response | prompt) of transformers' own forward, token by token, under `params`."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    lp = filtered_logprobs(logits[len(prompt) - 1:-1], params.temperature, params.top_k, params.top_p)
    return lp.gather(-1, torch.tensor(response)[:, None]).squeeze(-1).numpy()


def assert_kept_kv_equals_reprefill(model) -> None:
    """Rows join and leave across three windows; with KV kept, the same tokens and log-probs as
    an engine that re-reads every context (and it did keep them)."""
    import numpy as np

    from asyncrl.engines.base import SamplingParams
    from asyncrl.engines.torch_engine import TorchEngine
    from asyncrl.messages.structs import FinishReason

    cached, fresh = TorchEngine(model, NO_EOS), TorchEngine(model, NO_EOS)
    got = {e: ({i: [] for i in range(5)}, {i: [] for i in range(5)}) for e in ("cached", "fresh")}
    for window in ([0, 1, 2], [0, 1, 2, 3, 4], [0, 2, 3, 4]):
        for name, engine, keyed in (("cached", cached, True), ("fresh", fresh, False)):
            tokens, logprobs = got[name]
            outs = engine.generate_window_sync([seq(i, tokens[i], keyed) for i in window], 5, SamplingParams())
            for i, out in zip(window, outs):
                assert out.finish_reason is FinishReason.WINDOW
                tokens[i] += out.token_ids.tolist()
                logprobs[i] += out.logprobs.tolist()
    assert got["cached"][0] == got["fresh"][0]
    for i in range(5):
        np.testing.assert_allclose(got["cached"][1][i], got["fresh"][1][i], atol=1e-5)
    assert cached.kept.stats["reused"] == 3 + 4 and fresh.kept.stats["reused"] == 0


def assert_own_forward_matches_transformers(model, params) -> None:
    """fp32: the bound of the Llama path (`tests/test_engine.py`): 1e-4 nats from a teacher-forced
    pass, and the same tokens and log-probs (1e-5) as the engine on transformers' forward."""
    import numpy as np

    from asyncrl.engines.torch_engine import TorchEngine

    own, padded = TorchEngine(model, NO_EOS), TorchEngine(model, NO_EOS)
    assert own.decoder is not None
    padded.decoder = None
    outs = own.generate_window_sync([seq(i) for i in range(5)], 12, params)
    theirs = padded.generate_window_sync([seq(i) for i in range(5)], 12, params)
    for i, (out, other) in enumerate(zip(outs, theirs)):
        np.testing.assert_allclose(out.logprobs, teacher_forced(model, PROMPTS[i], out.token_ids.tolist(), params),
                                   atol=1e-4)
        assert out.token_ids.tolist() == other.token_ids.tolist()
        np.testing.assert_allclose(out.logprobs, other.logprobs, atol=1e-5)
