import json
import os

import pytest

from asyncrl.config import ConfigError, compose, config_dir
from asyncrl.data.files import file_examples
from asyncrl.data.tasks import arithmetic_examples, encode_prompt, score_response, tiny_examples, tiny_seq_examples
from asyncrl.models.loading import build_tiny_tokenizer
from asyncrl.rewards.math import math_correct, score_from_correct


def _group_options(group):
    return sorted(f[:-5] for f in os.listdir(os.path.join(config_dir(), group)) if f.endswith(".yaml"))


@pytest.mark.parametrize("algorithm", _group_options("algorithm"))
@pytest.mark.parametrize("model", _group_options("model"))
def test_every_shipped_config_composes(algorithm, model):
    for task in _group_options("task"):
        extra = ["task.path=/tmp/x.jsonl"] if task == "file" else []
        if algorithm == "dqo":  # offline: it learns from a store or a file
            extra += ["mode=learn", "offline.data=/tmp/store"]
        overrides = [f"algorithm={algorithm}", f"model={model}", f"task={task}", *extra]
        if task == "shapes" and model != "tiny_vl":  # images on a text-only model
            with pytest.raises(ConfigError, match="task=shapes gives every prompt an image"):
                compose(overrides)
            continue
        if model == "tiny_vl" and algorithm == "dqo":
            with pytest.raises(ConfigError, match="is a vision-language model: algorithm=dqo's offline step"):
                compose(overrides)  # DQO's own step takes no images
            continue
        config = compose(overrides)
        assert config.algorithm.name == algorithm


def test_bad_config_fails_naming_the_field():
    with pytest.raises(ConfigError, match="windw"):
        compose(["engine.windw=3"])
    with pytest.raises(ConfigError, match="window_tokens"):
        compose(["engine.window_tokens=abc"])
    with pytest.raises(ConfigError, match="policy.loss.agg"):
        compose(["policy.loss.agg=mean"])
    with pytest.raises(ConfigError, match="dual_clip"):
        compose(["policy.loss.dual_clip=0.5"])


def test_config_mistakes_are_one_line_naming_the_field_and_the_nearest_name():
    cases = {
        "policy.loss.clip_hgh=0.3": "policy.loss has no field 'clip_hgh'; did you mean 'clip_high'?",
        # Hydra's `+` would add the field and the schema would refuse it later, far from its cause.
        "+policy.loss.clip_hgh=0.3": "policy.loss has no field 'clip_hgh'; did you mean 'clip_high'?",
        # A field of another section (the role that reads it) is named with its section.
        "algorithm.clip_hgh=0.3": "algorithm has no field 'clip_hgh'; did you mean 'policy.loss.clip_high' or "
                                  "'critic.loss.clip_high'?",
        # One of our fields that moved names its new place (never a silent alias); one removed says
        # what replaces it.
        "policy.clip_high=0.3": "policy.clip_high moved to policy.loss.clip_high",
        "algorithm.lr=1e-5": "algorithm.lr moved to policy.optimizer.lr",
        "algorithm.estimator=gae": "algorithm.estimator moved to algorithm.advantage.type",
        "engine.temperature=1.0": "engine.temperature moved to sampling.temperature",
        "trainer.num_generators=2": "trainer.num_generators moved to cluster.num_generators",
        "task.pre_ppo_pool_path=/tmp/c.jsonl": "task.pre_ppo_pool_path moved to task.pre_ppo_candidates_path",
        "trainer.record=true": "trainer.record moved to trainer.store_trajectories",
        "trainer.record_keep_mb=100": "trainer.record_keep_mb moved to trainer.store_keep_mb",
        "trainer.generator_threads=2": "trainer.generator_threads was removed: it was read by nothing",
        "trainer.total_steps=abc": "trainer.total_steps expects an integer >= 1, got 'abc'",
        "trainer.total_steps=-5": "trainer.total_steps=-5 is out of range: it must be >= 1",
        "sampling.top_p=0": "sampling.top_p=0 is out of range: it must be in (0, 1]",
        "sampling.first_token_temperature=hot": "expects a number > 0 or null, got 'hot'",
        "policy.loss.agg=mean": "policy.loss.agg=mean: must be one of token-mean, seq-mean-token-mean",
        "algorithm=dapoo": "no algorithm named 'dapoo'; did you mean 'dapo'?",
        "modle=tiny": "the config has no field 'modle'; did you mean 'model'?",
        "reward.endpoints.verifer.kind=genrm": "reward.endpoints has no entry 'verifer'; did you mean 'verifier'?",
        "+reward.endpoints.judge={kindd: genrm}": "reward.endpoints.judge.kind must be one of verifier, genrm, bt, prm",
        "+reward.endpoints.rm={kind: bt}": "reward.endpoints.rm: Object missing required field `model_path`",
        # A union: a field of another variant names the variant it belongs to.
        "algorithm.advantage.lam=0.9": "algorithm.advantage is type grpo, which has no field 'lam'; it is a field "
                                       "of gae: set algorithm.advantage.type first",
        "algorithm.advantage.type=gaee": "algorithm.advantage.type must be one of grpo, drgrpo, rloo, "
                                         "reinforce_plus_plus, pairwise, gae; did you mean 'gae'?",
        "algorithm.dynamic_sampling=false": "algorithm.dynamic_sampling expects a mapping of DynamicSampling fields",
        "~trainer.total_steps": "cannot be removed",
        "trainer.total_steps=1,2": "sweeps",
        "trainer.total_steps=[1": "is not an override",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError) as caught:
            compose([override])
        assert message in str(caught.value) and "\n" not in str(caught.value), (override, str(caught.value))


