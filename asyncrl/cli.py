"""`asyncrl` command line: generate, train, eval, data, export, bench. Trailing arguments are Hydra overrides."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _composed(args: argparse.Namespace, derived: dict | None = None, weights: dict | None = None):
    """The command's config: `derived` settings (what a checkpoint or an endpoint says: dotted field
    -> value, or a group -> one of its options), the user's overrides (which win), then `weights`
    (field -> value); verl's and TRL's names said in one line each. Derived settings and weights are
    data (`compose(values=...)`): never parsed or interpolated as the user's overrides are. None when
    `--cfg` printed it (the command then ends)."""
    from asyncrl.config import compose, to_yaml

    named = {o.split("=", 1)[0].lstrip("+~") for o in args.overrides}
    kept = {k: v for k, v in (derived or {}).items() if not any(k == n or k.startswith(n + ".") for n in named)}
    groups = [f"{k}={v}" for k, v in kept.items() if "." not in k]  # an option name of asyncrl's own
    values = {**{k: v for k, v in kept.items() if "." in k}, **(weights or {})}
    notices: list[str] = []
    config = compose([*groups, *args.overrides], args.config_name, args.config_dir, notices, values)
    for line in notices:
        print(f"asyncrl {args.command}: {line}", file=sys.stderr)
    if args.cfg:
        print(to_yaml(config), end="")
        return None
    return config


def _train(args: argparse.Namespace) -> int:
    config = _composed(args)
    if config is None:
        return 0
    from asyncrl.driver import train_cli  # torch and Ray: only for a run

    return train_cli(config)


def _generate(args: argparse.Namespace) -> int:
    import torch

    from asyncrl.data.files import load_examples
    from asyncrl.engines.base import SamplingParams
    from asyncrl.engines.generation import build_engine
    from asyncrl.evaluation import respond

    config = _composed(args)
    if config is None:
        return 0
    torch.set_num_threads(max(1, torch.get_num_threads()))
    start = time.perf_counter()
    engine, tokenizer = build_engine(config.model)
    print(f"loaded {config.model.name} ({sum(p.numel() for p in engine.model.parameters()) / 1e6:.1f}M params) "
          f"in {time.perf_counter() - start:.1f}s")
    examples = load_examples(config.task, "eval", args.n)[: args.n]
    params = SamplingParams.of(config.sampling)
    start = time.perf_counter()
    # As evaluation samples: a prompt's images (a vision-language model) go with it.
    completions = respond(config, engine, tokenizer, examples, 1, params,
                          [config.trainer.seed + i for i in range(len(examples))])
    elapsed = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for c in completions)
    for ex, c in zip(examples, completions):
        print(f"\n### {ex.text}\n{c.text}  [{c.finish_reason.value}]")
    print(f"\n{tokens} tokens in {elapsed:.1f}s ({tokens / elapsed:.1f} tokens/s, batch {len(examples)})")
    return 0


def _eval_config(args: argparse.Namespace, api_key: str):
    """`asyncrl eval`'s config: what the checkpoint's run or the endpoint says (task, lengths, model
    name), then the user's own overrides, which win (a task the user names replaces the derived task
    settings), then the checkpoint's weights (what --checkpoint means)."""
    from asyncrl import evaluation
    from asyncrl.storage.checkpoint_parts import policy_dir

    derived, weights = {}, {}
    if args.checkpoint:
        from asyncrl.weights import lora

        derived.update(evaluation.run_settings(args.checkpoint))
        path = policy_dir(args.checkpoint)
        if lora.is_adapter_dir(path):  # a LoRA run's: the merged model, written aside
            import tempfile

            path = lora.export(path, tempfile.mkdtemp(prefix="asyncrl-eval-"), adapter_only=False,
                               trust_remote_code=_trusts_code(args), dtype="float32")  # evaluated as trained
        weights = {"model.source": "hf", "model.path": path}
        derived = {**evaluation.directory_settings(path), **derived}  # what the run says wins
    if args.endpoint:
        derived.update(evaluation.endpoint_settings(args.endpoint, api_key))
    return _composed(args, derived, weights)


