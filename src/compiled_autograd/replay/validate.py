"""What a compiled graph must return, checked on its first run.

NOTE [A compiled graph's outputs are checked on its first run]
The engine validates each node's outputs (`validate_outputs`: their number,
then each one's shape, dtype, device and layout against what the next node
expects). Our graphs are traced from those nodes, so the traced graph returns
what eager would; a backend's compiled function need not (a user's callable
that returns too few outputs, or a grad of the wrong shape or dtype, which
would otherwise land in `.grad` or raise an IndexError deep in the apply step).
So each compiled function's first run -- right after its compile, and right
after a background compile swapped it in -- has its outputs compared with the
traced graph's (the output node's `meta['val']`, recorded before the backend
saw the graph: a backend may rewrite it), before anything is applied; a
mismatch raises (errors.BackendOutputError) and the graph leaves the cache.
Later runs of that function (cache hits) are not checked: one flag on the entry.
A dynamic graph's symbolic sizes are evaluated with this backward's sizes (each
symbol is bound to the size position of a graph input that carries it); a size
that cannot be evaluated (data-dependent) is not compared. A graph loaded from
the disk cache has no metadata: only its number of outputs is checked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import BackendOutputError


@dataclass(frozen=True)
class Expected:
    """What a graph returns: per output (shape, dtype, device, layout), or None where
    unknown (not a tensor, or no metadata); a shape holds ints and sympy expressions."""

    outputs: tuple
    bind: tuple = ()  # (sympy symbol, position in the backward's sizes) per symbol of the inputs


def _output_args(gm: torch.fx.GraphModule) -> tuple | None:
    for node in reversed(gm.graph.nodes):
        if node.op == "output":
            out = node.args[0]
            return tuple(out) if isinstance(out, (list, tuple)) else (out,)
    return None


def _meta(node):
    v = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(v, torch.Tensor):
        return None
    shape = tuple(s.node.expr if isinstance(s, torch.SymInt) else int(s) for s in v.shape)
    return shape, v.dtype, v.device, v.layout


def expected_outputs(gm: torch.fx.GraphModule, collected=None, size_inputs=()) -> Expected | None:
    """Read from the traced graph before a backend compiles it. `collected` and `size_inputs`
    (a dynamic capture's): where in the sizes each symbol of the graph's inputs is found."""
    try:
        outs = _output_args(gm)
        if outs is None:
            return None
        bind = _binding(gm, collected, size_inputs) if collected is not None else ()
        return Expected(tuple(_meta(o) for o in outs), bind)
    except Exception:  # (never the reason a backward fails: no check then)
        return None


def _binding(gm, collected, size_inputs) -> tuple:
    import sympy

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    positions = collected.tensor_positions
    if len(placeholders) != len(positions) + len(size_inputs):
        return ()
    bind = {}
    for node, (start, dim, _) in zip(placeholders, positions):
        v = node.meta.get("val")
        if isinstance(v, torch.Tensor) and v.dim() == dim:
            for d, s in enumerate(v.shape):
                if isinstance(s, torch.SymInt) and isinstance(s.node.expr, sympy.Symbol):
                    bind.setdefault(s.node.expr, start + d)
    for node, pos in zip(placeholders[len(positions) :], size_inputs):
        v = node.meta.get("val")
        if isinstance(v, torch.SymInt) and isinstance(v.node.expr, sympy.Symbol):
            bind.setdefault(v.node.expr, pos)
    return tuple(bind.items())


def _describe(shape, dtype, device, layout) -> str:
    return f"shape {tuple(shape)}, dtype {dtype}, device {device}, layout {layout}"


def mismatches(expected: Expected, results, sizes: tuple, count: int | None = None, skip=()) -> list[str]:
    """What differs between a compiled graph's results and the traced graph's outputs
    (`count`: how many of the graph's outputs `results` holds, if not all; `skip`: results
    that are no longer the graph's own, values held by reference in their tokens' place)."""
    want = expected.outputs if count is None else expected.outputs[:count]
    if len(results) != len(want):
        return [f"it returned {len(results)} output{'s' if len(results) != 1 else ''}; the traced graph returns {len(want)}"]
    env = None
    out = []
    for i, (meta, got) in enumerate(zip(want, results)):
        if meta is None or i in skip:
            continue
        shape, dtype, device, layout = meta
        if not isinstance(got, torch.Tensor):
            out.append(f"output {i}: expected a tensor of {_describe(*meta)}; got {type(got).__name__}")
            continue
        if any(not isinstance(s, int) for s in shape):
            if env is None:
                env = {sym: sizes[pos] for sym, pos in expected.bind if pos < len(sizes)}
            shape = tuple(_evaluate(s, env) for s in shape)
        same_shape = got.dim() == len(shape) and all(s is None or s == g for s, g in zip(shape, got.shape))
        if not same_shape or got.dtype != dtype or got.device != device or got.layout != layout:
            want_shape = tuple("?" if s is None else s for s in shape)
            out.append(
                f"output {i}: expected {_describe(want_shape, dtype, device, layout).replace(chr(39), '')}; "
                f"got {_describe(tuple(got.shape), got.dtype, got.device, got.layout)}"
            )
    return out


def _evaluate(expr, env):
    """An int, or None where the expression has a symbol this backward's sizes do not give."""
    import sympy

    if isinstance(expr, int):
        return expr
    try:
        v = sympy.sympify(expr.xreplace(env))
        return int(v) if v.is_Integer else None
    except Exception:
        return None


def backend_output_error(entry, problems: list[str]) -> BackendOutputError:
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return BackendOutputError(
        f"compiled_autograd: the backward graph compiled by backend {entry.backend!r} returned outputs "
        f"that differ from the traced graph's: {'; '.join(problems[:3])}{more}. No gradient was "
        "applied, and the graph was dropped from the cache: the next backward of this structure "
        "captures and compiles it again."
    )
