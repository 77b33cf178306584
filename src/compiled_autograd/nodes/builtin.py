"""Built-in nodes (the generated ones, Foreach nodes, CopySlices): their real C++ formula runs
on the trace's fakes through `apply_with_saved` (the native helper's apply_node), so the
graph records it as aten ops."""

from __future__ import annotations

from ..errors import NeedsOpaque
from . import opaque


def trace(t, idx, values, args):
    tensors = [v.t if v is not None else None for v in values]
    defined = [v for v in values if v is not None]
    if len(defined) > 1 and any(v.bits is not None for v in defined):
        # a formula given an undefined grad beside others skips its terms; on the zeros
        # standing in for it, 0 * inf in such a term would be NaN (var_mean's var term
        # with one element). The node runs as is, given None where eager gives None.
        # (Inline: a flag means a hook or an opaque node is already in the graph.)
        t.opaque_extra[idx] = "a grad that may be None at run time, beside others"
        return opaque.trace(t, idx, values)
    try:
        t.node_inputs = tensors
        return t.capture.apply_node(idx, tensors)
    except Exception as e:
        # a formula that cannot run on fake tensors (data-dependent output
        # shapes, a missing meta kernel, a functional bound by another
        # compiler): that node runs as is, the rest stays compiled
        first = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise NeedsOpaque(idx, f"not traceable: {first}") from e
