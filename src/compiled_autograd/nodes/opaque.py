"""Opaque nodes: run as is inside the graph, one compiled_autograd::call each (C++ custom
Functions, what cannot be traced, what enable(opaque=...) names); their outputs laid out as an
eager backward showed (NOTE [Layouts of call outputs], calls/kernel.py)."""

from __future__ import annotations

import torch

from ..values import REFERENCE, CallHow, NodeFamily, NodeKind, OutputMeta, SlotKind
from . import compiled_region, references
from .grads import Value

FAMILY = "opaque"
NODE = "node"  # the node itself, run as is


def is_opaque(t, idx) -> bool:
    n = t.nodes[idx]
    if n.opaque or idx in t.opaque_extra:
        return True
    info = t.c.pynodes.get(idx)
    return info is not None and info.opaque_reason is not None


def may_read_grads(t, idx) -> bool:
    """Whether an opaque node may run code that reads a `.grad` (so AccumulateGrad runs at its
    eager position): a custom Function's backward or a C++ node we know nothing of may; a
    built-in formula (marked opaque, or not traceable on fakes) does not, nor does the
    backward AOTAutograd compiled for a torch.compile'd forward (a compiled graph of aten
    ops between its prologue and epilogue)."""
    if idx in t.c.pynodes:
        return not compiled_region.is_compiled_function(t.walk.node_object(idx)._forward_cls)
    n = t.nodes[idx]
    return n.opaque and not (n.kind == NodeKind.GENERIC and references.REASON in n.opaque_reason)


def reason(t, idx) -> str:
    n = t.nodes[idx]
    if n.opaque:
        return n.opaque_reason
    if idx in t.opaque_extra:
        return t.opaque_extra[idx]
    return t.c.pynodes[idx].opaque_reason


def trace(t, idx, values):
    edges, edge_sizes = t.nodes[idx].edges, t.nodes[idx].edge_sizes
    metas, by_reference = [], []
    # what it computes from a value the graph cannot hold, the graph does not hold either (a
    # subclass grad through a plain edge: NOTE [A call output not as traced], capture/resume.py)
    given = any(v is not None and t.is_reference(v.t) for v in values)
    for k, ((to, nr), pos) in enumerate(zip(edges, edge_sizes)):
        m = None
        md = t.walk.input_metadata(to)[nr] if to >= 0 else None
        if md is not None and (given or md[0] is None or nr in t.walk.subclass_inputs(to) or t.layouts.get(("node", idx, k)) == REFERENCE):
            # a grad that is a tensor subclass (a nested tensor, whose sizes are no ints; a
            # DTensor; one an eager backward saw come) from a node the graph does not trace: held
            # beside the graph, a token in it (NOTE [Values passed by reference], nodes/references.py)
            m = references.token(md[1], md[2])
            by_reference.append(k)
        elif md is not None:
            # the output's shape, symbolic where the edge's metadata sizes are; laid out
            # as an eager backward showed (NOTE [Layouts of call outputs], calls/kernel.py)
            shape, dtype, device = md
            dims = [v if t.sym_sizes[pos + d] is None else t.sym_sizes[pos + d] for d, v in enumerate(shape)]
            m = t._seen_layout(OutputMeta.dense(dims, dtype, torch.device(device)), t.layouts.get(("node", idx, k)))
        metas.append(m)
    tensors = [v.t if v is not None else None for v in values]
    outs, flag = t._call(NODE, idx, tensors, metas, flags=True, values=values, by_reference_outs=by_reference)
    result, k = [], 0
    for o in outs:
        if o is None:
            result.append(None)
        elif flag is None:  # (run for real: what came back is defined; capture/resume.py)
            result.append(Value(o))
        else:
            result.append(Value(o, ((flag, k),), exact=True))
            k += 1
    return result


def _run(capture, node, args, mask, metas, hooks, steal):
    return capture.call_node(node, args)


# a grad it returns where the trace had None goes nowhere: its edge is not in the graph
SLOT_KINDS = (SlotKind(NODE, FAMILY, _run, CallHow.NODE, stage=2, resumable=True, new_grads_go_nowhere=True),)


def _trace_node(t, idx, values, args):
    return trace(t, idx, values)


ROW = NodeFamily(FAMILY, NodeKind.OPAQUE, _trace_node)
