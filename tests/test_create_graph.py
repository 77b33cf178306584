"""create_graph=True: compiled backwards whose gradients can be differentiated again
(NOTE [create_graph] in capture/create_graph.py). Each test runs two inputs through one
cache entry and compares every value, and whether it requires grad, with eager."""

from __future__ import annotations

import contextlib

import pytest
import torch

import compiled_autograd as ca
from helpers import assert_grads_equal, assert_same, compare, higher_order_tol


def _parity(step, backend, steps=2, captures=1, hits=None, first=1):
    """step(seed, first, second): the values to compare, each also by whether it requires
    grad; `first`/`second` are the scopes of the create_graph backward and of the backward
    through it (`second` eager here). `hits`: compiled backwards per step (helpers.compare).
    The first `first` values are first-order grads, bitwise eager's; the rest are differentiated
    through a create_graph graph, held to NOTE [The contract of a second-order gradient]."""
    results = compare(
        lambda seed, scope: step(seed, scope, contextlib.nullcontext()),
        backend,
        steps,
        captures=captures,
        hits=steps * (1 if hits is None else hits) - captures,
        requires_grad=True,
        tol=higher_order_tol,
    )
    for n, (want, got) in enumerate(results):
        assert_same(got[:first], want[:first], f"step {n}: first order", exact=True)


def _critic():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 16),
        torch.nn.GELU(),
        torch.nn.LayerNorm(16),
        torch.nn.Linear(16, 1),
    )


def _grads(params):
    return [None if p.grad is None else p.grad.clone() for p in params]


def _gradient_penalty_step(D, second_in_scope: bool):
    """WGAN-GP: the gradient of the critic with respect to its input, then the penalty's
    backward to the weights, through the first backward's graph: in the compiled scope too
    (its double backward traced into a graph of its own), or in `second`."""
    params = list(D.parameters())

    def step(seed, first, second):
        torch.manual_seed(seed)
        x = torch.randn(4, 8, requires_grad=True)
        for p in params:
            p.grad = None
        with first:
            (g,) = torch.autograd.grad(D(x).sum(), x, create_graph=True)
            gp = ((g.norm(2, dim=1) - 1) ** 2).mean()
            if second_in_scope:
                gp.backward()
        if not second_in_scope:
            with second:
                gp.backward()
        return [g, *_grads(params), x.grad]

    return step


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("second_in_scope", [False, True])
def test_gradient_penalty_matches_eager(backend, second_in_scope):
    step = _gradient_penalty_step(_critic(), second_in_scope)
    if second_in_scope:  # per step: the create_graph backward and the backward through it
        _parity(step, backend, captures=2, hits=2)
    else:
        _parity(step, backend)


def test_backward_create_graph_accumulates_differentiable_grads():
    """`backward(create_graph=True)`: AccumulateGrad clones into `.grad` (with
    history), then adds out of place, as eager does in grad mode."""
    torch.manual_seed(0)
    w = torch.randn(5, 3, requires_grad=True)
    b = torch.randn(3, requires_grad=True)

    def step(seed, first, second):
        torch.manual_seed(seed)
        x = torch.randn(4, 5)
        w.grad = b.grad = None
        with first:
            torch.tanh(x @ w + b).pow(2).sum().backward(create_graph=True)
            gw, gb = w.grad, b.grad
            torch.sin(x @ w).sum().backward(create_graph=True)  # .grad exists: out of place
        penalty = w.grad.pow(2).sum() + gb.pow(2).sum()
        out = [gw, gb, w.grad, b.grad]
        w.grad = b.grad = None
        with second:
            penalty.backward()
        return out + [w.grad.clone(), b.grad.clone()]

    _parity(step, "aot_eager", captures=2, hits=2, first=4)


def test_hessian_vector_product_and_third_order_match_eager():
    """g is bitwise eager's; hv, the third order and dv are differentiated through our
    create_graph graphs, within the contract of a higher-order gradient (NOTE [The contract of
    a second-order gradient]: the same terms, summed in another order; up to ~1e-6 here)."""

    def step(seed, first, second):
        torch.manual_seed(seed)
        x = torch.randn(6, requires_grad=True)
        v = torch.randn(6, requires_grad=True)  # a grad_output that itself requires grad
        with first:
            y = (x.sin() * x.pow(3)).sum()
            (g,) = torch.autograd.grad(y, x, create_graph=True)
            (hv,) = torch.autograd.grad(g, x, grad_outputs=v, create_graph=True)
            (third,) = torch.autograd.grad(hv.sum(), x, create_graph=True)
            (dv,) = torch.autograd.grad(third.sum(), v)
        return [g, hv, third, dv]

    results = compare(
        lambda seed, scope: step(seed, scope, contextlib.nullcontext()),
        "eager",
        2,
        captures=4,
        hits=4,
        tol=higher_order_tol,
        requires_grad=True,
    )
    for want, got in results:
        assert torch.equal(got[0], want[0]), "the first order is bitwise eager's"


