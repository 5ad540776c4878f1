"""Weights on the move: how a version travels from the policy learner to each generator
(`transport`, the one place that names the paths), the mechanisms it uses (`sync`: process groups,
shared memory, buckets), delta updates (`delta`), LoRA adapters and their merge (`lora`), and the
learner's data parallelism over ranks (`sharding`). May import the config and the messages; never an
engine, a role or the run (the engines import this, not the other way round)."""
