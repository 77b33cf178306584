"""Capture: trace one whole backward into a torch.fx graph of aten ops.

The native `GraphCapture.trace` walks the nodes in engine order and calls each
node's real backward formula with its saved tensors swapped for the fake
tensors make_fx hands us; the aten ops they run are recorded here.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.fx.experimental.proxy_tensor import make_fx


def trace_backward(capture, lifted: Sequence[torch.Tensor]) -> torch.fx.GraphModule:
    def backward_graph(*args):
        return capture.trace(list(args))

    with torch.no_grad():
        gm = make_fx(backward_graph, tracing_mode="fake", _allow_non_fake_inputs=False)(*lifted)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm
