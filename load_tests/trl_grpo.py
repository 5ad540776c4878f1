"""TRL's GRPOTrainer on asyncrl's task, model and reward function (the other half of
`asyncrl bench trl`). Runs in the benchmark's own environment (`make bench-venv`), which adds TRL
to asyncrl's packages without installing it into asyncrl's.

Prints one JSON object: per-step wall time, trained samples and mean reward of the generated
samples, the same figures asyncrl's driver logs.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--overrides", default="[]", help="asyncrl Hydra overrides (JSON list): model, task, sizes")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import torch
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from asyncrl.config import compose
    from asyncrl.models.loading import load_policy
    from asyncrl.data.files import load_examples
    from asyncrl.data.tasks import score_response

    torch.set_num_threads(args.threads)
    config = compose(json.loads(args.overrides))
    a, p, e, t = config.algorithm, config.policy, config.engine, config.task
    model, tokenizer = load_policy(config.model)
    tokenizer.padding_side = "left"
    examples = load_examples(t, "train")
    rows = [{"prompt": ex.messages if config.model.use_chat_template else ex.text,
             "ground_truth": ex.ground_truth, "data_source": ex.data_source} for ex in examples]
    dataset = Dataset.from_list(rows * 200)  # epochs, as asyncrl's prompt source cycles

    def reward(prompts, completions, ground_truth, data_source, **_):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [score_response(ds, text, gt, t.reward)[0] for text, gt, ds in zip(texts, ground_truth, data_source)]

    log: list[dict] = []
    started = {}

    class Log(TrainerCallback):
        def on_train_begin(self, *_, **__):
            started["t"] = time.time()

        def on_log(self, _args, state, _control, logs=None, **__):
            if logs and "reward" in logs:
                log.append({"step": state.global_step, "wall_time_s": time.time() - started["t"],
                            "samples_trained": state.global_step * a.group_size * config.trainer.prompts_per_step,
                            "reward_mean_generated": logs["reward"]})

    batch = a.group_size * config.trainer.prompts_per_step
    with tempfile.TemporaryDirectory() as out_dir:
        trl_config = GRPOConfig(
            output_dir=out_dir, max_steps=args.steps, per_device_train_batch_size=batch, gradient_accumulation_steps=1,
            num_generations=a.group_size, max_completion_length=e.max_response_tokens,
            temperature=config.sampling.temperature, top_p=config.sampling.top_p, learning_rate=p.optimizer.lr,
            lr_scheduler_type="constant", warmup_steps=0, weight_decay=p.optimizer.weight_decay,
            max_grad_norm=p.optimizer.grad_clip, beta=a.kl.coef, epsilon=p.loss.clip_low, epsilon_high=p.loss.clip_high,
            loss_type="grpo", scale_rewards="group" if a.advantage.type == "grpo" else "none",
            num_iterations=1, logging_steps=1, report_to="none", use_cpu=True, bf16=False, save_strategy="no",
            seed=config.trainer.seed, dataloader_num_workers=0, disable_tqdm=True,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=trl_config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[Log()])
        trainer.remove_callback(PrinterCallback)  # one dict per step on stdout otherwise
        trainer.train()
    import trl

    with open(args.out, "w") as f:
        json.dump({"trl_version": trl.__version__, "records": log}, f)


if __name__ == "__main__":
    main()
