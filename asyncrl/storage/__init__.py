"""What a run writes down and reads back: checkpoints (`checkpoint`: layout, atomic commit,
checksums, retention, export), checkpoints that reach the run directory from any node
(`checkpoint_transfer`), the trajectory store of finished trajectories and trained batches as
Parquet (`trajectory_store`), and the ledger of every admitted sample (`ledger`). May import the
messages and the config; never an engine, a role or the run."""
