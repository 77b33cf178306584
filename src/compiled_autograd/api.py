"""The user surface: enable(), backward(), grad(), stats(), explain(), graphs(), dump(), reset().

NOTE [One interception point]
`torch.autograd.backward` (hence `Tensor.backward`) and `torch.autograd.grad`
both end in `torch.autograd._engine_run_backward`, looked up as a global of the
`torch.autograd` module, after `_make_grads` has built the root grads and raised
eager's own argument errors. We replace that global once, at import, with a
router that sends the call to us when an `enable()` scope is active in the
current context (a ContextVar: nestable, per thread/task) and to the eager
engine otherwise.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
from typing import Any

import torch
import torch.autograd

from . import calls
from . import config as _config
from .cache.memory import CACHE
from .config import BackendLike, Config
from .compile import background as _background
from .compile import torch_patches as _torch_patches
from .compile.background import synchronize
from .runtime import reset_runtime, run_backward
from .nodes.tracing import is_tracing
from .observe import explain as _explain
from .observe.stats import LOCK, STATS, Stats, reset_stats

_eager_engine_run_backward = torch.autograd._engine_run_backward


def _routed_engine_run_backward(
    t_outputs,
    grad_tensors,
    keep_graph,
    create_graph,
    inputs=(),
    allow_unreachable=False,
    accumulate_grad=False,
    *args,
    **kwargs,
):
    cfg = _config.current()
    eager = functools.partial(
        _eager_engine_run_backward,
        t_outputs,
        grad_tensors,
        keep_graph,
        create_graph,
        inputs,
        allow_unreachable,
        accumulate_grad,
        *args,
        **kwargs,
    )
    if is_tracing():
        # a custom Function's backward that runs a backward itself (reentrant
        # checkpointing) cannot be traced: it will run opaquely instead
        raise RuntimeError("compiled_autograd: backward() called while tracing a backward")
    if cfg is None or args or kwargs:
        return eager()
    return run_backward(
        cfg,
        eager,
        tuple(t_outputs),
        tuple(grad_tensors),
        bool(keep_graph),
        bool(create_graph),
        tuple(inputs or ()),
        bool(allow_unreachable),
        bool(accumulate_grad),
    )


def _install() -> None:
    """What a scope needs of torch, installed when one is first entered: importing the library
    changes nothing in torch (tests/test_api.py)."""
    calls.install()  # compiled_autograd::call, which our graphs call
    if torch.autograd._engine_run_backward is not _routed_engine_run_backward:
        try:
            _torch_patches.install(_torch_patches.FIRST_USE)
        except _torch_patches.LayoutDiffers:  # every backward runs in eager, with its reason (NOTE [Torch versions])
            pass
        torch.autograd._engine_run_backward = _routed_engine_run_backward


# NOTE [Each use of a scope is its own]
# One enable()/disable() object may be in use several times at once: entered
# again while inside it, on a recursive decorated function, or in two threads
# (a decorated function, or one object shared by `with` in both). So nothing
# about a use is kept on the object (a ContextVar token kept there is reset
# twice, or in another thread's context): each entry pushes (object, the config
# it was entered from) on a stack that is itself a context variable, so each
# thread (and asyncio task) has its own, and an exit pops this object's
# innermost entry in its own context and restores that config.
_scopes: contextvars.ContextVar[tuple] = contextvars.ContextVar("compiled_autograd_scopes", default=())


def _enter_scope(owner, cfg: Config | None) -> None:
    _scopes.set(_scopes.get() + ((owner, _config._active.get()),))
    _config._active.set(cfg)


def _exit_scope(owner) -> None:
    stack = _scopes.get()
    i = len(stack) - 1
    while i >= 0 and stack[i][0] is not owner:
        i -= 1
    if i < 0:
        raise RuntimeError(f"compiled_autograd: leaving a {type(owner).__name__}() scope that was not entered in this thread or task")
    previous = stack[i][1]
    if i == len(stack) - 1:
        _scopes.set(stack[:i])
        _config._active.set(previous)
    else:  # left before a scope entered inside it: that one restores what this one found
        _scopes.set(stack[:i] + ((stack[i + 1][0], previous),) + stack[i + 2 :])


class enable(contextlib.ContextDecorator):
    """Compile every backward run inside this scope.

    >>> with ca.enable(backend="inductor"):
    ...     loss.backward()

    Also usable as a decorator. Scopes nest; the innermost one wins.
    """

    def __init__(
        self,
        backend: BackendLike = "inductor",
        *,
        fullgraph: bool = False,
        cache_size_limit: int = 256,
        opaque: tuple = (),
        dynamic: bool | None = None,
        background: bool | None = None,
        disk_cache: bool | None = None,
        mode: str | None = None,
        options: dict | None = None,
    ):
        self.config = Config(
            backend=backend,
            fullgraph=fullgraph,
            cache_size_limit=cache_size_limit,
            opaque=opaque,
            dynamic=dynamic,
            background=background,
            mode=mode,
            options=options or (),
            **({} if disk_cache is None else {"disk_cache": disk_cache}),
        )

    def __enter__(self):
        _install()
        _enter_scope(self, self.config)
        return self

    def __exit__(self, *exc):
        _exit_scope(self)
        return False


class disable(contextlib.ContextDecorator):
    """Run backwards in eager autograd inside this scope, even within `enable()`."""

    def __enter__(self):
        _enter_scope(self, None)
        return self

    def __exit__(self, *exc):
        _exit_scope(self)
        return False


def backward(
    tensors,
    grad_tensors=None,
    retain_graph: bool | None = None,
    inputs=None,
    backend: BackendLike = "inductor",
    *,
    fullgraph: bool = False,
) -> None:
    """`torch.autograd.backward`, compiled."""
    with enable(backend, fullgraph=fullgraph):
        torch.autograd.backward(tensors, grad_tensors=grad_tensors, retain_graph=retain_graph, inputs=inputs)


def grad(
    outputs,
    inputs,
    grad_outputs=None,
    retain_graph: bool | None = None,
    allow_unused: bool | None = None,
    backend: BackendLike = "inductor",
    *,
    fullgraph: bool = False,
) -> tuple[Any, ...]:
    """`torch.autograd.grad`, compiled."""
    with enable(backend, fullgraph=fullgraph):
        return torch.autograd.grad(outputs, inputs, grad_outputs=grad_outputs, retain_graph=retain_graph, allow_unused=allow_unused)


def stats() -> Stats:
    """A snapshot of the counters (captures, hits, eager_fallbacks, opaque_nodes, ...)."""
    with LOCK:
        return STATS.snapshot()


def explain(file=sys.stdout) -> _explain.Report:
    """Print a readable report -- counters, one line per capture with its reason, why
    backwards ran in eager and nodes ran opaquely -- to `file` (None: print nothing), and
    return its text."""
    judged = [line for _, fam in CACHE.items() if (line := fam.payback.summary())]  # NOTE [A compiled graph slower than eager]
    return _explain.explain(CACHE.entries(), file, _background.report(), judged)


def graphs() -> list:
    """The cached compiled backwards (each has `.graph`, an FX GraphModule)."""
    return CACHE.entries()


def dump(path) -> list[str]:
    """Write every cached graph to `path`: a script that runs it and compares a backend with
    its eager run (graph_<i>.py: `python graph_0.py --backend inductor`; NOTE [A graph you can
    run]), how it was captured and its code with shapes (graph_<i>.txt), and a picture of the
    backward graph (graph_<i>.svg, plus .dot) with node kinds, opaque nodes and hooks marked.
    Returns the files written."""
    from .compile import repro

    return _explain.dump(CACHE.entries(), path, repro.write)


def reset() -> None:
    """Clear the cache and the counters (after waiting for background compiles)."""
    synchronize()
    CACHE.clear()
    reset_stats()
    reset_runtime()
