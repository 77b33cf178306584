"""compiled_autograd: capture, cache and compile PyTorch's backward pass.

    import compiled_autograd as ca
    with ca.enable(backend="inductor"):
        loss.backward()
"""

from .api import backward, disable, enable, grad, reset, stats
from .explain import explain, graphs
from .runtime import CompiledAutogradError

__all__ = [
    "backward",
    "disable",
    "enable",
    "explain",
    "grad",
    "graphs",
    "reset",
    "stats",
    "CompiledAutogradError",
]
