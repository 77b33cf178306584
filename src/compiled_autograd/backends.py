"""Turning a captured FX graph into something callable.

Every backend receives the traced aten-level `GraphModule` and example inputs
(the real lifted tensors for a static graph; fake tensors and SymInts for a
dynamic one), and returns a callable taking the graph inputs positionally and
returning the list of graph outputs.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import threading
from typing import Callable, Sequence

import torch

from .config import BackendLike

_lock = threading.RLock()


def compile_graph(
    backend: BackendLike, gm: torch.fx.GraphModule, example_inputs: Sequence, dynamic: bool = False
) -> Callable:
    # Compile as an inference graph: the backward graph is never differentiated
    # again (create_graph=True runs eagerly). One compile at a time: inductor
    # is not thread-safe, and background compiles run in threads.
    with _lock, torch.no_grad():
        if backend == "eager":
            return gm
        if backend == "aot_eager":
            from torch._dynamo.backends.debugging import aot_eager

            return aot_eager(gm, list(example_inputs))
        if backend == "inductor":
            from torch._inductor.compile_fx import compile_fx

            with _size_class_agnostic_reductions() if dynamic else contextlib.nullcontext():
                return compile_fx(gm, list(example_inputs))
        return backend(gm, list(example_inputs))


@contextlib.contextmanager
def _size_class_agnostic_reductions():
    """NOTE [One dynamic graph per size range]
    Inductor's CPU code generator picks a summation helper for float sums by
    guarding on `reduction size > 4096`. In a dynamic graph that guard splits
    the sizes into two ranges, each needing its own compile. When the size is
    symbolic and not known either way, we take the helper (cascade summation,
    correct and precise for every size) instead of guarding."""
    try:
        import sympy
        from torch._inductor.codegen.cpp import CppKernel
        from torch._inductor.virtualized import V
    except ImportError:  # pragma: no cover - other torch versions
        yield
        return
    original = CppKernel.need_use_acc_helper

    def need_use_acc_helper(self, reduction_type, dtype, use_scalar):
        if reduction_type == "sum" and dtype == torch.float and self.call_ranges is not None:
            size = functools.reduce(operator.mul, self.call_ranges[self.reduction_depth :], sympy.Integer(1))
            sizevars = V.graph.sizevars
            if not sizevars.statically_known_true(sympy.Le(size, 4096)):
                return True
        return original(self, reduction_type, dtype, use_scalar)

    CppKernel.need_use_acc_helper = need_use_acc_helper
    try:
        with _cache_tag():
            yield
    finally:
        CppKernel.need_use_acc_helper = original


@contextlib.contextmanager
def _cache_tag():
    """Keep inductor's on-disk caches from mixing graphs compiled with and
    without the change above: a no-op custom pass whose uuid enters the key."""
    from torch._inductor import config

    if config.post_grad_custom_post_pass is not None:
        yield
        return
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass
    except ImportError:  # pragma: no cover
        yield
        return

    class _Tag(CustomGraphPass):
        def __call__(self, graph):
            return None

        def uuid(self):
            return "compiled_autograd: size-class agnostic reductions v1"

    with config.patch(post_grad_custom_post_pass=_Tag()):
        yield
