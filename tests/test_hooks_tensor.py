"""Tensor hooks inside the compiled graph: what every hook observes equals eager's.

Most cases build a fresh forward with `build(log, step)`, which registers hooks that append
observations to `log`, and hand it to helpers.observe: eager then compiled, two steps with
different values (the second compiled step a cache hit), grads and logs compared entry by
entry. Here: order, replacement and removal, closures, retain_grad, what hooks see, the grads
they return (kept, changed in place, unchanged), the grad mode and dispatch state they run in.
"""

import pytest
import torch
import torch.nn as nn

import compiled_autograd as ca
from helpers import EXACT_BACKENDS, INDUCTOR, assert_grads_equal, copies_in, leaf, observe


def test_tensor_hooks_on_leaf_in_order_with_replacement_and_removal():
    def build(log, step):
        x = leaf(4)
        w = leaf(4)
        x.register_hook(lambda g: log.append(("x1", g.clone())))
        x.register_hook(lambda g: g * 3)
        x.register_hook(lambda g: log.append(("x3", g.clone())))
        removed = w.register_hook(lambda g: log.append(("removed", g)))
        w.register_hook(lambda g: log.append(("w", g.clone())) or g + 1)
        removed.remove()
        return (x * w).sin().sum(), [x, w]

    observe(build)


def test_tensor_hooks_on_non_leaf_and_new_closure_each_step():
    def build(log, step):
        x = leaf(3, 4)
        h = x.exp()
        k = step + 2.0  # a new closure with a new constant every step: no recapture

        def hook(g):
            log.append(("h", g.clone()))
            return g * k

        h.register_hook(hook)
        h.register_hook(lambda g: log.append(("h2", g.clone())))
        return (h * h).sum(), [x]

    observe(build)


def test_retain_grad_with_hooks_on_the_same_tensor():
    seen = {}

    def build(log, step):
        x = leaf(3)
        h = x * 2
        h.retain_grad()
        h.register_hook(lambda g: g * 10)
        y = h.exp()
        y.retain_grad()
        seen[len(seen)] = (h, y)
        return y.sum(), [x]

    observe(build)
    # the last two builds: eager then compiled
    (he, ye), (hc, yc) = seen[len(seen) - 2], seen[len(seen) - 1]
    assert_grads_equal([hc.grad, yc.grad], [he.grad, ye.grad], exact=True)


def test_hook_order_across_the_backward_matches_eager():
    def build(log, step):
        w1, w2, x = leaf(4, 4), leaf(4, 4), leaf(2, 4)
        h1 = x @ w1
        h1.register_hook(lambda g: log.append("h1"))
        h2 = h1.tanh() @ w2
        h2.register_hook(lambda g: log.append("h2"))
        for name, p in (("w1", w1), ("w2", w2), ("x", x)):
            p.register_hook(lambda g, name=name: log.append(f"tensor:{name}"))
            p.register_post_accumulate_grad_hook(lambda p, name=name: log.append(f"acc:{name}:{p.grad is not None}"))
        return h2.sum(), [w1, w2, x]

    observe(build)


def test_hook_that_reads_other_grads_sees_them_like_eager():
    def build(log, step):
        a, b = leaf(3), leaf(3)
        h = (a * 2) * b.exp()
        h.register_hook(lambda g: log.append(("a.grad is None", a.grad is None)))
        b.register_hook(lambda g: log.append(("a.grad at b", a.grad.clone() if a.grad is not None else None)))
        return h.sum() + a.sum(), [a, b]

    observe(build)


def test_hooks_with_aot_eager():
    def build(log, step):
        x = leaf(3, 4)
        h = x.exp()
        h.register_hook(lambda g: log.append(("h", g.clone())) or g * 2)
        x.register_post_accumulate_grad_hook(lambda p: log.append(("acc", p.grad.clone())))
        return (h * x).sum(), [x]

    observe(build, backend="aot_eager")


@pytest.mark.inductor
def test_hooks_with_inductor():
    def build(log, step):
        x = leaf(8, 8)
        h = (x @ x).relu()
        h.register_hook(lambda g: log.append(("h", g.clone())) or g * 2)
        return h.sum(), [x]

    observe(build, backend="inductor")


def test_hook_error_propagates_like_eager():
    def run():
        x = leaf(3)
        y = x * 2
        y.register_hook(lambda g: g[:2])  # wrong shape
        y.sum().backward()

    with pytest.raises(RuntimeError) as eager:
        run()
    with pytest.raises(RuntimeError) as compiled:
        with ca.enable("eager"):
            run()
    assert str(compiled.value) == str(eager.value)


