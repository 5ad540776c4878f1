"""The loop controls shared by the long-lived roles that train (stop, metrics hand-off)."""

from __future__ import annotations


class TrainingLoop:
    _running: bool = False
    _metrics: list[dict]

    def stop(self) -> None:
        self._running = False

    def pop_metrics(self) -> list[dict]:
        """Metrics recorded since the last call (the driver / controller drains them)."""
        out, self._metrics = self._metrics, []
        return out
