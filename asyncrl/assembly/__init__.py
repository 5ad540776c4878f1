"""From segments to training batches: the assembly strategies (which decide) and the pure functions they use.

One seam (`asyncrl.assembly.decisions`): a strategy is told of new rows and scored samples and
returns a `Decision` (kept, dropped with a reason, ready batches, trajectories for the critic);
the assembler role (`actors.assembler`) alone acts on it (ledger, counters, store, staleness mask,
batches). Each kind of advantage function (`asyncrl.algo.advantages.ADVANTAGES`, chosen by
`algorithm.advantage.type`) is fed by the strategy of that kind (`strategies.STRATEGIES`).
Overlong shaping is applied once, by the assembler, when a reward arrives (`Scored.score`).
"""
