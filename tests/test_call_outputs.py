"""What a call returns after its graph was captured (issue 45): every kind of call that runs user
code from inside a compiled graph -- an opaque node, a tensor hook, a node's pre and post hook,
an unpack hook, and a tensor hook feeding a torch.compile'd region -- returning something other
than what the graph was traced with: a tensor subclass, a wrapper without storage, a
`__torch_function__` subclass, another dtype, another layout, None, a tensor that requires grad.

The property, for each (kind, change): every backward gives eager's grads -- their types, dtypes
and values, bitwise on aot_eager, within inductor's rounding on inductor -- or eager's error
(NOTE [A call output not as traced], capture/resume.py). The change starts after the graph was
captured and hit once, and goes away again at the end, so the captures, hits and resumes
between are all exercised on one cache entry.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor
from torch.utils._pytree import tree_map

import compiled_autograd as ca
from helpers import INDUCTOR


class Wrapper(torch.Tensor):
    """A wrapper subclass without storage and without __tensor_flatten__: its dispatch unwraps,
    so what is computed from it is plain."""

    @staticmethod
    def __new__(cls, t):
        return torch.Tensor._make_wrapper_subclass(cls, t.shape, dtype=t.dtype, device=t.device, strides=t.stride())

    def __init__(self, t):
        self.t = t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda x: x.t if isinstance(x, Wrapper) else x  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))

    def __repr__(self):
        return f"Wrapper({self.t})"


class Tagged(torch.Tensor):
    """A `__torch_function__` subclass (`as_subclass`): its type goes with what it computes in Python."""


CHANGES = {
    "subclass": lambda g: TwoTensor(g, g.clone()),
    "wrapper": lambda g: Wrapper(g.clone()),
    "torch_function": lambda g: g.clone().as_subclass(Tagged),
    "dtype": lambda g: g.double(),
    "layout": lambda g: g.t().contiguous().t(),
    "none": lambda g: None,
    "requires_grad": lambda g: g.detach().clone().requires_grad_(),
}
KINDS = ["opaque node", "tensor hook", "pre hook", "post hook", "unpack hook", "compiled region"]

_region = None


def _compiled_region():
    global _region
    if _region is None:
        _region = torch.compile(lambda t: t * torch.sigmoid(t), backend="aot_eager", fullgraph=True)
    return _region


class Twice(torch.autograd.Function):
    change = staticmethod(lambda g: g)

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return Twice.change(g * 2)


def _step(kind, change, step, params, compiled, backend):
    """One training step's backward: the grads (or the error) it leaves."""
    w1, w2 = params
    for p in params:
        p.grad = None
    torch.manual_seed(step)
    x = torch.randn(4, 6)
    f = CHANGES[change] if change is not None else (lambda g: g)
    Twice.change = staticmethod(f)

    def unpack(t):
        out = f(t)
        return t if change == "none" and kind != "unpack hook" else out

    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack) if kind == "unpack hook" else contextlib.nullcontext()
    h = x @ w1
    if kind == "opaque node":
        h = Twice.apply(h)
    with hooks:
        a = torch.tanh(h)
    if kind == "tensor hook":
        h.register_hook(f)
    elif kind == "pre hook":
        a.grad_fn.register_prehook(lambda g_out: (f(g_out[0]),))
    elif kind == "post hook":
        a.grad_fn.register_hook(lambda g_in, g_out: (f(g_in[0]),))
    if kind == "compiled region":
        a = _compiled_region()(a)
        a.register_hook(f)
    loss = ((a @ w2) ** 2).sum()
    scope = ca.enable(backend, opaque=("TwiceBackward",), background=False) if compiled else contextlib.nullcontext()
    try:
        with scope, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss.backward()
    except Exception as e:  # (eager's error, or ours)
        return type(e), str(e).strip().splitlines()[0]
    return [None if p.grad is None else p.grad for p in params]


def _same(got, want, exact: bool) -> bool:
    if got is None or want is None:
        return got is None and want is None
    if type(got) is not type(want) or got.dtype != want.dtype or got.shape != want.shape:
        return False
    if isinstance(want, TwoTensor):
        return _same(got.a, want.a, exact) and _same(got.b, want.b, exact)
    if isinstance(want, Wrapper):
        return _same(got.t, want.t, exact)
    got, want = torch.Tensor.as_subclass(got, torch.Tensor), torch.Tensor.as_subclass(want, torch.Tensor)
    return torch.equal(got, want) if exact else torch.allclose(got, want, rtol=1e-4, atol=1e-5)


def _check(kind, change, backend):
    torch.manual_seed(0)
    params = [torch.randn(6, 8, requires_grad=True), torch.randn(8, 3, requires_grad=True)]
    plan = [None, None, change, change, change, None]  # captured and hit, then the change, then none again
    for step, c in enumerate(plan):
        want = _step(kind, c, step, params, False, backend)
        got = _step(kind, c, step, params, True, backend)
        where = f"{kind} returning {change}, step {step}"
        if isinstance(want, tuple):  # eager's error: the same, where ours raised it
            assert got == want, f"{where}: eager raised {want}, ours {got if isinstance(got, tuple) else 'returned'}"
            continue
        assert not isinstance(got, tuple), f"{where}: ours raised {got}, eager did not"
        for g, w in zip(got, want):
            assert _same(g, w, backend != "inductor"), f"{where}: {type(g).__name__} {g} vs eager's {type(w).__name__} {w}"
    s = ca.stats()
    assert s.eager_fallbacks == 0 or kind == "unpack hook", s


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("kind", KINDS)
def test_a_call_output_not_as_traced(kind, change):
    _check(kind, change, "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", [INDUCTOR])
def test_a_call_output_not_as_traced_under_inductor(kind, change, backend):
    _check(kind, change, backend)


_STATE = {"sub": False}  # (as the snippet: state no key holds)


class _Doubled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        out = g * 2
        return TwoTensor(out, out.clone()) if _STATE["sub"] else out


@pytest.mark.parametrize("backend", ["aot_eager", INDUCTOR])
def test_an_opaque_node_that_starts_returning_a_subclass(backend):
    """The issue's case: an opaque node returns a plain grad while its graph is captured, then a
    TwoTensor (was: a plain grad of other values, silently, on aot_eager and inductor). The hit
    stops at the node and goes on in eager's order, counted; the next capture holds that output
    by reference; every backward's `.grad` is eager's, type and values."""
    w = torch.nn.Parameter(torch.randn(8, 8))
    for i in range(6):
        _STATE["sub"] = i in (2, 3, 4)
        torch.manual_seed(i)
        m = torch.randn(8, 8)
        grads = []
        for compiled in (False, True):
            w.grad = None
            scope = ca.enable(backend, opaque=("_DoubledBackward",), background=False) if compiled else contextlib.nullcontext()
            with scope:
                _Doubled.apply(w).matmul(m).square().sum().backward()
            grads.append(w.grad)
        want, got = grads
        assert _same(got, want, backend != "inductor"), f"backward {i}: {type(got).__name__} vs eager's {type(want).__name__}"
    s = ca.stats()
    # a learning backward, a capture, a hit, the hit that stops (counted), a capture holding it by
    # reference, two hits
    assert (s.learning_backwards, s.captures, s.hits, s.type_resumes, s.eager_fallbacks) == (1, 2, 3, 1, 0), s
