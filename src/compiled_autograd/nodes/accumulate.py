"""AccumulateGrad: a graph result applied after the graph by the real AccumulateGrad, or, when
hooks or opaque nodes could observe `.grad`, a call at its eager position (NOTE [Stealing a
fresh grad], replay/calls.py)."""

from __future__ import annotations

from ..capture.grads import _Value
from ..replay import calls as ops


def trace(t, idx, v: _Value | None):
    if t.in_graph_accumulate:
        if v is not None:
            args = [v.t] + ([t._defined(v.bits)] if v.bits is not None else [])
            t._call(ops.ACCUMULATE, idx, args, [])
    else:
        r, f = t._result(v)
        if r >= 0:
            t.accumulate.append((idx, r, f))
