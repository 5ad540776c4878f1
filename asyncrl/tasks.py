"""Prompt sets with ground truth: built-in tasks that generate their own data, and local files in
the layout verl uses (`prompt` as chat messages, `reward_model.ground_truth`, `data_source`).

Each task also names how its responses are scored (`score_response`), a pure function.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass



@dataclass(frozen=True)
class Example:
    prompt_id: str
    messages: list[dict]  # chat messages; the user turn holds the task text
    ground_truth: str
    data_source: str

    @property
    def text(self) -> str:
        return "\n".join(m["content"] for m in self.messages)


# --- tiny: successor digit ----------------------------------------------------------------------


def tiny_examples(split: str) -> list[Example]:
    """"d:" -> the next digit (d+1 mod 10). Train and eval share the 10 prompts (it is a
    memorisation task for a model with no prior); the eval is sampled, so it measures the policy."""
    return [
        Example(f"tiny-{split}-{d}", [{"role": "user", "content": f"{d}:"}], str((d + 1) % 10), "tiny")
        for d in range(10)
    ]


TINY_SEQ_DIGITS = 3


def tiny_seq_examples(split: str) -> list[Example]:
    """"d:" -> the next three digits ("3:" -> "456"): with 2-token windows the answer spans two
    windows, so T-PPO must credit a window before the response is finished."""
    return [
        Example(f"tiny_seq-{split}-{d}", [{"role": "user", "content": f"{d}:"}],
                "".join(str((d + i) % 10) for i in range(1, TINY_SEQ_DIGITS + 1)), "tiny_seq")
        for d in range(10)
    ]


# --- tiny_tool: an answer only a tool knows ------------------------------------------------------


def tiny_tool_examples(split: str) -> list[Example]:
    """"d:" -> a digit drawn per episode that nothing in the prompt reveals (the `lookup` tool's
    answer, `asyncrl.environments.tools.episode_secret`): right only by calling the tool (`?`) and
    copying what it returns. Guessing is right one time in ten."""
    from asyncrl.environments.tools import EPISODE_TRUTH

    return [Example(f"tiny_tool-{split}-{d}", [{"role": "user", "content": f"{d}:"}], EPISODE_TRUTH, "tiny_tool")
            for d in range(10)]


# --- arithmetic word problems -------------------------------------------------------------------

_NAMES = ["Sam", "Ana", "Li", "Omar", "Mia", "Ravi", "Zoe", "Ben", "Kai", "Eva"]
_ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "coins", "cards", "shells"]
_INSTRUCTION = "Put the final answer in \\boxed{}."


def _word_problem(rng: random.Random) -> tuple[str, int]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    kind = rng.choice(["add", "sub", "mul"])
    if kind == "add":
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        return f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", a + b
    if kind == "sub":
        a = rng.randint(5, 30)
        b = rng.randint(1, a - 1)
        return f"{name} has {a} {item} and gives away {b}. How many {item} are left?", a - b
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return f"{name} has {a} bags with {b} {item} in each bag. How many {item} are there in total?", a * b


TOOL_INSTRUCTION = ("You can run Python: write <tool_call>{\"name\": \"python\", \"arguments\": "
                    "{\"code\": \"print(12 * 7)\"}}</tool_call> and its output comes back. ")


def arithmetic_examples(split: str, n: int, seed: int = 0) -> list[Example]:
    """Deterministic; the eval split never repeats a train question."""
    train_rng = random.Random(f"arith-train-{seed}")
    train_texts: list[tuple[str, int]] = []
    seen: set[str] = set()
    while len(train_texts) < (n if split == "train" else 4096):
        q, a = _word_problem(train_rng)
        if q not in seen:
            seen.add(q)
            train_texts.append((q, a))
        if len(seen) >= 4096:
            break
    if split == "train":
        pairs = train_texts[:n]
    else:
        eval_rng = random.Random(f"arith-eval-{seed}")
        train_set = {q for q, _ in train_texts}
        pairs = []
        while len(pairs) < n:
            q, a = _word_problem(eval_rng)
            if q not in train_set and q not in {p for p, _ in pairs}:
                pairs.append((q, a))
    return [
        Example(f"arith-{split}-{i}", [{"role": "user", "content": f"{q} {_INSTRUCTION}"}], str(a), "arithmetic")
        for i, (q, a) in enumerate(pairs)
    ]


# --- local files in verl's layout ------------------------------------------------------------------


def read_rows(path: str) -> list[dict]:
    """The rows of a jsonl or parquet prompt file, as dicts."""
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.endswith(".jsonl") or path.endswith(".json"):
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    raise ValueError(f"task.path must be a .jsonl or .parquet file, got {path!r}")


def file_examples(path: str) -> list[Example]:
    """Rows of a jsonl or parquet file: `prompt` (list of chat messages, or a string),
    `reward_model.ground_truth`, `data_source`; an `extra_info.index` or the row number is the id."""
    rows = read_rows(path)
    examples = []
    for i, row in enumerate(rows):
        for key in ("prompt", "reward_model"):
            if key not in row:
                raise ValueError(f"{path}: row {i} has no `{key}` field")
        prompt = row["prompt"]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        extra = row.get("extra_info") or {}
        index = extra.get("index", i) if isinstance(extra, dict) else i
        examples.append(
            Example(
                prompt_id=f"{row.get('data_source', 'file')}-{index}",
                messages=[{"role": m["role"], "content": m["content"]} for m in messages],
                ground_truth=str(row["reward_model"]["ground_truth"]),
                data_source=str(row.get("data_source", "file")),
            )
        )
    return examples


def verl_rows(examples: list[Example], split: str) -> list[dict]:
    """Examples as rows in verl's layout, as `file_examples` reads them (`extra_info.index` is the
    row's place in its split)."""
    return [{"data_source": ex.data_source, "prompt": [dict(m) for m in ex.messages],
             "reward_model": {"style": "rule", "ground_truth": ex.ground_truth},
             "extra_info": {"split": split, "index": i}} for i, ex in enumerate(examples)]


