"""Prompts and data: the built-in tasks and their default scoring (`tasks`), users' files in verl's
and TRL's layouts (`files`), prompts' images as references in a content-addressed store (`images`), Pre-PPO's selection of prompts before training (`pre_ppo`) and the
retirement of prompts with no learning signal (`retirement`). May import the config, the messages,
the algorithms and (for Pre-PPO's scoring) the engines and rewards; never a role or the run."""
