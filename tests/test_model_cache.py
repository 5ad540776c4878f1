"""The embedded GGUF model read once into asyncrl's cache as a Hugging Face directory: the same
weights and tokenizer as the GGUF file itself, a fallback to the file when the cache cannot be
written, and one whole directory when several processes write it at once."""

import logging
import os
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.config import compose
from asyncrl.models.loading import cache_root, cached_directory, embedded_gguf_dir, gguf_location


@pytest.mark.slow
def test_the_cached_directory_holds_the_gguf_files_weights_and_tokenizer_bit_for_bit(embedded_policy):
    """`embedded_policy` was loaded through the cache; the GGUF file read directly gives the same
    tensors, token ids, special tokens and chat template."""
    model_config = compose([]).model
    directory, direct = gguf_location(model_config)
    assert direct == {} and directory.startswith(cache_root("gguf"))
    cached_model, cached_tokenizer = embedded_policy
    gguf = {"gguf_file": model_config.gguf_file}
    tokenizer = AutoTokenizer.from_pretrained(embedded_gguf_dir(), **gguf)
    model = AutoModelForCausalLM.from_pretrained(embedded_gguf_dir(), dtype=torch.float32, **gguf)
    assert cached_model.state_dict().keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, cached_model.state_dict()[name]), name
    assert cached_model.config.eos_token_id == model.config.eos_token_id
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12+30? Ünïcödé ✓"}]
    for text in ("12 + 30 = 42\n\n  tabs\tand spaces", "<|im_start|>user\nhi<|im_end|>", "日本語 and émojis 🙂"):
        assert cached_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"], text
    assert (cached_tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            == tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    assert (cached_tokenizer.eos_token, cached_tokenizer.pad_token, len(cached_tokenizer)) == (
        tokenizer.eos_token, tokenizer.pad_token, len(tokenizer))


def test_a_cache_that_cannot_be_written_falls_back_to_the_gguf_file_with_a_notice(tmp_path, monkeypatch, caplog):
    (tmp_path / "a_file").write_text("")  # the cache root would be under a file: no directory can be made
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "a_file" / "cache"))
    model_config = compose([]).model
    with caplog.at_level(logging.WARNING, logger="asyncrl.models.loading"):
        directory, gguf = gguf_location(model_config)
    assert directory == embedded_gguf_dir() and gguf == {"gguf_file": model_config.gguf_file}
    assert "cache cannot be written" in caplog.text
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="no-such.gguf"):
        gguf_location(compose(["model.gguf_file=no-such.gguf"]).model)


def test_writers_racing_for_one_cached_directory_leave_one_whole_directory(tmp_path):
    """Each actor of a run loads the model at start-up: several may find the cache empty at once.
    Each writes beside it and renames into place; one wins, the others use its directory."""
    calls, all_writing = [], threading.Barrier(4, timeout=30)

    def write(staging):
        calls.append(staging)
        all_writing.wait()  # every writer found the cache empty
        for i in range(3):
            (open(os.path.join(staging, f"part{i}"), "w")).write("x" * 1000)
            time.sleep(0.05)

    results = []
    threads = [threading.Thread(target=lambda: results.append(cached_directory(str(tmp_path), "model", write)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 4 and set(results) == {str(tmp_path / "model")}
    assert sorted(os.listdir(tmp_path)) == ["model"]  # no staging directory left behind
    assert sorted(os.listdir(tmp_path / "model")) == ["part0", "part1", "part2"]
    assert cached_directory(str(tmp_path), "model", write) == str(tmp_path / "model") and len(calls) == 4