def write_examples(examples: list[Example], path: str, split: str, overwrite: bool = False) -> bool:
    """A prompt file in verl's layout (`.parquet` or `.jsonl`) that `task=file` trains on. An
    existing file with these rows is left as it is (False: nothing written); one with other rows is
    refused unless `overwrite`."""
    rows = verl_rows(examples, split)
    if os.path.exists(path) and not overwrite:
        if read_rows(path) == rows:
            return False
        raise FileExistsError(f"{path} exists and holds other prompts; pass --force to overwrite it")
    if path.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.endswith(".jsonl"):
        with open(path, "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    else:
        raise ValueError(f"a prompt file is .parquet or .jsonl, got {path!r}")
    return True


def load_examples(task_name: str, split: str, n: int, seed: int, path: str = "") -> list[Example]:
    if task_name == "tiny":
        return tiny_examples(split)
    if task_name == "tiny_seq":
        return tiny_seq_examples(split)
    if task_name == "arithmetic":
        return arithmetic_examples(split, n, seed)
    if task_name == "arithmetic_tool":  # the same problems, told that a Python tool is there
        return [Example(e.prompt_id.replace("arith-", "arith_tool-", 1),
                        [{"role": "user", "content": TOOL_INSTRUCTION + e.messages[-1]["content"]}], e.ground_truth,
                        "arithmetic_tool") for e in arithmetic_examples(split, n, seed)]
    if task_name == "tiny_tool":
        return tiny_tool_examples(split)
    if task_name == "file":
        if not path:
            raise ValueError(f"task=file needs task.{'path' if split == 'train' else 'eval_path'}")
        return file_examples(path)
    raise ValueError(f"unknown task {task_name!r}: expected tiny, tiny_seq, tiny_tool, arithmetic, arithmetic_tool "
                     f"or file")


def score_response(data_source: str, response: str, ground_truth: str, style: str) -> tuple[float, bool, str]:
    """(score, correct, prediction) of a response with the default verifier of its data source."""
    from asyncrl.rewards.verifiers import kind_for, verify

    verdict = verify(kind_for(data_source), response, ground_truth, style)
    return verdict.score, verdict.correct, str(verdict.details.get("pred", ""))


def reference_response(data_source: str, ground_truth: str) -> str:
    """The anchor response of Pairwise PPO's `anchor=reference`: the ground truth written as the
    task asks a response to end (a judge compares two responses, not a response with a bare
    number). Maths: the instruction's `\\boxed{}`; code and the tiny tasks: the answer itself."""
    from asyncrl.rewards.verifiers import kind_for

    if kind_for(data_source) == "math":
        return f"The answer is \\boxed{{{ground_truth}}}."
    return ground_truth


def encode_prompt(example: Example, tokenizer, use_chat_template: bool, environment=None) -> list[int]:
    """Prompt token ids: the chat template with a generation prompt, or the raw user text. With an
    environment (`EnvironmentConfig` with a name), the template lists its tools, as the policy
    endpoint's prompt does (`asyncrl.environments.templates.ChatTemplate.prompt`)."""
    if use_chat_template and environment is not None and environment.name:
        from asyncrl.environments.formats import FORMATS
        from asyncrl.environments.templates import ChatTemplate, encode
        from asyncrl.environments.tools import tool_specs

        render = ChatTemplate(tokenizer, FORMATS[environment.tool_format]())
        return encode(tokenizer, render.prompt(example.messages, tool_specs(environment)))
    if use_chat_template:
        return list(tokenizer.apply_chat_template(example.messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    return tokenizer.encode(example.text, add_special_tokens=False)
