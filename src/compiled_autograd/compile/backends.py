"""Turning a captured FX graph into something callable: the built-in backends, registered in
config.py's registry (the one list of names an option may give).

Every backend receives the traced aten-level `GraphModule` and example inputs
(the real lifted tensors for a static graph; fake tensors and SymInts for a
dynamic one), and returns a callable taking the graph inputs positionally and
returning the list of graph outputs.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch

from .. import calls
from ..config import BACKENDS, Backend, register
from ..values import BackendLike
from .boxed import _boxed_graph_module, _direct_calls_nop, compile_on_static_fakes
from .torch_patches import compile_lock


def _eager(gm, example_inputs, dynamic, patches):
    return _boxed_graph_module(gm)


def _aot_eager(gm, example_inputs, dynamic, patches):
    from torch._dynamo.backends.debugging import aot_eager

    # (as inductor's: against fakes of a mode with a ShapeEnv, in which an op whose output
    # shape depends on data -- a boolean-mask index in a grad formula -- gets an unbacked
    # size; AOTAutograd's own fake mode for real inputs has no ShapeEnv, and raised
    # DynamicOutputShapeException)
    compile = functools.partial(aot_eager, fw_compiler=_direct_calls_nop)
    return compile_on_static_fakes(compile, gm, example_inputs, static=not dynamic)


def _inductor(gm, example_inputs, dynamic, patches):
    from .inductor import compile_inductor

    return compile_inductor(gm, example_inputs, dynamic, patches)


register(Backend("eager", _eager, steals=True, background=False, eager_kernels=True))
register(Backend("aot_eager", _aot_eager, steals=True, background=False, eager_kernels=True))
register(Backend("inductor", _inductor, steals=True, background=True, eager_kernels=False))


def compile_graph(
    backend: BackendLike,
    gm: torch.fx.GraphModule,
    example_inputs: Sequence,
    dynamic: bool = False,
    patches: dict | None = None,
) -> Callable:
    """The backend's callable for a captured graph. Compiled as an inference graph: the
    compiled graph is never differentiated itself (under create_graph=True the traced FX
    graph is: NOTE [create_graph] in capture/create_graph.py). One compile at a time:
    inductor is not thread-safe, and background compiles run in threads. `patches`:
    inductor config (enable(mode=..., options=...)), set for this compile only."""
    calls.exempt_from_aliasing_check()
    with compile_lock, torch.no_grad():
        if isinstance(backend, str):
            return BACKENDS[backend].compile(gm, example_inputs, dynamic, patches)
        return backend(gm, list(example_inputs))


def may_steal(backend: BackendLike) -> bool:
    """Whether the code `backend` compiles leaves a grad handed to AccumulateGrad alone
    (NOTE [Stealing a fresh grad] in nodes/accumulate.py). A user's backend is unknown."""
    return isinstance(backend, str) and BACKENDS[backend].steals
