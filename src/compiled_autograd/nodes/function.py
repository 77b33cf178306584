"""Custom autograd.Functions: the user's backward traced with `ctx.saved_tensors` and tensors
kept on ctx swapped for the trace's fakes (NOTE [Python state a backward reads] and the
custom-Function collection in walk/collect.py)."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .tracing import _tracing
from ..errors import NeedsOpaque, Unkeyable
from ..values import NodeFamily, NodeKind
from .state import _pure_module, _tensors, _value_key, backward_state_key, state_reads, swapped, user_backward
from . import compiled_region
from . import compiled_region as aot
from .learned import LEARNED
from .saved_tensors import UNPACK
from .ctx_sizes import _has_int, _node_sizes, _sizes_may_be_symbolic, _take_sizes, fill_sizes


# -- collect: a custom Function's part of the key, and what it lifts --------------------


@dataclass
class PyNodeInfo:
    flags: tuple  # (materialize_grads, materialize_non_diff_grads, boxed_grads_call, is_variable_input)
    saved: tuple  # lifted index of each saved tensor
    # (name, value): ctx attributes holding tensors, or sizes (then `_SIZE` in their places:
    # NOTE [Sizes kept on ctx])
    attrs: tuple
    opaque_reason: str | None = None
    symints: tuple | None = None  # an inlined AOTAutograd backward's ctx.symints (NOTE [Inlining AOTAutograd backwards])
    # (id of the globals dict or closure cell, name, lifted index): the tensors its backward reads from
    # globals and closures (NOTE [Tensors a backward reads from globals and closures])
    read: tuple = ()
    aot_start: int = 0  # where its ints (`symints` or `ctx_ints`) sit among the Collected's `aot` sizes
    ctx_ints: tuple = ()  # the sizes kept on its ctx, in `attrs` order (NOTE [Sizes kept on ctx])


# NOTE [Functions whose values change every step]
# A custom Function's ctx values and the Python state its backward reads are keyed by value
# (NOTE [Python state a backward reads]): each new value is a new graph. A gradient-reversal
# layer whose lambda is annealed every step (ctx.lam), a temperature, a loss weight: every
# backward was a capture and a compile (seconds each under inductor), for ever. So the
# captures are counted per Function class: once a class has been captured with more than
# CHURN_LIMIT different sets of values (the values of all its nodes in one graph: a model
# that applies it with twelve fixed scales is one set), its nodes run as they are, opaquely,
# and the rest of the graph is captured once more and then hits. (As dynamo's recompile
# limit; the node's own backward, run eagerly, reads each step's values.)
CHURN_LIMIT = 8


class FunctionKey(NamedTuple):
    """A custom Function node's part of the key."""

    cls: type
    how: str  # "traced", "region" (a torch.compile'd region's inlined backward) or "opaque"
    flags: tuple = ()  # materialize grads, materialize non-differentiable, boxed, is_variable_input
    needs_input_grad: tuple = ()
    saved: tuple = ()  # lifted positions of its saved tensors
    attrs: tuple = ()  # its ctx attributes by value ("traced"); the region's saved ints ("region")
    state: tuple = ()  # the Python state its backward reads
    reason: str = ""  # why it runs opaquely


def note_capture(collected) -> list[str]:
    """Count the custom Functions a new graph traced (LEARNED.churn); the names of those that
    just went opaque (NOTE [Functions whose values change every step])."""
    churn = LEARNED.churn
    per_cls: dict = {}
    for _, k in collected.key.functions:
        if isinstance(k, FunctionKey) and k.how == "traced":
            per_cls.setdefault(k.cls, set()).add((_values_only(k.attrs), _values_only(k.state)))
    went = []
    with churn.lock:
        for cls, values in per_cls.items():
            sets = churn.sets.setdefault(cls, set())
            sets.add(frozenset(values))
            if len(sets) > CHURN_LIMIT and cls not in churn.opaque:
                churn.opaque[cls] = (
                    f"its ctx values or the Python state its backward reads changed in {len(sets)} captures "
                    "(NOTE [Functions whose values change every step]): it runs as is instead of a capture per value"
                )
                went.append(cls.__qualname__)
    return went


def _values_only(key):
    """A ctx attributes' key without the lifted positions of their tensors, which change with
    the graph around the node, not with the values (`_value_key`: ("T", position))."""
    if type(key) is tuple:
        if len(key) == 2 and key[0] == "T" and type(key[1]) is int:
            return ("T",)
        return tuple(_values_only(x) for x in key)
    return key


