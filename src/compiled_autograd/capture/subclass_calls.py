"""Calls given tensor subclasses (docs/design/subclasses.md section 5): a subclass argument is
passed as its inner tensors and rebuilt before the call (Slot.rebuild); where output i is
argument i's new value (a tensor hook's), a subclass output comes back as its inner tensors,
checked against the traced metadata by the kernel, and is rebuilt in the graph (Slot.out_specs).
An opaque node's subclass outputs, and what a node's pre and post hooks return for a subclass
grad, are held by reference (NOTE [Values passed by reference], nodes/references.py)."""

from __future__ import annotations

from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..nodes import opaque, references
from ..values import OutputMeta


def flatten_args(t, kind, args, out_metas, flags, outs_like_args):
    """(the call's arguments with subclasses flattened, its output metas so too, Slot.rebuild,
    Slot.out_specs, the outputs it hands on by reference); `t` the tracer."""
    if not any(is_traceable_wrapper_subclass(a) for a in args):
        return args, out_metas, (), (), ()
    flat, rebuild, out_specs, by_reference = [], [], (), ()
    for i, a in enumerate(args):
        if is_traceable_wrapper_subclass(a):
            spec, inner = t._flatten(a)
            rebuild.append((i, spec, inner))
            flat += inner
        else:
            flat.append(a)
    if any(m is not None for m in out_metas) and kind != opaque.NODE:
        if not outs_like_args or flags:
            # a node's pre or post hooks (which may return None for a grad): what they return for a
            # subclass grad is held by reference (NOTE [Values passed by reference]), the nodes given
            # it opaque
            by_reference = tuple(i for i, _, _ in rebuild if i < len(out_metas) and out_metas[i] is not None)
            out_metas = [references.token(m.dtype, m.device) if i in by_reference else m for i, m in enumerate(out_metas)]
            return flat, out_metas, tuple((i, spec) for i, spec, _ in rebuild), (), by_reference
        out_specs = tuple((i, spec) for i, spec, _ in rebuild if i < len(out_metas) and out_metas[i] is not None)
        inner_of = {i: inner for i, _, inner in rebuild}
        wide = []
        for i, m in enumerate(out_metas):
            wide += [OutputMeta.like(x) for x in inner_of[i]] if i in inner_of and m is not None else [m]
        out_metas = wide
    return flat, out_metas, tuple((i, spec) for i, spec, _ in rebuild), out_specs, by_reference


def regroup(positional, mask, out_specs) -> list:
    """A call's outputs with each subclass (Slot.out_specs) rebuilt over its inner outputs."""
    if not out_specs:
        return positional
    specs, wide, out = dict(out_specs), iter(positional), []
    for i in range(len(mask) - sum(len(spec.names) - 1 for spec in specs.values())):
        spec = specs.get(i)
        out.append(spec.rebuild([next(wide) for _ in spec.names]) if spec is not None else next(wide))
    return out
