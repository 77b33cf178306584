"""Seeing what happened: why each capture exists and what fell back."""

from __future__ import annotations

from .cache import CACHE
from .runtime import capture_log
from .stats import LOCK, STATS


def explain() -> str:
    """A readable report: counters, then one line per capture with its reason."""
    with LOCK:
        s = STATS.snapshot()
    lines = [f"compiled_autograd: {s}"]
    for i, c in enumerate(capture_log()):
        lines.append(
            f"  capture {i}: {c['nodes']} nodes, {c['inputs']} inputs, backend {c['backend']}: {c['reason']} "
            f"(trace {c['trace_seconds']:.2f}s, compile {c['compile_seconds']:.2f}s)"
        )
        for name, why in c.get("opaque", ()):
            lines.append(f"    opaque: {name}: {why}")
        if c.get("dynamic"):
            shown = ", ".join(c["dynamic"][:12]) + (" ..." if len(c["dynamic"]) > 12 else "")
            lines.append(f"    symbolic sizes: {shown}")
            lines.append(f"    guards: {c.get('guards') or 'none'}")
    for reason, n in s.fallback_reasons.most_common():
        lines.append(f"  eager fallback x{n}: {reason}")
    lines.append(f"  cached graphs: {len(CACHE)}")
    return "\n".join(lines)


def graphs():
    """The cached compiled backwards (each has `.graph`, an FX GraphModule)."""
    return CACHE.entries()