def _trusts_code(args: argparse.Namespace) -> bool:
    """The user's own `model.trust_remote_code` (their overrides and recipes): the one thing that
    lets a model directory's code run. A checkpoint's saved model settings never do."""
    if not args.overrides and not getattr(args, "config_dir", None):
        return False
    from asyncrl.config import compose

    return compose(args.overrides, getattr(args, "config_name", "config"),
                   getattr(args, "config_dir", None)).model.trust_remote_code


def _eval(args: argparse.Namespace) -> int:
    from asyncrl import evaluation
    from asyncrl.config import ConfigError

    api_key = os.environ.get(args.api_key_env, "") if args.api_key_env else ""
    if args.api_key_env and not api_key:
        raise ConfigError(f"--api-key-env {args.api_key_env}: that environment variable is not set")
    config = _eval_config(args, api_key)
    if config is None:
        return 0
    ks = sorted({int(k) for k in args.k.split(",")})
    n = max(args.n, max(ks))
    examples = evaluation.held_out(config, args.prompts)
    if args.endpoint:
        texts, versions = evaluation.sample_endpoint(args.endpoint, config.model.name, examples, n, args.temperature,
                                                     config.engine.max_response_tokens, api_key=api_key)
        label = f"{args.endpoint} (weight versions {sorted(v for v in versions if v)})"
    else:
        from asyncrl.engines.generation import build_engine

        engine, tokenizer = build_engine(config.model)
        texts = evaluation.sample_engine(config, engine, tokenizer, examples, n, args.temperature)
        label = args.checkpoint or config.model.name
    failures: list[str] = []
    result = {"model": label, "task": config.task.name, "temperature": args.temperature,
              **evaluation.summarize(evaluation.score(config, examples, texts, failures), ks),
              "rewards_failed": len(failures), "reward_failure": failures[0] if failures else ""}
    table, paths = evaluation.write_table(result, args.out)
    print(table)
    if failures:  # each scored as wrong: the table's figures are not the model's
        print(f"{len(failures)} of {sum(map(len, texts))} rewards failed: {failures[0]}", file=sys.stderr)
    print(f"wrote {' and '.join(paths)}")
    return 0


def _data_example(args: argparse.Namespace) -> int:
    """Write a built-in task's prompts (`--task`) as `train` and `test` files in verl's layout, with a
    reward function beside them: the same prompts as `task=<name>` with the same settings, for
    `task=file` to train on (`asyncrl.data.example`)."""
    from asyncrl.data.example import write_example

    return write_example(args.task, args.out, args.format, args.overrides, args.force)


def _export(args: argparse.Namespace) -> int:
    from asyncrl.config import ConfigError
    from asyncrl.models.loading import refuse_own_code
    from asyncrl.storage.checkpoint_parts import EXPORT_DTYPES, export_hf, policy_dir, stored_dtypes
    from asyncrl.weights import lora

    others = [o for o in args.overrides if o.split("=", 1)[0] != "model.trust_remote_code"]
    if others:
        raise ConfigError(f"takes one setting, model.trust_remote_code=true (to run the model directory's own "
                          f"code), not {' '.join(others)}")
    if args.dtype and args.dtype not in EXPORT_DTYPES:
        raise ConfigError(f"--dtype {args.dtype}: must be one of {', '.join(EXPORT_DTYPES)}")
    if args.dtype and args.adapter:
        raise ConfigError("--dtype sets the merged model's weights; --adapter copies the adapter as it was trained")
    trusted = _trusts_code(args)
    source = policy_dir(args.source)
    if lora.is_adapter_dir(source):
        out = lora.export(source, args.out, args.adapter, trust_remote_code=trusted, dtype=args.dtype)
        how = "peft's PeftModel.from_pretrained(base, dir)" if args.adapter else "transformers' from_pretrained"
        print(f"exported to {out}{'' if args.adapter else ', weights in ' + ', '.join(sorted(stored_dtypes(out)))} "
              f"(load it with {how})")
        return 0
    if args.adapter:
        raise FileNotFoundError(f"{source} holds a full fine-tune (model.lora_rank=0): no adapter to export; "
                                f"drop --adapter for the model")
    refuse_own_code(source, trusted)
    out = export_hf(args.source, args.out, trusted, args.dtype)
    from asyncrl.storage.images import directory_has_vision

    how = ("transformers' AutoModelForImageTextToText.from_pretrained, its image processor (preprocessor_config.json) "
           "AutoImageProcessor's" if directory_has_vision(out) else "transformers' from_pretrained")
    print(f"exported to {out}, weights in {', '.join(sorted(stored_dtypes(out)))} (load it with {how})")
    return 0


