"""The prompts of a run (`load_examples`): a built-in task's, or data as users have it: jsonl and parquet files, globs of them, and directories written by
`datasets`' `save_to_disk`, in verl's layout (`prompt` as chat messages, `reward_model.ground_truth`,
`data_source`, `extra_info`) or TRL's (`prompt` as text or messages, `answer`/`solution`), read into
`Example`s. Images: verl's `images` column (bytes, paths, `{"bytes", "path"}` dicts, data URIs) with
`<image>` placeholders in the prompt, or TRL's `image`/`images` with `{"type": "image"}` content
parts; each image goes to the store once (`asyncrl.storage.images`) and the row keeps its path. Every row keeps its own columns (`Example.row`): a reward function of the user's gets
them (verl's `extra_info`, TRL's columns). Rows that cannot be trained on are refused at start-up
naming where they are; nothing is dropped silently.
"""

from __future__ import annotations

import base64
import glob
import json
import os
from dataclasses import dataclass

from asyncrl.config import Config, ConfigError, RewardConfig, TaskConfig
from asyncrl.config.checks import is_vision_model_section
from asyncrl.storage.images import IMAGE_PLACEHOLDER, store_image
from asyncrl.data.tasks import BUILTIN_TASKS, Example


@dataclass(frozen=True)
class DataKeys:
    """Which columns hold the prompt and the answer (`task.prompt_key`, `task.answer_key`)."""

    prompt: str = "prompt"
    answer: str = ""  # empty: verl's reward_model.ground_truth


def load_examples(task: TaskConfig, split: str, n: int | None = None) -> list[Example]:
    """The prompts of `task` for `split` (train | eval): a built-in task's (`n` of them, default
    the task's count), or the rows of its files (eval: `task.eval_path`, else `task.path`)."""
    if task.name != "file":
        count = n if n is not None else (task.num_train_prompts if split == "train" else task.num_eval_prompts)
        return BUILTIN_TASKS[task.name](split, count, task.seed)
    path = task.path if split == "train" else (task.eval_path or task.path)
    if not path:
        raise ValueError("task=file needs task.path (and task.eval_path for held-out prompts)")
    return file_examples(path, DataKeys(task.prompt_key, task.answer_key))


def data_paths(path: str | list[str]) -> list[str]:
    """Every file or `save_to_disk` directory that `path` names (a path, a glob, or a list of them), in
    order; a name that matches nothing is an error, not an empty dataset."""
    out = []
    for entry in [path] if isinstance(path, str) else list(path):
        matches = sorted(glob.glob(entry)) if glob.has_magic(entry) else [entry]
        missing = [m for m in matches if not os.path.exists(m)]
        if not matches or missing:
            raise FileNotFoundError(f"task.path: {entry!r} names no file or directory")
        out += matches
    return out


def read_rows(path: str) -> list[dict]:
    """The rows of a jsonl/json or parquet file, or of a `save_to_disk` directory, as dicts."""
    if os.path.isdir(path):
        return _saved_dataset_rows(path)
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.endswith(".jsonl") or path.endswith(".json"):
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    raise ValueError(f"task.path: {path!r} is not a .jsonl, .parquet or a datasets directory")


def _saved_dataset_rows(directory: str) -> list[dict]:
    """A `datasets.Dataset.save_to_disk` directory: its Arrow stream files, in the order its
    `state.json` lists them (read with pyarrow: asyncrl does not need `datasets` to read one)."""
    import pyarrow as pa

    state_file = os.path.join(directory, "state.json")
    if not os.path.isfile(state_file):
        splits = os.path.join(directory, "dataset_dict.json")
        if os.path.isfile(splits):
            names = json.load(open(splits)).get("splits", [])
            raise ValueError(f"task.path: {directory} holds several splits ({', '.join(names)}); name one, "
                             f"e.g. {os.path.join(directory, names[0] if names else 'train')}")
        raise ValueError(f"task.path: {directory} is not a directory written by datasets' save_to_disk")
    rows = []
    for entry in json.load(open(state_file))["_data_files"]:
        with pa.memory_map(os.path.join(directory, entry["filename"])) as source:
            rows += pa.ipc.open_stream(source).read_all().to_pylist()
    return rows


def file_examples(path: str | list[str], keys: DataKeys = DataKeys(), distinct_ids: bool = True) -> list[Example]:
    """The rows of every file `path` names, as examples. The prompt id is `data_source-index`
    (`extra_info.index`, else the row's number in its file); two rows with one id are refused,
    naming both (unless not `distinct_ids`: labelled responses repeat their prompt)."""
    examples, where = [], {}
    for file in data_paths(path):
        for i, row in enumerate(read_rows(file)):
            example = row_example(row, keys, f"{file}: row {i}", i)
            if distinct_ids and example.prompt_id in where:
                raise ConfigError(f"prompt id {example.prompt_id!r} is on {where[example.prompt_id]} and on "
                                 f"{file}: row {i}: give the rows distinct extra_info.index (or data_source)")
            where[example.prompt_id] = f"{file}: row {i}"
            examples.append(example)
    return examples


