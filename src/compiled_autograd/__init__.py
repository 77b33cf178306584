"""compiled_autograd: capture, cache and compile PyTorch's backward pass.

import compiled_autograd as ca
with ca.enable(backend="inductor"):
    loss.backward()
"""

from .api import backward, disable, dump, enable, explain, grad, graphs, reset, stats
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
