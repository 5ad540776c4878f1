"""Where a run's step records go besides `metrics.jsonl` (`trainer.loggers`), the same for `asyncrl
train` and the Serve `train` app, each from its own process: a wandb run, TensorBoard scalars, and
Ray metrics (`asyncrl.run.ray_metrics`: the live figures as gauges on Ray's Prometheus endpoint).

A run is one wandb run however many processes it takes: the id is kept in the run directory
(`loggers.json`) and every later process that resumes the run (`resume=true`, a Serve controller
that replaces another) opens it again with `resume="allow"`; a start without resuming is a new run. Offline, wandb writes each process's part to
`<run_dir>/wandb/offline-run-<time>-<id>/`, and `wandb sync` of them all uploads one run, part
after part. TensorBoard's event files of every part are in `<run_dir>/tensorboard/`, which
TensorBoard reads as one run.

Steps only go up, in both: a step redone after a restart from an earlier checkpoint is in
`metrics.jsonl` with both of its records, and logged here once (wandb drops a step below its last;
TensorBoard would draw two points). The last step logged is kept beside the id, so a resume that
redoes steps logged before it skips them too.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

from asyncrl.config import Config, to_record

STATE_FILE = "loggers.json"  # {"wandb_id": ..., "last_step": ...}
TENSORBOARD_DIR = "tensorboard"


def scalars(record: dict) -> dict[str, float]:
    """A step record's numbers (booleans as 0/1), the step itself aside: what TensorBoard takes.
    A NaN (a diverged loss) stays a NaN."""
    return {key: float(value) for key, value in record.items()
            if key != "step" and isinstance(value, (int, float))}


class StepLoggers:
    """The open loggers of one process of a run. `log` takes step records as `RunRecords` writes
    them; `finish` adds the run's last figures (wandb's summary) and closes every logger."""

    def __init__(self, run_dir: str, wandb_run: Any = None, tensorboard: Any = None, last_step: int = 0,
                 ray_metrics: Any = None):
        self.run_dir = run_dir
        self.wandb_run = wandb_run
        self.tensorboard = tensorboard
        self.ray_metrics = ray_metrics  # `asyncrl.run.ray_metrics.RayMetrics`
        self.last_step = last_step  # the highest step any process of the run has logged

    def log(self, records: list[dict], status: dict | None = None) -> None:
        """`status`: the run's status read with the records (the mailboxes' depths for Ray)."""
        if self.ray_metrics is not None:  # gauges show the run as it is now, a redone step too
            self.ray_metrics.log(records, status)
        if self.wandb_run is None and self.tensorboard is None:
            return
        logged = False
        for record in records:
            if record["step"] <= self.last_step:
                continue
            if self.wandb_run is not None:
                self.wandb_run.log(record, step=record["step"])
            if self.tensorboard is not None:
                for key, value in scalars(record).items():
                    self.tensorboard.add_scalar(key, value, record["step"])
            self.last_step, logged = record["step"], True
        if logged:
            if self.tensorboard is not None:
                self.tensorboard.flush()  # readable while the run goes on
            _write_state(self.run_dir, {**_read_state(self.run_dir), "last_step": self.last_step})

    def finish(self, summary: dict | None = None) -> None:
        """The run's figures of the end (wandb's summary), then every logger closed; once."""
        if self.wandb_run is not None:
            if summary:
                self.wandb_run.summary.update(summary)
            self.wandb_run.finish()
            self.wandb_run = None
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None


def open_loggers(config: Config, run_dir: str) -> StepLoggers:
    """The loggers `config.trainer.loggers` names, for the run in `run_dir`: a resumed run's own
    (`config.resume`: its wandb id, its last step); a run started afresh in a directory used
    before is a new run (a new wandb id; TensorBoard drops the old run's points from step 1 on)."""
    state = _read_state(run_dir) if config.resume else {}
    wanted = config.trainer.loggers
    wandb_mode = os.environ.get("WANDB_MODE", config.trainer.wandb_mode)
    use_wandb = "wandb" in wanted and wandb_mode != "disabled"
    if use_wandb:
        state.setdefault("wandb_id", uuid.uuid4().hex[:12])  # wandb's own are 8 characters of [a-z0-9]
    state.setdefault("last_step", 0)
    loggers = StepLoggers(run_dir, last_step=int(state["last_step"]))
    if use_wandb or "tensorboard" in wanted:
        _write_state(run_dir, state)  # before wandb starts: a process that dies in it still names the run
    if use_wandb:
        loggers.wandb_run = _open_wandb(config, run_dir, state["wandb_id"], wandb_mode)
    if "tensorboard" in wanted:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a START marker at step 1, past which TensorBoard drops the points of files before it.
        loggers.tensorboard = SummaryWriter(os.path.join(run_dir, TENSORBOARD_DIR),
                                            purge_step=None if config.resume else 1)
    if "ray" in wanted:
        from asyncrl.run.ray_metrics import RayMetrics, export_address, run_name

        loggers.ray_metrics = RayMetrics(run_name(config, run_dir))
        where = export_address() or "the Ray cluster's metrics endpoint"
        print(f"Ray metrics of run {run_name(config, run_dir)!r} (asyncrl_*): {where}", flush=True)
    return loggers


def _open_wandb(config: Config, run_dir: str, run_id: str, mode: str) -> Any:
    """The run's wandb run, `run_id` opened with `resume="allow"`: a new run the first time, the
    same one from every later process of the run."""
    import wandb

    trainer = config.trainer
    name = trainer.experiment_name or os.path.basename(os.path.abspath(run_dir))
    # quiet: no run summary printed after the run (the driver prints its own figures, labelled).
    run = wandb.init(project=trainer.wandb_project, name=name, group=trainer.wandb_group or None,
                     tags=list(trainer.wandb_tags) or None, id=run_id, resume="allow", dir=run_dir, mode=mode,
                     settings=wandb.Settings(quiet=True))
    # A resumed run's config differs from the first part's (resume, total_steps): the newest wins.
    run.config.update(to_record(config), allow_val_change=True)
    return run


def _read_state(run_dir: str) -> dict:
    try:
        with open(os.path.join(run_dir, STATE_FILE)) as f:
            state = json.load(f)
    except FileNotFoundError:
        return {}
    return state if isinstance(state, dict) else {}


def _write_state(run_dir: str, state: dict) -> None:
    """`loggers.json`, replaced whole (a reader never sees half of it)."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, STATE_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(state, f)
    os.replace(path + ".tmp", path)
