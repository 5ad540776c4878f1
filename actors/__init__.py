"""The long-lived roles of a training run, one module each: prompt source, generator, assembler,
policy learner, value learner, recorder, reward endpoints.

Each module holds the role (a plain class that holds state and does I/O through mailboxes and
the callables it is given: tests use it without Ray), the builder that makes it from its config
sections, and its thin Ray shell. The roles import only the library below them (`asyncrl`),
never each other: they reach one another through the handles and callables the run wires
(`asyncrl.run.wiring`). Algorithms live in `asyncrl.algo` and `asyncrl.assembly`, not here.
"""
