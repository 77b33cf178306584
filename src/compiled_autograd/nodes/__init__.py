"""Node families: the rules for each kind of node, one module each (the walk's NodeKind ->
its trace rule). Opaque nodes, hooks, AccumulateGrad and saved-tensor hooks have their own
modules, called by the tracer's loop at their step (capture/trace.py)."""

from __future__ import annotations

from ..values import NodeKind
from . import builtin, function

TRACE_RULES = {NodeKind.GENERIC: builtin.trace, NodeKind.PYNODE: function.trace}
