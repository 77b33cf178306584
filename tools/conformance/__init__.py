"""Conformance runner: compiled backward vs eager autograd over torch's OpInfo and ModuleInfo tables.

    python -m tools.conformance [--backend eager|aot_eager] [--ops-only|--modules-only]
        [--filter SUBSTR] [--sample N] [--every K] [--dtypes float32,float64] [--disk-cache]
        [--out docs/conformance] [--stem NAME] [--render docs/conformance/conformance_eager.json.gz]

For every op of `torch.testing._internal.common_methods_invocations.op_db` that supports
autograd (float32 and float64 where the op supports them on CPU) and every module of
`torch.testing._internal.common_modules.module_db`, and for each of their sample inputs:

1. run the forward and reduce every differentiable floating output to one scalar loss with
   fixed random weights;
2. backward in eager autograd and record the grad of every input that requires grad (a
   sample's non-leaf inputs are first detached into leaves of the same layout; a module's
   parameters count as inputs);
3. the same forward again, backward inside `ca.enable(backend)`, compare every grad with
   `torch.testing.assert_close`;
4. give every floating input tensor new values in place (same shapes, dtypes, strides: one
   random scale in [0.75, 0.95] per tensor times a 1e-3 per-element jitter, which keeps the
   signs, zeros and value ranges samples rely on), and repeat 2 and 3 through the SAME cache
   entry, without resetting it -- a graph that baked in a value
   it should have lifted gives a wrong gradient here; a key that contains a value it should
   not gives a recapture (`recaptured`).

Multi-input samples are also run through `torch.autograd.grad(loss, inputs=subset)` (mode
`grad_subset`, every other input). Mode `create_graph` (not in the default modes; ops whose
OpInfo supports gradgrad) runs `grad(loss, inputs, create_graph=True)`, then the backward of a
weighted sum of those grads, both in the scope, and compares the first- and second-order
grads and which first-order grads require grad. The cache and counters are reset before every case, so
the `ca.stats()` differences belong to that case alone. The on-disk graph cache is off; with
`--disk-cache` every case also drops the in-memory cache after step 4 and runs the second
value set once more, which must load the graph from disk and give the same grads.

Each case ends in one status:
  compiled             correct, no eager fallback, no opaque node
  opaque               correct, some nodes ran eagerly inside the compiled graph
  fallback             correct, the backward ran in eager autograd (reason recorded)
  wrong                a gradient differs from eager (input and max abs diff recorded)
  error                compiled_autograd raised where eager did not
  skipped_eager_error  eager itself raised: not a compiled_autograd case
  skipped_no_grad      nothing to differentiate (no differentiable output / input)
`recaptured` is a flag on top of the status; a `compiled` case that recaptured is not
counted as compiled in the totals.

The library API is `run(...)`, returning a `Report`; `write(report, out_dir)` writes
`STEM.json.gz` (one case per line) and `STEM.md`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import json
import os
import re
import sys
import time
import warnings
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

import compiled_autograd as ca

STATUSES = ("compiled", "opaque", "fallback", "wrong", "error", "skipped_eager_error", "skipped_no_grad")
BUG_STATUSES = ("wrong", "error")
DEFAULT_TOL = {torch.float32: (1e-4, 1e-5), torch.float64: (1e-7, 1e-7)}
DTYPES = {"float32": torch.float32, "float64": torch.float64}


# --------------------------------------------------------------------------- results


@dataclass
class CaseResult:
    kind: str  # "op" or "module"
    name: str  # op full name (name.variant) or module name
    variant: str  # OpInfo variant_test_name / ModuleInput desc
    mode: str  # "backward" or "grad_subset"
    dtype: str
    sample: int
    status: str
    recaptured: bool = False
    reason: str = ""
    recapture_reason: str = ""
    stride_mismatch: str = ""
    second_values: str = ""  # how the second value set went ("ok", "skipped: ...")
    disk: str = ""  # --disk-cache: how the round trip through the on-disk cache went
    nodes: list[str] = field(default_factory=list)
    captures: int = 0
    hits: int = 0
    seconds: float = 0.0

    @property
    def counted_status(self) -> str:
        """The status the totals use: a recaptured `compiled` case is not compiled."""
        if self.status == "compiled" and self.recaptured:
            return "compiled_recaptured"
        return self.status

    @property
    def case_id(self) -> str:
        v = f"[{self.variant}]" if self.variant else ""
        return f"{self.kind}:{self.name}{v} {self.dtype} sample {self.sample} {self.mode}"


@dataclass
class Report:
    backend: str
    command: str
    cases: list[CaseResult] = field(default_factory=list)
    seconds: float = 0.0
    torch_version: str = torch.__version__
    options: dict = field(default_factory=dict)

    def of(self, kind: str) -> list[CaseResult]:
        return [c for c in self.cases if c.kind == kind]

    def bugs(self) -> list[CaseResult]:
        return [c for c in self.cases if c.status in BUG_STATUSES]


class _Skip(Exception):
    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason


def _exc_line(e: BaseException, limit: int = 300) -> str:
    msg = str(e).strip().splitlines()
    first = msg[0] if msg else ""
    return f"{type(e).__name__}: {first[:limit]}"


# --------------------------------------------------------------------------- tensors


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
    return [
        t
        for _, t in _walk(outs, "out")
        if t.requires_grad and (t.is_floating_point() or t.is_complex())
    ]


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


def _compare(got, want, labels, dtype, tol=None) -> tuple[str | None, str]:
    """(why the grads differ or None, stride mismatch note)."""
    rtol, atol = tol or DEFAULT_TOL.get(dtype, (1e-4, 1e-5))
    strides = []
    for label, g, w in zip(labels, got, want):
        if w is None and g is None:
            continue
        if w is None or g is None:
            return f"grad of {label}: eager {'None' if w is None else 'tensor'}, compiled {'None' if g is None else 'tensor'}", ""
        if g.shape != w.shape or g.dtype != w.dtype or g.layout != w.layout:
            return (f"grad of {label}: shape/dtype/layout {tuple(g.shape)}/{g.dtype}/{g.layout} vs eager "
                    f"{tuple(w.shape)}/{w.dtype}/{w.layout}"), ""
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
                f"grad of {label} {tuple(w.shape)}: max abs diff {mad:.3g} (max |eager grad| {ref:.3g}, "
                f"rtol {rtol:g} atol {atol:g}{extra})"
            ), ""
        if strided and g.numel() > 1 and _strides(g) != _strides(w):
            strides.append(f"{label}: {g.stride()} vs eager {w.stride()}")
    return None, "; ".join(strides)


# --------------------------------------------------------------------------- one case


class Subject:
    """What a case differentiates: a forward, the tensors whose grads are compared,
    the floating tensors that get new values for the second value set."""

    def forward(self) -> Any:
        raise NotImplementedError

    def targets(self) -> list[tuple[str, torch.Tensor]]:
        raise NotImplementedError

    def perturbables(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def before_forward(self) -> None:
        pass


def _stats_delta(a, b) -> dict:
    reasons = b.fallback_reasons - a.fallback_reasons
    return dict(
        captures=b.captures - a.captures,
        disk_hits=getattr(b, "disk_hits", 0) - getattr(a, "disk_hits", 0),
        hits=b.hits - a.hits,
        fallbacks=b.eager_fallbacks - a.eager_fallbacks,
        opaque=b.opaque_nodes - a.opaque_nodes,
        reasons=reasons,
        opaque_reasons=getattr(b, "opaque_reasons", Counter()) - getattr(a, "opaque_reasons", Counter()),
    )


def _graph_nodes() -> list[str]:
    names: set[str] = set()
    for e in ca.graphs():
        names.update(e.node_names)
    return sorted(names)


def _cached_pairs() -> list[tuple[Any, Any]]:
    """(cache key or None, entry) for every cached graph, oldest first."""
    try:
        from compiled_autograd.cache.memory import CACHE

        if hasattr(CACHE, "items"):  # key -> family of entries
            return [(k, e) for k, fam in CACHE.items() for e in fam.entries()]
        if hasattr(CACHE, "keys"):
            return list(zip(CACHE.keys(), CACHE.entries()))
    except Exception:  # pragma: no cover - internal layout changed
        pass
    return [(None, e) for e in ca.graphs()]


def _recapture_reason() -> str:
    """Why the second value set captured again: compare the two cached graphs."""
    pairs = _cached_pairs()
    if len(pairs) < 2:
        return "second capture replaced the first (cache holds one entry)"
    (ka, a), (kb, b) = pairs[-2], pairs[-1]
    parts = [str(getattr(b, "reason", ""))]
    if a.node_names != b.node_names:
        parts.append(f"node lists differ ({len(a.node_names)} vs {len(b.node_names)} nodes)")
    if a.num_inputs != b.num_inputs:
        parts.append(f"lifted inputs {a.num_inputs} vs {b.num_inputs}")
    if getattr(a, "sizes", ()) != getattr(b, "sizes", ()):
        parts.append("sizes differ")
    if isinstance(ka, tuple) and isinstance(kb, tuple) and len(ka) == len(kb):
        if ka[1] != kb[1]:
            parts.append(f"global state differs: {ka[1]} vs {kb[1]}")
        ba, bb = ka[-1], kb[-1]
        if isinstance(ba, (bytes, bytearray)) and isinstance(bb, (bytes, bytearray)) and ba != bb:
            first = next((i for i, (x, y) in enumerate(zip(ba, bb)) if x != y), min(len(ba), len(bb)))
            parts.append(f"graph key differs at byte {first} of {len(ba)}/{len(bb)}")
    nka, nkb = getattr(a, "node_keys", ()), getattr(b, "node_keys", ())
    if nka and nkb and len(nka) == len(nkb):
        for i, (x, y) in enumerate(zip(nka, nkb)):
            if x != y:
                where = a.node_names[i] if i < len(a.node_names) else "lifted tensor metadata"
                parts.append(f"key bytes of {where} differ")
                break
    try:
        ca_code, cb_code = a.graph.code.splitlines(), b.graph.code.splitlines()
        diff = [(x.strip(), y.strip()) for x, y in zip(ca_code, cb_code) if x != y]
        if diff:
            x, y = diff[0]
            parts.append(f"first differing graph line: {x[:120]!r} vs {y[:120]!r}")
        elif len(ca_code) == len(cb_code):
            parts.append("identical FX code (the key holds a value the graph does not use)")
    except Exception:
        pass
    return "; ".join(p for p in parts if p)


def run_case(
    subject: Subject,
    *,
    backend: str,
    mode: str,
    dtype: torch.dtype,
    seed: int,
    meta: dict,
    tol=None,
    disk_cache: bool = False,
) -> CaseResult:
    t0 = time.perf_counter()
    res = CaseResult(status="error", mode=mode, dtype=str(dtype).replace("torch.", ""), **meta)
    try:
        _run_case(subject, res, backend=backend, mode=mode, dtype=dtype, seed=seed, tol=tol, disk_cache=disk_cache)
    except _Skip as s:
        res.status, res.reason = s.status, s.reason
    except Exception as e:  # the runner's own failure: say so
        res.status, res.reason = "error", f"runner: {_exc_line(e)}"
    finally:
        try:
            res.nodes = _graph_nodes()
        except Exception:
            pass
        ca.reset()
        res.seconds = round(time.perf_counter() - t0, 3)
    return res


def _enable_kwargs(disk_cache: bool) -> dict:
    """Options of `ca.enable` this core has: the on-disk graph cache is off unless asked for
    (it would turn captures into disk hits across cases and runs)."""
    import inspect

    try:
        params = inspect.signature(ca.enable.__init__).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return {}
    return {"disk_cache": disk_cache} if "disk_cache" in params else {}


def _new_graphs(d: dict) -> int:
    return d["captures"] + d["disk_hits"]


def _run_case(subject: Subject, res: CaseResult, *, backend, mode, dtype, seed, tol, disk_cache=False) -> None:
    targets = subject.targets()
    if mode == "grad_subset":
        targets = targets[::2]
    if not targets:
        raise _Skip("skipped_no_grad", "no input requires grad")
    labels = [l for l, _ in targets]
    tensors = [t for _, t in targets]
    if mode == "create_graph":
        labels += [f"d2 {l}" for l in labels] + ["requires_grad of the first-order grads"]
    state: dict = {}
    enable_kw = _enable_kwargs(disk_cache)

    def once(compiled: bool):
        for t in tensors:
            t.grad = None
        subject.before_forward()
        torch.manual_seed(seed)
        outs = _diff_outputs(subject.forward())
        if not outs:
            raise _Skip("skipped_no_grad", "no differentiable floating output")
        sig = _signature(outs)
        if "weights" not in state or state["sig"] != sig:
            state["weights"], state["sig"] = _make_weights(outs, seed), sig
        loss = _loss(outs, state["weights"])
        if not loss.requires_grad:
            raise _Skip("skipped_no_grad", "loss does not require grad")
        del outs
        scope = ca.enable(backend, **enable_kw) if compiled else contextlib.nullcontext()
        with scope:
            if mode == "grad_subset":
                grads = list(torch.autograd.grad(loss, tensors, allow_unused=True))
            elif mode == "create_graph":
                grads = list(torch.autograd.grad(loss, tensors, create_graph=True, allow_unused=True))
                grads += _second_order(grads, tensors, seed)
            else:
                loss.backward()
                grads = [t.grad for t in tensors]
        out = [None if g is None else g.detach().clone() for g in grads]
        for t in tensors:
            t.grad = None
        return out, sig

    def eager():
        try:
            return once(False)
        except _Skip:
            raise
        except Exception as e:
            raise _Skip("skipped_eager_error", _exc_line(e))

    ca.reset()
    want, sig = eager()
    s0 = ca.stats()
    try:
        got, _ = once(True)
    except _Skip:
        raise
    except Exception as e:
        res.status, res.reason = "error", _exc_line(e)
        return
    s1 = ca.stats()
    first = _stats_delta(s0, s1)
    bad, strides = _compare(got, want, labels, dtype, tol)
    res.stride_mismatch = strides
    if bad is not None:
        res.captures, res.hits = first["captures"], first["hits"]
        res.status = "wrong"
        res.reason = bad + (f" [eager fallback: {', '.join(first['reasons'])}]" if first["fallbacks"] else "")
        return
    del got, want

    # second value set through the same cache entry
    pert = subject.perturbables()
    originals = [t.detach().clone() for t in pert]
    try:
        want2 = _second_values(once, res, pert, originals, labels, dtype, seed, sig, s0, first, tol)
        if disk_cache and want2 is not None and res.status not in BUG_STATUSES:
            _disk_round_trip(once, res, want2, labels, dtype, tol)
    finally:
        with torch.no_grad():  # the sample is shared with the next mode: give it its values back
            for t, o in zip(pert, originals):
                t.copy_(o)


def _disk_round_trip(once, res, want2, labels, dtype, tol) -> None:
    """--disk-cache: drop the in-memory cache and run the second value set again; the graph
    must now come from the disk cache and give the same grads."""
    ca.reset()
    s4 = ca.stats()
    try:
        got3, _ = once(True)
    except Exception as e:
        res.status, res.reason = "error", f"disk cache round trip: {_exc_line(e)}"
        return
    d = _stats_delta(s4, ca.stats())
    res.disk = "fallback" if d["fallbacks"] else ("hit" if d["disk_hits"] else "miss (traced again)")
    bad, _ = _compare(got3, want2, labels, dtype, tol)
    if bad is not None:
        res.status, res.reason = "wrong", f"disk cache round trip ({res.disk}): {bad}"


def _second_values(once, res, pert, originals, labels, dtype, seed, sig, s0, first, tol):
    want2 = None
    for jitter in (True, False):
        _perturb(pert, originals, seed, jitter)
        try:
            want2, sig2 = once(False)
            break
        except Exception as e:
            res.second_values = f"skipped: eager raised on the new values ({_exc_line(e, 120)})"
    if want2 is not None and sig2 != sig:
        res.second_values = "skipped: output shapes changed with the new values"
        want2 = None
    s2 = s3 = ca.stats()
    if want2 is not None:
        res.second_values = "ok"
        s2 = ca.stats()
        try:
            got2, _ = once(True)
        except Exception as e:
            res.status, res.reason = "error", f"second value set: {_exc_line(e)}"
            return None
        s3 = ca.stats()
        bad, strides = _compare(got2, want2, labels, dtype, tol)
        if bad is not None:
            res.status = "wrong"
            res.reason = f"second value set (cache {'hit' if s3.hits > s2.hits else 'miss'}): {bad}"
            res.captures, res.hits = s3.captures - s0.captures, s3.hits - s0.hits
            return None
        if strides and not res.stride_mismatch:
            res.stride_mismatch = strides
    total = _stats_delta(s0, s3)
    second = _stats_delta(s2, s3)
    res.captures, res.hits = _new_graphs(total), total["hits"]
    # a graph that fell back is not cached, so trying again is no recapture
    res.recaptured = (_new_graphs(first) > 0 and _new_graphs(second) > 0
                      and not first["fallbacks"] and not second["fallbacks"])
    if res.recaptured:
        res.recapture_reason = _recapture_reason()
    if _new_graphs(total) + total["hits"] + total["fallbacks"] == 0 or (
        want2 is not None and _new_graphs(second) + second["hits"] + second["fallbacks"] == 0
    ):
        res.status = "error"
        res.reason = "the compiled backward did not go through compiled_autograd (no capture, hit or fallback counted)"
    elif total["fallbacks"]:
        res.status = "fallback"
        res.reason = "; ".join(f"{r}" + (f" (x{n})" if n > 1 else "") for r, n in total["reasons"].items())
    elif total["opaque"]:
        res.status = "opaque"
        why = "; ".join(f"{r}" + (f" (x{n})" if n > 1 else "") for r, n in total["opaque_reasons"].items())
        res.reason = f"{total['opaque']} opaque node run(s)" + (f": {why}" if why else "")
    else:
        res.status = "compiled"
    return want2


# --------------------------------------------------------------------------- ops


def _leafify(obj: Any, memo: dict) -> Any:
    """The same structure with every non-leaf tensor that requires grad replaced by a leaf
    with the same values and geometry (a detached view). A sample's non-leaf input carries a
    graph that the eager run would free and the compiled run would then reach again; as a
    leaf, its own gradient is compared too."""
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad and not obj.is_leaf:
            if id(obj) not in memo:
                memo[id(obj)] = obj.detach().requires_grad_()
            return memo[id(obj)]
        return obj
    if type(obj) in (list, tuple):
        return type(obj)(_leafify(x, memo) for x in obj)
    if type(obj) is dict:
        return {k: _leafify(x, memo) for k, x in obj.items()}
    return obj


class OpSubject(Subject):
    def __init__(self, op, sample):
        self.op, self.sample = op, sample
        memo: dict = {}
        self.input = _leafify(sample.input, memo)
        self.args = _leafify(tuple(sample.args), memo)
        self.kwargs = _leafify(dict(sample.kwargs), memo)
        items = list(_walk(self.input, "input")) + list(_walk(list(self.args), "args"))
        items += list(_walk(self.kwargs, "kwargs"))
        self.items = _unique(items)

    def forward(self):
        out = self.op(self.input, *self.args, **self.kwargs)
        return self.sample.output_process_fn_grad(out)

    def targets(self):
        return [(l, t) for l, t in self.items if t.requires_grad and t.is_leaf]

    def perturbables(self):
        return [t for _, t in self.items if _perturbable(t)]


def _perturbable(t: torch.Tensor) -> bool:
    return (t.is_floating_point() or t.is_complex()) and t.is_leaf and t.layout == torch.strided


def _import_db(which: str):
    argv = sys.argv
    sys.argv = argv[:1]  # torch's test utilities parse the command line
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if which == "ops":
                from torch.testing._internal.common_methods_invocations import op_db

                return op_db
            from torch.testing._internal.common_modules import module_db

            return module_db
    finally:
        sys.argv = argv


def op_full_name(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def select_ops(filter: str | None = None, every: int = 1, names: Sequence[str] | None = None) -> list:
    ops = [o for o in _import_db("ops") if o.supports_autograd]
    if names is not None:
        wanted = set(names)
        ops = [o for o in ops if op_full_name(o) in wanted or o.name in wanted]
    if filter:
        ops = [o for o in ops if filter in op_full_name(o)]
    return ops[:: max(1, every)]


def _seed_for(*parts) -> int:
    h = 0
    for p in parts:
        for ch in str(p):
            h = (h * 131 + ord(ch)) % 1_000_003
    return h


def run_op(op, *, backend: str, dtypes: Sequence[torch.dtype], sample_limit: int | None,
           modes=("backward", "grad_subset"), disk_cache: bool = False) -> list[CaseResult]:
    name = op_full_name(op)
    results: list[CaseResult] = []
    try:
        supported = op.supported_backward_dtypes("cpu")
    except Exception:
        supported = op.supported_dtypes("cpu")
    for dtype in dtypes:
        if dtype not in supported:
            continue
        dname = str(dtype).replace("torch.", "")
        torch.manual_seed(_seed_for(name, dname))
        try:
            samples = op.sample_inputs("cpu", dtype, requires_grad=True)
            it = iter(samples)
            i = 0
            while sample_limit is None or i < sample_limit:
                torch.manual_seed(_seed_for(name, dname, i))
                try:
                    sample = next(it)
                except StopIteration:
                    break
                subject = OpSubject(op, sample)
                for mode in modes:
                    if mode == "grad_subset" and len(subject.targets()) < 2:
                        continue
                    if mode == "create_graph" and not op.supports_gradgrad:
                        continue  # eager's own double backward is not defined for it
                    seed = _seed_for(name, dname, i, mode)
                    meta = dict(kind="op", name=name, variant=sample.name or "", sample=i)
                    results.append(run_case(subject, backend=backend, mode=mode, dtype=dtype, seed=seed, meta=meta,
                                        disk_cache=disk_cache))
                del subject, sample
                i += 1
        except Exception as e:
            results.append(
                CaseResult(kind="op", name=name, variant="", mode="-", dtype=dname, sample=-1,
                           status="skipped_eager_error", reason=f"sample_inputs raised: {_exc_line(e)}")
            )
    return results


# --------------------------------------------------------------------------- modules


class ModuleSubject(Subject):
    def __init__(self, module: torch.nn.Module, forward_input):
        self.m = module
        memo: dict = {}
        self.args = _leafify(tuple(forward_input.args), memo)
        self.kwargs = _leafify(dict(forward_input.kwargs), memo)
        self.items = _unique(list(_walk(list(self.args), "args")) + list(_walk(self.kwargs, "kwargs")))
        self.buffers = {k: b.detach().clone() for k, b in module.named_buffers()}

    def before_forward(self):
        # buffers (running stats) updated by a training forward: every run starts the same
        with torch.no_grad():
            for k, b in self.m.named_buffers():
                if k in self.buffers and b.shape == self.buffers[k].shape:
                    b.copy_(self.buffers[k])

    def forward(self):
        return self.m(*self.args, **self.kwargs)

    def targets(self):
        params = [(f"param {k}", p) for k, p in self.m.named_parameters() if p.requires_grad]
        inputs = [(l, t) for l, t in self.items if t.requires_grad and t.is_leaf]
        return _unique(params + inputs)

    def perturbables(self):
        ps = [p for _, p in self.m.named_parameters() if _perturbable(p)]
        ins = [t for _, t in self.items if _perturbable(t)]
        return [t for _, t in _unique([("", t) for t in ps + ins])]


def select_modules(filter: str | None = None, every: int = 1, names: Sequence[str] | None = None) -> list:
    mods = list(_import_db("modules"))
    if names is not None:
        mods = [m for m in mods if m.name in set(names)]
    if filter:
        mods = [m for m in mods if filter in m.name]
    return mods[:: max(1, every)]


def _has_lazy(m: torch.nn.Module) -> bool:
    from torch.nn.parameter import is_lazy

    return any(is_lazy(p) for p in m.parameters()) or any(is_lazy(b) for b in m.buffers())


def run_module(info, *, backend: str, dtypes: Sequence[torch.dtype], sample_limit: int | None,
               modes=("backward", "grad_subset"), disk_cache: bool = False) -> list[CaseResult]:
    name = info.name
    results: list[CaseResult] = []
    for dtype in dtypes:
        if dtype not in info.dtypes:
            continue
        dname = str(dtype).replace("torch.", "")
        torch.manual_seed(_seed_for(name, dname))
        try:
            inputs = info.module_inputs_func(info, device="cpu", dtype=dtype, requires_grad=True, training=True)
        except Exception as e:
            results.append(
                CaseResult(kind="module", name=name, variant="", mode="-", dtype=dname, sample=-1,
                           status="skipped_eager_error", reason=f"module_inputs_func raised: {_exc_line(e)}")
            )
            continue
        if sample_limit is not None:
            inputs = inputs[:sample_limit]
        for i, mi in enumerate(inputs):
            for mode in modes:
                seed = _seed_for(name, dname, i, mode)
                meta = dict(kind="module", name=name, variant=mi.desc or "", sample=i)
                torch.manual_seed(seed)
                try:
                    ci, fi = mi.constructor_input, mi.forward_input
                    m = info.module_cls(*ci.args, **ci.kwargs)
                    m = m.to(device="cpu", dtype=dtype)
                    m.train(True)
                    if _has_lazy(m):
                        with torch.no_grad():
                            torch.manual_seed(seed)
                            m(*fi.args, **fi.kwargs)
                    subject = ModuleSubject(m, fi)
                except Exception as e:
                    results.append(CaseResult(status="skipped_eager_error", mode=mode, dtype=dname,
                                              reason=f"constructing the module raised: {_exc_line(e)}", **meta))
                    continue
                if mode == "grad_subset" and len(subject.targets()) < 2:
                    continue
                if mode == "create_graph" and not getattr(info, "supports_gradgrad", True):
                    continue
                results.append(run_case(subject, backend=backend, mode=mode, dtype=dtype, seed=seed, meta=meta,
                                        disk_cache=disk_cache))
                del subject, m
    return results


# --------------------------------------------------------------------------- driver


def run(
    backend: str = "eager",
    *,
    ops: bool = True,
    modules: bool = True,
    filter: str | None = None,
    sample: int | None = None,
    every: int = 1,
    dtypes: Sequence[str] = ("float32", "float64"),
    module_dtypes: Sequence[str] | None = None,
    op_names: Sequence[str] | None = None,
    module_names: Sequence[str] | None = None,
    modes: Sequence[str] = ("backward", "grad_subset"),
    disk_cache: bool = False,
    progress: Callable[[str], None] | None = None,
    command: str = "",
) -> Report:
    """Run the conformance cases and return the report (see the module docstring)."""
    t0 = time.perf_counter()
    from compiled_autograd import native

    native.load()  # fail fast (not once per case) when the helper cannot be built
    report = Report(
        backend=backend,
        command=command,
        options=dict(ops=ops, modules=modules, filter=filter, sample=sample, every=every,
                     dtypes=list(dtypes), module_dtypes=list(module_dtypes or dtypes), modes=list(modes),
                     disk_cache=disk_cache,
                     native_build=native._build_name(), core=_core_version()),
    )
    tmp = None
    if disk_cache and not os.environ.get("COMPILED_AUTOGRAD_GRAPH_DIR"):
        import tempfile

        tmp = tempfile.mkdtemp(prefix="ca_conformance_graphs_")
        os.environ["COMPILED_AUTOGRAD_GRAPH_DIR"] = tmp
    try:
        _run_all(report, backend, ops, modules, filter, sample, every, dtypes, module_dtypes, op_names,
                 module_names, modes, disk_cache, progress)
    finally:
        if tmp is not None:
            import shutil

            os.environ.pop("COMPILED_AUTOGRAD_GRAPH_DIR", None)
            shutil.rmtree(tmp, ignore_errors=True)
    report.seconds = time.perf_counter() - t0
    return report


def _run_all(report, backend, ops, modules, filter, sample, every, dtypes, module_dtypes, op_names,
             module_names, modes, disk_cache, progress) -> None:
    op_dt = [DTYPES[d] for d in dtypes]
    mod_dt = [DTYPES[d] for d in (module_dtypes or dtypes)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if ops:
            sel = select_ops(filter, every, op_names)
            for k, op in enumerate(sel):
                t = time.perf_counter()
                rs = run_op(op, backend=backend, dtypes=op_dt, sample_limit=sample, modes=modes, disk_cache=disk_cache)
                report.cases.extend(rs)
                if progress:
                    progress(_progress_line("op", k, len(sel), op_full_name(op), rs, time.perf_counter() - t))
                if k % 50 == 49:  # a full collection costs ~0.2 s with op_db loaded
                    gc.collect()
        if modules:
            sel = select_modules(filter, every, module_names)
            for k, info in enumerate(sel):
                t = time.perf_counter()
                rs = run_module(info, backend=backend, dtypes=mod_dt, sample_limit=sample, modes=modes,
                                disk_cache=disk_cache)
                report.cases.extend(rs)
                if progress:
                    progress(_progress_line("module", k, len(sel), info.name, rs, time.perf_counter() - t))
                if k % 10 == 9:
                    gc.collect()


def _core_version() -> str:
    """The commit of the compiled_autograd checkout under test (`+dirty` with local changes)."""
    env = os.environ.get("COMPILED_AUTOGRAD_COMMIT")
    if env:
        return env
    import subprocess

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tools/, as before the package
    try:
        commit = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no", "--", "."],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return commit + ("+dirty" if dirty else "")
    except Exception:
        return "unknown"


def _progress_line(kind, k, n, name, rs, secs) -> str:
    c = Counter(r.counted_status for r in rs)
    bugs = [r for r in rs if r.status in BUG_STATUSES]
    s = f"[{kind} {k + 1}/{n}] {name}: " + " ".join(f"{st}={c[st]}" for st in sorted(c)) + f" ({secs:.1f}s)"
    for b in bugs[:3]:
        s += f"\n    {b.status.upper()}: {b.case_id}: {b.reason[:200]}"
    return s


# --------------------------------------------------------------------------- output

TOTAL_COLUMNS = ("compiled", "compiled_recaptured", "opaque", "fallback", "wrong", "error",
                 "skipped_eager_error", "skipped_no_grad")


def totals(cases: Sequence[CaseResult]) -> dict:
    c = Counter(r.counted_status for r in cases)
    t = {k: c.get(k, 0) for k in TOTAL_COLUMNS}
    t["cases"] = len(cases)
    t["run"] = sum(v for k, v in t.items() if k in TOTAL_COLUMNS and not k.startswith("skipped"))
    t["compiled_pct"] = round(100.0 * t["compiled"] / t["run"], 2) if t["run"] else 0.0
    return t


def _norm_reason(r: str) -> str:
    r = re.sub(r"\[[0-9, ]*\]", "[...]", r)
    r = re.sub(r"\(x\d+\)", "", r)
    r = re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", r)
    return r.strip()


_OPTIONAL_FIELDS = ("recapture_reason", "stride_mismatch", "captures", "hits", "disk")


def to_json(report: Report) -> dict:
    """The report as JSON. Each case's `nodes` are indices into the top-level `node_types`
    (the node types of the graphs that case captured); `recapture_reason`, `stride_mismatch`,
    `captures` and `hits` are left out when empty/0; `counted_status` (the status the totals
    use) is only there when it differs from `status`."""
    node_types = sorted({n for c in report.cases for n in c.nodes})
    index = {n: i for i, n in enumerate(node_types)}
    cases = []
    for c in report.cases:
        d = asdict(c)
        d["nodes"] = [index[n] for n in c.nodes]
        for k in _OPTIONAL_FIELDS:  # omitted when empty, to keep the file small
            if not d[k]:
                del d[k]
        if c.counted_status != c.status:
            d["counted_status"] = c.counted_status
        cases.append(d)
    return dict(
        backend=report.backend,
        command=report.command,
        torch_version=report.torch_version,
        seconds=round(report.seconds, 1),
        options=report.options,
        totals=dict(ops=totals(report.of("op")), modules=totals(report.of("module"))),
        node_types=node_types,
        cases=cases,
    )


def from_json(d: dict) -> Report:
    """The inverse of `to_json` (to re-render the Markdown of a stored run)."""
    names = d.get("node_types")
    fields = set(CaseResult.__dataclass_fields__)
    cases = []
    for c in d["cases"]:
        c = {k: v for k, v in c.items() if k in fields}
        if names is not None:
            c["nodes"] = [names[i] if isinstance(i, int) else i for i in c.get("nodes", [])]
        cases.append(CaseResult(**c))
    return Report(backend=d["backend"], command=d["command"], cases=cases, seconds=d.get("seconds", 0.0),
                  torch_version=d.get("torch_version", ""), options=d.get("options", {}))


def _esc(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def to_markdown(report: Report) -> str:
    L: list[str] = []
    L.append(f"# compiled_autograd conformance: backend `{report.backend}`")
    L.append("")
    L.append("Generated by `compiled_autograd.conformance` (torch "
             f"{report.torch_version}); do not edit. Regenerate with:")
    L.append("")
    L.append(f"    {report.command}")
    L.append("")
    L.append(f"Core under test: `{report.options.get('core', 'unknown')}`. "
             f"Wall time: {report.seconds:.0f} s ({report.seconds / 60:.1f} min). Options: "
             f"`{json.dumps(report.options)}`.")
    L.append("")
    L.append("Each case: one sample input of one op/module and dtype, backward eagerly vs inside "
             f"`ca.enable({report.backend!r})`, all grads compared; then the same case with new values through "
             "the same cache entry. Mode `backward` is `loss.backward()` (leaf `.grad`); mode `grad_subset` is "
             "`torch.autograd.grad(loss, inputs=every other input)`. `compiled_recaptured` = correct and compiled, "
             "but the second value set captured a new graph although the structure did not change (counted as "
             "not compiled). `%compiled` is over cases that ran (not skipped).")
    L.append("")
    L.append("## Totals")
    L.append("")
    L.append("| | cases | " + " | ".join(TOTAL_COLUMNS) + " | %compiled |")
    L.append("|---|---|" + "---|" * len(TOTAL_COLUMNS) + "---|")
    for kind, label in (("op", "ops"), ("module", "modules")):
        cs = report.of(kind)
        if not cs:
            continue
        t = totals(cs)
        L.append(f"| {label} | {t['cases']} | " + " | ".join(str(t[k]) for k in TOTAL_COLUMNS) + f" | {t['compiled_pct']}% |")
        names = {c.name for c in cs}
        bad_names = {c.name for c in cs if c.counted_status != "compiled" and not c.status.startswith("skipped")}
        L.append(f"| {label}: distinct names | {len(names)} | fully compiled: {len(names - bad_names)} | | | | | | | | |")
    L.append("")

    bugs = report.bugs()
    L.append(f"## Bugs: `wrong` and `error` cases ({len(bugs)})")
    L.append("")
    if bugs:
        L.append("| case | status | reason |")
        L.append("|---|---|---|")
        for c in bugs:
            L.append(f"| `{_esc(c.case_id)}` | {c.status} | {_esc(c.reason)} |")
    else:
        L.append("None.")
    L.append("")

    fb = [c for c in report.cases if c.status == "fallback"]
    L.append(f"## Fallback reasons ({len(fb)} cases)")
    L.append("")
    if fb:
        agg: Counter = Counter()
        names: dict = defaultdict(set)
        for c in fb:
            for part in c.reason.split("; "):
                k = _norm_reason(part)
                agg[k] += 1
                names[k].add(c.name)
        L.append("| cases | reason (numbers replaced by N) | ops/modules |")
        L.append("|---|---|---|")
        for k, n in agg.most_common():
            ns = sorted(names[k])
            L.append(f"| {n} | {_esc(k)} | {_esc(', '.join(ns[:12]) + (f' (+{len(ns) - 12})' if len(ns) > 12 else ''))} |")
    L.append("")

    oq = [c for c in report.cases if c.status == "opaque"]
    L.append(f"## Opaque nodes ({len(oq)} cases)")
    L.append("")
    if oq:
        agg = Counter()
        names = defaultdict(set)
        for c in oq:
            k = _norm_reason(re.sub(r"^\d+ opaque node run\(s\): ", "", c.reason))
            agg[k] += 1
            names[k].add(c.name)
        L.append("| cases | node: reason (numbers replaced by N) | ops/modules |")
        L.append("|---|---|---|")
        for k, n in agg.most_common():
            ns = sorted(names[k])
            L.append(f"| {n} | {_esc(k)} | {_esc(', '.join(ns[:12]) + (f' (+{len(ns) - 12})' if len(ns) > 12 else ''))} |")
    L.append("")

    rc = [c for c in report.cases if c.recaptured]
    L.append(f"## Recaptures on the second value set ({len(rc)} cases)")
    L.append("")
    if rc:
        L.append("| case | status | why |")
        L.append("|---|---|---|")
        for c in rc:
            L.append(f"| `{_esc(c.case_id)}` | {c.status} | {_esc(c.recapture_reason)} |")
    L.append("")

    sv = Counter(c.second_values.split(" (")[0] for c in report.cases if c.second_values and c.second_values != "ok")
    if sv:
        L.append("## Second value set not run")
        L.append("")
        for k, n in sv.most_common():
            L.append(f"- {n} cases: {k}")
        L.append("")

    dk = Counter(c.disk for c in report.cases if c.disk)
    if dk:
        L.append("## On-disk cache round trip (`--disk-cache`)")
        L.append("")
        L.append("After the two value sets, the in-memory cache is dropped and the second value set runs again; "
                 "the graph should now be loaded from the disk cache.")
        L.append("")
        for k, n in dk.most_common():
            L.append(f"- {n} cases: {k}")
        L.append("")

    sm = [c for c in report.cases if c.stride_mismatch and not c.status.startswith("skipped")]
    L.append(f"## Gradient strides differing from eager ({len(sm)} cases; values equal, not counted as wrong)")
    L.append("")
    for c in sm[:200]:
        L.append(f"- `{c.case_id}`: {_esc(c.stride_mismatch)}")
    if len(sm) > 200:
        L.append(f"- ... {len(sm) - 200} more in conformance.json")
    L.append("")

    node_cases: dict = defaultdict(Counter)
    for c in report.cases:
        for n in c.nodes:
            node_cases[n][c.counted_status] += 1
    L.append(f"## Node types in captured graphs ({len(node_cases)})")
    L.append("")
    L.append("Number of cases whose captured graphs contain the node, by case status.")
    L.append("")
    cols = ("compiled", "compiled_recaptured", "wrong", "error", "fallback", "opaque")
    L.append("| node | cases | " + " | ".join(cols) + " |")
    L.append("|---|---|" + "---|" * len(cols))
    for n, cnt in sorted(node_cases.items(), key=lambda kv: (-sum(kv[1].values()), kv[0])):
        L.append(f"| {n} | {sum(cnt.values())} | " + " | ".join(str(cnt.get(k, 0)) for k in cols) + " |")
    L.append("")

    for kind, label in (("op", "Ops"), ("module", "Modules")):
        cs = report.of(kind)
        if not cs:
            continue
        L.append(f"## {label}: statuses per {kind}")
        L.append("")
        L.append("| name | cases | " + " | ".join(TOTAL_COLUMNS) + " | recaptured | time (s) |")
        L.append("|---|---|" + "---|" * len(TOTAL_COLUMNS) + "---|---|")
        by: dict = defaultdict(list)
        for c in cs:
            by[c.name].append(c)
        for n in sorted(by):
            t = totals(by[n])
            rcn = sum(1 for c in by[n] if c.recaptured)
            secs = sum(c.seconds for c in by[n])
            L.append(f"| {n} | {t['cases']} | " + " | ".join(str(t[k]) if t[k] else "" for k in TOTAL_COLUMNS)
                     + f" | {rcn or ''} | {secs:.1f} |")
        L.append("")

    L.append("## Every non-`compiled` case")
    L.append("")
    L.append("| case | status | recaptured | reason |")
    L.append("|---|---|---|---|")
    for c in report.cases:
        if c.counted_status == "compiled":
            continue
        why = c.reason or c.recapture_reason
        L.append(f"| `{_esc(c.case_id)}` | {c.status} | {'yes' if c.recaptured else ''} | {_esc(why[:400])} |")
    L.append("")
    return "\n".join(L)


def write(report: Report, out_dir: str, stem: str | None = None) -> tuple[str, str]:
    stem = stem or ("conformance" if report.backend == "eager" else f"conformance_{report.backend}")
    os.makedirs(out_dir, exist_ok=True)
    jpath = os.path.join(out_dir, stem + ".json.gz")  # a full run is ~10 MB of JSON, 0.2 MB gzipped
    mpath = os.path.join(out_dir, stem + ".md")
    d = to_json(report)
    cases = d.pop("cases")
    with gzip.open(jpath, "wt") as f:  # one case per line: zgrep-able
        head = json.dumps(d, indent=1, default=str)
        f.write(head[:-2] + ',\n "cases": [\n')
        f.write(",\n".join(json.dumps(c, default=str, separators=(",", ":")) for c in cases))
        f.write("\n ]\n}\n")
    with open(mpath, "w") as f:  # from what the JSON holds (its rounded times): --render gives the same
        f.write(to_markdown(from_json(dict(d, cases=cases))))
    return jpath, mpath


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.conformance", description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="eager", choices=("eager", "aot_eager", "inductor"))
    g = p.add_mutually_exclusive_group()
    g.add_argument("--ops-only", action="store_true")
    g.add_argument("--modules-only", action="store_true")
    p.add_argument("--filter", default=None, help="only ops/modules whose name contains SUBSTR")
    p.add_argument("--sample", type=int, default=None, metavar="N", help="at most N sample inputs per op/module and dtype")
    p.add_argument("--every", type=int, default=1, metavar="K", help="only every K-th op/module (deterministic subset)")
    p.add_argument("--dtypes", default="float32,float64", help="comma-separated, of float32,float64")
    p.add_argument("--module-dtypes", default=None, help="dtypes for modules (default: --dtypes)")
    p.add_argument("--modes", default="backward,grad_subset")
    p.add_argument("--out", default="docs/conformance", help="directory for STEM.json.gz / STEM.md")
    p.add_argument("--stem", default=None, help="file name stem (default conformance[_BACKEND])")
    p.add_argument("--disk-cache", action="store_true",
                   help="also round-trip every case through the on-disk graph cache (in a temporary "
                        "directory unless COMPILED_AUTOGRAD_GRAPH_DIR is set)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--render", default=None, metavar="JSON",
                   help="only re-render JSON (a stored run) into --out, without running anything")
    a = p.parse_args(argv)
    if a.render:
        with (gzip.open if a.render.endswith(".gz") else open)(a.render, "rt") as f:
            report = from_json(json.load(f))
        print("wrote %s and %s" % write(report, a.out, a.stem))
        return 0
    if a.threads:
        torch.set_num_threads(a.threads)
    args = list(sys.argv[1:] if argv is None else argv)
    command = "python -m tools.conformance" + "".join(f" {x}" for x in args)
    warnings.simplefilter("ignore")
    import logging

    logging.getLogger("compiled_autograd").setLevel(logging.ERROR)
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if not a.quiet else None
    report = run(
        a.backend,
        ops=not a.modules_only,
        modules=not a.ops_only,
        filter=a.filter,
        sample=a.sample,
        every=a.every,
        dtypes=[d for d in a.dtypes.split(",") if d],
        module_dtypes=[d for d in a.module_dtypes.split(",") if d] if a.module_dtypes else None,
        modes=[m for m in a.modes.split(",") if m],
        disk_cache=a.disk_cache,
        progress=log,
        command=command,
    )
    jpath, mpath = write(report, a.out, a.stem)
    for kind in ("op", "module"):
        cs = report.of(kind)
        if cs:
            print(f"{kind}s: {json.dumps(totals(cs))}")
    for c in report.bugs():
        print(f"{c.status.upper()}: {c.case_id}: {c.reason}")
    print(f"wrote {jpath} and {mpath} in {report.seconds:.0f} s")
    return 0