def test_results_that_do_not_depend_on_anything_differentiable_do_not_require_grad():
    """d(x @ w)/dw with x constant does not require grad in eager: nor here."""
    w = torch.randn(4, 2, requires_grad=True)
    z = torch.randn(3, requires_grad=True)

    def step(seed, first, second):
        torch.manual_seed(seed)
        x = torch.randn(3, 4)
        with first:
            gw, gz = torch.autograd.grad((x @ w).sum() + z.sin().sum(), [w, z], create_graph=True)
        assert not gw.requires_grad and gz.requires_grad
        return [gw, gz]

    _parity(step, "eager", first=2)


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.pow(3)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * g * x * x  # differentiable: a double backward goes through it


class _Once(_Twice):
    backward = staticmethod(torch.autograd.function.once_differentiable(_Twice.backward))


def test_custom_function_backward_is_differentiated_as_in_eager():
    """g is bitwise eager's; gg, eager's backward through the graph our create_graph backward
    recorded, is within the contract of a second-order gradient (~2.4e-7 off at seed 1)."""

    def step(seed, first, second):
        torch.manual_seed(seed)
        x = torch.randn(5, requires_grad=True)
        with first:
            (g,) = torch.autograd.grad(_Twice.apply(x.exp()).sum(), x, create_graph=True)
        with second:
            (gg,) = torch.autograd.grad(g.sum(), x)
        return [g, gg]

    results = compare(
        lambda seed, scope: step(seed, scope, contextlib.nullcontext()),
        "eager",
        2,
        captures=1,
        hits=1,
        tol=higher_order_tol,
        requires_grad=True,
    )
    for want, got in results:
        assert torch.equal(got[0], want[0]), "the first order is bitwise eager's"


def test_once_differentiable_function_falls_back_and_raises_as_eager():
    """Eager records a DelayedError node when the grads entering a once_differentiable
    backward require grad; a second backward through it raises. So do we (eagerly)."""
    x = torch.randn(4, requires_grad=True)
    v = torch.ones(4, requires_grad=True)
    with ca.enable("eager"):
        (g,) = torch.autograd.grad(_Once.apply(x), x, grad_outputs=v, create_graph=True)
        torch.testing.assert_close(g, 3 * x.detach() ** 2)
        with pytest.raises(RuntimeError, match="once_differentiable"):
            g.sum().backward()
        (g,) = torch.autograd.grad(_Once.apply(x), x, grad_outputs=v, create_graph=True)  # not traced again
        # without a grad that requires grad, eager records no error node: compiled
        (g,) = torch.autograd.grad(_Once.apply(x).sum(), x, create_graph=True)
        assert not g.requires_grad
    s = ca.stats()
    # the backward that raises is the first of a graph with an opaque node (the error node):
    # it runs in eager autograd to learn the node's output layouts (NOTE [Layouts of call
    # outputs]) and raises there, as eager does, uncounted; the last one is captured
    assert (s.captures, s.learning_backwards, s.eager_fallbacks) == (1, 0, 2), s
    assert any("cannot differentiate twice" in r for r in s.fallback_details), s.fallback_details
    with pytest.raises(ca.CompiledAutogradError, match="differentiate twice"):
        with ca.enable("eager", fullgraph=True):
            torch.autograd.grad(_Once.apply(x), x, grad_outputs=v, create_graph=True)


class _NoGradInside(_Twice):
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.no_grad():
            c = 2 * x  # a constant for the next order, in eager
        return 3 * g * x * x + c * g


@pytest.mark.parametrize("fn", [_Once, _NoGradInside])
def test_ops_a_custom_backward_runs_without_grad_mode_stay_constants_for_the_next_order(fn):
    """Found by the fuzzer: once_differentiable runs the backward under no_grad, so with
    a grad that does not require grad its result is a constant (no error node), and so
    is whatever a backward computes under no_grad. Eager's second order does not
    differentiate through them, and the compiled graph's vjp must not either."""

    def step(seed, first, second):
        torch.manual_seed(seed)
        x = torch.randn(5, requires_grad=True)
        w = torch.randn(5, requires_grad=True)
        with first:
            # the grad reaching fn's backward is a constant; x's grad also depends on w
            loss = (fn.apply(x) * 2).sum() + (x * w).pow(2).sum()
            (g,) = torch.autograd.grad(loss, x, create_graph=True)
        with second:
            gx, gw = torch.autograd.grad(g.pow(2).sum(), [x, w])
        return [g, gx, gw]

    _parity(step, "eager")
    _parity(step, "aot_eager")


