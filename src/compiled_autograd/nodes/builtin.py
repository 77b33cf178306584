"""Built-in nodes (the generated ones, Foreach nodes, CopySlices): their real C++ formula runs
on the trace's fakes through `apply_with_saved` (the native helper's apply_node), so the
graph records it as aten ops.

NOTE [Formulas that take another path when traced]
A few of torch's formulas branch on whether a tensor is "subclass-like" -- a FakeTensor is,
and so is every tensor while any TorchDispatchMode is active, as our recorders are -- or on
its data (`(input == 0).nonzero()`, `.item()`), and their two paths round differently. Traced,
such a formula records its subclass path, and every later run of the graph computes what eager
never does (an audit of torch 2.13's derivatives, each row checked against eager on CPU):

  ProdBackward0/1        eager: grad * result / input where no zero; traced: the zero-safe
                         cumprod formula (~4e-9 off; with two zeros, -0.0 where eager has 0.0)
  MaskedFillBackward1    value's grad: eager sums grad.masked_select(mask), traced
                         where(mask, grad, 0) (another summation order)
  Max/MinBackward1,      (CPU) eager: zeros masked_fill'ed with grad / count; traced:
  (Nan)MedianBackward0   mask * (grad / count): -0.0 for a negative grad, NaN for an infinite one
  CumprodBackward0,      only under create_graph (grad mode picks another formula): the O(n^2)
  LinalgDetBackward0     loop / the SVD formula where eager divides / solves (~8e-6)

Those nodes run as they are, inside the graph (an opaque call: no mode is active then, so the
formula takes eager's path), whose first backward learns how their outputs are laid out; under
create_graph, where opaque nodes are not taken, the backward runs in eager autograd. Every
other branch on subclass-likeness the audit found is structural only (an in-place op where
eager copies): bitwise the same.
"""

from __future__ import annotations

from ..errors import NeedsOpaque
from ..values import NodeFamily, NodeKind
from . import opaque

# node name -> when its traced formula rounds other than eager's: "always", "cpu" (on CUDA
# eager takes the traced path too), "create_graph"; for MaskedFillBackward1 only when value's
# grad is computed (its edge 1 is live)
OTHER_PATH = {
    "ProdBackward0": "always",
    "ProdBackward1": "always",
    "MaskedFillBackward1": "always",
    "MaxBackward1": "cpu",
    "MinBackward1": "cpu",
    "MedianBackward0": "cpu",
    "NanmedianBackward0": "cpu",
    "CumprodBackward0": "create_graph",
    "LinalgDetBackward0": "create_graph",
}
OTHER_PATH_REASON = "its formula takes another path when traced than eager's (NOTE [Formulas that take another path when traced])"


def other_path(collected, create_graph: bool) -> dict:
    """The nodes of this backward whose traced formula would not be eager's: index -> reason."""
    out = {}
    for i, n in enumerate(collected.nodes):
        when = OTHER_PATH.get(n.name)
        if when is None or not n.execute:
            continue
        if when == "create_graph" and not create_graph:
            continue
        if when == "cpu":
            md = collected.walk.input_metadata(i)
            if not md or md[0] is None or md[0][2] != "cpu":
                continue
        if n.name == "MaskedFillBackward1" and (len(n.edges) < 2 or n.edges[1][0] < 0):
            continue  # value's grad is not computed: self's is eager's
        out[i] = f"{n.name}: {OTHER_PATH_REASON}"
    return out


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
        t.node_inputs, t.node_values, t.unpacked_here = tensors, values, {}
        return t.walk.apply_node(idx, tensors)
    except Exception as e:
        # a formula that cannot run on fake tensors (data-dependent output
        # shapes, a missing meta kernel, a functional bound by another
        # compiler): that node runs as is, the rest stays compiled
        first = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        raise NeedsOpaque(idx, f"not traceable: {first}") from e


ROW = NodeFamily("node", NodeKind.GENERIC, trace, live=True)
