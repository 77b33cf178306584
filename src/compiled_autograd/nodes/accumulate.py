"""AccumulateGrad: a graph result applied after the graph by the real AccumulateGrad, or, when
hooks or opaque nodes could observe `.grad`, a call at its eager position (NOTE [Stealing a
fresh grad] below); with a leaf's tensor hooks, one call for both (NOTE [A leaf's hooks and its
accumulation in one call])."""

from __future__ import annotations

from ..values import CallHow, NodeFamily, NodeKind, SlotKind
from .grads import Value

HANDED_OVER = "handed over"  # `steal` for a grad held by reference nothing reads after it (references.handed_over)

FAMILY = "AccumulateGrad"
# its trace is the tracer's loop's own (`trace` below, with the leaf's hooks: capture/trace.py);
# the hooks on it read no saved tensor; enable(opaque=...) never names it (it writes `.grad`)
ROW = NodeFamily(FAMILY, NodeKind.ACCUMULATE, None, color="#c5e0b4", leaf=True, opaque_by_name=False, hooks_read_saved=False, live=True)
ACCUMULATE = "accumulate"
# a leaf's tensor hooks and its AccumulateGrad (NOTE [A leaf's hooks and its accumulation in one call])
HOOKED_ACCUMULATE = "tensor_hooks_and_accumulate"


def trace(t, idx, v: Value | None):
    if t.in_graph_accumulate:
        if v is not None:
            args = [v.t] + ([t._defined(v.bits)] if v.bits is not None else [])
            t._call(ACCUMULATE, idx, args, [])
    else:
        r, f = t._result(v)
        if r >= 0:
            t.accumulate.append((idx, r, f))


def accumulate(capture, node, args, steal, hooked=False):
    """NOTE [Stealing a fresh grad]
    AccumulateGrad runs inside the graph when hooks or opaque nodes could
    observe `.grad` (DDP's reducer, module hooks). Eager's AccumulateGrad takes
    the incoming grad as `.grad` without a copy when nothing else refers to it
    (it "steals" it); here the graph's code still refers to it, so it would copy
    every parameter's gradient (a 4 MB copy, and fresh pages to fault in, per
    weight of the D=1024 MLP: 1.3-1.8x eager's backward with such hooks, where
    it is 0.8-1.0x without). So AccumulateGrad gets a new tensor on the grad's
    memory that nothing else refers to, and applies its own rule to it (steal
    if the layout contract holds, else copy), as eager decides for the grad its
    engine hands it, when that memory is the graph's own and nothing writes
    into it afterwards:
      * the traced graph computed it (an op's result or a view of one, not a
        view of a graph input) and reads it nowhere else (a hook may change
        `.grad` in place; eager copies a grad its engine still holds for
        another node): `fresh`, capture/passes.py mark_fresh_grads;
      * at run time its storage is none of the graph inputs' (`steal`: those
        storages, by identity; a compiler that removes no-ops could hand over
        an input), nor of a tensor a hook kept (its reference count rose across
        the hook's call, calls/kernel.py `input_storages(...).add`: a logging hook storing its grad;
        eager's AccumulateGrad sees that reference and copies);
      * nothing in the compiled code writes into it afterwards: the eager
        graph and aot_eager run functional aten ops; inductor reuses a dead
        buffer for a later result (`buf3 = buf1; del buf1  # reuse`), so the
        call is marked in the graph (its flags have HANDS_OVER) and our
        lowering of it (compile/inductor.py _register_inductor_lowering) puts the grad's
        buffer in inductor's never-reuse set. (Making it a graph output would
        stop the reuse too, but keep every new grad alive to the end of the
        graph when it is added into an existing `.grad`.) A user's backend
        gets the copy, as torch's built-in copies every such grad.

    NOTE [A leaf's hooks and its accumulation in one call]
    A leaf's tensor hooks (`param.register_hook`: logging, clipping, DDP-style
    bucketing) run right before its AccumulateGrad, in the same step of the
    engine, and what they return is what it accumulates. Two calls cost two
    trips out of the compiled code and back (dispatch, the frame, conforming the
    hooks' result to the graph's expectations), ~80 us per hooked parameter
    against eager's ~3 us; so a leaf whose grad is always defined, and whose
    AccumulateGrad node has no pre or post hooks of its own (those see what the
    tensor hooks returned), gets one call (`hooked`,
    GraphWalk.accumulate_graph_grad), which hands the hooks' result to
    AccumulateGrad as the engine does: nothing of the graph sees it. The hooks
    get the grad as the lone call got it: a tensor nothing else refers to on
    the graph's buffer when that may be stolen (above), so a hook that keeps it
    raises its reference count and AccumulateGrad copies, as eager's does."""
    grad, defined = args[0], (args[1] if len(args) > 1 else None)
    if grad is None or (defined is not None and not bool(defined)):
        return []
    if steal == HANDED_OVER and not hooked:
        # a value held by reference (NOTE [Values passed by reference], references.py): handed to
        # AccumulateGrad with no Python reference left, as the engine hands it over
        box, args[0] = [grad], None
        del grad
        capture.apply_results(box, [(node, 0)], [])
        return []
    steal = None if steal == HANDED_OVER else steal
    # (the new tensor on the grad's memory is made there: no Python object refers to it)
    capture.accumulate_graph_grad(node, grad, hooked, steal)
    return []


def _run(capture, node, args, mask, metas, hooks, steal):
    return accumulate(capture, node, args, steal)


def _run_hooked(capture, node, args, mask, metas, hooks, steal):
    return accumulate(capture, node, args, steal, hooked=True)


# AccumulateGrad and the hooks on it read no saved tensor: nothing waits for them to free one
SLOT_KINDS = (
    SlotKind(ACCUMULATE, FAMILY, _run, CallHow.ACCUMULATE, stage=2, accumulates=True, reads_saved=False, shares_args=False),
    SlotKind(HOOKED_ACCUMULATE, FAMILY, _run_hooked, CallHow.HOOKED_ACCUMULATE, stage=0, accumulates=True, reads_saved=False),
)
