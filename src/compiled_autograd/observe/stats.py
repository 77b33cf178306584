"""Counters: what compiled_autograd did, and why it did not when it did not."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field, fields


@dataclass
class Stats:
    """Process-wide counters (`ca.stats()` returns a snapshot).

    captures:        graphs traced and compiled (cache misses that compiled)
    dynamic_captures: those of them with symbolic sizes
    disk_hits:       graphs loaded from the on-disk cache instead of traced
    hits:            backwards served by a cached compiled graph
    eager_fallbacks: backwards that ran in eager autograd instead
    eager_while_compiling: backwards of a graph whose background compile was still running,
                     run by eager autograd's engine (NOTE [Steps while a graph compiles]; not
                     fallbacks: the compiled graph takes over when it is ready)
    eager_turns:     backwards of a graph compiled in the background run in eager autograd in
                     turn with its compiled ones, both timed, to judge it (NOTE [A compiled graph
                     slower than eager] in cache/memory.py; not fallbacks)
    learning_backwards: backwards run in eager autograd to learn what saved-tensor unpack
                     hooks return (the first of each graph and sizes with such hooks; not
                     fallbacks: the next one is compiled)
    opaque_nodes:    nodes run eagerly inside a compiled graph (per backward run)
    opaque_reasons:  Counter of kind -> runs of opaque nodes (observe/reasons.py OPAQUES)
    opaque_details:  Counter of "node: what happened" -> runs (bounded)
    fallback_reasons: Counter of kind -> eager fallbacks (observe/reasons.py FALLBACKS)
    fallback_details: Counter of what happened -> eager fallbacks (bounded)
    trace_seconds / compile_seconds: time spent capturing and compiling
    compiles_pending: background compiles still running (see `synchronize()`)
    compile_failures: background compiles that failed (the traced graph stays in use)
    child_compiles:  background compiles first done by a child process, whose result the
                     training process loaded from inductor's caches (NOTE [Compiling in a child
                     process] in compile/child.py)
    shared_compiles: background compiles another process made while this one waited for it
                     (NOTE [One compile per machine] in compile/claims.py)
    packages_loaded: graphs loaded from the disk cache with their compiled package, no
                     inductor imported (NOTE [Compiled graphs loaded without inductor] in
                     compile/package.py)
    make_fx_traces:  static captures traced with make_fx because the recorder did not take
                     them (NOTE [Recording a static trace] in capture/record.py)
    live_records:    captures recorded on the real tensors, their results the first backward's
                     (NOTE [Recording on the real tensors] in capture/record.py)
    live_refusals:   captures a live record refused, traced on fakes instead
    layout_copies:   outputs of hooks, opaque nodes and unpack hooks copied into the layout
                     the graph was traced with (NOTE [Layouts of call outputs] in calls/kernel.py)
    layout_resumes:  backwards in which a call returned another layout than traced, finished in
                     eager's order from that call, bitwise (NOTE [A call output not as traced] in
                     capture/resume.py)
    type_resumes:    backwards in which a call returned a tensor subclass where the graph has a
                     plain tensor, finished in eager's order from that call (the same NOTE)
    """

    captures: int = 0
    dynamic_captures: int = 0
    disk_hits: int = 0
    hits: int = 0
    eager_fallbacks: int = 0
    learning_backwards: int = 0
    eager_while_compiling: int = 0
    eager_turns: int = 0
    opaque_nodes: int = 0
    fallback_reasons: Counter = field(default_factory=Counter)
    opaque_reasons: Counter = field(default_factory=Counter)
    fallback_details: Counter = field(default_factory=Counter)
    opaque_details: Counter = field(default_factory=Counter)
    trace_seconds: float = 0.0
    compile_seconds: float = 0.0
    compiles_pending: int = 0
    compile_failures: int = 0
    child_compiles: int = 0
    shared_compiles: int = 0
    packages_loaded: int = 0
    layout_copies: int = 0
    layout_resumes: int = 0
    type_resumes: int = 0
    make_fx_traces: int = 0
    live_records: int = 0
    live_refusals: int = 0

    def snapshot(self) -> "Stats":
        return Stats(**{f.name: (Counter(v) if isinstance(v, Counter) else v) for f in fields(self) for v in [getattr(self, f.name)]})

    def __str__(self) -> str:
        reasons = ", ".join(f"{r}: {n}" for r, n in self.fallback_reasons.most_common())
        learning = f"learning_backwards={self.learning_backwards} " if self.learning_backwards else ""
        learning += f"layout_copies={self.layout_copies} " if self.layout_copies else ""
        learning += f"layout_resumes={self.layout_resumes} " if self.layout_resumes else ""
        learning += f"type_resumes={self.type_resumes} " if self.type_resumes else ""
        learning += f"packages_loaded={self.packages_loaded} " if self.packages_loaded else ""
        learning += f"eager_while_compiling={self.eager_while_compiling} " if self.eager_while_compiling else ""
        learning += f"eager_turns={self.eager_turns} " if self.eager_turns else ""
        return (
            f"captures={self.captures} (dynamic {self.dynamic_captures}) disk_hits={self.disk_hits} hits={self.hits} "
            f"eager_fallbacks={self.eager_fallbacks} {learning}"
            f"opaque_nodes={self.opaque_nodes} trace={self.trace_seconds:.2f}s "
            f"compile={self.compile_seconds:.2f}s" + (f" fallbacks[{reasons}]" if reasons else "")
        )


STATS = Stats()
LOCK = threading.RLock()


def reset_stats() -> None:
    global STATS
    with LOCK:
        STATS.__init__()
