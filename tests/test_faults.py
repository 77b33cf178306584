"""Faults inside a backward (issue 24): what eager does, we do."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import compiled_autograd as ca
from helpers import higher_order_tol


def _retry_after_raise(compiled, backend, where, seed, warm=False):
    """A hook raises in the first backward; the user fixes it and calls backward again.
    Returns (first error, second error or None, grads)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    state = {"raise": False}

    def hook(*args):
        if state["raise"]:
            raise ValueError("boom")

    def make():
        torch.manual_seed(seed)
        x = torch.randn(3, 4)
        h = m[0](x)
        r = m[1](h)
        out = m[2](r)
        if where == "tensor":
            r.register_hook(hook)
        elif where == "pre":
            h.grad_fn.register_prehook(hook)
        elif where == "post":
            r.grad_fn.register_hook(hook)
        return out.sum()

    scope = (lambda: ca.enable(backend)) if compiled else torch.enable_grad
    if warm:  # the structure is cached: the failing backward is a hit
        with scope():
            make().backward()
        m.zero_grad(set_to_none=True)
    loss = make()
    state["raise"] = True
    errors = []
    for _ in range(2):
        try:
            with scope():
                loss.backward()
            errors.append(None)
        except (ValueError, RuntimeError) as e:
            errors.append(type(e).__name__ + ": " + str(e).split("(")[0][:50])
        state["raise"] = False
    return errors, [None if p.grad is None else p.grad.clone() for p in m.parameters()]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("where", ["tensor", "pre", "post"])
@pytest.mark.parametrize("warm", [False, True])
def test_retry_after_a_hook_raised(backend, where, warm):
    """A retry without retain_graph raises as eager's does (the nodes that ran before the
    error freed their saved tensors), never accumulating the same grads twice."""
    want_errors, want = _retry_after_raise(False, backend, where, 1, warm)
    got_errors, got = _retry_after_raise(True, backend, where, 1, warm)
    assert want_errors[0].startswith("ValueError") and want_errors[1].startswith("RuntimeError: Trying to backward")
    assert got_errors == want_errors
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if w is not None:
            assert torch.equal(g, w)
    assert ca.stats().eager_fallbacks == 0


# -- layouts (NOTE [Layouts of call outputs]) -----------------------------------------------


def _mlp(d=64, h=256):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(d, h), torch.nn.Tanh(), torch.nn.Linear(h, h), torch.nn.Tanh(), torch.nn.Linear(h, 4))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_hook_that_returns_another_layout(backend):
    """A hook returning a transposed-layout grad (issue 36 item 5): the graph's first run stops
    at the hook and goes on in eager's order (NOTE [A call output not as traced]): bitwise eager's,
    where the copy into the traced layout had summed the
    bias grad in another order (2.4e-7 off); then captured again in the layout it returns."""
    m = _mlp()

    def step(seed, compiled):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        h = m[0](torch.randn(128, 64))
        h.register_hook(lambda g: g.t().contiguous().t())
        loss = m[4](m[3](m[2](m[1](h)))).sum()
        with ca.enable(backend) if compiled else torch.enable_grad():
            loss.backward()
        return [p.grad.clone() for p in m.parameters()]

    for seed in range(4):
        want, got = step(seed, False), step(seed, True)
        for g, w in zip(got, want):
            assert torch.equal(g, w) and g.stride() == w.stride()
    s = ca.stats()
    assert (s.captures, s.hits, s.layout_resumes, s.layout_copies, s.eager_fallbacks) == (2, 2, 1, 0, 0), s


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("where", ["tensor hook", "pre hook", "post hook", "grad inputs"])
def test_a_first_run_that_meets_another_layout_goes_on_in_eagers_order(backend, where):
    """NOTE [A call output not as traced]: wherever the hook that
    returns another layout sits (a tensor hook, a node's pre or post hook; under grad(inputs=)
    with results captured before and after it), the first backward is eager's bitwise, and
    every hook runs once per backward, those before the point and those after it."""

    def step(seed, compiled):
        m = _mlp(16, 32)  # (a new module each time: hooks registered on it go with it)
        calls = []
        torch.manual_seed(seed)
        h = m[0](torch.randn(8, 16))
        a = m[1](h)

        def relaid(g):
            calls.append("relaid")
            return g.t().contiguous().t()

        if where in ("tensor hook", "grad inputs"):
            h.register_hook(relaid)
        elif where == "pre hook":
            a.grad_fn.register_prehook(lambda gO: (relaid(gO[0]),))
        else:
            a.grad_fn.register_hook(lambda gI, gO: (relaid(gI[0]),))
        m[0].weight.register_hook(lambda g: calls.append(("leaf", g.sum().item())))  # after the point
        b = m[2](a)
        b.register_hook(lambda g: calls.append(("before", g.sum().item())))  # before it
        loss = m[4](m[3](b)).sum()
        with ca.enable(backend) if compiled else torch.enable_grad():
            if where == "grad inputs":
                grads = list(torch.autograd.grad(loss, [m[4].weight, h, m[0].weight, m[0].bias]))
            else:
                loss.backward()
                grads = [p.grad.clone() for p in m.parameters()]
        return grads, calls

    for seed in range(3):
        (want, want_calls), (got, got_calls) = step(seed, False), step(seed, True)
        assert got_calls == want_calls, (got_calls, want_calls)
        for g, w in zip(got, want):
            assert torch.equal(g, w) and g.stride() == w.stride(), f"seed {seed}"
    s = ca.stats()
    assert (s.layout_resumes, s.layout_copies, s.eager_fallbacks, s.captures, s.hits) == (1, 0, 0, 2, 1), s


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("region", [(0, 4), (2, 4)])
def test_checkpoint_is_bitwise_from_the_first_backward(backend, region):
    """Checkpointed Linear layers save `weight.t()`, which the recomputation returns
    transposed; traced contiguous, the copy changed the first layer's grads in the last bit.
    The first backward learns the layouts in eager; every compiled one is bitwise eager's."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    m = torch.nn.Sequential(*(torch.nn.Linear(8, 8) if i % 2 == 0 else torch.nn.ReLU() for i in range(5)))
    a, b = region

    def step(seed, compiled):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        h = m[:a](torch.randn(4, 8))
        h = checkpoint(m[a:b], h, use_reentrant=False)
        loss = m[b:](h).sum()
        with ca.enable(backend) if compiled else torch.enable_grad():
            loss.backward()
        return [p.grad.clone() for p in m.parameters()]

    for seed in range(3):
        want, got = step(seed, False), step(seed, True)
        for g, w in zip(got, want):
            assert torch.equal(g, w) and g.stride() == w.stride()
    s = ca.stats()
    assert (s.learning_backwards, s.captures, s.hits, s.layout_copies, s.eager_fallbacks) == (1, 1, 1, 0, 0)


# -- sparse gradients -------------------------------------------------------------------------


class _Keep:
    """A ctx attribute no key can hold: the Function's node runs opaquely."""


