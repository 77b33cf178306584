"""compiled_autograd: capture, cache and compile PyTorch's backward pass.

    import compiled_autograd as ca
    with ca.enable(backend="inductor"):
        loss.backward()
"""

from .api import backward, disable, enable, grad, reset, stats
from .observe.explain import dump, explain, graphs
from .observe.logs import configure_logging
from .errors import BackendOutputError, CompiledAutogradError
from .compile.background import synchronize

configure_logging()

__all__ = [
    "dump",
    "backward",
    "disable",
    "enable",
    "explain",
    "grad",
    "graphs",
    "reset",
    "stats",
    "synchronize",
    "CompiledAutogradError",
    "BackendOutputError",
]
