"""A prompt's data row, fetched once per prompt for the reward calls that read it.

A row of the user's data (every column: `extra_info`, long reference texts, a test suite) is read
only by reward functions. It stays with the prompt source; the assembler asks for the rows of the
prompts it scores (`rows_of`, one call for a scoring batch) and keeps them while their samples
come in (the most recent `keep` prompts), instead of the row riding in every prompt request, each
of the G samples' segments, every batch and checkpoint. A task without rows (the built-in ones)
answers None once, and the lookup stops there.
"""

from __future__ import annotations

import collections
from typing import Awaitable, Callable

import msgspec

from asyncrl.messages.structs import Reward, RewardRequest

RowsOf = Callable[[list[str]], Awaitable[dict[str, dict | None] | None]]


class PromptRows:
    """Reward requests completed with their prompts' rows (see the module's docstring)."""

    def __init__(self, rows_of: RowsOf, keep: int = 512):
        self.rows_of, self.keep = rows_of, keep
        self._rows: collections.OrderedDict[str, dict | None] = collections.OrderedDict()
        self.has_rows = True  # until the prompt source says its task has none
        self.fetched = 0  # rows fetched: once per prompt while it is kept

    async def fill(self, requests: list[RewardRequest]) -> list[RewardRequest]:
        if not self.has_rows or not requests:
            return requests
        missing = sorted({r.prompt_id for r in requests if r.row is None} - set(self._rows))
        if missing:
            answer = await self.rows_of(missing)
            if answer is None:
                self.has_rows = False
                return requests
            self.fetched += len(answer)
            self._rows.update(answer)
        filled = [r if r.row is not None or self._rows.get(r.prompt_id) is None
                  else msgspec.structs.replace(r, row=self._rows[r.prompt_id]) for r in requests]
        for pid in {r.prompt_id for r in requests}:
            if pid in self._rows:
                self._rows.move_to_end(pid)
        while len(self._rows) > self.keep:
            self._rows.popitem(last=False)
        return filled


def scoring_with_rows(score: Callable[[list[RewardRequest]], Awaitable[list[Reward]]],
                      rows: PromptRows) -> Callable[[list[RewardRequest]], Awaitable[list[Reward]]]:
    """`score` whose requests carry their prompts' rows."""
    async def scored(requests: list[RewardRequest]) -> list[Reward]:
        return await score(await rows.fill(requests))

    return scored