def row_example(row: dict, keys: DataKeys, where: str, number: int) -> Example:
    if keys.prompt not in row:
        raise ConfigError(f"{where} has no `{keys.prompt}` column (task.prompt_key)")
    prompt = row[keys.prompt]
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and all(isinstance(m, dict) and "content" in m for m in prompt):
        messages = [{"role": m.get("role", "user"), "content": _content_text(m["content"], where)} for m in prompt]
    else:
        raise ConfigError(f"{where}: `{keys.prompt}` is neither text nor a list of chat messages")
    row, images = _row_images(row, where)
    if keys.answer:
        truth = row.get(keys.answer)
    else:
        reward_model = row.get("reward_model")
        truth = reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    source = str(row.get("data_source") or "file")
    return Example(prompt_id=f"{source}-{extra.get('index', number)}", messages=messages,
                   ground_truth=truth, data_source=source, row=row, where=where, images=images)


def _content_text(content, where: str) -> str:
    """A message's content as text: TRL's parts (`{"type": "text", "text": ...}`, `{"type": "image"}`)
    joined, each image part as verl's `<image>` placeholder."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ConfigError(f"{where}: a message's content is neither text nor a list of parts")
    kinds = {"text": lambda part: part.get("text") or "", "image": lambda part: IMAGE_PLACEHOLDER}
    unknown = [p.get("type") for p in content if not isinstance(p, dict) or p.get("type") not in kinds]
    if unknown:
        raise ConfigError(f"{where}: content parts of type {unknown[0]!r}: text and image are read")
    return "".join(kinds[p["type"]](p) for p in content)


def _row_images(row: dict, where: str) -> tuple[dict, tuple[str, ...]]:
    """The row's images (verl's and TRL's `images`, TRL's `image`) put in the store, and the row with
    their paths in place of their bytes (what a reward function gets)."""
    column = "images" if row.get("images") is not None else "image" if row.get("image") is not None else None
    if column is None:
        return row, ()
    values = row[column] if isinstance(row[column], (list, tuple)) else [row[column]]
    refs = tuple(store_image(value, f"{where}: {column}[{k}]") for k, value in enumerate(values))
    return {**row, column: list(refs) if isinstance(row[column], (list, tuple)) else refs[0]}, refs


def check_prompts(config: Config) -> None:
    """At start-up, before any role: the user's code loads (each `kind: python` reward function with
    a signature it can be called with, the environment's class), a task's files read (every row
    with a prompt; no two rows with one id) and every row scorable by its route (a ground truth
    where the route needs one). Each failure is one line naming what and where."""
    from asyncrl.rewards.user_function import detect_signature, load_function
    from asyncrl.user_code import load_attribute, split_class_path

    for name, endpoint in config.reward.endpoints.items():
        if endpoint.kind == "python":
            try:
                detect_signature(load_function(endpoint.path, endpoint.function), endpoint.signature)
            except Exception as exc:  # noqa: BLE001 - a user's module may raise anything as it imports
                raise ConfigError(f"reward.endpoints.{name} ({endpoint.path}:{endpoint.function}): "
                                  f"{type(exc).__name__}: {exc}") from exc
    if config.environment.class_path:
        try:
            load_attribute(*split_class_path(config.environment.class_path), what="class")
        except Exception as exc:  # noqa: BLE001
            raise ConfigError(f"environment.class_path: {type(exc).__name__}: {exc}") from exc
    if config.task.name != "file":
        return
    train = load_examples(config.task, "train")
    refuse_unscorable(train, config.reward)
    examples = train + (load_examples(config.task, "eval") if config.task.eval_path else [])
    with_images = next((ex for ex in examples if ex.images), None)
    if with_images is not None and not is_vision_model_section(config.model):
        m = config.model
        raise ConfigError(f"{with_images.where}: the prompt has images, and "
                          f"{f'model.path={m.path}' if m.path else f'model.source={m.source}'} is a text-only model")


def fit_notices(config: Config, tokenizer, context_tokens: int) -> list[str]:
    """Where the defaults do not fit a user's data (`task=file`): prompts that leave a whole
    response no room in the model's context, and answers longer than a response may be. Each line
    names the setting to change."""
    from asyncrl.data.tasks import encode_prompt
    from asyncrl.messages.structs import ground_truth_text, has_ground_truth

    if config.task.name != "file":
        return []
    examples = load_examples(config.task, "train")
    budget, notices = config.engine.max_response_tokens, []
    if not config.task.max_prompt_length:
        images = _image_prep(config, tokenizer, examples)
        lengths = [len(encode_prompt(ex, tokenizer, config.model.use_chat_template, config.task.chat_template_kwargs,
                                     images=images)) for ex in examples]
        crowded = sum(n + budget > context_tokens for n in lengths)
        if crowded:
            notices.append(f"{crowded} of {len(examples)} prompts are longer than the model's {context_tokens}-token "
                           f"context less a response (engine.max_response_tokens={budget}): set "
                           f"task.max_prompt_length={max(context_tokens - budget, 1)} to drop them")
    answers = [ground_truth_text(ex.ground_truth) for ex in examples if has_ground_truth(ex.ground_truth)]
    long = sum(len(tokenizer(text, add_special_tokens=False)["input_ids"]) > budget for text in answers)
    if long:
        notices.append(f"{long} of {len(answers)} answers ({config.task.answer_key or 'reward_model.ground_truth'}) "
                       f"are longer than engine.max_response_tokens={budget} tokens, so no response can hold one: "
                       f"raise engine.max_response_tokens")
    if not config.task.eval_path:
        notices.append("no task.eval_path: the held-out accuracy is measured on training prompts "
                       "(task.eval_path names held-out files)")
    return notices


def _image_prep(config: Config, tokenizer, examples: list[Example]):
    """The model's image prep where a prompt has images (its image tokens count in its length)."""
    from asyncrl.models.vision import image_prep

    return image_prep(config.model, tokenizer) if any(ex.images for ex in examples) else None


