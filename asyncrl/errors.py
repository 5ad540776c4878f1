"""Errors a command ends on with one line and no traceback, each saying what is wrong and what to do
(the CLI prints the line; its exit status is the error's `exit_status`). Light to import: the CLI
reads this before it knows whether a command needs torch or Ray."""

from __future__ import annotations


class StartupError(RuntimeError):
    """The run could not start on this machine (Ray, a port): what to try."""

    exit_status = 2


class RewardsFailing(RuntimeError):
    """Every reward of the first samples failed: the one line naming the function, the exception and
    the sample. Training on rewards that all fail would only burn time."""

    exit_status = 1
