"""What the stages hand each other, each defined once and read by name.

The native helper builds some of them as plain tuples in the field order given
here (its `GraphCapture.nodes()` makes NodeRows' tuples); nothing reads them by
position but the constructors below.
"""

from __future__ import annotations

import enum
from typing import NamedTuple


class NodeKind(enum.IntEnum):
    """How the native walker classed a node (native/_C.cpp `enum Kind`)."""

    GENERIC = 0  # implements torch's compiled-autograd interface: traced through apply_with_saved
    ACCUMULATE = 1  # AccumulateGrad
    PYNODE = 2  # a custom autograd.Function: its Python backward is traced
    OPAQUE = 3  # runs as is inside the graph (a C++ custom Function, ...)


class Hooks(NamedTuple):
    """How many hooks of each kind a node has, as the walk found them."""

    tensor_pre: int  # tensor pre-hooks (`tensor.register_hook`)
    retains: int  # retain_grad()
    pre: int  # `grad_fn.register_prehook`
    post: int  # `grad_fn.register_hook`
    post_accumulate: int  # a leaf's post-accumulate-grad hooks (AccumulateGrad)

    @property
    def any(self) -> bool:
        return any(self)


class NodeRow(NamedTuple):
    """One node of the backward, in the engine's order (`Collected.nodes`)."""

    name: str
    kind: NodeKind
    execute: bool  # the backward runs it (not only a node `inputs=` captures at)
    opaque: bool  # the walker decided it runs as is
    opaque_reason: str
    edges: tuple  # (node index or -1, input_nr) per output
    captures: tuple  # (input_nr, result index) where grad() captures what reaches it
    hooks: Hooks
    num_inputs: int
    edge_sizes: tuple  # per edge, where its input metadata's sizes start in the sizes vector (-1: none)
    size_start: int  # where this node's saved sizes start in the sizes vector

    @staticmethod
    def rows(capture) -> tuple:
        """The walk's nodes, from the native helper's tuples."""
        return tuple(
            NodeRow(name, NodeKind(kind), execute, opaque, reason, tuple(edges), tuple(caps), Hooks(*hooks), n, tuple(sizes), start)
            for name, kind, execute, opaque, reason, edges, caps, hooks, n, sizes, start in capture.nodes()
        )


class NodeSummary(NamedTuple):
    """A node as a cached graph remembers it, for `explain()` and `dump()`."""

    name: str
    kind: NodeKind
    hooks: Hooks
    opaque_reason: str | None  # why it ran opaquely in this graph, or None
    edges: tuple