# NOTE [Opaque nodes keep their state out of the key]
# A node that runs opaquely runs its own backward, as is, with the values it holds when it
# runs: the graph bakes in none of its Python state (its ctx values, the identity of a closure
# it keeps), only its outputs' metadata (the native key holds it). So its key is its class and
# the reason it is opaque, nothing it holds: no ctx value is keyed, no tensor of it lifted
# (what was lifted before the reason was found is forgotten, `_Lifter.rollback`). Reentrant
# checkpointing (torch.utils.checkpoint.CheckpointFunction, Hugging Face's gradient
# checkpointing with use_reentrant=True) is known opaque by its class, before its ctx is read:
# its backward recomputes the region and runs a backward inside (compiled on its own), which no
# trace can inline; keyed, its `run_function` (a new lambda or functools.partial each step)
# made every step a capture.
REENTRANT_CHECKPOINT = "reentrant checkpoint: runs eagerly inside the graph"


def _is_reentrant_checkpoint(cls) -> bool:
    ckpt = sys.modules.get("torch.utils.checkpoint")  # (not imported: no such node exists)
    return ckpt is not None and cls is getattr(ckpt, "CheckpointFunction", None)


def collect_pynode(capture, idx: int, lift, keep_graph: bool) -> tuple[tuple, PyNodeInfo]:
    node = capture.node_object(idx)
    m, mnd, boxed, is_var = capture.pynode_flags(idx)
    flags = (m, mnd, boxed, tuple(is_var))
    cls = node._forward_cls
    info = PyNodeInfo(flags=flags, saved=(), attrs=())
    if flags[2]:
        # AOTAutograd's CompiledFunction is the one boxed Function we trace (NOTE [Inlining
        # AOTAutograd backwards], nodes/compiled_region.py); any other runs as is
        why = aot.inline_reason(cls, node) if aot.is_compiled_function(cls) else "boxed_grads_call Function"
        if why is not None:
            info.opaque_reason = why
            return FunctionKey(cls, "opaque", reason=why), info
        if keep_graph:
            aot.check_keep_graph(cls)  # (eager's error: a RuntimeError, eager raises it again)
        saved = list(node.saved_tensors)
        capture.hand_over_saved(idx, saved, keep_graph)
        info.saved = tuple(lift(t) if t is not None else -1 for t in aot.saved_tensors(node, saved))
        info.symints = tuple(node.symints)
        return FunctionKey(
            cls, "region", flags, tuple(node.needs_input_grad), info.saved, aot.key(info.symints, aot.objects_key(node))
        ), info
    # reading saved_tensors runs eager's own checks (freed graph, version
    # counter) and saved-tensor unpack hooks
    saved = node.saved_tensors
    # what their unpack hooks returned serves the rest of this backward: the node may yet run
    # its own backward (opaque), or eager its own (a fallback)
    capture.hand_over_saved(idx, list(saved), keep_graph)
    if _is_reentrant_checkpoint(cls):  # NOTE [Opaque nodes keep their state out of the key]
        info.opaque_reason = REENTRANT_CHECKPOINT
        return FunctionKey(cls, "opaque", reason=REENTRANT_CHECKPOINT), info
    user = not _pure_module(getattr(cls, "__module__", "") or "")
    churned = LEARNED.churn.opaque.get(cls)
    if churned is not None:
        info.opaque_reason = churned
        return FunctionKey(cls, "opaque", reason=churned), info
    read: list = []  # NOTE [Tensors a backward reads from globals and closures]
    why, state = backward_state_key(cls, read)
    if why is not None:
        if why.startswith("a write to"):
            info.opaque_reason = f"its backward makes {why}, which a trace would make once and a cache hit never"
        else:
            info.opaque_reason = f"its backward reads {why}, which a trace would freeze"
        return FunctionKey(cls, "opaque", reason=info.opaque_reason), info
    mark = lift.mark()
    try:
        info.saved = tuple(lift(t) if t is not None else -1 for t in saved)
        info.read = tuple((id(where), name, lift(t)) for where, name, t in read)
        attrs = []
        attr_keys = []
        ints: list = []  # NOTE [Sizes kept on ctx]
        items = sorted(vars(node).items())
        sizes = ()
        if any(_has_int(v) for _, v in items) and _sizes_may_be_symbolic(cls, [v for _, v in items]):
            sizes = _node_sizes(capture, idx, node, saved)
        for name, value in items:
            kept = _take_sizes(value, sizes, ints) if sizes else value
            attr_keys.append((name, _value_key(kept, lift, user)))
            if kept is not value or _tensors(value):
                attrs.append((name, kept))
        info.attrs = tuple(attrs)
    except Unkeyable as e:
        # NOTE [Opaque nodes keep their state out of the key]
        lift.rollback(mark)
        info.saved, info.read = (), ()
        info.opaque_reason = str(e)
        return FunctionKey(cls, "opaque", reason=info.opaque_reason), info
    info.ctx_ints = tuple(ints)
    key = FunctionKey(
        cls, "traced", flags, tuple(node.needs_input_grad), info.saved, tuple(attr_keys), state + tuple(("T", i) for _, _, i in info.read)
    )
    return key, info


