"""Values passed by reference: the grads a graph cannot hold, kept beside it, a token in it.

NOTE [Values passed by reference]
Some grads a graph cannot hold: a jagged NestedTensor's (its sizes hold a nested
int; torch's own collect(InputMetadata) refuses it), or a tensor subclass an
opaque node returns (the trace never saw it made, so it has no inner tensors to
flatten). Such a value never enters the graph. The call that returns it keeps it
beside the graph, in the running graph's frame (`refs`, keyed by (slot, output)),
and gives the graph a token in its place: an empty plain tensor, which only
orders the calls after it. A call given a token gets the value back before it
runs (`Slot.by_reference`: the arguments' sources, the outputs it hands on), and
a result that is a token is replaced by its value before it is applied
(`Plan.by_reference`). Who holds such values:
  * a node that takes or returns a nested tensor's grad is opaque from the walk
    on (native/collect.cpp: nothing of it collected, so its saved nested tensors
    are never lifted); so is an opaque node's output whose edge's metadata is a
    subclass (nodes/opaque.py);
  * a subclass without __tensor_flatten__: every node that takes or returns a
    subclass's grad opaque from the walk on (walk/precheck.py opaque_subclasses:
    its loss is one; or the walk found one to lift and walks again,
    errors.OpaqueSubclasses), its root grad held from the start (Plan.held,
    source ("lifted", index)); one that a node with plain grads saved still
    makes the backward run in eager;
  * a built-in node given a token runs opaquely too (a custom Function's is traced
    again as opaque: its backward may read `.grad`); hooks given one get the value
    and hand back theirs by reference, and so do a node's pre and post hooks given a
    traceable subclass (capture/subclass_calls.py);
  * two grads of one input, one a token, are summed by a call (SUM), as the
    engine's InputBuffer sums them;
  * AccumulateGrad and grad()'s results take the value itself (replay/run.py).
A value is dropped from the frame by its last reader (`handed_over`), so it lives
as long as eager's engine keeps it; an AccumulateGrad call in the graph then takes
it with no Python reference left, as the engine hands a grad over: it may steal
it (copying it instead ran the subclass's own clone, which a test's ScaledTensor
gets wrong).
So a nested tensor runs its nodes opaquely, each, and what is plain around them
(a Linear's weight and bias grads) is compiled; never a whole-backward fallback.
A graph does not stop at a call once values are held (NOTE [A call output not as
traced], capture/resume.py): a later call's other layout is copied, another type
raises; create_graph has no calls.
"""

from __future__ import annotations

import torch

from ..values import REFERENCE, OutputMeta, SlotKind
from .grads import Value

FAMILY = "references"
SUM = "sum_by_reference"  # two grads of one node input summed, one held by reference
# in the reason of a built-in node the walk made opaque for a nested tensor's grad (native/collect.cpp)
REASON = "passed by reference"


def token(dtype, device) -> OutputMeta:
    """A token's layout: an empty plain tensor (its value is held beside the graph)."""
    return OutputMeta([0], dtype, torch.device(device), [1])


def root_values(t, args, roots) -> list:
    """The root grads (`t` the tracer), validated as the engine validates them; one held by
    reference is its token (the call given it gets the value)."""
    held = set(t.c.held)
    values = list(t.walk.root_values([args[g] if g >= 0 and g not in held else None for _, _, g in roots]))
    for k, (_, _, g) in enumerate(roots):
        if g in held:
            values[k] = args[g]
            t.refs[id(args[g])] = (("lifted", g), args[g])
    return values


def learned(t, slot: int, out_metas) -> tuple:
    """The positions of call `slot`'s outputs that an earlier backward saw come as a tensor
    subclass (NOTE [A call output not as traced], capture/resume.py): held by reference."""
    positions = [i for i, m in enumerate(out_metas) if m is not None]
    return tuple(positions[k] for k in range(len(positions)) if t.layouts.get((slot, k)) == REFERENCE)


def sum_grads(t, a: Value, b: Value) -> Value:
    """Two grads for one node input, one of them held by reference: summed by a call, as the
    engine's InputBuffer sums them, and handed on by reference."""
    (out,), flag = t._call(SUM, t.at, [a.t, b.t], [OutputMeta.like(a.t)], flags=True, values=[a, b], by_reference_outs=(0,))
    return Value(out, ((flag, 0),), exact=True)


def handed_over(slots, results) -> list:
    """The slots, each with the sources it is the last to read appended to its `by_reference`
    (those no result reads): the kernel drops them from the frame as it takes them, so that a
    value lives as long as in eager (its last reader), and an AccumulateGrad given one may steal
    it, as the engine hands a grad over (calls run in the traced order: the last slot is the
    last reader)."""
    last = {src: i for i, s in enumerate(slots) if s.by_reference for _, src in s.by_reference.args}
    for _, src in results:
        last.pop(src, None)
    return [
        s._replace(by_reference=s.by_reference._replace(handed=tuple({src for _, src in s.by_reference.args if last.get(src) == i})))
        if s.by_reference
        else s
        for i, s in enumerate(slots)
    ]


def _run_sum(capture, node, args, mask, metas, hooks, steal):
    a, b = args
    return [a if b is None else b if a is None else a + b]


SLOT_KINDS = (SlotKind(SUM, FAMILY, _run_sum, reads_saved=False, what="the sum of two grads held by reference"),)