def refuse_unscorable(examples: list[Example], reward: RewardConfig) -> None:
    """Rows whose route needs a ground truth and that have none are refused, by where they are."""
    from asyncrl.rewards.hybrid import needs_ground_truth
    from asyncrl.messages.structs import has_ground_truth

    needs: dict[str, bool] = {}
    missing = [ex.where or ex.prompt_id for ex in examples if not has_ground_truth(ex.ground_truth)
               and needs.setdefault(ex.data_source, needs_ground_truth(ex.data_source, reward))]
    if missing:
        raise ConfigError(f"{len(missing)} prompts have no ground truth and their reward needs one "
                         f"({'; '.join(missing[:5])}{'; ...' if len(missing) > 5 else ''}): set task.answer_key to "
                         f"the column that holds it, or score them with a reward that needs none")


def drop_overlong(examples: list[Example], tokens: list[list[int]], max_tokens: int,
                  split: str) -> tuple[list[Example], list[list[int]]]:
    """verl's `filter_overlong_prompts`: prompts longer than `max_tokens` (0: no limit) are dropped,
    and how many is said. None left is an error."""
    if max_tokens <= 0:
        return examples, tokens
    kept = [i for i, t in enumerate(tokens) if len(t) <= max_tokens]
    if len(kept) < len(examples):
        print(f"task.max_prompt_length={max_tokens}: dropped {len(examples) - len(kept)} of {len(examples)} "
              f"{split} prompts longer than that", flush=True)
    if not kept:
        raise ConfigError(f"task.max_prompt_length={max_tokens}: every {split} prompt is longer")
    return [examples[i] for i in kept], [tokens[i] for i in kept]


def verl_rows(examples: list[Example], split: str) -> list[dict]:
    """Examples as rows in verl's layout, as `file_examples` reads them (`extra_info.index` is the
    row's place in its split)."""
    return [{"data_source": ex.data_source, "prompt": [dict(m) for m in ex.messages],
             "reward_model": {"style": "rule", "ground_truth": ex.ground_truth},
             "extra_info": {"split": split, "index": i},
             **({"images": [{"bytes": open(ref, "rb").read(), "path": None} for ref in ex.images]} if ex.images else {})}
            for i, ex in enumerate(examples)]


def write_examples(examples: list[Example], path: str, split: str, overwrite: bool = False) -> bool:
    """A prompt file in verl's layout (`.parquet` or `.jsonl`) that `task=file` trains on. An
    existing file with these rows is left as it is (False: nothing written); one with other rows is
    refused unless `overwrite`."""
    rows = verl_rows(examples, split)
    if not path.endswith((".parquet", ".jsonl")):
        raise ValueError(f"a prompt file is .parquet or .jsonl, got {path!r}")
    lines = [json.dumps(row, default=_data_uri) for row in rows] if path.endswith(".jsonl") else None
    if os.path.exists(path) and not overwrite:
        if read_rows(path) == (rows if lines is None else [json.loads(line) for line in lines]):
            return False
        raise FileExistsError(f"{path} exists and holds other prompts; pass --force to overwrite it")
    if lines is None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        with open(path, "w") as f:
            f.writelines(line + "\n" for line in lines)
    return True


def _data_uri(value: bytes) -> str:
    """An image's bytes in a jsonl row: a data URI (`asyncrl.storage.images.decode_image` reads it)."""
    return "data:image/png;base64," + base64.b64encode(value).decode()
