"""The backward of a torch.compile'd forward, inlined into the backward graph.

NOTE [Inlining AOTAutograd backwards]
A torch.compile'd forward records one autograd node, AOTAutograd's CompiledFunction, whose
backward is the joint graph's backward half (`bw_module`, aten ops) between a prologue
(checks, the tangents coerced to the memory format the forward traced them with, the
arguments in `bw_module`'s order: symints, saved tensors, opaque objects, tangents) and an
epilogue (effect tokens and RNG offsets dropped, subclasses rewrapped). Run as it is, that
backward is one opaque call per compiled region: a boxed list of grads in, a separately
compiled kernel set out, nothing fused across its edges and every grad it feeds copied out of
our graph's buffers. Torch's built-in compiled autograd copies `bw_module` into its graph
(`proxy_call_aot_backward`); we trace prologue, `bw_module` and epilogue on the fakes like
any custom Function's backward, so all three become aten ops of our graph.

What the trace bakes in and the key holds: the Function class (its metadata, its
`bw_module`: one per compiled region), which tensors it saved (by lifted index), and the
deterministic-algorithms flag (the prologue checks it; a functorch transform, which it also
checks, sends the whole backward to eager before any capture). The ints the forward saved
for the backward (`ctx.symints`: concrete on every run, a batch size where the region was
compiled with dynamic shapes) are not in the key but in the sizes vector (`Collected.n_aot`):
static in a first capture, symbolic with guards in a dynamic one, as any size; any other
saved scalar is a constant of the key. The tangents' memory-format coercion decides on the
fakes' strides: a copy or not, the same values either way in a functional graph.

A region with tensor subclasses (DTensor parameters under TP, a user's wrapper) is inlined too:
its prologue flattens the subclass grads our trace rebuilt over the fakes, and its epilogue
rewraps its results from AOTAutograd's subclass metadata (for DTensor, the mesh it saved as an
opaque object, `ctx.opaque_objects`, passed to the prologue as AOTAutograd's own backward
passes it: metadata of the rebuilt results, never a graph input), keyed by value (`objects_key`).

Not inlined (the node runs opaquely, counted with the reason): a region with effect tokens,
functionalized RNG or a BackwardState (dynamo's compiled-autograd hooks), input mutations in its backward, ops that read or write a tensor's
strides (`as_strided*`: their meaning depends on layouts our graph's compiler may choose
differently from the forward's), or a `bw_module` AOTAutograd no longer has; a backward that
builds a graph (create_graph: AOTAutograd refuses double backward itself).
"""

from __future__ import annotations

import weakref

import torch

from .tracing import _tracing
from ..errors import NeedsOpaque, Unkeyable
from .state import value_key


def is_compiled_function(cls) -> bool:
    """AOTAutograd's CompiledFunction (torch._functorch._aot_autograd.runtime_wrappers)."""
    return (
        getattr(cls, "__module__", None) == "torch._functorch._aot_autograd.runtime_wrappers"
        and cls.__name__ == "CompiledFunction"
        and hasattr(cls, "_lazy_backward_info")
    )


def _bw_module(cls):
    module = cls.__dict__.get("_compiled_autograd_bw_module")
    if module is None:
        from torch._dynamo.compiled_autograd import extract_bw_module

        module = extract_bw_module(cls)
        cls._compiled_autograd_bw_module = module
    return module