@pytest.mark.inductor
def test_hook_returning_a_tensor_it_keeps_is_not_overwritten_by_the_graph():
    # inductor reuses a dead buffer in place (`buf3 = buf2; del buf2  # reuse`): a
    # hook's result that something else still refers to must not become such a buffer
    kept = torch.ones(16, 16)

    def build(log, step):
        x, w = leaf(16, 16), torch.randn(16, 16)
        h = (x @ w).sin()
        h.register_hook(lambda g: kept)
        x.register_post_accumulate_grad_hook(lambda p: log.append(("kept", kept.clone())))
        return (h * 3).sum(), [x]

    observe(build, backend="inductor")
    assert torch.equal(kept, torch.ones(16, 16))


def test_hooks_run_in_the_backward_calls_dispatch_state():
    # AOTAutograd runs a compiled function's first call under a dispatch mode whose handler
    # calls our op with Conjugate, Negative, ZeroTensor... excluded; a hook run there computed
    # `c.conj()` as `c` (silently, on the first backward)
    def build(log, step):
        x, w = leaf(4, 3), leaf(3, 3)
        z = (x @ w).tanh()

        def hook(g):
            c = torch.complex(g, torch.ones_like(g))
            log.append(("conj", (c.conj() * 1).imag.sum()))
            return (c.conj() * c).real - g * g  # 1 everywhere in eager

        z.register_hook(hook)
        return z.sum(), [x, w]

    observe(build, "aot_eager", background=False)


@pytest.mark.parametrize("backend", ["eager", INDUCTOR])
def test_hook_that_modifies_a_shared_gradient_in_place_raises(backend):
    # AddBackward gives both branches one tensor; a's hook changes it in place, which
    # PyTorch's hooks must not do. Eager's other branch sees the change or not by engine
    # order; inductor computed that branch before the hook (y.grad was wrong, silently).
    # Where the tensor is the hook's alone, changing it in place stays as in eager.
    def run(compiled, step, shared):
        torch.manual_seed(step)
        x, y = leaf(4), leaf(4)
        b = y.cos()
        a = x.sin()
        if shared:
            a.register_hook(lambda g: g.mul_(2))
            out = ((a + b) ** 2).sum()
        else:
            x.register_hook(lambda g: g.mul_(2))
            out = ((a * 3) ** 2).sum() + b.sum()
        if compiled:
            with ca.enable(backend, fullgraph=True, background=False):
                out.backward()
        else:
            out.backward()
        return [x.grad, y.grad]

    for step in range(2):
        assert_grads_equal(run(True, step, False), run(False, step, False), what=f"step {step}", exact=backend in EXACT_BACKENDS)
    s = ca.stats()
    assert (s.captures, s.hits, s.eager_fallbacks) == (1, 1, 0), s
    with pytest.raises(RuntimeError, match="modified a gradient in place"):
        run(True, 0, True)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", INDUCTOR])
def test_hooks_that_return_their_grad_unchanged_cost_no_copy(backend):
    # logging hooks (returning None) on every parameter and on activations: each call gives
    # back its own input, which the graph reads nowhere else, so no copy is made (NOTE
    # [Outputs the graph owns]); with inductor that input's buffer must not be reused for
    # a later result of the same size while the hook's output is still read
    def run(compiled, step):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        seen = []
        for p in model.parameters():
            p.register_hook(lambda g: seen.append(g.sum().item()))
        torch.manual_seed(step)
        x = torch.randn(8, 8)
        h = model[:2](x)
        h.register_hook(lambda g: seen.append(g.sum().item()))
        out = model[2:](h).tanh()

        def backward():
            if compiled:
                with ca.enable(backend, fullgraph=True, background=False):
                    out.backward(torch.ones(8, 8))
            else:
                out.backward(torch.ones(8, 8))

        copies = copies_in(backward)
        return copies, [p.grad for p in model.parameters()], seen

    for step in range(2):
        copies, got, got_seen = run(True, step)
        eager_copies, want, want_seen = run(False, step)
        assert_grads_equal(got, want, what=f"step {step}", exact=backend in EXACT_BACKENDS)
        if backend in EXACT_BACKENDS:
            assert got_seen == want_seen, (got_seen, want_seen)
        else:
            torch.testing.assert_close(got_seen, want_seen, rtol=1e-5, atol=1e-5)
        if step == 1:
            assert copies <= eager_copies, (copies, eager_copies)
    s = ca.stats()
    assert (s.captures, s.hits, s.eager_fallbacks) == (1, 1, 0), s