def test_an_in_place_op_without_grad_mode_in_a_custom_backward_runs_as_is():
    # not traceable (an in-place op on a grad-requiring value): the Function runs opaquely, and the
    # create_graph graph runs in grad mode, its backward called for real (NOTE [create_graph with
    # an opaque node]; before: the whole backward in eager): both orders bitwise eager's
    class F(_Twice):
        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            y = 3 * g * x * x
            with torch.no_grad():
                y.mul_(2)  # eager's next order does not see this factor
            return y

    def run():
        x = torch.randn(5, requires_grad=True)
        w = torch.randn(5, requires_grad=True)
        loss = (F.apply(x) * 2).sum() + (x * w).pow(2).sum()
        (g,) = torch.autograd.grad(loss, x, create_graph=True)
        return g, torch.autograd.grad(g.pow(2).sum(), [x, w])

    for seed in range(3):  # (the first order: a learning backward of the opaque node's layout, a capture, a hit;
        # the second order: a capture, two hits)
        torch.manual_seed(seed)
        want = run()
        torch.manual_seed(seed)
        with ca.enable("eager"):
            got = run()
        assert_grads_equal([got[0], *got[1]], [want[0], *want[1]], exact=True)
    s = ca.stats()
    assert (s.eager_fallbacks, s.captures, s.hits, s.learning_backwards) == (0, 2, 3, 1), s


