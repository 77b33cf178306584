"""Hooks on nodes and tensors: one compiled_autograd::call per node step that has them, run at
its eager position (NOTE [Opaque calls], calls/__init__.py)."""

from __future__ import annotations

import torch

from ..values import CallHow, OutputMeta, SlotKind
from .grads import Value

FAMILY = "hooks"
TENSOR_PRE_HOOKS = "tensor_pre_hooks"  # a tensor's hooks (`tensor.register_hook`) and retain_grad
PRE_HOOKS = "pre_hooks"  # `grad_fn.register_prehook`
POST_HOOKS = "post_hooks"  # `grad_fn.register_hook`: run after the node, given its inputs too


def call(t, kind, idx, values: list, extra=()):
    """One call of a node's hooks on the grads `values` (post hooks also get the
    node's inputs, `extra`). A hook may return None for a grad (a module's full
    backward hook blocking a gradient): the call then returns zeros and a False
    flag, and the grad is defined iff it was before and the flag is set (NOTE
    [Undefined grads of opaque nodes])."""
    tensors = [v.t if v is not None else None for v in values]
    # a hook's result is predicted in its grad's layout (dense: as empty_like lays it out)
    metas = [OutputMeta.like(t) if t is not None else None for t in tensors]
    every = list(values) + list(extra)
    # a tensor hook gets None for an undefined grad and cannot make a defined one
    # undefined (returning None keeps it; giving a tensor for None raises in eager's
    # hook code): what it returns is defined as its input was, and needs no flag (but a
    # call with no tensor at all, where every grad is None, keeps its flag output: a
    # compiler places a call by its tensors' device)
    flags = kind != TENSOR_PRE_HOOKS or all(t is None for t in tensors)
    # a grad held by reference (a nested tensor's) comes back by reference (NOTE [Values passed by reference])
    by_reference = tuple(i for i, x in enumerate(tensors) if t.is_reference(x))
    outs, flag = t._call(
        kind,
        idx,
        [v.t if v is not None else None for v in every],
        metas,
        flags=flags,
        values=every,
        keeps=True,
        outs_like_args=kind == TENSOR_PRE_HOOKS,
        by_reference_outs=by_reference,
    )
    result, k = [], 0
    for o, v in zip(outs, values):
        if o is None:
            result.append(None)
            continue
        if not flags:
            result.append(Value(o, v.bits, exact=True))
            continue
        if flag is None:  # (run for real: what came back is defined; capture/resume.py)
            result.append(Value(o))
            continue
        if v.bits is None:
            bits = ((flag, k),)
        else:  # defined iff (any of v's flags) and this one
            bits = ((torch.logical_and(t._defined(v.bits), flag[k]).reshape(1), 0),)
        result.append(Value(o, bits, exact=True))
        k += 1
    return result


def post_hooks(t, idx, outputs, inputs):
    return call(t, POST_HOOKS, idx, outputs, inputs)


def _run_tensor_pre(capture, node, args, mask, metas, hooks, steal):
    return capture.call_tensor_pre_hooks(node, args)


def _run_pre(capture, node, args, mask, metas, hooks, steal):
    return capture.call_pre_hooks(node, args)


def _run_post(capture, node, args, mask, metas, hooks, steal):
    n = len(mask)
    return capture.call_post_hooks(node, args[:n], args[n:])


SLOT_KINDS = (
    SlotKind(TENSOR_PRE_HOOKS, FAMILY, _run_tensor_pre, CallHow.TENSOR_PRE_HOOKS, stage=0, resumable=True),
    SlotKind(PRE_HOOKS, FAMILY, _run_pre, CallHow.PRE_HOOKS, stage=1, resumable=True),
    SlotKind(POST_HOOKS, FAMILY, _run_post, CallHow.POST_HOOKS, stage=2, completes_node=True, resumable=True),
)
