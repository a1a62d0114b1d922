"""A bounded least-recently-used map shared by threads, for maskc's caches: the runtime's plans
and block maps, and the trace-level caches of pure sympy steps (maskc/trace/dag.py). The
runtime's caches are bounded by the bytes their entries keep alive too (captured tensors,
tables), not only by their count."""
from __future__ import annotations

import threading
from collections import OrderedDict


class Slots:
    """A bounded map that drops its least recently used entry first, shared by threads.

    `held(value)`: what an entry keeps alive, as {identity: bytes} (a storage by its device and
    pointer), and `max_bytes()`: the bytes all entries may keep alive together, None for no
    bound (read at each put, so that a setting changed between calls holds). Memory two entries
    share counts once; the newest entry stays even where it alone is larger, so that repeating
    the call that made it finds it."""

    def __init__(self, size: int, held=None, max_bytes=None):
        self._items: OrderedDict = OrderedDict()
        self._held: dict = {}  # key -> held(value), taken at put
        self._lock = threading.Lock()
        self._size = size
        self._weigh, self._max_bytes = held, max_bytes

    def get(self, key):
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key, value) -> None:
        held = self._weigh(value) if self._weigh is not None else None
        limit = self._max_bytes() if self._max_bytes is not None else None
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            if held is not None:
                self._held[key] = held
            while len(self._items) > self._size or (
                    limit is not None and len(self._items) > 1 and self._nbytes() > limit):
                self._held.pop(self._items.popitem(last=False)[0], None)

    def values(self) -> list:
        with self._lock:
            return list(self._items.values())

    def drop(self, test) -> int:
        """Drop the entries whose value passes `test`; returns how many."""
        with self._lock:
            gone = [key for key, value in self._items.items() if test(value)]
            for key in gone:
                del self._items[key]
                self._held.pop(key, None)
            return len(gone)

    @property
    def nbytes(self) -> int:
        """The bytes the entries keep alive, as `held` counted them when each was put."""
        with self._lock:
            return self._nbytes()

    def _nbytes(self) -> int:
        union: dict = {}
        for held in self._held.values():
            union.update(held)
        return sum(union.values())

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._held.clear()

    def __len__(self) -> int:
        return len(self._items)


__all__ = ["Slots"]