def test_a_union_switches_variant_from_its_defaults_and_keeps_its_own_knobs():
    config = compose(["algorithm=grpo", "algorithm.advantage.type=gae", "algorithm.advantage.lam=0.5"])
    assert config.algorithm.advantage.type == "gae" and config.algorithm.advantage.lam == 0.5
    assert config.algorithm.advantage.gamma == 1.0 and config.algorithm.value_based
    # A whole variant as a mapping; the same type again keeps what was set.
    config = compose(["algorithm=ppo", "algorithm.advantage={type: gae, lam: 0.8}", "algorithm.advantage.type=gae"])
    assert config.algorithm.advantage.lam == 0.8 and config.algorithm.advantage.whiten  # ppo.yaml's, merged
    assert compose(["algorithm=ppo", "algorithm.advantage.type=rloo"]).algorithm.advantage.type == "rloo"


def test_plus_adds_entries_to_mappings_only():
    config = compose(["+reward.endpoints.judge={kind: genrm}", "+reward.endpoints.bt.kind=bt",
                      "+reward.endpoints.bt.model_path=/models/rm", "+trainer.total_steps=3",
                      "reward.routes=[{match: '*', endpoints: [verifier, judge]}]",
                      "reward.endpoints.verifier.verifier_kinds={chat: none}"])
    assert config.reward.endpoints["judge"].kind == "genrm" and config.reward.endpoints["bt"].model_path == "/models/rm"
    assert config.reward.endpoints["verifier"].verifier_kinds == {"chat": "none"} and config.trainer.total_steps == 3
    assert sorted(compose(["reward=hybrid", "~reward.endpoints.genrm", "reward.routes.0.endpoints=[verifier]"])
                  .reward.endpoints) == ["verifier"]


def test_a_runs_config_json_written_before_a_rename_reads_back_with_the_new_names():
    """`config_from_dict` moves the fields of an older `config.json` through `RENAMED` (a resumed
    run, the golden batches): here the names issue 41 changed."""
    from asyncrl.config import config_from_dict, to_dict

    old = to_dict(compose([]))
    trainer, task = old["trainer"], old["task"]
    trainer["record"], trainer["record_keep_mb"] = True, 7
    task["pre_ppo_pool_path"] = "/tmp/candidates.jsonl"
    for name in ("store_trajectories", "store_keep_mb"):
        del trainer[name]
    del task["pre_ppo_candidates_path"]
    config = config_from_dict(old)
    assert config.trainer.store_trajectories and config.trainer.store_keep_mb == 7
    assert config.task.pre_ppo_candidates_path == "/tmp/candidates.jsonl"