@pytest.mark.parametrize("backend", ["aot_eager", INDUCTOR])
def test_a_grad_a_hook_keeps_is_not_overwritten_by_the_graph(backend):
    # a logging hook stores the grad it is given (and returns None); a later hook uses it.
    # Inductor wrote later results into that buffer, through the call's input and through
    # its output (the same tensor): both are kept from reuse (NOTE [Outputs the graph owns])
    def build(log, step):
        W = [leaf(8, 8) for _ in range(4)]
        x = leaf(8, 8)
        h, hs = x, []
        for w in W:
            h = torch.tanh(h @ w)
            hs.append(h)
        kept = {}
        hs[2].register_hook(lambda g: kept.__setitem__("g2", g))
        hs[1].register_hook(lambda g: log.append(("g2", kept["g2"].clone())))
        hs[0].register_hook(lambda g: g + kept["g2"])
        return (h * h).sum(), [x] + W

    observe(build, backend=backend, background=False)


@pytest.mark.parametrize("kind", ["leaf", "nonleaf", "retain", "executed"])
def test_grad_with_inputs_runs_the_inputs_tensor_hooks_as_eager(kind):
    # torch.autograd.grad(out, inputs): a captured node that does not run still gets its
    # tensor pre-hooks and retain_grad before the capture; one that runs (h, when x is an
    # input too) is captured before them (the engine's evaluate_function)
    def run(compiled, step):
        torch.manual_seed(step)
        x = leaf(4)
        h = x.exp()
        if kind == "leaf":
            x.register_hook(lambda g: g * 3)
            out, inputs = (x * x).sum(), [x]
        elif kind == "nonleaf":
            h.register_hook(lambda g: g * 3)
            out, inputs = (h * h).sum(), [h]
        elif kind == "retain":
            h.retain_grad()
            out, inputs = (h * h).sum(), [h]
        else:
            h.register_hook(lambda g: g * 3)
            out, inputs = (h * h).sum(), [h, x]
        if compiled:
            with ca.enable("eager", fullgraph=True):
                grads = torch.autograd.grad(out, inputs)
        else:
            grads = torch.autograd.grad(out, inputs)
        return list(grads) + [h.grad]

    for step in range(2):
        got, want = run(True, step), run(False, step)
        assert_grads_equal(got, want, what=f"step {step}", exact=True)
    s = ca.stats()
    assert (s.captures, s.hits, s.eager_fallbacks) == (1, 1, 0), s


@pytest.mark.parametrize("kind", ["leaf_hook", "nonleaf_hook", "retain_grad"])
def test_hook_registered_during_the_backward_on_a_node_without_hooks_raises(kind):
    # eager runs a hook that an earlier hook registers on a node it has not reached; the
    # graph has no call there (it ran the backward without it: x.grad off by 19). Now it
    # raises; a hook added where the node already has hooks of that kind runs with them
    def run(compiled, step):
        torch.manual_seed(step)
        x, w = leaf(4), leaf(4)
        h = x * w
        k = h.exp()
        if kind == "leaf_hook":
            w.register_hook(lambda g: g)  # one there already: a second one is followed

        def hook(g):
            if kind == "leaf_hook":
                w.register_hook(lambda gw: gw * 10)
            elif kind == "nonleaf_hook":
                h.register_hook(lambda gh: gh * 10)
            else:
                h.retain_grad()

        k.register_hook(hook)
        if compiled:
            with ca.enable("eager", fullgraph=True):
                k.sum().backward()
        else:
            k.sum().backward()
        return [x.grad, w.grad, h.grad]

    for step in range(2):
        if kind == "leaf_hook":
            assert_grads_equal(run(True, step), run(False, step), what=f"step {step}", exact=True)
        else:
            with pytest.raises(RuntimeError, match="has not reached"):
                run(True, step)
    s = ca.stats()
    # a graph that raises on its first run is not cached: the raising kinds capture twice
    expected = (1, 1) if kind == "leaf_hook" else (2, 0)
    assert (s.captures, s.hits, s.eager_fallbacks) == (*expected, 0), s


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_hook_that_modifies_the_users_root_grad_in_place_as_eager(backend):
    # nothing else in the graph reads the root grad: the change is followed as in eager,
    # the user's tensor included (it raised as a shared gradient)
    def run(compiled, step):
        torch.manual_seed(step)
        x = leaf(4)
        y = x.exp()
        y.register_hook(lambda g: (g.mul_(2), None)[1])
        g0 = torch.randn(4)
        if compiled:
            with ca.enable(backend, fullgraph=True):
                y.backward(g0)
        else:
            y.backward(g0)
        return [x.grad, g0]

    for step in range(2):
        assert_grads_equal(run(True, step), run(False, step), what=f"step {step}", exact=backend in EXACT_BACKENDS)
    s = ca.stats()
    assert (s.captures, s.hits, s.eager_fallbacks) == (1, 1, 0), s


