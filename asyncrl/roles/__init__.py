"""The long-lived roles of a training run, one module each: prompt source, generator, assembler (with
its estimators), policy learner and value learner. Each is a plain class that holds state and does
I/O through mailboxes and callables; `shells.py` builds each from its config sections and wraps it
in a thin Ray actor. The reward scorers are not roles: they live in `asyncrl/rewards/`."""