def test_hooks_with_create_graph_fall_back():
    for seed in range(2):  # the second is not traced: the key is known to fall back
        torch.manual_seed(seed)
        x = torch.randn(3, requires_grad=True)
        y = x.pow(3)
        y.register_hook(lambda g: g * 2)
        with ca.enable("eager"):
            (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        torch.testing.assert_close(g, 6 * x.detach() ** 2)
        assert g.requires_grad
        (gg,) = torch.autograd.grad(g.sum(), x)
        torch.testing.assert_close(gg, 12 * x.detach())
    s = ca.stats()
    assert (s.captures, s.hits, s.eager_fallbacks) == (0, 0, 2), s
    assert s.fallback_details["create_graph=True with hooks"] == 2 and s.fallback_reasons["create_graph"] == 2


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_leaf_hooks_under_create_graph_compile(backend):
    # NOTE [A leaf's hooks under create_graph]: a leaf's tensor hooks (one that scales its grad,
    # one that reads the other leaf's .grad) and post-accumulate-grad hooks run as each grad is
    # applied, in grad mode, on the differentiable result; then a backward through the .grads
    def step(seed, first, second):
        torch.manual_seed(seed)
        w, b = torch.randn(4, 3, requires_grad=True), torch.randn(3, requires_grad=True)
        b.grad = torch.ones(3)  # accumulated into out of place, with history
        log = []
        w.register_hook(lambda g: log.append(("w", g.requires_grad, None if b.grad is None else b.grad.clone())) or g * 2)
        b.register_hook(lambda g: log.append(("b", g.requires_grad, g.detach().clone())))
        w.register_post_accumulate_grad_hook(lambda p: log.append(("w acc", p.grad.requires_grad, p.grad.detach().clone())))
        x = torch.randn(5, 4)
        loss = ((x @ w + b).tanh() ** 2).sum()
        with first:
            loss.backward(create_graph=True)
        penalty = (w.grad**2).sum() + (b.grad**3).sum()
        gw, gb = w.grad, b.grad
        w.grad = b.grad = None
        with second:
            penalty.backward()
        return [gw, gb, w.grad, b.grad, log]

    _parity(step, backend, first=2)
    s = ca.stats()
    assert (s.eager_fallbacks, s.opaque_nodes) == (0, 0), s.fallback_reasons


def test_saved_tensor_hooks_with_create_graph_fall_back_before_running_them():
    # eager runs the backward: an offloading-style hook (unpack pops its stash) must be
    # unpacked by eager alone, not first by compiled_autograd's collection too (a KeyError)
    for seed in range(2):
        torch.manual_seed(seed)
        stash = {}

        def pack(t):
            stash[len(stash)] = t
            return len(stash) - 1

        x = torch.randn(3, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, stash.pop):
            y = x.pow(3)
        with ca.enable("eager"):
            (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        torch.testing.assert_close(g, 3 * x.detach() ** 2)
        (gg,) = torch.autograd.grad(g.sum(), x)
        torch.testing.assert_close(gg, 6 * x.detach())
    s = ca.stats()
    assert (s.captures, s.hits, s.eager_fallbacks) == (0, 0, 2), s
    assert s.fallback_details["create_graph=True with saved-tensor hooks"] == 2


@pytest.mark.inductor
def test_inductor_gradient_penalty():
    step = _gradient_penalty_step(_critic(), second_in_scope=True)
    # (tol={}: torch.testing.assert_close's own tolerance)
    compare(
        lambda seed, scope: step(seed, scope, None),
        "inductor",
        captures=2,
        hits=2,
        requires_grad=True,
        tol={},
        fullgraph=False,
        background=False,
    )


def test_in_place_view_updates_split_where_the_mutation_is_of_a_fresh_temporary():
    """CopySlices (an in-place update of a view) writes into a buffer it made: the split into
    forward and vjp keeps every read of it on the same side of the write, so it is allowed,
    and the second order is eager's (eager and compiled second backward)."""

    def step(seed, first, second):
        torch.manual_seed(seed)
        x = torch.randn(4, 3, requires_grad=True)
        y = x.clone()
        y[1:] *= 3
        with first:
            (g,) = torch.autograd.grad(y.pow(3).sum(), x, create_graph=True)
        with second:
            (gg,) = torch.autograd.grad(g.pow(2).sum(), x)
        return [g, gg]

    _parity(step, "eager")
    (entry,) = ca.graphs()
    assert entry.vjp is not None
    assert any("copy_" in str(n.target) for n in entry.graph.graph.nodes)

    def compiled_second(seed, first, second):
        return step(seed, first, first if isinstance(first, ca.enable) else second)

    _parity(compiled_second, "eager", captures=1, hits=2)  # + the second backward, captured once


def test_second_order_reads_saved_intermediates_instead_of_rerunning():
    """NOTE [create_graph]: the compiled graph returns what its vjp reads; the vjp graph does
    not recompute the first backward (no leaky_relu_backward of the first order in it)."""
    D = _critic()
    D[1] = torch.nn.LeakyReLU(0.2)
    _parity(_gradient_penalty_step(D, second_in_scope=False), "eager")  # second backward eager: the vjp graph
    (entry,) = ca.graphs()
    assert entry.vjp is not None
    first_order = [n for n in entry.graph.graph.nodes if "leaky_relu_backward" in str(n.target)]
    vjp_ops = [str(n.target) for n in entry.vjp.graph.graph.nodes if n.op == "call_function"]
    assert first_order and len(entry.graph.graph.find_nodes(op="output")[0].args[0]) > entry.plan.num_results
    assert sum("leaky_relu_backward" in t for t in vjp_ops) == len(first_order), vjp_ops  # its derivative only


def test_explain_and_dump_show_the_split(tmp_path):
    _parity(_gradient_penalty_step(_critic(), second_in_scope=False), "eager")
    assert "create_graph: 1 differentiable results; the graph also returns" in ca.explain()
    files = ca.dump(tmp_path)
    code = open(next(f for f in files if f.endswith("graph_0.txt"))).read()
    assert "its vjp graph" in code and "tangents_1" in code


def test_lifted_tensors_that_are_views_of_each_other_get_their_own_gradients():
    """torch.cov saves x and a transposed view of it: two lifted inputs, one a view of the
    other. The vjp must give each its own gradient (the engine then sends the view's into its
    base); found by the conformance run, where the second order was twice eager's."""
    w = torch.randn(2, 3)

    def step(seed, first, second):
        torch.manual_seed(seed)
        x = torch.randn(2, 3, requires_grad=True)
        with first:
            (g,) = torch.autograd.grad((torch.cov(x.sin()) * w[:, :2]).sum(), x, create_graph=True)
        (gg,) = torch.autograd.grad((g * w).sum(), x, create_graph=True)  # eager, through the vjp graph
        with first:
            (gg2,) = torch.autograd.grad((g * w).sum(), x, create_graph=True)  # compiled, rerun with grad
        (ggg,) = torch.autograd.grad((gg2 * w).sum().exp(), x)
        return [g, gg, gg2, ggg]

    _parity(step, "eager", captures=2, hits=2)


class _FreshLeafBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return torch.ones_like(g, requires_grad=True) * 3.0


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("existing_grad", [True, False])
def test_a_grad_differentiable_only_through_a_leaf_the_backward_made_keeps_its_history(backend, existing_grad):
    """issue 36 item 3 (torch's test_accumulate_grad_polyfill_case_3_2): a backward returning
    `ones_like(g, requires_grad=True) * 3` under create_graph, into an existing `.grad`: eager's
    `.grad` is old + new with history (requires grad); ours was a plain tensor on the capture
    and on the hit (NOTE [Results differentiable through a leaf the backward made])."""

    def step(seed, scope):
        torch.manual_seed(seed)
        var = torch.randn(2, 2, requires_grad=True)
        if existing_grad:
            var.grad = torch.randn(2, 2)
        out = _FreshLeafBackward.apply(var)
        with scope:
            out.backward(torch.randn(2, 2), create_graph=True)
        assert (var.grad.grad_fn is not None) == var.grad.requires_grad
        return [var.grad]

    compare(step, backend, steps=2, captures=1, hits=1, requires_grad=True)