@pytest.mark.parametrize("root", ["non-leaf", "leaf"])
def test_the_root_runs_its_tensor_hooks_when_it_leads_to_no_input(root):
    # with one root the engine evaluates the root's node whatever `inputs=` says: a node
    # that leads to none of them still runs its tensor hooks and retain_grad (but not
    # itself: a leaf root's AccumulateGrad does not accumulate). Compiled skipped them
    def build(log, step):
        x, z = leaf(3), leaf(3)
        y = x * 2 if root == "non-leaf" else x
        if root == "non-leaf":
            y.retain_grad()
        y.register_hook(lambda g: log.append(("hook", g.clone())))
        return y, [x, z]

    for step in range(2):
        runs = []
        for compiled in (False, True):
            log = []
            torch.manual_seed(step)
            y, (x, z) = build(log, step)
            g = torch.randn(3)
            if compiled:
                with ca.enable("eager", fullgraph=True):
                    y.backward(g, inputs=[z])
            else:
                y.backward(g, inputs=[z])
            runs.append((log, y.grad if root == "non-leaf" else None, x.grad, z.grad))
        (want_log, want_y, want_x, want_z), (log, y_grad, x_grad, z_grad) = runs
        assert [n for n, _ in log] == [n for n, _ in want_log] == ["hook"]
        assert_grads_equal([log[0][1], y_grad], [want_log[0][1], want_y], what=f"step {step}", exact=True)
        assert x_grad is None and want_x is None and z_grad is None and want_z is None
    s = ca.stats()
    assert (s.captures, s.hits, s.eager_fallbacks) == (1, 1, 0), s


@pytest.mark.inductor
def test_hooks_run_in_eagers_order_under_inductor():
    # post-accumulate hooks on every parameter, no data between them: inductor ran a call
    # whose outputs were needed early before the one traced ahead of it (the ORDERED
    # effect's dependency was lost: NOTE [Calls run in eager's order], compile/inductor.py)
    def build(log, step):
        net = nn.Sequential(*[m for _ in range(2) for m in (nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8))])
        for name, p in net.named_parameters():
            p.register_post_accumulate_grad_hook(lambda p, name=name: log.append(name))
        return net(torch.randn(4, 8)).pow(2).mean(), list(net.parameters())

    observe(build, backend="inductor", background=False)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_hook_that_leaks_grad_mode_does_not_change_it_for_the_next_nodes(backend):
    # the engine runs each node in the backward's own thread-local state: a hook that leaves
    # grad mode on (torch.set_grad_enabled(True) as a statement) changes it for its own node
    # only; later hooks see it off again, and the grads they return do not require grad
    def build(log, step):
        x = leaf(3)
        a = x.exp()
        b = a * 2.0
        b.register_hook(lambda g: torch.set_grad_enabled(True) and None)
        a.register_hook(lambda g: log.append(("a", torch.is_grad_enabled(), g.requires_grad)))
        x.register_hook(lambda g: log.append(("x", torch.is_grad_enabled(), g.requires_grad)))
        return b.sum(), [x]

    runs = observe(build, backend)
    assert runs[1][1] == [("a", False, False), ("x", False, False)]
    assert torch.is_grad_enabled()


def test_grad_mode_a_hook_leaves_on_lasts_to_the_end_of_its_node():
    # as in eager: the next hook of the same node sees it (the engine resets it per node)
    def build(log, step):
        x = leaf(4, 3)
        y = x * 2.0
        y.register_hook(lambda g: torch.set_grad_enabled(True) and None)  # MulBackward0's pre-hook
        y.grad_fn.register_hook(lambda gi, go: log.append(("same node", torch.is_grad_enabled())))
        x.register_hook(lambda g: log.append(("next node", torch.is_grad_enabled())))
        return y.exp().sum(), [x]

    runs = observe(build, "aot_eager")
    assert runs[1][1] == [("same node", True), ("next node", False)]
    torch.set_grad_enabled(True)