def _graph_reason(module) -> str | None:
    for n in module.graph.nodes:
        if n.op in ("call_module", "get_attr"):
            return f"its backward graph has a {n.op} node ({n.target})"
        if n.op != "call_function":
            continue
        name = str(getattr(n.target, "__name__", n.target))
        if "as_strided" in name:
            return f"its backward graph has {name}"
        schema = getattr(n.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            return f"its backward graph mutates ({name})"
    return None


_REASONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # class -> why its backward is not inlined, or None


def objects_key(node) -> tuple | None:
    """The opaque objects the region saved (DTensor's mesh), keyed by value; None if one cannot be."""

    def no_tensor(_):
        raise Unkeyable("a tensor")

    try:
        return tuple(value_key(o, no_tensor, user=True) for o in getattr(node, "opaque_objects", None) or ())
    except Unkeyable:
        return None


def inline_reason(cls, node) -> str | None:
    """Why this CompiledFunction's backward runs opaquely, or None when it is inlined."""
    if objects_key(node) is None:
        return "a torch.compile'd region that saved opaque objects that cannot be keyed by value"
    if getattr(node, "_compiled_autograd_backward_state", None) is not None:
        return "a torch.compile'd region with a BackwardState"
    if not all(type(s) in (int, float, bool) for s in getattr(node, "symints", ())):
        return "a torch.compile'd region that saved something other than ints and floats for its backward"
    if cls in _REASONS:
        return _REASONS[cls]
    why = None
    md = cls.metadata
    if md.num_backward_tokens or md.is_rng_op_functionalized:
        why = "a torch.compile'd region with effect tokens or functionalized RNG"
    elif md.indices_of_inputs_that_requires_grad_with_mutations_in_bw:
        why = "a torch.compile'd region whose backward mutates its inputs"
    else:
        try:
            _bw_module(cls)
        except Exception as e:
            why = f"a torch.compile'd region whose backward graph is not available ({type(e).__name__})"
    _REASONS[cls] = why
    return why


def check_keep_graph(cls) -> None:
    """A backward that keeps the graph (retain_graph, create_graph) through a region whose
    compiled backward may reuse its saved tensors' memory (donated buffers) raises in eager
    (CompiledFunction's backward). The inlined backward reuses nothing, but raises the same."""
    if torch._functorch.config.donated_buffer and cls.metadata.bw_donated_idxs != []:
        raise RuntimeError(
            "This backward function was compiled with non-empty donated "
            "buffers which requires create_graph=False and retain_graph=False. "
            "Please keep backward(create_graph=False, retain_graph=False) "
            "across all backward() function calls, or set "
            "torch._functorch.config.donated_buffer=False to disable "
            "donated buffer."
        )


def saved_tensors(node, checked: list) -> list:
    """What the compiled backward reads as its saved tensors, in `bw_module`'s order
    (AOTAutograd's `_codegen_compiled_backward`): `checked` (`ctx.saved_tensors`, read with
    their version check), then those saved without one."""
    return [*checked, *getattr(node, "_tensors_no_vc_check", ())]


def key(symints: tuple, objects: tuple = ()) -> tuple:
    """The ints among `ctx.symints` are sizes of the backward (a dynamic capture may make them
    symbolic); anything else is a constant of the key, as are the opaque objects it saved
    (`objects_key`: the epilogue rebuilds its DTensor results over those meshes)."""
    return ("aot", tuple(None if type(s) is int else (type(s), s) for s in symints), torch.are_deterministic_algorithms_enabled(), objects)


def rebuild_symints(symints: tuple, ints: list) -> list:
    """`symints` with its ints replaced by `ints` (the trace's, symbolic where dynamic)."""
    it = iter(ints)
    return [next(it) if type(s) is int else s for s in symints]


class _ReshapeViews(torch.fx.Interpreter):
    """`bw_module` with its views as reshapes: AOTAutograd applied inductor's view-to-reshape
    pass to the forward it compiled, so a tangent may not be viewable where its view was
    traced (torch's compiled autograd does the same, `proxy_call_aot_backward`)."""

    def call_function(self, target, args, kwargs):
        if target is torch.ops.aten.view.default:
            target = torch.ops.aten.reshape.default
        return super().call_function(target, args, kwargs)


def trace_backward(cls, symints: list, saved: list, grads: list, opaque_objects=()) -> tuple:
    """Prologue, `bw_module` and epilogue on the tracer's fakes (aten ops in its graph)."""
    module = _bw_module(cls)
    # checked at each trace: a compile of this backward (eager's, lazily) may rewrite it in place
    why = _graph_reason(module)
    if why is not None:
        raise NotImplementedError(why)
    all_args = cls._bw_prologue_fn(saved, symints, list(opaque_objects), list(grads))
    # the joint trace made every dtype explicit; AOTAutograd runs it with autocast off
    with torch._C._DisableAutocast():
        out = _ReshapeViews(module).run(*all_args)
    return tuple(cls._bw_epilogue_fn(out))


def trace_in_graph(t, idx, node, grads, args):
    """NOTE [Inlining AOTAutograd backwards] (nodes/compiled_region.py)."""
    if torch.is_grad_enabled():
        raise NeedsOpaque(idx, "a torch.compile'd region's backward under create_graph (AOTAutograd has no double backward)")
    info = t.c.pynodes[idx]
    saved = [args[i] if i >= 0 else None for i in info.saved]
    symints = rebuild_symints(info.symints, t.aot_ints[info.aot_start :])
    try:
        _tracing.active = True
        try:
            return trace_backward(node._forward_cls, symints, saved, grads, getattr(node, "opaque_objects", ()) or ())
        finally:
            _tracing.active = False
    except Exception as e:
        raise NeedsOpaque(
            idx, f"a torch.compile'd region's backward not traceable: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        )
