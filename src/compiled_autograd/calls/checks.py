"""The checks a call makes around what it runs, and the errors it raises: eager's own where
eager has one (a saved tensor changed in place), else one naming what the compiled graph
cannot follow (NOTE [Opaque calls] in calls/__init__.py). The native helper raises through
these same functions (NOTE [Calls in the helper])."""

from __future__ import annotations

_ABSENT = object()  # an attribute no ctx holds


def _hooks_added_error(kind, capture, node):
    raise RuntimeError(
        f"compiled_autograd: {kind.replace('_', ' ')} of {capture.node_name(node)} registered a hook "
        "(or called retain_grad()) on a node this backward has not reached, which had none of that "
        "kind: the compiled graph has no place to run it (register it before the backward)"
    )


def _still_empty_error(kind, capture, node):
    raise RuntimeError(
        f"compiled_autograd: after the {kind.replace('_', ' ')} of {capture.node_name(node)}, a saved tensor whose "
        "storage was empty when the backward started is still empty where the graph reads it (NOTE [Tensors "
        "whose data arrives during the backward]): no hook refilled it before its node"
    )


def _shared_modified_error(kind, capture, node):
    raise RuntimeError(
        f"compiled_autograd: {kind.replace('_', ' ')} of {capture.node_name(node)} modified a "
        "gradient in place that other nodes of the backward also read; hooks must not modify "
        "their arguments (return a new tensor instead), and the compiled graph cannot follow"
    )


def _check_ctx(snapshots) -> None:
    """A hook that rebinds an attribute of a custom Function's ctx before its backward runs
    (`grad_fn.W = new`), or a global or closure value its backward reads: eager's backward
    reads the new value, the traced one read the old (a tensor lifted, a number keyed) when
    the backward started."""
    from ..nodes.state import read_state

    for obj, items, state in snapshots:
        now = vars(obj)
        changed = [f"ctx.{name}" for name, old in items if not _same(now.get(name, _ABSENT), old)]
        changed += [name or "a closure value" for c, name, old in state if not _same(read_state(c, name), old)]
        if changed:
            raise RuntimeError(
                f"compiled_autograd: a hook set {changed[0]} (which the backward of {obj.name()} reads) before "
                "that node ran; the compiled graph read it when the backward started (set it in the forward, "
                "change a tensor in place instead, or run this backward without compiled_autograd)"
            )


def _same(new, old) -> bool:
    return new is old or (type(new) is type(old) and isinstance(old, (bool, int, float, complex, str)) and repr(new) == repr(old))


def _check_versions(tensors, expected) -> None:
    """Eager's error for a saved tensor changed in place before its node unpacks it."""
    for t, v in zip(tensors, expected):
        if t._version != v:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace "
                f"operation: [{t.type()} {list(t.shape)}] is at version {t._version}; expected version {v} "
                "instead (compiled_autograd: a hook changed it during the backward, before a node that saved it)"
            )
