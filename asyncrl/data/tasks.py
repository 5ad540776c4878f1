"""The built-in tasks: prompt sets with ground truth that generate their own data (the tiny tasks,
arithmetic word problems), and how a task's responses are scored by default (`score_response`), a
pure function. Users' own files: `asyncrl.data.files`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

@dataclass(frozen=True)
class Example:
    prompt_id: str
    messages: list[dict]  # chat messages; the user turn holds the task text
    ground_truth: Any  # a string for the built-in tasks; what the data holds for a file (None: none)
    data_source: str
    row: dict | None = None  # a file's row as read (its columns), for a reward function of the user's
    where: str = ""  # where a file's row is ("train.parquet: row 7"), for the errors that name it
    images: tuple[str, ...] = ()  # the prompt's images in the store (`asyncrl.storage.images`), placeholder order

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
    answer, `asyncrl.rewards.verifiers.episode_secret`): right only by calling the tool (`?`) and
    copying what it returns. Guessing is right one time in ten."""
    from asyncrl.rewards.verifiers import EPISODE_TRUTH

    return [Example(f"tiny_tool-{split}-{d}", [{"role": "user", "content": f"{d}:"}], EPISODE_TRUTH, "tiny_tool")
            for d in range(10)]


# --- shapes: what the image shows -------------------------------------------------------------

SHAPE_COLOURS = [(220, 30, 30), (30, 170, 40), (40, 60, 220), (230, 200, 20)]  # red, green, blue, yellow: 0..3


def shapes_examples(split: str, n: int, seed: int = 0) -> list[Example]:
    """"<image>c?" -> the colour of the square in the image, as a digit (0 red, 1 green, 2 blue, 3
    yellow). Each image (56x56, drawn with PIL) has one square of a random size and place on a grey
    background of random shade; the held-out images are drawn apart from the training ones, so
    the policy must read the image, not remember a prompt (the text is the same for all). Right
    one time in four by guessing a colour."""
    from PIL import Image, ImageDraw

    from asyncrl.storage.images import store_image

    rng = random.Random(f"shapes-{split}-{seed}")
    out = []
    for i in range(n):
        colour = rng.randrange(len(SHAPE_COLOURS))
        shade = rng.randint(90, 170)
        image = Image.new("RGB", (56, 56), (shade, shade, shade))
        side = rng.randint(20, 36)
        x, y = rng.randint(0, 56 - side), rng.randint(0, 56 - side)
        ImageDraw.Draw(image).rectangle([x, y, x + side - 1, y + side - 1], fill=SHAPE_COLOURS[colour])
        ref = store_image(image, f"shapes {split} {i}")
        out.append(Example(f"shapes-{split}-{i}", [{"role": "user", "content": "<image>c?"}], str(colour), "shapes",
                           images=(ref,)))
    return out


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


def arithmetic_tool_examples(split: str, n: int, seed: int = 0) -> list[Example]:
    """The arithmetic problems, told that a Python tool is there."""
    return [Example(e.prompt_id.replace("arith-", "arith_tool-", 1),
                    [{"role": "user", "content": TOOL_INSTRUCTION + e.messages[-1]["content"]}], e.ground_truth,
                    "arithmetic_tool") for e in arithmetic_examples(split, n, seed)]


# The built-in tasks by `task.name`: (split, prompts wanted, seed) -> examples. `task=file` reads the
# user's own (`asyncrl.data.files`).
BUILTIN_TASKS = {
    "tiny": lambda split, n, seed: tiny_examples(split),
    "tiny_seq": lambda split, n, seed: tiny_seq_examples(split),
    "tiny_tool": lambda split, n, seed: tiny_tool_examples(split),
    "arithmetic": arithmetic_examples,
    "arithmetic_tool": arithmetic_tool_examples,
    "shapes": shapes_examples,
}


def score_response(data_source: str, response: str, ground_truth, style: str) -> tuple[float, bool, str]:
    """(score, correct, prediction) of a response with the default verifier of its data source."""
    from asyncrl.rewards.verifiers import kind_for, verify

    check = verify(kind_for(data_source), response, ground_truth, style)
    return check.score, check.correct, str(check.details.get("pred", ""))


def reference_response(data_source: str, ground_truth) -> str:
    """The anchor response of Pairwise PPO's `anchor=reference`: the ground truth written as the
    task asks a response to end (a judge compares two responses, not a response with a bare
    number). Maths: the instruction's `\\boxed{}`; code and the tiny tasks: the answer itself."""
    from asyncrl.rewards.verifiers import kind_for
    from asyncrl.messages.structs import ground_truth_text

    if kind_for(data_source) == "math":
        return f"The answer is \\boxed{{{ground_truth_text(ground_truth)}}}."
    return ground_truth_text(ground_truth)


def encode_prompt(example: Example, tokenizer, use_chat_template: bool, template_kwargs: dict | None = None,
                  environment=None, images=None) -> list[int]:
    """Prompt token ids: the chat template with a generation prompt (and `task.chat_template_kwargs`),
    or the raw user text. With an environment (an `EnvironmentConfig` that has one), the template
    lists its tools, as the policy endpoint's prompt does (`asyncrl.environments.templates.ChatTemplate.prompt`).
    An example with images needs the model's `images` (`asyncrl.storage.images.ImagePrep`): its
    placeholders become the image tokens each processed image fills."""
    if example.images:
        return _encode_with_images(example, tokenizer, use_chat_template, template_kwargs, images)
    if use_chat_template and environment is not None and environment.enabled:
        from asyncrl.environments.formats import FORMATS
        from asyncrl.environments.templates import ChatTemplate, encode
        from asyncrl.environments.tools import tool_specs

        render = ChatTemplate(tokenizer, FORMATS[environment.tool_format](), template_kwargs)
        return encode(tokenizer, render.prompt(example.messages, tool_specs(environment)))
    if use_chat_template:
        return list(tokenizer.apply_chat_template(example.messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False, **(template_kwargs or {})))
    return tokenizer.encode(example.text, add_special_tokens=False)


def _encode_with_images(example: Example, tokenizer, use_chat_template: bool, template_kwargs: dict | None,
                        images) -> list[int]:
    from asyncrl.config import ConfigError

    where = example.where or example.prompt_id
    if images is None:
        raise ConfigError(f"{where}: the prompt has images, and the model is a text-only one")
    messages = [{**m, "content": images.placeholder_text(m["content"])} for m in example.messages]
    if use_chat_template:
        ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False, **(template_kwargs or {})))
    else:
        ids = tokenizer.encode("\n".join(m["content"] for m in messages), add_special_tokens=False)
    return images.expand(ids, images.processed(example.images, where), where)