class _SparseRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, idx, opaque):
        ctx.save_for_backward(idx)
        ctx.shape = w.shape
        if opaque:
            ctx.keep = _Keep()
        return w[idx]

    @staticmethod
    def backward(ctx, g):
        (idx,) = ctx.saved_tensors
        return torch.sparse_coo_tensor(idx.unsqueeze(0), g, ctx.shape), None, None


def _sparse_job(compiled, backend, source, hooks, steps=3):
    """Grads (dense copies) and layouts of `.grad` after each step."""
    torch.manual_seed(0)
    if source in ("function", "opaque function"):
        w = torch.randn(10, 3, requires_grad=True)
        module = None
    else:
        module = (torch.nn.Embedding if source == "embedding" else torch.nn.EmbeddingBag)(10, 3, sparse=True)
        w = module.weight
    if "tensor hook" in hooks:
        w.register_hook(lambda g: g * 2)
    if "post-accumulate hook" in hooks:  # DDP-like: reads the accumulated grad
        seen = []
        w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.coalesce().values().sum() if p.grad.is_sparse else p.grad.sum()))
    if "existing grad" in hooks:
        w.grad = torch.zeros(10, 3).to_sparse()
    out = []
    for step in range(steps):
        torch.manual_seed(step + 1)
        idx = torch.randint(0, 10, (6,))
        if module is None:
            y = _SparseRows.apply(w, idx, source == "opaque function")
        elif source == "embedding":
            y = module(idx)
        else:
            y = module(idx.view(2, 3))
        loss = (y * torch.randn_like(y)).sum()
        with ca.enable(backend) if compiled else torch.enable_grad():
            loss.backward()
        out.append((w.grad.to_dense().clone(), w.grad.layout))
    return out


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("source", ["function", "opaque function", "embedding", "embedding bag"])
@pytest.mark.parametrize(
    "hooks", [("tensor hook",), ("post-accumulate hook",), ("tensor hook", "post-accumulate hook"), ("tensor hook", "existing grad")]
)
def test_sparse_gradients_with_hooks(backend, source, hooks):
    """Sparse grads (a Function's, opaque or traced; sparse embeddings) through hooks and
    accumulated over steps: never an error, every value and layout eager's. An opaque node's
    outputs are laid out as an eager backward showed (NOTE [Layouts of call outputs])."""
    want = _sparse_job(False, backend, source, hooks)
    got = _sparse_job(True, backend, source, hooks)
    for step, ((g, gl), (w, wl)) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"step {step}"
        assert gl == wl, f"step {step}: .grad is {gl}, eager's {wl}"
    s = ca.stats()
    assert (s.eager_fallbacks, s.layout_copies) == (0, 0), s
    learning = 1 if source == "opaque function" else 0
    assert (s.learning_backwards, s.captures, s.hits) == (learning, 1, 2 - learning)
    assert s.opaque_nodes == (2 if source == "opaque function" else 0)


