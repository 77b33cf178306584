"""Before the walk: what makes a backward run in eager autograd whatever its graph, and the
process state a traced formula may branch on (part of the key)."""

from __future__ import annotations

import sys

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode, is_traceable_wrapper_subclass

from .. import config
from ..observe.stats import STATS
from .subclasses import unflattenable


# Traceable wrapper subclasses (DTensor, a user's) flattened into their inner tensors and traced
# through their __torch_dispatch__ (docs/design/subclasses.md), unless COMPILED_AUTOGRAD_SUBCLASSES=0
def subclasses_on() -> bool:
    """COMPILED_AUTOGRAD_SUBCLASSES, read when used."""
    return config.SUBCLASSES.on()


def global_state(dtensors: bool = True) -> tuple:
    # process state a traced formula may branch on; a backward run inside an autocast region
    # runs its formulas autocast (the engine runs CPU work on the calling thread, and a CUDA
    # device thread takes the caller's autocast state): the dtype per device type, or None.
    # DTensor's state only where the graph traces through a subclass (`dtensors`): importing
    # inductor imports DTensor, and a graph of plain tensors keyed by it was captured again
    # (and compiled again) once its first compile had imported it
    return (
        torch.get_default_dtype(),
        torch.are_deterministic_algorithms_enabled(),
        torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None,
        torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None,
        _dtensor_state() if dtensors else None,
    )


def _dtensor_state():
    """What DTensor's sharding propagation branches on besides the specs a graph keys: implicit
    replication (`implicit_replication()`) and the custom op handlers (`loss_parallel()` swaps
    cross entropy's rules in); None until DTensor is imported (docs/design/subclasses.md, Risks)."""
    api = sys.modules.get("torch.distributed.tensor._api")
    if api is None:
        return None
    ops = tuple(api.DTensor._op_dispatcher._custom_op_handlers)
    names = _HANDLER_NAMES.get(ops)
    if names is None:  # (by name, sorted: the disk key's text is the same in every process)
        names = _HANDLER_NAMES[ops] = tuple(sorted(map(str, ops)))
    return (torch._C._get_dtensor_allow_implicit_replication(), names)


_HANDLER_NAMES: dict = {}


def _is_edge(e) -> bool:
    """A GradientEdge (node, output_nr, ...); the native side checks the node."""
    return isinstance(e, torch.autograd.graph.GradientEdge) and type(e[1]) is int


def precheck(roots, grads, create_graph, inputs, accumulate_grad) -> tuple[str | None, bool]:
    """(reason to run eagerly, whether eager is only there to raise the user's error)."""
    for r in roots:
        if not isinstance(r, torch.Tensor):
            if not _is_edge(r):
                return "root neither a tensor nor a GradientEdge", True
        elif r.grad_fn is None and not r.requires_grad:
            return "root does not require grad", True
    for t in inputs:
        if not isinstance(t, torch.Tensor):
            if not _is_edge(t):
                return "input neither a tensor nor a GradientEdge", True
        elif not t.requires_grad:
            return "input does not require grad", True
        elif accumulate_grad and t.grad_fn is not None:
            t.retain_grad()  # what eager does for a non-leaf input of backward(): its grad lands in .grad
    if torch.is_anomaly_enabled() and (torch.is_anomaly_check_nan_enabled() or not STATS.compiles_pending):
        # (aot autograd turns anomaly mode on, without NaN checks, while it
        # compiles; that global flag is not the user's while ours compile)
        return "anomaly mode", False
    if torch._C._are_functorch_transforms_active() or any(_is_functorch_wrapped(t) for t in (*roots, *inputs, *grads)):
        # (torch.func.vjp's function runs the engine on its transform's tensors, outside it)
        return "functorch transform active", False
    if any(g is not None and _is_vmapped(g) for g in grads):
        return "grads batched by vmap (is_grads_batched=True)", False
    if _get_current_dispatch_mode() is not None:
        return "TorchDispatchMode active", False
    for g in grads:
        if g is not None and type(g) not in (torch.Tensor, torch.nn.Parameter):
            if not subclasses_on() or not (is_traceable_wrapper_subclass(g) or _held(g)):
                return "tensor subclass root grad", False
    return None, False


def _held(g) -> bool:
    """A subclass the graph cannot flatten: a `__torch_dispatch__` subclass without
    __tensor_flatten__, a jagged nested tensor, one with a subclass inside or metadata that
    cannot be keyed (walk/subclasses.py unflattenable)."""
    if type(g) in (torch.Tensor, torch.nn.Parameter) or not torch._C._dispatch_keys(g).has(torch._C.DispatchKey.Python):
        return False
    return unflattenable(g)


def opaque_subclasses(grads) -> bool:
    """Whether a root grad is a tensor subclass the graph cannot flatten (no __tensor_flatten__):
    it is held by reference, and every node that takes or returns a subclass's grad runs as is
    (NOTE [Values passed by reference], nodes/references.py)."""
    return any(g is not None and _held(g) for g in grads)


def _is_functorch_wrapped(t) -> bool:
    return isinstance(t, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(t)


def _is_vmapped(t) -> bool:
    """A grad batched by the vmap that `grad(..., is_grads_batched=True)` runs the engine in."""
    check = getattr(torch._C._functorch, "is_legacy_batchedtensor", None)
    return bool(check is not None and isinstance(t, torch.Tensor) and check(t))