def test_cli_reports_a_config_mistake_in_one_line(capsys):
    from asyncrl.cli import main

    assert main(["train", "policy.loss.clip_hgh=0.3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "asyncrl train: policy.loss.clip_hgh=0.3: policy.loss has no field 'clip_hgh'; did you mean 'clip_high'?"


def test_math_verifier_cases():
    assert math_correct("so the answer is \\boxed{12}.", "12")[0]
    assert math_correct("Answer: 1,000", "1000")[0]
    assert math_correct("\\boxed{\\frac{1}{2}}", "0.5")[0]
    assert math_correct("The total is 12 apples.", "12")[0]
    assert not math_correct("\\boxed{7} hmm 12", "12")[0]  # the boxed answer wins
    assert not math_correct("", "3")[0]
    assert not math_correct("\\boxed{", "3")[0]
    assert not math_correct("The total is 12 apples.", "12", require_boxed=True)[0]
    # An answer outside the last 300 characters is ignored.
    assert not math_correct("\\boxed{12}" + " filler" * 60, "12", require_boxed=True)[0]
    assert score_from_correct(True, "plus_minus") == 1.0 and score_from_correct(False, "plus_minus") == -1.0


def test_the_public_math_check_returns_within_its_timeout_on_a_power_tower():
    """`math_correct` is the bounded check: from a thread (where math-verify's SIGALRM limits are
    off) a power tower asks sympy for a number of ~10^8 digits, which ran for minutes unbounded."""
    import threading
    import time

    assert math_correct("\\boxed{2}", "2")[0]  # the worker processes are up: their start is not timed below
    timeout_s, results = 2.0, []

    def check():
        start = time.monotonic()
        results.append((math_correct("\\boxed{9^{9^{9}}}", "3", timeout_s=timeout_s), time.monotonic() - start))

    worker = threading.Thread(target=check, daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "math_correct ran unbounded"
    (correct, _, problem), seconds = results[0]
    assert not correct and seconds < timeout_s + 2.0, (problem, seconds)
    assert math_correct("\\boxed{\\frac{1}{2}}", "0.5")[0]  # the workers still answer after a killed check


def test_builtin_tasks_are_deterministic_and_disjoint():
    train = arithmetic_examples("train", 200, seed=0)
    again = arithmetic_examples("train", 200, seed=0)
    held_out = arithmetic_examples("eval", 50, seed=0)
    assert [e.text for e in train] == [e.text for e in again]
    assert not {e.text for e in train} & {e.text for e in held_out}
    for ex in train[:20]:
        assert "\\boxed{}" in ex.text and int(ex.ground_truth) >= 0
    assert score_response("tiny", "45", "4", "zero_one")[:2] == (1.0, True)
    assert score_response("tiny", "54", "4", "zero_one")[:2] == (0.0, False)
    tok = build_tiny_tokenizer()
    assert tok.decode(encode_prompt(tiny_examples("train")[3], tok, False)) == "3:"


def test_verl_layout_jsonl_and_parquet(tmp_path):
    rows = [
        {"data_source": "gsm8k", "prompt": [{"role": "user", "content": "1+1?"}],
         "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"index": 7}},
        {"data_source": "gsm8k", "prompt": "2+2?", "reward_model": {"ground_truth": 4}},
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    examples = file_examples(str(path))
    assert [e.prompt_id for e in examples] == ["gsm8k-7", "gsm8k-1"]
    assert examples[1].ground_truth == 4 and examples[1].messages[0]["content"] == "2+2?"  # as the data holds it
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(rows[:1]), tmp_path / "train.parquet")
    assert file_examples(str(tmp_path / "train.parquet"))[0].ground_truth == "2"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x"}))
    (bad_example,) = file_examples(str(bad))  # no reward_model: no ground truth (refused where one is needed)
    assert bad_example.ground_truth is None


@pytest.mark.parametrize("name", ["ppo", "vcppo", "vapo", "tppo", "tppo_sync", "grpo", "dapo"])
def test_every_algorithm_composes_with_its_paper_settings(name):
    config = compose([f"algorithm={name}"])
    a, p, c = config.algorithm, config.policy, config.critic
    adv = a.advantage
    assert a.name == name
    value_based = name not in ("grpo", "dapo")
    assert (adv.type == "gae") == value_based and a.value_based == value_based
    if name in ("vcppo", "vapo", "tppo"):
        assert c.loss.lam == 1.0 and adv.lam == 0.95 and c.warmup.steps > 0  # decoupled GAE + value pretraining
    if name in ("vapo", "tppo"):
        assert adv.length_adaptive_alpha == 1.0 and a.nll_coef == 0.1 and p.loss.clip_high == 0.28  # α scaled to 64 tokens
        assert p.mini_batches == (2 if name == "vapo" else 1)  # VAPO paper: 16 updates per step; T-PPO recipe: 1
        assert adv.lambda_floor == (name == "tppo")  # NeMo clamp vs the T-PPO recipe's floor
    if name == "tppo":
        assert adv.window_training and config.engine.window_tokens < config.engine.max_response_tokens
        assert (c.loss.clip_low, c.loss.clip_high) == (0.5, 0.6) and adv.clamp == 10.0 and p.loss.dual_clip == 10.0
    if name == "dapo":
        assert p.mini_batches == 2 and p.loss.proximal_anchor
    if name == "tppo_sync":
        assert config.trainer.synchronous and config.engine.window_tokens == config.engine.max_response_tokens


def test_value_based_knobs_are_validated():
    with pytest.raises(ConfigError, match="window_training"):
        compose(["algorithm=grpo", "algorithm.advantage.window_training=true"])
    with pytest.raises(ConfigError, match="algorithm.advantage.bootstrap=sometimes: must be one of previous, next"):
        compose(["algorithm=tppo", "algorithm.advantage.bootstrap=sometimes"])
    with pytest.raises(ConfigError, match="synchronous"):
        compose(["algorithm=tppo", "trainer.synchronous=true"])
    # Synchronous batches are whole responses whatever window the task sets (tiny_seq: W=2 < 4).
    sync = compose(["algorithm=tppo_sync", "model=tiny", "task=tiny_seq"])
    assert sync.engine.window_tokens == sync.engine.max_response_tokens == 4
    # An edge mask as long as the window would leave every cut window out of the loss: refused. The
    # 2-token tasks take T-PPO with none (configs/task_algorithm/); a task whose responses fit one
    # window (task=tiny) never cuts one, so the preset's mask is harmless there.
    with pytest.raises(ConfigError, match="edge_mask_tokens=2 leaves every token of a cut window out of the loss"):
        compose(["algorithm=tppo", "model=tiny", "task=tiny_seq", "algorithm.advantage.edge_mask_tokens=2"])
    for task in ("tiny_seq", "tiny_tool"):
        assert compose(["algorithm=tppo", "model=tiny", f"task={task}"]).algorithm.advantage.edge_mask_tokens == 0
    assert compose(["algorithm=tppo", "model=tiny", "task=tiny"]).algorithm.advantage.edge_mask_tokens == 4
    assert compose(["algorithm=tppo"]).algorithm.advantage.edge_mask_tokens == 4  # W=16 on the embedded model
    with pytest.raises(ConfigError, match="long_tail"):
        compose(["engine.long_tail_fraction=1.5"])


def test_tiny_seq_partial_credit():
    example = tiny_seq_examples("train")[3]
    assert example.text == "3:" and example.ground_truth == "456"
    assert score_response("tiny_seq", "456", "456", "zero_one")[:2] == (1.0, True)
    assert score_response("tiny_seq", "4x6", "456", "zero_one")[:2] == (pytest.approx(2 / 3), False)
    assert score_response("tiny_seq", "", "456", "plus_minus")[:2] == (-1.0, False)


def test_reward_presets_and_validation():
    hybrid = compose(["reward=hybrid"]).reward
    assert sorted(hybrid.endpoints) == ["genrm", "verifier"] and hybrid.routes[0].endpoints == ["verifier", "genrm"]
    assert compose(["reward=mix"]).reward.routes[0].weights == [0.7, 0.3]
    with pytest.raises(ConfigError, match="unknown endpoint 'judge'"):
        compose(["reward.routes=[{match: '*', endpoints: [judge]}]"])
    with pytest.raises(ConfigError, match="one weight per endpoint"):
        compose(["reward=mix", "reward.routes=[{match: '*', endpoints: [verifier, genrm], combine: mix}]"])
    with pytest.raises(ConfigError, match="pre_ppo_fraction"):
        compose(["task.pre_ppo_fraction=1.5"])


def test_services_bind_to_localhost_by_default():
    import yaml

    from asyncrl.config import config_dir

    serve_yaml = yaml.safe_load(open(os.path.join(config_dir(), "serve.yaml")))
    assert serve_yaml["http_options"]["host"] == "127.0.0.1"
    assert compose([]).serve.admin_token == ""  # admin routes are off until a token is set


def test_episode_settings_a_run_cannot_honour_are_refused():
    with pytest.raises(ConfigError, match="process reward model"):
        compose(["model=tiny", "task=tiny_tool", "+reward.endpoints.prm={kind: prm, model_path: /x}"])
    with pytest.raises(ConfigError, match="environment.max_turns"):
        compose(["model=tiny", "task=tiny_tool", "environment.max_turns=0"])
    # Names are refused at start-up, before any role starts (the field allows the built-ins' names).
    with pytest.raises(ConfigError, match=r"environment.name=search: must be one of '', python, lookup"):
        compose(["model=tiny", "task=tiny_tool", "environment.name=search"])
    with pytest.raises(ConfigError, match="environment.tool_format=xml"):
        compose(["model=tiny", "task=tiny_tool", "environment.tool_format=xml"])
    compose(["model=tiny", "task=tiny_tool"])


def test_the_docs_table_of_foreign_names_is_the_code_s():
    from asyncrl.config.names import foreign_table, ignored_table

    docs = open(os.path.join(os.path.dirname(config_dir()), "docs", "config.md")).read()
    assert foreign_table() in docs and ignored_table() in docs


def test_a_config_directory_without_a_primary_recipe_adds_its_options_first(tmp_path):
    (tmp_path / "task").mkdir()
    # An option of the package's name (task=tiny) is replaced by the user's; a new one is added.
    (tmp_path / "task" / "tiny.yaml").write_text("defaults:\n  - arithmetic\n  - _self_\nnum_train_prompts: 7\n")
    (tmp_path / "task" / "mine.yaml").write_text("num_train_prompts: 9\n")
    assert compose(["task=tiny"], user_dir=str(tmp_path)).task.num_train_prompts == 7
    assert compose(["task=mine"], user_dir=str(tmp_path)).task.num_train_prompts == 9
    assert compose(["task=tiny"]).task.num_train_prompts != 7
    with pytest.raises(ConfigError, match="no such directory"):
        compose([], user_dir=str(tmp_path / "absent"))


def test_a_serve_app_s_overrides_string_splits_as_a_shell_does():
    from asyncrl.serve.guards import config_from_args

    config = config_from_args({"overrides": "model=tiny 'task.chat_template_kwargs={enable_thinking: false}'",
                               "trainer.total_steps": "7"})
    assert config.task.chat_template_kwargs == {"enable_thinking": False} and config.trainer.total_steps == 7


def test_an_eval_interval_without_held_out_files_is_refused_in_one_line(tmp_path):
    from asyncrl.config import ConfigError, compose

    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    with pytest.raises(ConfigError, match=r"^trainer.eval_every=5 scores held-out prompts as the run trains, but "
                                          r"task=file has no task.eval_path \(the held-out files\): set "
                                          r"task.eval_path, or trainer.eval_every=0$"):
        compose(["model=tiny", "task=file", f"task.path={data}", "trainer.eval_every=5"])
    assert compose(["model=tiny", "task=file", f"task.path={data}", f"task.eval_path={data}",
                    "trainer.eval_every=5"]).trainer.eval_every == 5
    assert compose(["model=tiny", "task=tiny", "trainer.eval_every=5"]).trainer.eval_every == 5
