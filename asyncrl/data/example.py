"""`asyncrl data example`: a built-in task's prompts written as `train` and `test` files in verl's
layout (`write_examples`), a reward function in verl's signature beside them, and the
`asyncrl train task=file ...` command that trains on them as the built-in task trains.

Two tasks: `arithmetic` (word problems, `\\boxed{}` answers; the default) and `shapes` (an image
per prompt, "<image>c?" -> the colour of the square as a digit, for a vision-language model:
the `images` column holds each prompt's PNG bytes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from asyncrl.config import compose
from asyncrl.data.files import write_examples
from asyncrl.data.tasks import BUILTIN_TASKS


@dataclass(frozen=True)
class ExampleFiles:
    """What `asyncrl data example --task NAME` writes for a built-in task: its prompts (`what` they
    are, in the summary line), its reward file and the model its command trains."""

    what: str
    reward: str  # reward.py's text: a function in verl's signature
    model: tuple[str, ...] = ()  # the command's model (a task of images needs a vision-language model)


ARITHMETIC_REWARD = r'''"""A reward function in verl's signature, for the arithmetic word problems of `asyncrl data example`.

Use it with `custom_reward_function.path=data/reward.py` (or a `kind: python` endpoint). It is called
once per response, in a worker process of the reward endpoint, with a timeout.
"""

import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the last boxed answer of the response's tail is the ground truth. The other numbers
    are averaged per data source into the step records; `acc` says which are right."""
    boxed = re.findall(r"\\boxed\{([^}]*)\}", solution_str[-300:])
    right = bool(boxed) and boxed[-1].strip() == str(ground_truth)
    return {"score": 1.0 if right else 0.0, "acc": right, "boxed": float(bool(boxed))}
'''

SHAPES_REWARD = r'''"""A reward function in verl's signature, for the images of `asyncrl data example --task shapes`:
"<image>c?" -> the colour of the square in the image, as a digit (0 red, 1 green, 2 blue, 3 yellow).

Use it with `custom_reward_function.path=data/reward.py` (or a `kind: python` endpoint). It is called
once per response, in a worker process of the reward endpoint, with a timeout. `extra_info` is the
row's; its `images` are the paths of the stored images, never their pixels.
"""

COLOURS = {"0": "red", "1": "green", "2": "blue", "3": "yellow"}


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the response's first character is the colour's digit, as task=shapes scores it (the
    answer is one token; what follows it is not read). `acc` says which are right; `colour` counts
    the responses that name a colour at all, right or wrong."""
    answer = solution_str[:1]
    right = answer == str(ground_truth)
    return {"score": 1.0 if right else 0.0, "acc": right, "colour": float(answer in COLOURS)}
'''

TASKS = {
    "arithmetic": ExampleFiles("arithmetic word problems", ARITHMETIC_REWARD),
    "shapes": ExampleFiles("images of a coloured square", SHAPES_REWARD, ("model=tiny_vl",)),
}


def task_recipe_settings(task: str) -> list[str]:
    """The settings a built-in task's recipe (`configs/task/<task>.yaml`, a global package) gives
    outside `task`: the response budget, sampling, learning rate, group size of `task=shapes`, which
    `task=file` does not bring. As `key=value` overrides, in the recipe's order."""
    from omegaconf import OmegaConf

    from asyncrl.config.files import config_dir

    recipe = OmegaConf.to_container(OmegaConf.load(os.path.join(config_dir(), "task", f"{task}.yaml")))

    def leaves(node, prefix: str):
        for key, value in node.items():
            path = f"{prefix}.{key}" if prefix else key
            yield from leaves(value, path) if isinstance(value, dict) else [f"{path}={value}"]

    return [line for section, node in recipe.items() if section != "task" and isinstance(node, dict)
            for line in leaves(node, section)]


def write_example(task_name: str, out: str, file_format: str, overrides: list[str], force: bool) -> int:
    """Write `task_name`'s train and test prompts (with `overrides` of its settings, e.g.
    task.num_train_prompts=64) and its reward file into `out`; print what was written and the
    command that trains on them. Files that hold these prompts already are left as they are."""
    files = TASKS[task_name]
    task = compose([f"task={task_name}", *files.model, *overrides]).task
    make = BUILTIN_TASKS[task_name]
    splits = {"train": make("train", task.num_train_prompts, task.seed),
              "test": make("eval", task.num_eval_prompts, task.seed)}
    paths = {split: os.path.join(out, f"{split}.{file_format}") for split in splits}
    os.makedirs(out, exist_ok=True)
    for split, examples in splits.items():
        if write_examples(examples, paths[split], split, overwrite=force):
            print(f"wrote {paths[split]}: {len(examples)} {files.what} (verl's layout)")
        else:
            print(f"{paths[split]} already holds these {len(examples)} prompts: left as it is")
    reward = os.path.join(out, "reward.py")
    _write_reward(reward, files.reward, force)
    settings = task_recipe_settings(task_name) if files.model else []  # arithmetic's are the defaults'
    print("train on them: " + " ".join(["asyncrl train", *files.model, "task=file", f"task.path={paths['train']}",
                                        f"task.eval_path={paths['test']}", f"custom_reward_function.path={reward}",
                                        *settings]))
    return 0


def _write_reward(path: str, text: str, force: bool) -> None:
    if os.path.exists(path):
        with open(path) as f:
            held = f.read()
        if held == text:
            print(f"{path} is the example's reward function: left as it is")
            return
        if not force:
            print(f"{path} exists and is not the example: left as it is (--force replaces it)")
            return
    with open(path, "w") as f:
        f.write(text)
    print(f"wrote {path}: a reward function in verl's signature for these prompts")
