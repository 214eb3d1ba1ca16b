"""A bounded memory of counts: two generations, an approximate LRU without bookkeeping.

New entries and hits go into the young generation; when it holds ``entries / 2`` it becomes the
old one and the old one is dropped. An entry used in the current or the previous generation is
remembered, so memory is bounded by ``entries`` whatever the churn (an ``OrderedDict`` LRU under
the same churn settled at twice the memory, and later: ``benchmarks/memory.py``).

Used for the token counts of whole texts (``extproc.tokens.estimate``, under its lock) and of pieces
(``extproc.tokens.pieces``, without one: a count lost to a race is only asked again). The hot loop
of the latter reads ``young`` directly and calls ``get`` only when it misses.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class TwoGenerations(Generic[K]):
    def __init__(self, entries: int) -> None:
        self.entries = entries
        self.young: dict[K, int] = {}
        self._old: dict[K, int] = {}

    def __len__(self) -> int:
        return len(self.young) + len(self._old)

    def __iter__(self) -> Iterator[K]:
        yield from self.young
        yield from self._old

    def get(self, key: K) -> int | None:
        """The remembered count, if any; one found in the old generation lives another."""
        hit = self.young.get(key)
        if hit is None and (hit := self._old.get(key)) is not None:
            self.put(key, hit)
        return hit

    def put(self, key: K, count: int) -> None:
        self.young[key] = count
        if len(self.young) >= max(1, self.entries // 2):
            self._old, self.young = self.young, {}