def kept_indices(pynodes, lifted) -> set:
    """The lifted indices of the tensors custom Functions keep on ctx, and of those their
    backwards read from globals and closures: eager reads them as they are when the node
    runs, without a version check."""
    index = {id(t): i for i, t in enumerate(lifted)}
    out = {index[id(t)] for info in pynodes.values() for _, v in info.attrs for t in _tensors(v) if id(t) in index}
    return out | {i for info in pynodes.values() for _, _, i in info.read}


# -- trace ----------------------------------------------------------------------


def trace(t, idx, values, args):
    """A custom Function's node: its Python backward traced (or, for a torch.compile'd region,
    the backward AOTAutograd made: nodes/compiled_region.py)."""
    if not t.c.pynodes[idx].flags[0] and any(v is not None and v.bits is not None for v in values):
        # its backward sees None for an undefined grad, and may branch on it
        if not _none_in_none_out(t.walk.node_object(idx)._forward_cls, values):
            raise NeedsOpaque(idx, "set_materialize_grads(False) and a grad that may be None at run time")
    out = trace_backward(t, idx, [v.t if v is not None else None for v in values], args)
    # the trace read this ctx's attributes, and the globals and closures its backward
    # reads, as they were when the backward started; the last call before it checks
    # that no hook has rebound one since (Plan.ctx_checks)
    last = next((i for i in range(len(t.slots) - 1, -1, -1) if t.slots[i].kind != UNPACK), None)
    node = t.walk.node_object(idx)
    if last is not None and (vars(node) or state_reads(node._forward_cls)):
        t.ctx_checks.setdefault(last, []).append(idx)
    return out


# NOTE [Functions whose backward maps None to None]
# A Function that turns off materialized grads sees None for an undefined grad, and may
# branch on it: traced, its backward would take one branch for good, so it runs opaquely
# where its grad may be undefined at run time. These torch Functions of one grad return None
# for every input when that grad is None, and otherwise their traced computation: traced on
# the grad's stand-in (zeros with a flag, NOTE [Undefined grads of opaque nodes]), their
# results carry the grad's definedness flags (the tracer's `in_bits`), exactly eager's
# outputs. DTensor's to_local() and from_local() boundaries are here: under FSDP2 + TP their
# grads come from hooks' calls, whose outputs may be undefined.
NONE_IN_NONE_OUT = frozenset(
    {
        "torch.distributed.tensor._api._ToTorchTensor",
        "torch.distributed.tensor._api._FromTorchTensor",
    }
)


def _none_in_none_out(cls, values) -> bool:
    return sum(v is not None for v in values) == 1 and f"{cls.__module__}.{cls.__qualname__}" in NONE_IN_NONE_OUT


def trace_backward(t, idx, grads, args):
    info = t.c.pynodes[idx]
    capture = t.walk
    node = capture.node_object(idx)
    materialize, materialize_non_diff, _, is_variable_input = info.flags
    metas = capture.input_metadata(idx)
    output_info = capture.pynode_output_info(idx)
    inputs = []
    # PyNode::apply: undefined grads become zeros shaped like the forward
    # output, unless materialization is off (also for non-differentiable
    # outputs, separately)
    pos = t.nodes[idx].size_start  # the outputs' sizes are the node's size inputs (symbolic if dynamic)
    for g, m, info_i in zip(grads, metas, output_info):
        if info_i is None:
            inputs.append(g)
            continue
        shape, dtype, device = info_i
        dims = [v if t.sym_sizes[pos + d] is None else t.sym_sizes[pos + d] for d, v in enumerate(shape)]
        pos += len(shape)
        if g is None and materialize and (m is not None or materialize_non_diff):
            g = torch.zeros(dims, dtype=dtype, device=device)
        inputs.append(g)
    if info.flags[2]:
        out = compiled_region.trace_in_graph(t, idx, node, inputs, args)
    else:
        out = python_backward(t, idx, node, info, inputs, args)
    if not isinstance(out, tuple):
        out = (out,)
    return results(t, idx, out, is_variable_input)


