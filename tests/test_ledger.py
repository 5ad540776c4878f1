"""The sample ledger, bounded id sets, and the checkpoint files (atomic commit, checksums, retention)."""

import os

import numpy as np
import pytest

from asyncrl.messages.mailbox import RecentIds
from asyncrl.messages.structs import FinishReason, PromptRequest, Segment, TrainBatch, TrainingRow
from asyncrl.storage import checkpoint, checkpoint_parts
from asyncrl.storage.ledger import SampleLedger


def request(prompt_id: str, group_size: int = 3) -> PromptRequest:
    return PromptRequest(prompt_id=prompt_id, prompt_token_ids=np.array([5, 6], dtype=np.int32),
                         group_size=group_size, seed=11)


def test_ledger_states_move_forward_only_and_balance():
    ledger = SampleLedger()
    ids = ledger.admit(request("p@0"))
    assert ids == ["p@0/0", "p@0/1", "p@0/2"]
    assert ledger.advance(["p@0/0", "p@0/1"], "awaiting_training") == 2
    # An earlier state arriving late (events come from different actors) does not move it back.
    assert ledger.advance(["p@0/0"], "awaiting_reward") == 0
    assert ledger.state("p@0/0") == "awaiting_training"
    ledger.advance(["p@0/0"], "trained")
    ledger.advance(["p@0/2"], "dropped", "stale")
    counts = ledger.state_counts()
    assert counts["admitted"] == 3 and counts["trained"] == 1 and counts["dropped"] == 1
    assert counts["awaiting_training"] == 1 and counts["in_flight"] == 0
    assert counts["dropped_by_reason"] == {"stale": 1}
    assert ledger.check() == []


def test_ledger_catches_a_sample_trained_twice_and_unknown_ids():
    ledger = SampleLedger()
    ledger.admit(request("p@0", 1))
    ledger.advance(["p@0/0"], "trained")
    ledger.advance(["p@0/0"], "trained")
    ledger.advance(["nobody/0"], "trained")
    problems = ledger.check()
    assert any("trained twice" in p for p in problems) and any("never admitted" in p for p in problems)
    with pytest.raises(ValueError, match="admitted twice"):
        ledger.admit(request("p@0", 1))
    with pytest.raises(ValueError, match="reason"):
        ledger.advance(["p@0/0"], "dropped")


def test_ledger_memory_is_bounded():
    ledger = SampleLedger(ended_window=4)
    for i in range(10):
        ledger.admit(request(f"p{i}", 1))
        ledger.advance([f"p{i}/0"], "trained")
    assert len(ledger.trained_ids()) == 4 and ledger.state_counts()["trained"] == 10
    assert ledger.snapshot().requests == []  # a prompt's request is dropped once its samples ended
    assert ledger.check() == []


def test_restore_reissues_exactly_the_lost_samples():
    ledger = SampleLedger()
    ledger.admit(request("a", 3))  # a/0 trained, a/1 in a saved batch, a/2 lost with a generator
    ledger.admit(request("b", 2))  # both lost in the assembler
    ledger.admit(request("c", 2))  # ended
    ledger.advance(["a/0"], "trained")
    ledger.advance(["a/1", "b/0"], "awaiting_training")
    ledger.advance(["c/0", "c/1"], "dropped", "no_signal")
    restored, again = SampleLedger.restore(ledger.snapshot(), held={"a/1"})
    by_id = {r.prompt_id: r for r in again}
    assert set(by_id) == {"a", "b"}
    assert by_id["a"].sample_indices == (2,) and by_id["a"].samples == (2,) and by_id["a"].seed == 11
    assert by_id["b"].sample_indices == () and by_id["b"].samples == (0, 1)  # the whole group
    assert restored.state("a/1") == "awaiting_training" and restored.state("b/0") == "in_flight"
    assert restored.state("a/0") == "trained" and restored.state("c/0") == "dropped"
    c = restored.state_counts()
    assert c["admitted"] == 7 and c["readmitted"] == 3 and restored.check() == []
    restored.advance(["a/0"], "trained")  # trained before the checkpoint: a duplicate
    assert restored.state_counts()["duplicates"] == 1


