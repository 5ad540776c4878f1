"""Held-out evaluation: n samples per prompt scored by the verifiers, pass@1 and pass@k.

`asyncrl eval` runs it on a checkpoint directory (a Hugging Face model dir), the configured model,
or a live policy endpoint (OpenAI-compatible), and writes a table (markdown and JSON).
"""

from __future__ import annotations

import json
import math
import os
import threading
from typing import Any

import numpy as np

from asyncrl.config import Config
from asyncrl.data.files import drop_overlong, load_examples
from asyncrl.data.tasks import Example, encode_prompt, score_response
from asyncrl.engines.base import SamplingParams
from asyncrl.engines.generation import complete
from asyncrl.redaction import masked


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 − C(n−c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarize(correct: list[list[bool]], ks: list[int]) -> dict:
    """Per-prompt correctness lists -> mean pass@k for each k (and accuracy = pass@1)."""
    out = {"prompts": len(correct), "samples_per_prompt": len(correct[0]) if correct else 0}
    for k in ks:
        out[f"pass@{k}"] = float(np.mean([pass_at_k(len(c), sum(c), k) for c in correct])) if correct else 0.0
    return out


def held_out(config: Config, max_prompts: int | None = None) -> list[Example]:
    examples = load_examples(config.task, "eval")
    if config.task.max_prompt_length:
        from asyncrl.models.loading import load_tokenizer
        from asyncrl.models.vision import image_prep

        tokenizer = load_tokenizer(config.model)
        images = image_prep(config.model, tokenizer) if any(ex.images for ex in examples) else None
        tokens = [encode_prompt(ex, tokenizer, config.model.use_chat_template, config.task.chat_template_kwargs,
                                images=images) for ex in examples]
        examples, _ = drop_overlong(examples, tokens, config.task.max_prompt_length, "held-out")
    return examples[: max_prompts or len(examples)]


def progress_bar(total: int, desc: str, enabled: bool = True):
    """A progress bar for a long evaluation (on stderr; gone when done); a silent one when not enabled."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="sample", leave=False, disable=not enabled)


def respond(config: Config, engine, tokenizer, examples: list[Example], n: int, params: SamplingParams,
            seeds: list[int], on_batch=None) -> list:
    """n completions per example from a local engine: whole responses, or whole episodes where the
    task has an environment (`config.environment`; run in this process), sample j of an example
    being the episode (its prompt id, j)."""
    from asyncrl.models.vision import image_prep

    images = image_prep(config.model, tokenizer) if any(ex.images for ex in examples) else None
    prompts = [encode_prompt(ex, tokenizer, config.model.use_chat_template, config.task.chat_template_kwargs,
                             config.environment, images) for ex in examples for _ in range(n)]
    if not config.environment.enabled:
        processed = [images.processed(ex.images) for ex in examples for _ in range(n)] if images else None
        return complete(engine, tokenizer, prompts, seeds, config.engine.max_response_tokens, params,
                        on_batch=on_batch, images=processed)
    from asyncrl.environments.episodes import LocalEnvironment, build_episodes, complete_episodes
    from asyncrl.environments.tools import Episode, build_environment

    episodes = build_episodes(config.environment, tokenizer, LocalEnvironment(build_environment(config.environment)),
                              use_chat_template=config.model.use_chat_template,
                              template_kwargs=config.task.chat_template_kwargs)
    identities = [Episode(ex.prompt_id, j) for ex in examples for j in range(n)]
    return complete_episodes(engine, tokenizer, episodes, prompts, seeds, identities,
                             config.engine.max_response_tokens, params, on_batch=on_batch)


def sample_engine(config: Config, engine, tokenizer, examples: list[Example], n: int, temperature: float,
                  progress: bool = True) -> list[list[str]]:
    """n responses per held-out prompt from a local engine (temperature 0 = greedy)."""
    params = SamplingParams(greedy=True) if temperature == 0 else SamplingParams(temperature=temperature)
    seeds = [1_000_003 * i + j for i in range(len(examples)) for j in range(n)]
    with progress_bar(len(examples) * n, "eval", progress) as bar:
        completions = respond(config, engine, tokenizer, examples, n, params, seeds, on_batch=bar.update)
    texts = [c.text for c in completions]
    return [texts[i * n : (i + 1) * n] for i in range(len(examples))]


class EvaluationCancelled(Exception):
    """An evaluation stopped between two engine calls (`greedy_accuracy`'s `cancel`)."""


def greedy_accuracy(config: Config, engine, tokenizer, max_prompts: int | None = None, progress: str = "",
                    cancel: threading.Event | None = None) -> dict:
    """Greedy pass@1 on the task's held-out prompts (`trainer.eval_samples` of them unless
    `max_prompts`): the before/after/periodic figure of a training run. `progress`: a label for a
    progress bar (empty = none). `cancel`, once set, stops it after the engine call in progress
    (`EvaluationCancelled`)."""
    examples = held_out(config, max_prompts or config.trainer.eval_samples)
    with progress_bar(len(examples), progress, bool(progress)) as bar:

        def on_batch(n: int) -> None:
            bar.update(n)
            if cancel is not None and cancel.is_set():
                raise EvaluationCancelled

        completions = respond(config, engine, tokenizer, examples, 1, SamplingParams(greedy=True),
                              list(range(len(examples))), on_batch=on_batch)
    failures: list[str] = []
    correct = score(config, examples, [[c.text] for c in completions], failures)
    return {"accuracy": sum(c[0] for c in correct) / max(len(examples), 1), "n": len(examples),
            "response_length_mean": float(np.mean([len(c.token_ids) for c in completions])) if completions else 0.0,
            "rewards_failed": len(failures), "reward_failure": failures[0] if failures else ""}


def accuracy_line(label: str, result: dict) -> str:
    """`held-out accuracy <label>: 0.750 (n=8)`, and how many of its rewards failed and why: a failed
    reward scores as wrong, and an accuracy of rewards that failed is no accuracy."""
    line = f"held-out accuracy {label}: {result['accuracy']:.3f} (n={result['n']})"
    if result.get("rewards_failed"):
        line += f", {result['rewards_failed']} of {result['n']} rewards failed: {result['reward_failure']}"
    return line


def run_settings(path: str) -> dict[str, Any]:
    """The task and response length of the run a checkpoint comes from (its `config.json`):
    `asyncrl eval --checkpoint` scores the task the run trained on. {} for a plain Hugging Face
    directory. Data for `compose(values=...)` (see `_task_settings`), never override strings."""
    path = os.path.abspath(path)
    for candidate in (path, os.path.dirname(os.path.dirname(path))):  # a run dir, or run/checkpoints/step_k
        config_path = os.path.join(candidate, "config.json")
        if os.path.exists(config_path):
            with open(config_path) as f:
                saved = json.load(f)
            if isinstance(saved, dict) and "task" in saved and "trainer" in saved:  # asyncrl's, not a model's
                engine, model = saved.get("engine") or {}, saved.get("model") or {}
                settings = _task_settings(saved["task"], engine.get("max_response_tokens"))
                if "use_chat_template" in model:
                    settings["model.use_chat_template"] = model["use_chat_template"]
                # What the run's response budget was checked against (a task=file run of 2-token
                # answers has a buffer of 0, which the default algorithm's would not fit).
                overlong = ((saved.get("algorithm") or {}).get("overlong") or {}).get("buffer_tokens")
                if engine.get("max_response_tokens") and isinstance(overlong, int):
                    settings["algorithm.overlong.buffer_tokens"] = overlong
                if engine.get("max_response_tokens") and isinstance(engine.get("long_tail_tokens"), int):
                    settings["engine.long_tail_tokens"] = engine["long_tail_tokens"]
                return _checked(settings, f"--checkpoint {config_path}")
    return {}


def directory_settings(directory: str) -> dict[str, Any]:
    """What a Hugging Face directory says of how it is prompted: a tokenizer without a chat template
    (none in tokenizer_config.json, no chat_template.jinja: an export of the tiny models) takes the
    prompt's text as it is (`model.use_chat_template=false`). Data, as `run_settings`."""
    if any(os.path.exists(os.path.join(directory, name)) for name in ("chat_template.jinja", "chat_template.json")):
        return {}
    try:
        with open(os.path.join(directory, "tokenizer_config.json")) as f:
            tokenizer = json.load(f)
    except (OSError, ValueError):
        return {}
    return {} if not isinstance(tokenizer, dict) or tokenizer.get("chat_template") else {"model.use_chat_template": False}


def endpoint_settings(url: str, api_key: str = "") -> dict[str, Any]:
    """The model name, task and response length a live policy endpoint reports (GET /models, with
    `api_key` when given): `asyncrl eval --endpoint` scores the task that policy learns, whatever
    the local defaults are (the user's own overrides win). Data, as `run_settings`."""
    import httpx

    from asyncrl.config import ConfigError

    try:
        reply = httpx.get(url.rstrip("/") + "/models", timeout=30,
                          headers={"authorization": f"Bearer {api_key}"} if api_key else None)
        reply.raise_for_status()
        card = reply.json()["data"][0]
        settings = {"model.name": card["id"], **_task_settings(card.get("task") or {}, card.get("max_response_tokens"))}
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        raise ConfigError(f"--endpoint {url}: no policy endpoint answers GET /models there ({exc})") from exc
    return _checked(settings, f"--endpoint {url}")


def _task_settings(task: dict, max_response_tokens: int | None) -> dict[str, Any]:
    """Dotted fields that select a run's task, and the run's values. Key `task` (no dot) is the
    config group named so, if there is one (it brings the task's own settings, as `task=tiny` on
    the command line does): one of asyncrl's own option names, never the text as it came."""
    from asyncrl.config import config_groups

    settings: dict[str, Any] = {}
    task = task if isinstance(task, dict) else {}
    if task.get("name") in config_groups().get("task", []):
        settings["task"] = task["name"]
    settings.update({f"task.{key}": task[key] for key in ("name", "seed", "num_eval_prompts") if key in task})
    if task.get("eval_path") or task.get("path"):
        settings["task.eval_path"] = task.get("eval_path") or task.get("path")
    if max_response_tokens:
        settings["engine.max_response_tokens"] = max_response_tokens
    return settings


def _checked(settings: dict[str, Any], source: str) -> dict[str, Any]:
    """`settings`, each value checked against its field: one that does not fit is refused naming
    where it came from."""
    from asyncrl.config import ConfigError
    from asyncrl.config.compose import value_problem

    for key, value in settings.items():
        problem = value_problem(key, value) if "." in key else None
        if problem is not None:
            raise ConfigError(f"{source}: {problem}")
    return settings


def sample_endpoint(url: str, model: str, examples: list[Example], n: int, temperature: float, max_tokens: int,
                    progress: bool = True, api_key: str = "") -> tuple[list[list[str]], set]:
    """`api_key`: the bearer key to send (none by default: a key from the environment, such as
    OPENAI_API_KEY, is never sent to a URL the user did not give it for)."""
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key=api_key or "EMPTY")  # the client needs one; vLLM's convention
    texts, versions = [], set()
    with progress_bar(len(examples) * n, "eval", progress) as bar:
        for i, ex in enumerate(examples):
            raw = client.chat.completions.with_raw_response.create(model=model, messages=ex.messages, n=n, seed=i,
                                                                   temperature=temperature, max_tokens=max_tokens)
            versions.add(raw.headers.get("x-asyncrl-weight-version"))
            texts.append([c.message.content or "" for c in raw.parse().choices])
            bar.update(n)
    return texts, versions


def score(config: Config, examples: list[Example], texts: list[list[str]],
          failures: list[str] | None = None) -> list[list[bool]]:
    """Each response checked as the run rewards it: by the first endpoint of its data source's route
    when that is a verifier or a reward function of the user's (`kind: python`: correct is its `acc`
    when it gives one, else a score above 0); where the route starts with a model (a judge, a reward
    model: a model to load here), by the data source's default verifier. Sample j of a task with an
    answer per episode is checked against the episode's (`episode_truth`). A failed reward is wrong,
    and its reason goes to `failures` (with its sample)."""
    from asyncrl.algo.shaping import is_positive
    from asyncrl.rewards.endpoint import build_scorer
    from asyncrl.rewards.hybrid import route_for
    from asyncrl.rewards.verifiers import episode_truth
    from asyncrl.messages.structs import RewardRequest

    reward = config.reward
    by_endpoint: dict[str, list[tuple[int, int, RewardRequest]]] = {}
    correct = [[False] * len(samples) for samples in texts]
    for i, (ex, samples) in enumerate(zip(examples, texts)):
        name = route_for(ex.data_source, reward.routes).endpoints[0]
        for j, text in enumerate(samples):
            truth = episode_truth(ex.ground_truth, ex.prompt_id, j)
            if reward.endpoints[name].kind in ("verifier", "python"):
                request = RewardRequest(prompt_id=ex.prompt_id, sample_idx=j, response_text=text, ground_truth=truth,
                                        data_source=ex.data_source, prompt_text=ex.text, row=ex.row)
                by_endpoint.setdefault(name, []).append((i, j, request))
            else:
                correct[i][j] = score_response(ex.data_source, text, truth, config.task.reward)[1]
    for name, items in by_endpoint.items():
        scorer = build_scorer(reward.endpoints[name], None, config.task.reward)
        try:
            rewards = scorer.score([request for _, _, request in items])
        finally:
            if hasattr(scorer, "close"):
                scorer.close()
        for (i, j, _), r in zip(items, rewards):
            correct[i][j] = not r.failed and is_positive(r.correct, r.score)
            if r.failed and failures is not None:
                failures.append(f"{masked(r.details.get('error', 'failed'))} (prompt {r.prompt_id}, sample {r.sample_idx})")
    return correct


def write_table(result: dict, out_dir: str) -> tuple[str, list[str]]:
    """The result as `eval.json` and a markdown table `eval.md` in `out_dir`: (the table, the
    paths written)."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, "eval.json"), os.path.join(out_dir, "eval.md")]
    with open(paths[0], "w") as f:
        json.dump(result, f, indent=2)
    keys = [k for k in result if k.startswith("pass@")]
    table = "| model | prompts | samples | " + " | ".join(keys) + " |\n|---|---|---|" + "---|" * len(keys) + "\n"
    table += f"| {result['model']} | {result['prompts']} | {result['samples_per_prompt']} | " + \
             " | ".join(f"{result[k]:.3f}" for k in keys) + " |\n"
    with open(paths[1], "w") as f:
        f.write(table)
    return table, paths


class EvaluationBeside:
    """Held-out evaluations during training that neither stop it nor hold the driver: each on a
    thread of its own, on the driver's engine, with a pinned copy of the weights of the version
    the learner has when it starts (`weights()`: `(version, weights)`). One runs at a time; a step
    due while one runs waits, and only the newest such step is evaluated after it (on the weights
    of its own start). Each result names the step that asked for it and the weight version it
    scored (`evals.jsonl` in the run directory, `results`), and goes on the next step record
    written (`annotate`: `eval_accuracy`, `eval_n`, `eval_step`, `eval_weight_version`)."""

    def __init__(self, config: Config, engine, tokenizer, weights, clock, run_dir: str, max_prompts: int | None):
        self.config, self.engine, self.tokenizer = config, engine, tokenizer
        self.weights, self.clock, self.max_prompts = weights, clock, max_prompts
        self.path = os.path.join(run_dir, "evals.jsonl")
        self.results: list[dict] = []  # every evaluation done, in order
        self._unrecorded: list[dict] = []  # results not yet on a step record
        self._pending: int | None = None  # the newest step due while one ran
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._cancel = threading.Event()
        self._closed = False  # stopped: no step is due any more

    def due(self, step: int) -> None:
        """Evaluate for `step`: now, or after the evaluation running."""
        with self._lock:
            if self._closed:
                return
            if self._thread is not None and self._thread.is_alive():
                self._pending = step
                return
            self._thread = threading.Thread(target=self._work, args=(step,), name="asyncrl-eval", daemon=True)
            self._thread.start()

    def annotate(self, record: dict) -> None:
        """The oldest result not yet recorded, on `record` (a step record about to be written)."""
        with self._lock:
            if not self._unrecorded:
                return
            result = self._unrecorded.pop(0)
        record.update({"eval_accuracy": result["accuracy"], "eval_n": result["n"], "eval_step": result["step"],
                       "eval_weight_version": result["weight_version"]})

    def stop(self, wait: bool = True) -> None:
        """No step is due from now on; the evaluation running and the one due after it are finished
        (`wait`), or the running one is cancelled after its engine call in progress. The engine is
        free when this returns."""
        with self._lock:
            self._closed = True
            if not wait:
                self._pending = None
                self._cancel.set()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _work(self, step: int | None) -> None:
        while step is not None:
            started = self.clock()
            try:
                version, weights = self.weights()  # pinned: a copy of this version, whatever the learner does next
                self.engine.update_weights(weights.items(), version)
                del weights
                result = greedy_accuracy(self.config, self.engine, self.tokenizer, self.max_prompts,
                                         cancel=self._cancel)
            except EvaluationCancelled:
                return
            except Exception as exc:  # the run restarting under it, an engine error: said, training goes on
                print(f"the evaluation for step {step} failed: {type(exc).__name__}: {exc}", flush=True)
                result, version = None, None
            with self._lock:
                if result is not None:
                    entry = {"step": step, "weight_version": version, **result, "started_s": started,
                             "finished_s": self.clock()}
                    self.results.append(entry)
                    self._unrecorded.append(entry)
                    with open(self.path, "a") as f:
                        f.write(json.dumps(entry) + "\n")
                step, self._pending = self._pending, None
