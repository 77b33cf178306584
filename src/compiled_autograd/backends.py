"""Turning a captured FX graph into something callable.

Every backend receives the traced aten-level `GraphModule` and the real lifted
tensors as example inputs, and returns a callable taking the lifted tensors
positionally and returning the list of graph outputs.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .config import BackendLike


def compile_graph(backend: BackendLike, gm: torch.fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> Callable:
    # Compile as an inference graph: the backward graph is never differentiated
    # again (create_graph=True runs eagerly).
    with torch.no_grad():
        if backend == "eager":
            return gm
        if backend == "aot_eager":
            from torch._dynamo.backends.debugging import aot_eager

            return aot_eager(gm, list(example_inputs))
        if backend == "inductor":
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, list(example_inputs))
        return backend(gm, list(example_inputs))
