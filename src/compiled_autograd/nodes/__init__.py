"""Node families: the rules for each kind of node, one module each, in one registry.

  FAMILIES    the walk's NodeKind -> its family's row (values.NodeFamily): how the trace
              runs such a node, whether a live record may take it, whether enable(opaque=...)
              may name it, whether hooks on it may read saved tensors, how dump() draws it
  SLOT_KINDS  each kind of call -> its row (values.SlotKind): the one table the trace, the
              passes, the call's kernel and the native helper follow

The families: built-in nodes (builtin.py: generated nodes, Foreach nodes, CopySlices, each
through its own C++ formula), AccumulateGrad (accumulate.py), custom Functions (function.py,
with the Python state their backwards read, state.py, and the sizes kept on ctx,
ctx_sizes.py; torch.compile'd regions inlined, compiled_region.py), opaque nodes (opaque.py),
and the calls that are no node: hooks (hooks.py), saved-tensor hooks (saved_tensors.py) and the
sums of grads held by reference (references.py).
What earlier backwards taught is one store, learned.py.
"""

from __future__ import annotations

from . import accumulate, builtin, function, hooks, opaque, references, saved_tensors

FAMILIES = {row.kind: row for row in (builtin.ROW, accumulate.ROW, function.ROW, opaque.ROW)}

SLOT_KINDS = {row.name: row for family in (hooks, opaque, references, accumulate, saved_tensors) for row in family.SLOT_KINDS}