def test_prompt_request_sample_indices_are_validated():
    with pytest.raises(ValueError, match="sample_indices"):
        PromptRequest(prompt_id="x", prompt_token_ids=np.array([1], dtype=np.int32), group_size=2,
                      sample_indices=(2,))


def test_recent_ids_keeps_the_newest():
    ids = RecentIds(window=2)
    for x in "abc":
        ids.add(x)
    assert "a" not in ids and "b" in ids and "c" in ids and len(ids) == 2


# --- checkpoint files ----------------------------------------------------------------------------


def write_checkpoint(run_dir, step: int, payload: bytes = b"x" * 100, keep: int = 2) -> str:
    tmp = checkpoint.begin(str(run_dir), step)
    os.makedirs(os.path.join(tmp, "policy"))
    with open(os.path.join(tmp, "policy", "model.safetensors"), "wb") as f:
        f.write(payload)
    checkpoint_parts.save_json({"step": step}, os.path.join(tmp, "learner.json"))
    return checkpoint.commit(tmp, step, keep)


def test_commit_is_atomic_and_keeps_the_last_k(tmp_path):
    for step in (3, 6, 9):
        write_checkpoint(tmp_path, step)
    root = checkpoint.checkpoints_dir(str(tmp_path))
    assert [s for s, _ in checkpoint.committed(root)] == [6, 9]
    assert not [n for n in os.listdir(root) if n.endswith(".tmp")]
    # An interrupted write (no rename) is never taken for a checkpoint.
    tmp = checkpoint.begin(str(tmp_path), 12)
    with open(os.path.join(tmp, "learner.json"), "w") as f:
        f.write("{")
    path, rejected = checkpoint.latest_valid(str(tmp_path))
    assert path.endswith("step_00000009") and rejected == []


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest"])
def test_a_corrupt_checkpoint_falls_back_to_the_previous(tmp_path, damage):
    write_checkpoint(tmp_path, 3)
    newest = write_checkpoint(tmp_path, 6)
    target = os.path.join(newest, "policy", "model.safetensors")
    if damage == "flip":
        data = bytearray(open(target, "rb").read())
        data[10] ^= 0xFF
        open(target, "wb").write(bytes(data))
    elif damage == "truncate":
        os.truncate(target, 50)
    elif damage == "delete":
        os.remove(target)
    else:
        open(os.path.join(newest, checkpoint.MANIFEST), "w").write("{not json")
    path, rejected = checkpoint.latest_valid(str(tmp_path))
    assert path.endswith("step_00000003")
    assert len(rejected) == 1 and "step_00000006" in rejected[0]


def test_resume_of_a_run_without_a_checkpoint_names_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="no run under"):
        checkpoint.resolve_run_dir("", resume=True, outputs=str(tmp_path))
    write_checkpoint(tmp_path / "run-a", 3)
    assert checkpoint.resolve_run_dir("", resume=True, outputs=str(tmp_path)).endswith("run-a")


def test_the_serve_train_app_continues_its_own_run_by_default(tmp_path, monkeypatch):
    """Issue 44 (4): a Serve controller that was replaced (a failed health check) started a new
    run from the base model in a new timestamped directory. Now its directory is the same at every
    start and it resumes from the newest checkpoint there; `serve.resume_run=false` is the old way."""
    from asyncrl.config import compose
    from asyncrl.serve.train import serve_run

    monkeypatch.chdir(tmp_path)
    config = compose(["model=tiny", "task=tiny"])
    run_dir, fresh = serve_run(config, "train")
    assert run_dir == os.path.join("outputs", "serve-train") and not fresh.resume  # nothing to resume yet
    write_checkpoint(tmp_path / run_dir, 3)
    again, resumed = serve_run(config, "train")
    assert again == run_dir and resumed.resume
    given = compose(["model=tiny", "task=tiny", f"trainer.run_dir={tmp_path / 'mine'}"])
    assert serve_run(given, "train")[1].resume is False  # no checkpoint there
    off = compose(["model=tiny", "task=tiny", "serve.resume_run=false"])
    new_dir, config_off = serve_run(off, "train")
    assert new_dir.startswith(os.path.join("outputs", "serve-2")) and not config_off.resume