def python_backward(t, idx, node, info, inputs, args):
    capture_swap = None
    originals = {}
    try:
        from .. import native

        capture_swap = native.load().PyNodeSavedSwap(node, [args[i] if i >= 0 else None for i in info.saved])
        kept = [args[i] for i in info.saved if i >= 0] + [args[i] for _, _, i in info.read]
        ints = iter(t.aot_ints[info.aot_start :])  # NOTE [Sizes kept on ctx] (nodes/ctx_sizes.py)
        for name, value in info.attrs:
            originals[name] = vars(node)[name]
            rebuilt = _rebuild(fill_sizes(value, ints), t.c, args)
            setattr(node, name, rebuilt)
            kept += _tensors(rebuilt)
        versions = [t._version for t in kept]
        _tracing.active = True
        try:
            with _ConstantsWithoutGradMode() if torch.is_grad_enabled() else contextlib.nullcontext():
                if info.read:  # NOTE [Tensors a backward reads from globals and closures]
                    # (_get_user_fn: eager's own error for a Function with both backward and vjp)
                    user = node._get_user_fn() if hasattr(node, "_get_user_fn") else user_backward(node._forward_cls)
                    fn = swapped(getattr(user, "__func__", user), {(w, name): args[i] for w, name, i in info.read})
                    out = fn(node, *inputs)  # (what BackwardCFunction.apply calls)
                else:
                    out = node.apply(*inputs)
        finally:
            _tracing.active = False
        if any(t._version != v for t, v in zip(kept, versions)):
            # the graph's functional code would leave that change invisible to the hooks
            # after it (a compiler writes a changed graph input back at the end): the node
            # runs as is, in its place
            raise NeedsOpaque(idx, "its backward changes in place a tensor it saved or keeps on ctx")
    except NeedsOpaque:
        raise
    except Exception as e:
        raise NeedsOpaque(
            idx, f"{node.name()} backward not traceable: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
        )
    finally:
        for name, value in originals.items():
            setattr(node, name, value)
        if capture_swap is not None:
            capture_swap.restore()
    return out


def results(t, idx, out, is_variable_input):
    capture = t.walk
    n_forward = len(is_variable_input)
    if len(out) > n_forward and all(o is None for o in out[n_forward:]):
        out = out[:n_forward]
    if len(out) != n_forward:
        raise NeedsOpaque(idx, "backward returned a wrong number of gradients")
    results = []
    for o, is_var in zip(out, is_variable_input):
        if not is_var:
            if o is not None:
                raise NeedsOpaque(idx, "gradient for a non-tensor input")
            continue
        if o is not None and not isinstance(o, torch.Tensor):
            raise NeedsOpaque(idx, "backward returned a non-tensor")
        results.append(o)
    return capture.validate(idx, results)


class _ConstantsWithoutGradMode(torch.overrides.TorchFunctionMode):
    """NOTE [Ops without grad mode under create_graph]
    A create_graph trace records aten ops, not grad mode, and the second order
    differentiates the recorded graph (NOTE [create_graph]). So what a custom
    backward computes with grad mode off (under `no_grad`, or all of it when
    `once_differentiable` gets grads that do not require grad) would be
    differentiated, where eager's results are constants for the next order. Around
    a custom backward traced in grad mode, each op that runs without grad mode on
    a tensor that requires grad has its results cut with `detach` in the graph. An
    in-place op there (on a tensor that requires grad, or with one) leaves in eager
    a history the graph cannot express: the node cannot be traced, and create_graph
    falls back."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.is_grad_enabled():
            return func(*args, **kwargs)
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        versions = [t._version for t in tensors]
        out = func(*args, **kwargs)
        if not any(t.requires_grad for t in tensors):
            return out
        if any(t._version != v for t, v in zip(tensors, versions)):
            raise RuntimeError("an in-place op without grad mode, on a tensor that requires grad or with one (create_graph)")

        def cut(o):
            if not isinstance(o, torch.Tensor) or o.requires_grad or not (o.is_floating_point() or o.is_complex()):
                return o  # (an op that returns its input as is, `x.to(x.dtype)`, keeps its history in eager too)
            return o.detach()

        return torch.utils._pytree.tree_map(cut, out)


def _rebuild(value, collected, args):
    """A ctx attribute with its (real) tensors replaced by the tracer's fakes."""
    lifted_index = {id(t): i for i, t in enumerate(collected.lifted)}

    def go(v):
        if isinstance(v, torch.Tensor):
            return args[lifted_index[id(v)]]
        if isinstance(v, (tuple, list)):
            return type(v)(go(x) for x in v)
        if isinstance(v, dict):
            return {k: go(x) for k, x in v.items()}
        return v

    return go(value)


ROW = NodeFamily("custom Function", NodeKind.PYNODE, trace, color="#bdd7ee")