# -- create_graph accumulation, stealing -------------------------------------------------------


def _double_backward_job(compiled, backend, first_create_graph, seed):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    torch.manual_seed(seed)
    x = torch.randn(5, 4)
    for create_graph in (first_create_graph, True):
        loss = m(x).pow(2).sum()
        with ca.enable(backend) if compiled else torch.enable_grad():
            loss.backward(create_graph=create_graph)
    grads = [p.grad for p in m.parameters()]
    out = [(g.requires_grad, type(g.grad_fn).__name__, g.detach().clone()) for g in grads]
    sum(g.sum() for g in grads).backward()  # the double backward through the new .grad
    return out, [p.grad.detach().clone() for p in m.parameters()]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("first_create_graph", [False, True])
def test_create_graph_accumulating_into_an_existing_grad(backend, first_create_graph):
    """Under create_graph, AccumulateGrad adds into an existing `.grad` out of place, in grad
    mode: the new `.grad` tracks history, for a double backward through it."""
    for seed in (1, 2):
        want, want2 = _double_backward_job(False, backend, first_create_graph, seed)
        got, got2 = _double_backward_job(True, backend, first_create_graph, seed)
        for (gr, gf, g), (wr, wf, w) in zip(got, want):
            assert (gr, gf) == (wr, wf) and torch.equal(g, w)
        # the second order runs the capture's vjp graph (NOTE [create_graph]): eager's
        # formulas, summed in another order: NOTE [The contract of a second-order gradient]
        for g, w in zip(got2, want2):
            torch.testing.assert_close(g, w, **higher_order_tol(w))
    assert ca.stats().eager_fallbacks == 0


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("hook", ["new tensor", "unchanged", "transposed copy"])
@pytest.mark.parametrize("extra", ["", "post-accumulate hook", "hook on an activation"])
def test_a_tensor_hooks_result_becomes_grad_as_in_eager(backend, hook, extra):
    """Eager's AccumulateGrad takes what a leaf's tensor hook returned as `.grad` without a
    copy when nothing else refers to it and its layout is the parameter's; the storage is
    observable (optimizers, gradient_as_bucket_view)."""

    def job(compiled, seed):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
        returned = []

        def h(g):
            r = {"new tensor": lambda: g * 2, "unchanged": lambda: g, "transposed copy": lambda: g.t().contiguous().t()}[hook]()
            returned.append(r.data_ptr())
            return r

        w = m[0].weight
        w.register_hook(h)
        if extra == "post-accumulate hook":
            w.register_post_accumulate_grad_hook(lambda p: None)
        torch.manual_seed(seed)
        a = m[0](torch.randn(5, 4))
        if extra == "hook on an activation":
            a.register_hook(lambda g: g + 1)
        loss = m[2](m[1](a)).sum()
        with ca.enable(backend) if compiled else torch.enable_grad():
            loss.backward()
        return returned[-1] == w.grad.data_ptr(), w.grad.clone()

    for seed in (1, 2):
        (want_same, want), (got_same, got) = job(False, seed), job(True, seed)
        assert got_same == want_same and torch.equal(got, want)


# -- reasons ----------------------------------------------------------------------------------


def test_reasons_are_a_fixed_set_of_kinds_with_details():
    """NOTE [Reasons are kinds with details]: the counters' keys are kinds from a documented
    table, whatever the texts; the texts are details, bounded in number."""
    from compiled_autograd.observe import reasons

    kinds = {k.name for k in reasons.FALLBACKS}
    x = torch.randn(3, requires_grad=True)
    with torch.autograd.detect_anomaly(), ca.enable("eager"):
        (x * 2).sum().backward()

    def broken(gm, example_inputs):
        raise ValueError(f"backend broke on {[tuple(t.shape) for t in example_inputs]}")  # a new text per graph

    for n in range(1, 4):
        w = torch.randn(n, requires_grad=True)
        with ca.enable(broken):
            (w * w).sum().backward()
    s = ca.stats()
    assert set(s.fallback_reasons) == {"anomaly mode", "capture failed"} <= kinds | {"capture failed"}, s.fallback_reasons
    # (the third is not traced: two failures of one key mark it, with the last reason)
    assert s.fallback_reasons["capture failed"] == 3 and len([d for d in s.fallback_details if "backend broke" in d]) == 2
    assert reasons.classify("a made-up text", reasons.OPAQUES) == "other"
    details: Counter = Counter()
    for i in range(reasons.MAX_DETAILS + 10):
        reasons.count(Counter(), details, f"detail {i}", reasons.OPAQUES)
    assert len(details) == reasons.MAX_DETAILS + 1 and details["other: (other details)"] == 10
    report = ca.explain(file=None)
    assert "eager fallback x3: capture failed" in report and "x1: anomaly mode" not in repr(report)
