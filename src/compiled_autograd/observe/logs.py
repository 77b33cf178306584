"""Logging: quiet by default; COMPILED_AUTOGRAD_LOG=info|debug turns it on."""

from __future__ import annotations

import contextlib
import logging
import threading
import time

from ..config import LOG

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure_logging() -> None:
    """COMPILED_AUTOGRAD_LOG=info|debug sends the `compiled_autograd` logger to
    stderr (quiet by default; `logging.getLogger("compiled_autograd")` works
    as usual too)."""
    level = LOG.read().strip().lower()
    if not level:
        return
    if level not in _LEVELS:
        raise ValueError(f"COMPILED_AUTOGRAD_LOG={level!r}: expected one of {', '.join(_LEVELS)}")
    logger = logging.getLogger("compiled_autograd")
    logger.setLevel(_LEVELS[level])
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[compiled_autograd] %(message)s"))
        logger.addHandler(handler)


@contextlib.contextmanager
def compile_status(what: str, every: float = 10.0, detail=None):
    """Log when a compile starts and ends, and a one-line status every
    `every` seconds while it runs (with `detail()`, where given)."""
    log = logging.getLogger("compiled_autograd")
    start = time.perf_counter()
    log.info("%s ...", what)
    stop = threading.Event()

    def tick():
        while not stop.wait(every):
            more = detail() if detail is not None else ""
            log.info("%s: still compiling (%.0fs)%s", what, time.perf_counter() - start, f": {more}" if more else "")

    ticker = threading.Thread(target=tick, daemon=True) if log.isEnabledFor(logging.INFO) else None
    if ticker:
        ticker.start()
    try:
        yield
    finally:
        stop.set()
        log.info("%s: done in %.2fs", what, time.perf_counter() - start)
