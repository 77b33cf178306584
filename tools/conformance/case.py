"""One case: a `Subject` differentiated eagerly and inside `ca.enable(backend)`, twice (the
second value set through the same cache entry), optionally through the on-disk cache; its
status from the grads and the `ca.stats()` differences."""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from typing import Any

import torch

import compiled_autograd as ca

from .report import BUG_STATUSES, CaseResult
from .tensors import _compare, _diff_outputs, _loss, _make_weights, _perturb, _second_order, _signature


class _Skip(Exception):
    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason


def _exc_line(e: BaseException, limit: int = 300) -> str:
    msg = str(e).strip().splitlines()
    first = msg[0] if msg else ""
    return f"{type(e).__name__}: {first[:limit]}"


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
    drifts: list = []
    bad, strides = _compare(got, want, labels, dtype, tol, drifts)
    res.drift = max(drifts, default=0.0)
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
    bad, _ = _compare(got3, want2, labels, dtype, tol, [])
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
        drifts: list = []
        bad, strides = _compare(got2, want2, labels, dtype, tol, drifts)
        res.drift = max([res.drift, *drifts])
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
    res.recaptured = _new_graphs(first) > 0 and _new_graphs(second) > 0 and not first["fallbacks"] and not second["fallbacks"]
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