def _scale(args: argparse.Namespace) -> int:
    """Grow or shrink a running service's generator pool (the admin route of its `train` app)."""
    import httpx

    token = args.token or os.environ.get("ASYNCRL_ADMIN_TOKEN", "")
    response = httpx.post(f"{args.endpoint.rstrip('/')}/train/admin/generators", json={"count": args.count},
                          headers={"authorization": f"Bearer {token}"}, timeout=1200)
    print(json.dumps(response.json(), indent=2))
    return 0 if response.status_code == 200 else 1


def _bench(args: argparse.Namespace) -> int:
    from asyncrl.bench import run_benchmark

    return run_benchmark(args.name, quick=args.quick, run_dir=args.run_dir, overrides=args.overrides)


class _TrainHelp(argparse.Action):
    """`asyncrl train --help`: the usage, then the config groups and every field with its docstring,
    read from the schema at the moment of asking (composing the defaults takes a second, so only then)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from asyncrl.config import compose
        from asyncrl.config.help import config_help

        parser.print_help()
        print()
        print(config_help(compose([])))
        parser.exit()


def _config_options(command: argparse.ArgumentParser) -> None:
    """The options every command that composes a config takes."""
    command.add_argument("--config-dir", default=None,
                         help="a directory of your own recipes, searched before asyncrl's (whose groups stay available)")
    command.add_argument("--config-name", default="config", help="the primary recipe (a YAML of --config-dir)")
    command.add_argument("--cfg", action="store_true", help="print the composed config as YAML and exit")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line as `main` reads it (the README check parses every command with it)."""
    parser = argparse.ArgumentParser(prog="asyncrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _model_commands(sub)
    _file_and_service_commands(sub)
    # Options may come after the Hydra overrides (`bench engine model=tiny --quick`).
    args, extra = parser.parse_known_args(argv)
    unknown = [a for a in extra if a.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.overrides = list(getattr(args, "overrides", [])) + extra
    return args


def _model_commands(sub) -> None:
    """generate, train, eval: the commands that compose a config and run a model."""
    gen = sub.add_parser("generate", help="generate from the configured model (engine smoke check)")
    gen.add_argument("-n", type=int, default=4, help="number of held-out task prompts")
    _config_options(gen)
    gen.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=tiny")
    gen.set_defaults(func=_generate)

    train = sub.add_parser("train", help="train for trainer.total_steps and exit", add_help=False,
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           description="Train for trainer.total_steps and exit (Ctrl-C stops cleanly, checkpointed).")
    train.add_argument("-h", "--help", action=_TrainHelp, help="show this help, every config group and field, and exit")
    _config_options(train)
    train.add_argument("overrides", nargs="*", help="Hydra overrides: group=option, section.field=value (listed below)")
    train.set_defaults(func=_train)

    ev = sub.add_parser("eval", help="pass@1 and pass@k on held-out prompts (a checkpoint, the model, or a live endpoint)")
    ev.add_argument("--checkpoint", default="", help="a run directory, an asyncrl checkpoint or a Hugging Face directory")
    ev.add_argument("--endpoint", default="", help="a live policy endpoint, e.g. http://127.0.0.1:8000/v1")
    ev.add_argument("--api-key-env", default="", metavar="NAME",
                    help="send the value of environment variable NAME as the endpoint's key (default: no key is "
                         "sent; OPENAI_API_KEY is never sent unasked)")
    ev.add_argument("--n", type=int, default=4, help="samples per prompt")
    ev.add_argument("--k", default="1,4", help="comma-separated k values")
    ev.add_argument("--temperature", type=float, default=0.7)
    ev.add_argument("--prompts", type=int, default=None, help="at most this many held-out prompts")
    ev.add_argument("--out", default="outputs/eval", help="directory for eval.json and eval.md (default: %(default)s)")
    _config_options(ev)
    ev.add_argument("overrides", nargs="*")
    ev.set_defaults(func=_eval)


def _file_and_service_commands(sub) -> None:
    """data, export, scale, bench."""
    data = sub.add_parser("data", help="prompt files in verl's layout for task=file")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    example = data_sub.add_parser("example", help="write a built-in task (arithmetic, shapes) as train/test files")
    example.add_argument("--task", default="arithmetic", choices=["arithmetic", "shapes"],
                         help="arithmetic word problems, or shapes: an image per prompt, for a vision-language model "
                              "(default: %(default)s)")
    example.add_argument("--out", default="data", help="directory for train.<format> and test.<format> (default: %(default)s)")
    example.add_argument("--format", choices=["parquet", "jsonl"], default="parquet")
    example.add_argument("--force", action="store_true", help="overwrite existing files")
    example.add_argument("overrides", nargs="*", help="task settings, e.g. task.num_train_prompts=64 task.seed=1")
    example.set_defaults(func=_data_example)

    export = sub.add_parser("export", help="copy a checkpoint's policy out as a Hugging Face directory")
    export.add_argument("source", help="a run directory (its newest valid checkpoint) or a checkpoint directory")
    export.add_argument("out", help="the directory to write (safetensors, config, tokenizer)")
    export.add_argument("--adapter", action="store_true",
                        help="a LoRA run's adapter alone, in peft's format (default: the merged model)")
    export.add_argument("--dtype", default="", metavar="bfloat16|float16|float32",
                        help="the weights' dtype, a LoRA run's merged model's too (default: the dtype of the model "
                             "directory the run trained from, as its config.json names it; else float32)")
    export.add_argument("overrides", nargs="*", metavar="model.trust_remote_code=true",
                        help="run the model directory's own code (auto_map): a checkpoint's settings never do")
    export.set_defaults(func=_export)

    scale = sub.add_parser("scale", help="set the number of generators of a running service (serve run)")
    scale.add_argument("count", type=int, help="generators wanted")
    scale.add_argument("--endpoint", default="http://127.0.0.1:8000", help="where Serve listens")
    scale.add_argument("--token", default="", help="the admin token (default: ASYNCRL_ADMIN_TOKEN)")
    scale.set_defaults(func=_scale, overrides=[])

    bench = sub.add_parser("bench", help="run a benchmark; prints figures and writes JSON")
    bench.add_argument("name")
    bench.add_argument("--quick", action="store_true", help="small size for checks")
    bench.add_argument("--run-dir", default="outputs/bench")
    bench.add_argument("overrides", nargs="*")
    bench.set_defaults(func=_bench)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:  # `asyncrl train --help | head`: the reader left; that is not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0


def _main(argv: list[str] | None) -> int:
    args = parse(argv)
    from asyncrl.config import ConfigError
    from asyncrl.errors import RewardsFailing, StartupError

    try:
        return int(args.func(args) or 0)
    # A mistake in the command line, or a machine where Ray cannot start: one line, no traceback.
    except (ConfigError, FileNotFoundError, FileExistsError, StartupError) as exc:
        print(f"asyncrl {args.command}: {exc}", file=sys.stderr)
        return 2
    except RewardsFailing as exc:  # the run stopped at once: its rewards all fail
        print(f"asyncrl {args.command}: {exc}", file=sys.stderr)
        return RewardsFailing.exit_status
    except Exception as exc:  # a disk that cannot take what the run writes: what to do, in one line
        from asyncrl.storage.checkpoint import DiskRefused

        if not isinstance(exc, DiskRefused):
            raise
        print(f"asyncrl {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
