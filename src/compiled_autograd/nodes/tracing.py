"""Whether this thread is tracing a backward (a backward() called then cannot be traced:
reentrant checkpointing runs opaquely instead). Apart from the tracer, which a hit never
imports."""

from __future__ import annotations

import threading


class _Tracing(threading.local):
    active = False


_tracing = _Tracing()


def is_tracing() -> bool:
    return _tracing.active
