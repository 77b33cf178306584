"""The in-memory cache: graph key -> compiled backwards of that structure (what a hit runs;
runtime.py looks up and adds, a background compile swaps an entry for its compiled version).

A backward is identified by `(key, sizes)` (walk/collect.py). All compiled graphs
with the same key form a `Family`:
  * static entries, looked up by the exact sizes tuple;
  * dynamic entries: some size positions are symbolic; the entry matches when
    every other position equals its recorded value and its guards (what the
    symbolic trace and the compiler assumed about the sizes) hold.
The key covers every value a traced graph bakes in (NOTE [One key per graph]
in native/collect.cpp); a guard failure is a miss, never a wrong graph.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import torch

from ..values import BOXED, Plan


@dataclass(frozen=True)
class Dynamic:
    """Which sizes a dynamic entry takes as symbols, and its guards."""

    mask: tuple[bool, ...]  # per size position: symbolic?
    static: tuple  # the sizes at the positions that are not symbolic (None at symbolic ones)
    size_inputs: tuple[int, ...]  # size-input positions passed to the graph as ints
    guard_source: str | None  # Python expression over L['t<i>'] (graph inputs), or None
    guard: Callable | None = field(default=None, compare=False, repr=False)

    def matches(self, sizes: tuple) -> bool:
        return all(s is None or s == v for s, v in zip(self.static, sizes))

    def extra_args(self, sizes: tuple) -> list[int]:
        return [sizes[i] for i in self.size_inputs]

    def check(self, args) -> bool:
        if self.guard is None:
            return True
        return bool(self.guard({f"t{i}": a for i, a in enumerate(args)}))

    @property
    def symbolic(self) -> tuple[int, ...]:
        return tuple(i for i, m in enumerate(self.mask) if m)


@dataclass(frozen=True)
class CompiledBackward:
    """One captured and compiled backward graph (a frozen value)."""

    fn: Callable
    graph: torch.fx.GraphModule
    plan: Plan
    backend: str
    node_names: tuple[str, ...]
    num_inputs: int
    reason: str
    trace_seconds: float
    compile_seconds: float
    sizes: tuple = ()
    dynamic: Dynamic | None = None
    compiled: bool = True  # False until a background compile is done (fn runs the traced FX graph)
    compiling: bool = False  # its background compile is scheduled or running (NOTE [Steps while a graph compiles])
    nodes: tuple = ()  # (name, kind, hooks, opaque reason, edges) per node, for dump()
    node_keys: tuple = ()  # each node's bytes of the key, then the tensor metadata, for explain()
    # create_graph=True: the vjp graph of `graph`, which then returns its results and what the vjp
    # reads (NOTE [create_graph] in capture/create_graph.py)
    vjp: Any = None  # create_graph.Vjp
    # in-graph AccumulateGrad may steal a fresh grad from this backend's code (NOTE
    # [Stealing a fresh grad] in nodes/accumulate.py)
    steals: bool = False
    # NOTE [A compiled graph's outputs are checked on its first run] (replay/validate.py): what the
    # traced graph returns (validate.Expected, or None: not checked), and whether this
    # entry's fn has run once and passed (not copied by dataclasses.replace: a background
    # compile's entry is checked again)
    expected: Any = field(default=None, compare=False, repr=False)
    # the inputs' geometry where the graph's placeholders lack it (one loaded from the disk
    # cache): a callable giving fakes of them (NOTE [A graph you can run], compile/repro.py)
    inputs: Any = field(default=None, compare=False, repr=False)
    checked: bool = field(default=False, init=False, compare=False, repr=False)

    def __call__(self, args: list):
        """Run the graph. A boxed callable (values.BOXED) takes the list
        itself and empties it, so each input can be freed at its last use."""
        if getattr(self.fn, BOXED, False):
            return self.fn(args)
        return self.fn(*args)


class Payback:
    """NOTE [A compiled graph slower than eager]
    A compile pays back only where the compiled backward is faster than eager's, which on a CPU
    it need not be (a backward of matmuls and oneDNN convolutions is the same kernels either
    way, and the compiled one adds its calls). Where a graph was compiled in the background (its
    backwards ran in eager while it compiled: NOTE [Steps while a graph compiles]), the landed
    graph is judged against eager in the same conditions: its key's backwards take turns, one in
    the compiled graph, the next in eager autograd (bitwise the same results on eager and
    aot_eager; on inductor each is its own rounding), each timed, until SAMPLES of each (the
    compiled graph's first run is left out: its page faults). The eager backwards timed while it
    compiled are not the baseline: they shared the machine with the compile (its slices, the
    caches it filled; in a DDP job the allreduce waits on a rank that gave a slice), so they ran
    slower than eager and let a slower compiled graph pass (a 2-rank DDP job: 23.2 ms while
    compiling, 21.6 ms compiled, eager's own 17.1 ms). The turns follow the key's count of
    backwards since the graph began to compile, so ranks that step together take the same turn
    whichever step each landed at. Where the compiled median is above MARGIN times eager's, the
    graph is set aside: the key's backwards run in eager from then on, counted with the two
    times as the reason ("slower than eager": stats(), explain()). A graph compiled at once (no
    background compile, a graph loaded compiled) is kept."""

    SAMPLES = 5
    MARGIN = 1.05

    def __init__(self):
        self.background = False  # its backwards ran in eager while it compiled: judge the landed graph
        self.count = 0  # the key's backwards since it began to compile (whose parity picks the turn: the same step's on every rank)
        self.eager: list = []
        self.compiled: list = []
        self.verdict: str | None = None  # why the key runs in eager, once decided; "" kept

    def compiling(self) -> None:
        """A backward ran in eager while the graph compiled in the background."""
        self.background = True
        self.count += 1

    def turn(self, entry) -> str | None:
        """'compiled' or 'eager' where this backward of `entry` is timed, None where it is not."""
        if self.verdict is not None or not self.background or not entry.compiled:
            return None
        self.count += 1
        if not self.compiled:
            return "compiled"  # (the first, left out)
        if len(self.eager) < self.SAMPLES and (self.count % 2 == 0 or len(self.compiled) > self.SAMPLES):
            return "eager"
        return "compiled"

    def note(self, turn: str, seconds: float) -> bool:
        """A timed backward; True when it decided that the graph is slower than eager."""
        (self.eager if turn == "eager" else self.compiled).append(seconds)
        if len(self.compiled) <= self.SAMPLES or len(self.eager) < self.SAMPLES:
            return False
        import statistics

        eager, compiled = statistics.median(self.eager), statistics.median(self.compiled[1:])
        if compiled > self.MARGIN * eager:
            self.verdict = (
                f"the compiled graph is slower than eager in this run ({1e3 * compiled:.2f} ms a backward against "
                f"eager's {1e3 * eager:.2f} ms, taking turns): its backwards run in eager (NOTE [A compiled graph slower than eager])"
            )
            return True
        self.verdict = ""
        return False

    def summary(self) -> str:
        """What the turns found, for explain(): '' where the graph is not judged."""
        if not self.background or not self.compiled:
            return ""
        if self.verdict is None:
            return (
                f"a graph compiled in the background, in turns with eager: {len(self.compiled)} compiled and "
                f"{len(self.eager)} eager backwards timed of {self.SAMPLES + 1} and {self.SAMPLES}"
            )
        import statistics

        eager, compiled = statistics.median(self.eager), statistics.median(self.compiled[1:])
        what = "set aside: its backwards run in eager" if self.verdict else "kept"
        return (
            f"a graph compiled in the background, judged in turns with eager: {1e3 * compiled:.2f} ms a backward "
            f"against eager's {1e3 * eager:.2f} ms (medians of {self.SAMPLES}): {what}"
        )


class Family:
    """The compiled graphs of one key."""

    def __init__(self):
        self.static: OrderedDict[tuple, CompiledBackward] = OrderedDict()
        self.dynamic: list[CompiledBackward] = []
        self.payback = Payback()

    def lookup(self, sizes: tuple, lifted) -> tuple[CompiledBackward | None, list]:
        entry = self.static.get(sizes)
        if entry is not None:
            return entry, []
        for entry in reversed(self.dynamic):
            d = entry.dynamic
            if d.matches(sizes):
                extra = d.extra_args(sizes)
                if d.check(list(lifted) + extra):
                    return entry, extra
        return None, []

    def add(self, entry: CompiledBackward) -> None:
        if entry.dynamic is None:
            self.static[entry.sizes] = entry
        else:
            self.dynamic.append(entry)

    def entries(self) -> list[CompiledBackward]:
        return list(self.static.values()) + list(self.dynamic)

    def replace(self, old: CompiledBackward, new: CompiledBackward) -> None:
        if self.static.get(old.sizes) is old:
            self.static[old.sizes] = new
        self.dynamic = [new if e is old else e for e in self.dynamic]

    def remove(self, entry: CompiledBackward) -> None:
        if self.static.get(entry.sizes) is entry:
            del self.static[entry.sizes]
        self.dynamic = [e for e in self.dynamic if e is not entry]

    def __len__(self) -> int:
        return len(self.static) + len(self.dynamic)


class Cache:
    def __init__(self):
        self._families: OrderedDict[Hashable, Family] = OrderedDict()
        self._lock = threading.Lock()

    def family(self, key: Hashable, create: bool = False) -> Family | None:
        with self._lock:
            fam = self._families.get(key)
            if fam is None and create:
                fam = self._families[key] = Family()
            if fam is not None:
                self._families.move_to_end(key)
            return fam

    def evict(self, limit: int) -> None:
        with self._lock:
            while sum(len(f) for f in self._families.values()) > limit and len(self._families) > 1:
                self._families.popitem(last=False)
            # a single family over the limit drops its oldest static entries
            for fam in self._families.values():
                while len(fam) > limit and fam.static:
                    fam.static.popitem(last=False)
                while len(fam) > limit and fam.dynamic:
                    fam.dynamic.pop(0)

    def entries(self) -> list[CompiledBackward]:
        with self._lock:
            return [e for f in self._families.values() for e in f.entries()]

    def replace(self, key: Hashable, old: CompiledBackward, new: CompiledBackward) -> None:
        """Swap an entry for its compiled version (if it is still cached)."""
        with self._lock:
            fam = self._families.get(key)
            if fam is not None:
                fam.replace(old, new)

    def discard(self, key: Hashable, entry: CompiledBackward) -> None:
        """Drop an entry (if it is still cached), and its family once empty."""
        with self._lock:
            fam = self._families.get(key)
            if fam is not None:
                fam.remove(entry)
                if not len(fam):
                    del self._families[key]

    def items(self) -> list[tuple[Hashable, Family]]:
        with self._lock:
            return list(self._families.items())

    def clear(self) -> None:
        with self._lock:
            self._families.clear()

    def __len__(self) -> int:
        return sum(len(f) for f in self._families.values())


CACHE = Cache()
