"""Tensor helpers of one case: the tensors inside a sample, the scalar loss, new values for
the second value set, the second-order grads of mode `create_graph`, and the comparison of
the grads with eager's."""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Sequence

import torch

DEFAULT_TOL = {torch.float32: (1e-4, 1e-5), torch.float64: (1e-7, 1e-7)}


def _walk(obj: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor inside nested lists/tuples/dicts, with a readable path."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, (list, tuple)):
        for i, x in enumerate(obj):
            yield from _walk(x, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for k, x in obj.items():
            yield from _walk(x, f"{path}[{k!r}]")


def _unique(items: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    seen: set[int] = set()
    out = []
    for label, t in items:
        if id(t) not in seen:
            seen.add(id(t))
            out.append((label, t))
    return out


def _diff_outputs(outs: Any) -> list[torch.Tensor]:
    return [t for _, t in _walk(outs, "out") if t.requires_grad and (t.is_floating_point() or t.is_complex())]


def _make_weights(outs: list[torch.Tensor], seed: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(seed + 7919)
    weights = []
    for o in outs:
        real = o.real.dtype if o.is_complex() else o.dtype
        n = 2 if o.is_complex() else 1
        weights.append(tuple(torch.randn(o.shape, dtype=real, generator=g) for _ in range(n)))
    return weights


def _loss(outs: list[torch.Tensor], weights: list[tuple[torch.Tensor, ...]]) -> torch.Tensor:
    total = None
    for o, w in zip(outs, weights):
        if o.is_complex():
            term = (o.real * w[0]).sum() + (o.imag * w[1]).sum()
        else:
            term = (o * w[0]).sum()
        total = term if total is None else total + term
    return total


def _signature(outs: list[torch.Tensor]) -> list:
    return [(tuple(o.shape), o.dtype) for o in outs]


def _perturb(tensors: Sequence[torch.Tensor], originals: Sequence[torch.Tensor], seed: int, jitter: bool) -> None:
    """New values in place: original * s (one s in [0.75, 0.95] per tensor), times
    (1 + 1e-3 u) per element when `jitter`. Keeps shape, dtype, strides, signs, zeros,
    order (without jitter), symmetry and intervals that contain 0 -- domain constraints of
    most samples."""
    g = torch.Generator().manual_seed(seed + 104729)
    with torch.no_grad():
        for t, o in zip(tensors, originals):
            s = 0.75 + 0.2 * torch.rand((), generator=g).item()
            new = o * s
            if jitter and o.numel():
                real = o.real.dtype if o.is_complex() else o.dtype
                u = torch.rand(o.shape, generator=g, dtype=real) * 2 - 1
                new = new * (1 + 1e-3 * u)
            t.copy_(new)


def _second_order(grads: list, tensors: list, seed: int) -> list:
    """Mode `create_graph`: the grads of a weighted sum of the first-order grads (those that
    require grad) with respect to the inputs, in the same scope (so compiled too: a backward
    through the compiled create_graph backward), and which first-order grads require grad."""
    g = torch.Generator().manual_seed(seed + 15485863)
    terms = []
    for d in grads:
        if d is None:
            continue
        w = torch.randn(d.shape, dtype=d.real.dtype if d.is_complex() else d.dtype, generator=g)
        if d.requires_grad:
            terms.append(((d.real if d.is_complex() else d) * w).sum())
    mask = torch.tensor([d is not None and d.requires_grad for d in grads], dtype=torch.float64)
    if not terms:
        return [None] * len(tensors) + [mask]
    return list(torch.autograd.grad(torch.stack(terms).sum(), tensors, allow_unused=True)) + [mask]


def _strides(t: torch.Tensor) -> tuple:
    # strides of dims of size 1 mean nothing (the layout contract ignores them too)
    return tuple(st for sz, st in zip(t.shape, t.stride()) if sz != 1)


# NOTE [The contract of a second-order gradient]
# A backward through a create_graph backward is not eager's bitwise by construction. Eager's
# engine differentiates the graph its first backward recorded, one node per formula op, and
# sums the contributions to each tensor's gradient as each node sends them; ours
# differentiates the compiled first-order graph, which is one node (DifferentiableGraph), so
# the contributions that cross it are summed inside it first, then with the rest: the same
# terms, added in another order. Which last bits that changes depends on the values, so on
# the CPU (MKL's kernels give other values on another one). The contract: the first-order
# grads (and which of them require grad) are bitwise eager's; each second-order grad is within
# SECOND_ORDER_EPS machine epsilons of its tensor's largest eager magnitude:
#     max |ours - eager| <= SECOND_ORDER_EPS * eps(dtype) * max |eager|
# with NaN and infinities where eager has them. Measured over torch's whole op_db (float32 and
# float64, docs/conformance.md): the largest drift is DRIFT_SEEN eps.
SECOND_ORDER_EPS = 64.0
DRIFT_SEEN = None


def second_order(label: str) -> bool:
    return label.startswith("d2 ")


def drift_eps(g: torch.Tensor, w: torch.Tensor) -> float:
    """max |g - w| in machine epsilons of w's dtype times max |w| (NOTE [The contract of a
    second-order gradient]); inf where NaN or infinite positions differ."""
    if g.layout != torch.strided:
        g, w = g.to_dense(), w.to_dense()
    if not w.numel():
        return 0.0
    gd, wd = g.double(), w.double()
    same = (gd == wd) | (torch.isnan(gd) & torch.isnan(wd))
    if bool(same.all()):
        return 0.0
    finite = torch.isfinite(wd) & torch.isfinite(gd)
    if bool((~same & ~finite).any()):
        return float("inf")
    real = w.real.dtype if w.is_complex() else w.dtype
    scale = wd[torch.isfinite(wd)].abs().max().item() * torch.finfo(real).eps
    diff = (gd - wd)[finite].abs().max().item()
    return float("inf") if scale == 0 else diff / scale


def _compare(got, want, labels, dtype, tol=None, drifts: list | None = None) -> tuple[str | None, str]:
    """(why the grads differ or None, stride mismatch note). Second-order grads are held to
    their contract when `drifts` is given (each one's drift is appended to it)."""
    rtol, atol = tol or DEFAULT_TOL.get(dtype, (1e-4, 1e-5))
    strides = []
    for label, g, w in zip(labels, got, want):
        if w is None and g is None:
            continue
        if (
            drifts is not None
            and second_order(label)
            and g is not None
            and w is not None
            and g.shape == w.shape
            and g.dtype == w.dtype
            and g.layout == w.layout
        ):
            d = drift_eps(g, w)
            drifts.append(d)
            if d > SECOND_ORDER_EPS:
                return (
                    f"grad of {label} {tuple(w.shape)}: {d:.3g} eps of its largest eager magnitude off "
                    f"(the second-order contract: {SECOND_ORDER_EPS:g})"
                ), ""
            continue
        if w is None or g is None:
            return f"grad of {label}: eager {'None' if w is None else 'tensor'}, compiled {'None' if g is None else 'tensor'}", ""
        if g.shape != w.shape or g.dtype != w.dtype or g.layout != w.layout:
            return (
                f"grad of {label}: shape/dtype/layout {tuple(g.shape)}/{g.dtype}/{g.layout} vs eager {tuple(w.shape)}/{w.dtype}/{w.layout}"
            ), ""
        strided = g.layout == torch.strided
        if not strided:
            g, w = g.to_dense(), w.to_dense()
        try:
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol, equal_nan=True)
        except AssertionError:
            d = (g.double() - w.double()).abs() if not g.is_complex() else (g - w).abs().double()
            finite = torch.isfinite(d)
            mad = d[finite].max().item() if finite.any() else float("nan")
            nan_mismatch = int((torch.isnan(g) != torch.isnan(w)).sum())
            ref = w.abs().max().item() if w.numel() else 0.0
            extra = f", {nan_mismatch} NaN positions differ" if nan_mismatch else ""
            return (
                f"grad of {label} {tuple(w.shape)}: max abs diff {mad:.3g} (max |eager grad| {ref:.3g}, rtol {rtol:g} atol {atol:g}{extra})"
            ), ""
        if strided and g.numel() > 1 and _strides(g) != _strides(w):
            strides.append(f"{label}: {g.stride()} vs eager {w.stride()}")
    return None, "; ".join(strides)
