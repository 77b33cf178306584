"""A user backend whose compiled graph returns the wrong outputs: a clear error on the
graph's first run, before any .grad changes, and the graph is not kept."""

import pytest
import torch

import compiled_autograd as ca


class ToggleBackend:
    """A backend whose compiled functions break their outputs while `fault` is set (read at
    compile time: a fixed backend serves new compiles)."""

    __name__ = "toggle_backend"

    def __init__(self, fault=None):
        self.fault = fault
        self.compiles = 0

    def __call__(self, gm, example_inputs):
        self.compiles += 1
        fault = self.fault

        def run(*args):
            out = list(gm(*args))
            if fault == "few":
                return out[:-1]
            for i, o in enumerate(out):
                if o.shape == (8, 4):  # the weight's grad
                    out[i] = o[:1] if fault == "shape" else o.double() if fault == "dtype" else o
            return out

        return run


def _model():
    torch.manual_seed(0)
    w = torch.randn(8, 4, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    return w, b


def _loss(w, b, x):
    return ((x @ w + b).tanh() * 3).sum()


def _eager_grads(w, b, x):
    return torch.autograd.grad(_loss(w, b, x), [w, b])


ERRORS = {
    "few": r"toggle_backend.*returned 1 outputs?; the traced graph returns 2",
    "shape": r"toggle_backend.*output [01]: expected shape \(8, 4\), dtype torch.float32.*got shape \(1, 4\)",
    "dtype": r"toggle_backend.*output [01]: expected shape \(8, 4\), dtype torch.float32.*got shape \(8, 4\), dtype torch.float64",
}


@pytest.mark.parametrize("fault", ["few", "shape", "dtype"])
def test_broken_backend_raises_clearly_then_works_once_fixed(fault):
    backend = ToggleBackend(fault)
    w, b = _model()
    x1, x2 = torch.randn(3, 8), torch.randn(3, 8)
    b.grad = torch.ones(4)  # an existing grad must stay as it was
    for _ in range(2):  # the broken graph is not cached: the second backward captures again, raises again
        with pytest.raises(ca.BackendOutputError, match=ERRORS[fault]) as info:
            with ca.enable(backend):
                _loss(w, b, x1).backward()
        assert isinstance(info.value, RuntimeError) and isinstance(info.value, ca.CompiledAutogradError)
        assert w.grad is None and torch.equal(b.grad, torch.ones(4))
    assert backend.compiles == 2
    s0 = ca.stats()
    assert s0.captures == 2 and s0.hits == 0 and s0.eager_fallbacks == 0

    backend.fault = None
    w.grad = b.grad = None
    for i, x in enumerate((x1, x2)):
        with ca.enable(backend):
            _loss(w, b, x).backward()
        ref = _eager_grads(w, b, x)
        assert torch.equal(w.grad, ref[0]) and torch.equal(b.grad, ref[1])
        w.grad = b.grad = None
        s = ca.stats()
        assert (s.captures, s.hits, s.eager_fallbacks) == (3, i, 0), s
    assert backend.compiles == 3


def test_broken_backend_under_grad():
    backend = ToggleBackend("shape")
    w, b = _model()
    x = torch.randn(3, 8)
    with pytest.raises(ca.BackendOutputError, match=ERRORS["shape"]):
        with ca.enable(backend):
            torch.autograd.grad(_loss(w, b, x), [w, b])
    backend.fault = None
    with ca.enable(backend):
        got = torch.autograd.grad(_loss(w, b, x), [w, b])
    ref = _eager_grads(w, b, x)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_broken_backend_in_background_is_checked_after_the_swap():
    backend = ToggleBackend("shape")
    w, b = _model()
    x1, x2 = torch.randn(3, 8), torch.randn(3, 8)
    with ca.enable(backend, background=True):
        _loss(w, b, x1).backward()  # the traced graph replays while the backend compiles
    ca.synchronize()
    ref = _eager_grads(w, b, x1)
    assert torch.equal(w.grad, ref[0]) and torch.equal(b.grad, ref[1])
    before = (w.grad.clone(), b.grad.clone())
    with pytest.raises(ca.BackendOutputError, match=ERRORS["shape"]):
        with ca.enable(backend, background=True):
            _loss(w, b, x2).backward()  # the first run of the compiled function
    assert torch.equal(w.grad, before[0]) and torch.equal(b.grad, before[1])
    assert ca.stats().hits == 1
    backend.fault = None
    w.grad = b.grad = None
    with ca.enable(backend, background=True):
        _loss(w, b, x2).backward()  # captured again: the traced graph replays
    ca.synchronize()
    w.grad = b.grad = None
    with ca.enable(backend, background=True):
        _loss(w, b, x2).backward()  # the fixed compiled function, checked, then a hit
    ref = _eager_grads(w, b, x2)
    assert torch.equal(w.grad, ref[0]) and torch.equal(b.grad, ref[1])
    s = ca.stats()
    assert (s.captures, s.hits, s.compile_failures, s.eager_fallbacks) == (2, 2, 0, 0), s


def test_dynamic_graph_outputs_are_checked_against_their_sizes():
    # a dynamic graph's expected shapes are symbolic: they are evaluated with this backward's sizes
    backend = ToggleBackend()
    w = torch.randn(8, 4, requires_grad=True)

    def loss(n):
        return (torch.randn(n, 8) @ w).tanh().sum()

    with ca.enable(backend, dynamic=True):
        loss(3).backward()
        loss(5).backward()
    assert ca.stats().hits == 1

    class Sliced(ToggleBackend):
        def __call__(self, gm, example_inputs):
            def run(*args):
                return [o[:-1] for o in gm(*args)]  # one row short, whatever the size

            return run

    x = torch.randn(6, 8, requires_grad=True)
    with pytest.raises(ca.BackendOutputError, match=r"expected shape \(6, 8\).*got shape \(5, 8\)"):
        with ca.enable(Sliced(), dynamic=True):
            (x @ w.detach()).tanh().sum().backward()
    assert x.grad is None


def test_broken_backend_under_create_graph():
    # the graph also returns what its vjp reads: those outputs are checked too
    backend = ToggleBackend("few")
    w, b = _model()
    x = torch.randn(3, 8)
    for _ in range(2):
        with pytest.raises(ca.BackendOutputError, match=r"toggle_backend.*returned \d+ outputs?; the traced graph returns"):
            with ca.enable(backend):
                torch.autograd.grad(_loss(w, b, x), [w, b], create_graph=True)
    backend.fault = None
    with ca.enable(backend):
        got = torch.autograd.grad(_loss(w, b, x), [w, b], create_graph=True)
        (got[0] ** 2).sum().backward()
    ref = torch.autograd.grad(_loss(w, b, x), [w, b], create_graph=True)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    w2 = w.grad.clone()
    w.grad = None
    (ref[0] ** 2).sum().backward()
    assert torch.allclose(w2, w.grad)