def _row(sample: str, turn: int, finished: bool) -> TrainingRow:
    prompt_id, idx = sample.split("/")
    seg = Segment(prompt_id=prompt_id, sample_idx=int(idx), window=turn, group_id=prompt_id,
                  prompt_token_ids=np.array([1], dtype=np.int32), prior_response_ids=np.zeros(0, dtype=np.int32),
                  prior_versions=np.zeros(0, dtype=np.int32), new_token_ids=np.array([3], dtype=np.int32),
                  new_logprobs=np.array([-1.0], dtype=np.float32), new_versions=np.array([0], dtype=np.int32),
                  finished=finished, group_size=2,
                  finish_reason=FinishReason.EOS if finished else FinishReason.WINDOW)
    return TrainingRow(segment=seg, score=1.0, advantages=np.array([0.5], dtype=np.float32))


def test_saved_batches_keep_only_samples_that_end_in_them(tmp_path):
    batches = [TrainBatch(batch_id="b1", rows=[_row("p/0", 0, False), _row("p/1", 0, False)]),
               TrainBatch(batch_id="b2", rows=[_row("p/0", 1, True)])]
    path = str(tmp_path / "batches.msgpack")
    checkpoint_parts.save_batches(batches, path)
    kept, held = checkpoint_parts.resumable_batches(checkpoint_parts.load_batches(path))
    assert held == {"p/0"}
    # p/1's first window goes: p/1 is regenerated whole, and its old window must not train too.
    assert [[(r.segment.sample_id, r.segment.window) for r in b.rows] for b in kept] == [[("p/0", 0)], [("p/0", 1)]]


def test_tied_weights_are_stored_once_and_reload_equal(tmp_path, capfd):
    """A policy whose output embedding is its input embedding (SmolLM2's) stores that matrix once,
    also from the learner's gathered weights (a copy per name), and loads back equal and tied. An
    older checkpoint that stored it twice is exported with it once."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from asyncrl.models.loading import build_tiny_tokenizer
    from asyncrl.weights.sharding import full_weights

    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                                         tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    unique_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # each tensor once
    weights = full_weights(model, None)  # what the policy learner saves: separate copies
    assert weights["lm_head.weight"].data_ptr() != weights["model.embed_tokens.weight"].data_ptr()

    def stored(directory):
        with safe_open(os.path.join(directory, "model.safetensors"), "pt") as f:
            return set(f.keys())

    policy = str(tmp_path / "policy")
    checkpoint_parts.save_policy(model, tokenizer, policy, state_dict=weights)
    # Quietly: a progress bar per checkpoint was most of a long run's log; bars elsewhere stay on.
    assert "Writing model shards" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()
    assert "lm_head.weight" not in stored(policy) and "model.embed_tokens.weight" in stored(policy)
    assert os.path.getsize(os.path.join(policy, "model.safetensors")) < unique_bytes + 64 * 1024  # + the header

    def assert_reloads_equal(directory):
        loaded = AutoModelForCausalLM.from_pretrained(directory)
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
        for name, tensor in model.state_dict().items():
            assert torch.equal(loaded.state_dict()[name], tensor), name

    assert_reloads_equal(policy)
    fresh = LlamaForCausalLM(model.config)
    checkpoint_parts.load_policy_weights(fresh, policy)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))

    # A checkpoint written the old way (copies passed as they were): exported with the tie stored once.
    old = tmp_path / "old"
    model.save_pretrained(old / "policy", state_dict=weights)
    tokenizer.save_pretrained(old / "policy")
    assert "lm_head.weight" in stored(old / "policy")
    out = checkpoint_parts.export_hf(str(old / "policy"), str(tmp_path / "hf"))
    assert "lm_head.weight" not in stored(out) and os.path.exists(os.path.join(out, "tokenizer.json"))
    assert_reloads_equal(out)
    # A policy stored right is copied as it is.
    assert checkpoint_parts.export_hf(policy, str(tmp_path / "hf2")) and stored(tmp_path / "hf2") == stored(policy)
