"""Traceable wrapper subclasses among the lifted tensors (DTensor, a user's): flattened at
collect, their inner tensors lifted and their metadata keyed by value, rebuilt over the trace's
fakes (docs/design/subclasses.md section 1; on by default, COMPILED_AUTOGRAD_SUBCLASSES=0: off)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..errors import Fallback, OpaqueSubclasses, Unkeyable
from ..nodes.state import value_key


class Wrapper(NamedTuple):
    """A lifted traceable wrapper subclass (DTensor, a user's), flattened: its inner tensors are
    lifted (graph inputs), and the trace rebuilds it from their fakes (docs/design/subclasses.md
    section 1)."""

    index: int  # its own lifted index (a placeholder the graph does not read)
    type: type
    inner: tuple  # (attribute name, lifted index) per inner tensor, in __tensor_flatten__'s order
    consts: tuple  # (attribute name, object) per inner attribute that is not a tensor (DTensor's mesh)
    meta: Any  # __tensor_flatten__'s metadata, keyed by value
    size: tuple  # its outer size and stride: __tensor_unflatten__'s outer_size, outer_stride
    stride: tuple

    def rebuild(self, args):
        """The subclass over `args`' inner tensors (the trace's fakes)."""
        inner = {name: args[i] for name, i in self.inner}
        inner.update(self.consts)
        return self.type.__tensor_unflatten__(inner, self.meta, self.size, self.stride)


def _no_tensor(t):
    raise Unkeyable("a tensor in a subclass's flatten metadata")


def _meta_key(v):
    """The key of a subclass's flatten metadata or of an inner attribute that is not a tensor
    (DTensor's mesh): by value (NOTE [Keys of a tensor subclass's metadata], nodes/state.py)."""
    return value_key(v, _no_tensor, user=True)


class _Unflattenable(Exception):
    """Why a tensor subclass cannot be flattened into the graph's inputs (its nodes then run
    opaquely: NOTE [Nodes that save what a graph cannot hold], native helper)."""


def _described(t) -> tuple:
    """(its inner attribute names, its flatten metadata, [(name, inner tensor)], [(name, object,
    key)] per inner attribute that is not a tensor, the metadata's key); raises _Unflattenable."""
    if t.is_nested:  # (a jagged nested tensor: its sizes hold a nested int)
        raise _Unflattenable("nested")
    if not is_traceable_wrapper_subclass(t):
        raise _Unflattenable(f"{type(t).__name__} without __tensor_flatten__")
    names, meta = t.__tensor_flatten__()
    inner, consts = [], []
    for name in names:
        v = getattr(t, name)
        if not isinstance(v, torch.Tensor):  # (DTensor's mesh: kept by reference, keyed by value)
            try:
                consts.append((name, v, _meta_key(v)))
            except Unkeyable as e:
                raise _Unflattenable(f"{type(t).__name__} whose {name} is unkeyable: {e}") from None
        elif type(v) not in (torch.Tensor, torch.nn.Parameter):  # (a subclass inside a subclass)
            raise _Unflattenable(f"{type(t).__name__} whose {name} is a {type(v).__name__}")
        else:
            inner.append((name, v))
    try:
        meta_key = _meta_key(meta)
    except Unkeyable as e:
        raise _Unflattenable(f"{type(t).__name__} whose flatten metadata is unkeyable: {e}") from None
    return names, meta, inner, consts, meta_key


def unflattenable(t) -> bool:
    """Whether the graph cannot take `t`, a lifted tensor subclass, as its inner tensors (the
    native helper asks, in the walk that makes the nodes that save one opaque)."""
    try:
        _described(t)
    except _Unflattenable:
        return True
    return False


def flatten_wrappers(capture, lifted: list, lift) -> tuple[tuple, tuple, tuple]:
    """(a Wrapper per lifted wrapper subclass, their key entries, the lifted indices held by
    reference); raises Fallback where one is not supported (yet). Their inner tensors are
    lifted through `lift` (deduplicated by identity: two subclasses may share one, a
    ScaledTensor's scale). One the graph cannot flatten (no __tensor_flatten__, nested, a
    subclass inside, metadata that cannot be keyed) is held by reference where it is a root
    grad; elsewhere the walk runs again with its nodes opaque (NOTE [Values passed by
    reference], nodes/references.py; NOTE [Nodes that save what a graph cannot hold])."""
    wrappers, keys, held = [], [], []
    roots = {g for _, _, g in capture.roots() if g >= 0} if capture.opaque_subclasses else ()
    for i in capture.wrapped():
        t = lifted[i]  # (with COMPILED_AUTOGRAD_SUBCLASSES=0 collect() fell back before)
        try:
            names, meta, attrs, consts, meta_key = _described(t)
        except _Unflattenable as e:
            if i in roots:
                held.append(i)
                keys.append(("R", i, type(t)))
                continue
            why = f"tensor subclass {e}"
            raise Fallback(why) if capture.opaque_subclasses else OpaqueSubclasses(why)
        inner = []
        for name, v in attrs:
            try:
                inner.append((name, lift(v)))
            except Unkeyable as e:
                raise Fallback(f"tensor subclass {type(t).__name__} whose {name} is a {e}") from None
        wrappers.append(Wrapper(i, type(t), tuple(inner), tuple((n, v) for n, v, _ in consts), meta, tuple(t.shape), tuple(t.stride())))
        keys.append(("W", i, type(t), tuple(names), meta_key, tuple(j for _, j in inner), tuple((n, k) for n, _, k in consts)))
    return tuple(wrappers), tuple(keys), tuple(held)
