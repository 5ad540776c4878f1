"""From segments to training batches: the estimators (which decide) and the pure functions they use.

One seam (`asyncrl.assembly.decisions`): an estimator is told of new rows and scored samples and
returns a `Decision` (kept, dropped with a reason, ready batches, trajectories for the critic);
the assembler role (`actors.assembler`) alone acts on it (ledger, counters, store, staleness mask,
batches). Each estimator feeds one kind of advantage function (`asyncrl.algo.advantages.ADVANTAGES`,
chosen by `algorithm.estimator`) through the strategy of that kind (`strategies.STRATEGIES`).
Overlong shaping is applied once, by the assembler, when a reward arrives (`Scored.score`).
"""
