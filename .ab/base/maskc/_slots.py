"""A bounded least-recently-used map shared by threads, for maskc's caches: the runtime's plans
and block maps, and the trace-level caches of pure sympy steps (maskc/trace/dag.py)."""
from __future__ import annotations

import threading
from collections import OrderedDict


class Slots:
    """A bounded map that drops its least recently used entry first, shared by threads."""

    def __init__(self, size: int):
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self._size = size

    def get(self, key):
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key, value) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            if len(self._items) > self._size:
                self._items.popitem(last=False)

    def values(self) -> list:
        with self._lock:
            return list(self._items.values())

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def __len__(self) -> int:
        return len(self._items)


__all__ = ["Slots"]
