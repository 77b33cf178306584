"""Cache: key -> compiled backward.

The key is `(backend, global state, graph key)`; the graph key comes from the
native collector and covers every value the traced graph bakes in (see NOTE
[One key per graph] in native/_C.cpp).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable

import torch

from .trace import Plan


@dataclass(frozen=True)
class CompiledBackward:
    """One captured and compiled backward graph (a frozen value)."""

    fn: Callable
    graph: torch.fx.GraphModule
    plan: "Plan"
    backend: str
    node_names: tuple[str, ...]
    num_inputs: int
    reason: str
    trace_seconds: float
    compile_seconds: float

    def __call__(self, lifted):
        return self.fn(*lifted)


class Cache:
    def __init__(self):
        self._entries: OrderedDict[Hashable, CompiledBackward] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> CompiledBackward | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, key: Hashable, entry: CompiledBackward, limit: int) -> None:
        with self._lock:
            self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > limit:
                self._entries.popitem(last=False)

    def entries(self) -> list[CompiledBackward]:
        with self._lock:
            return list(self._entries.values())

    def keys(self) -> list[Hashable]:
        with self._lock:
            return list(self._entries.keys())

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


CACHE = Cache()
