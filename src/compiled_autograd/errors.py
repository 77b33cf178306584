"""The errors compiled_autograd raises of its own (misuse gets eager's own errors)."""

from __future__ import annotations


class CompiledAutogradError(RuntimeError):
    """Raised under `fullgraph=True` when a backward cannot be compiled."""


class BackendOutputError(CompiledAutogradError):
    """A backend's compiled graph returned outputs that differ from the traced graph's: too
    few or too many, or one of another shape, dtype, device or layout (NOTE [A compiled
    graph's outputs are checked on its first run], replay/validate.py)."""


class Fallback(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class OpaqueSubclasses(Fallback):
    """A lifted tensor subclass without __tensor_flatten__: the walk runs again with every node that
    takes or returns a subclass's grad opaque (NOTE [Values passed by reference], nodes/references.py)."""


class NeedsOpaque(Exception):
    def __init__(self, idx: int, reason: str):
        super().__init__(reason)
        self.idx = idx
        self.reason = reason


class LearnLayouts(Exception):
    """A capture made nodes opaque whose outputs' layouts no backward has shown (their trace
    failed): this backward runs in eager autograd to learn them, and the next is captured
    (NOTE [Nodes made opaque by their trace], cache/learning.py)."""

    def __init__(self, idxs):
        super().__init__(f"{len(idxs)} nodes made opaque by the trace")
        self.idxs = tuple(idxs)


class ResumeHere(Exception):
    """A call of a running graph returned an output not as the graph was traced with it (another
    type or layout): the run stops there and the backward goes on in eager's order (NOTE [A call
    output not as traced], capture/resume.py). `outs`: what the call returned, per output;
    `args`: what it was given; `values`: what the graph held at the call (ResumePoint.values);
    `why`: "type" or "layout"."""

    def __init__(self, slot: int, outs: list, args: list, values: list, why: str):
        super().__init__(f"call {slot} returned another {why} than traced")
        self.slot, self.outs, self.args, self.values, self.why = slot, outs, args, values, why


class NotTwiceDifferentiable(Exception):
    """create_graph=True through a part of the backward eager records as an error node."""


class Unkeyable(Exception):
    """A value the key cannot hold (the runtime falls back when a saved-tensor hook's
    result is one)."""
