"""Hooks that change what a later backward reads: tensors a Function keeps on ctx (NOTE
[Hooks may change what the graph reads]), ctx attributes rebound, and saved tensors a hook
reads or changes (their version checks; NOTE [Saved tensors freed as eager frees them]).
"""

import pytest
import torch

import compiled_autograd as ca
from helpers import EXACT_BACKENDS, INDUCTOR, assert_grads_equal, leaf, observe


class _KeepsWOnCtx(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, W):
        ctx.W = W  # not save_for_backward: eager does no version check
        return x * W

    @staticmethod
    def backward(ctx, g):
        return g * ctx.W, None


@pytest.mark.parametrize("backend", ["eager", "aot_eager", INDUCTOR])
def test_a_tensor_kept_on_ctx_that_an_earlier_hook_changes(backend):
    # p's post-accumulate hook updates W in place before the Function's backward runs, and
    # eager's backward reads the new W; inductor read the old one (x.grad off by 58). The
    # hook's call returns W, and the Function's traced backward reads it from there (NOTE
    # [Hooks may change what the graph reads]): compiled, and ordered after the hook
    def build(log, step):
        x, p = leaf(16), leaf(16)
        W = torch.randn(16)

        def update(q):
            with torch.no_grad():
                W.add_(q.grad * 0.5)

        p.register_post_accumulate_grad_hook(update)
        return (_KeepsWOnCtx.apply(x, W).exp() * p).sum(), [x, p]

    observe(build, backend=backend, n_opaque=0, background=False)


@pytest.mark.inductor
def test_a_0_dim_tensor_kept_on_ctx_that_an_earlier_hook_changes():
    # passed on like any other: 0-dim tensors are left out only where they may be wrapped
    # numbers (saved variables of built-in nodes: `q * 3`'s 3 reaches a call as a number)
    def build(log, step):
        x, p = leaf(8), leaf(8)
        s = torch.tensor(1.5)

        def update(q):
            with torch.no_grad():
                s.add_(q.grad.sum())

        p.register_post_accumulate_grad_hook(update)
        return (_KeepsWOnCtx.apply(x, s).exp() * p * 3).sum(), [x, p]

    observe(build, backend="inductor", n_opaque=0, background=False)


class _KeepsWAndItsViewOnCtx(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, W):
        ctx.W, ctx.Wt = W, W.t()  # kept on ctx, a view among them: no version check in eager
        return x @ W

    @staticmethod
    def backward(ctx, g):
        return g @ ctx.Wt + ctx.W.diagonal().sum() * g, None


def _user_backend(gm, example_inputs):
    return gm  # a backend we know nothing of: what a call passes on is a copy


@pytest.mark.parametrize("backend", ["eager", "aot_eager", INDUCTOR, _user_backend])
def test_tensors_kept_on_ctx_that_two_hooks_change_between_reads(backend):
    # two post-accumulate hooks scale W in place; eager's first Function backward reads W
    # after the first, the second after both (each read, through the view too, follows the
    # last hook before it; ops that read W before a hook stay before it)
    def build(log, step):
        x, p1, p2 = leaf(4, 4), leaf(4, 4), leaf(4, 4)
        W = torch.randn(4, 4)

        def scale(by):
            def hook(q):
                with torch.no_grad():
                    W.mul_(by).add_(q.grad[0, 0])

            return hook

        p1.register_post_accumulate_grad_hook(scale(2.0))
        p2.register_post_accumulate_grad_hook(scale(-0.5))
        y1 = _KeepsWAndItsViewOnCtx.apply(x, W)
        y2 = _KeepsWAndItsViewOnCtx.apply(y1.tanh() * p2, W)
        return (y2.sin() * p1).sum(), [x, p1, p2]

    observe(build, backend=backend, n_opaque=0, background=False)


class _SavesW(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, W):
        ctx.save_for_backward(W)
        return x * W

    @staticmethod
    def backward(ctx, g):
        (W,) = ctx.saved_tensors
        return g * W, None


@pytest.mark.parametrize("saver", ["function", "built-in"])
def test_a_tensor_kept_on_ctx_and_saved_elsewhere_keeps_its_version_check(saver):
    # W is kept on one Function's ctx and saved by another node; p's hook changes W before
    # the saver runs: eager raises its version-counter error (the ctx reader alone would
    # not check). The tensor stays checked for its saver (compiled returned gradients)
    def run(compiled, step):
        torch.manual_seed(step)
        x, p, z = leaf(8), leaf(8), leaf(8)
        W = torch.randn(8)

        def hook(q):
            if step == 1:
                with torch.no_grad():
                    W.mul_(3)

        p.register_post_accumulate_grad_hook(hook)
        a = _SavesW.apply(z.tanh(), W) if saver == "function" else z.tanh() * W
        loss = ((a + _KeepsWOnCtx.apply(x, W)).exp() * p).sum()
        if compiled:
            with ca.enable("eager", fullgraph=True):
                loss.backward()
        else:
            loss.backward()
        return [x.grad, z.grad]

    assert_grads_equal(run(True, 0), run(False, 0), what="step 0", exact=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(False, 1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(True, 1)
    s = ca.stats()
    assert (s.captures, s.hits, s.opaque_nodes) == (1, 1, 0), s


class _CountsOnCtx(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, c):
        ctx.c = c
        return x * 2

    @staticmethod
    def backward(ctx, g):
        ctx.c.add_(1)  # a backward that changes a tensor it keeps
        return g * 2 + ctx.c[0], None


@pytest.mark.parametrize("backend", ["eager", "aot_eager", INDUCTOR])
def test_a_backward_that_changes_a_tensor_on_its_ctx_runs_in_place(backend):
    # the graph's functional code wrote that change back at the end (aot_eager, inductor)
    # or into a tensor a call had passed on: the hook after it saw the old value and c
    # ended at 10 instead of 11. Such a Function runs as an opaque call
    def build(log, step):
        x, p = leaf(8), leaf(8)
        c = torch.zeros(3)

        def hook(q):
            c.add_(10)

        p.register_post_accumulate_grad_hook(hook)
        y = _CountsOnCtx.apply(x.exp(), c)
        y.register_hook(lambda g: log.append(("c", c.clone())))
        log.append(("result", c))
        return (y * p).sum(), [x, p]

    observe(build, backend=backend, n_opaque=1, background=False)
    assert any("changes in place a tensor it saved or keeps on ctx" in r for r in ca.stats().opaque_details)


class _UsesGradOnCtx(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, G):
        ctx.G = G
        return x * 1

    @staticmethod
    def backward(ctx, g):
        return g * ctx.G, None


@pytest.mark.parametrize("backend", ["eager", INDUCTOR])
def test_a_grad_kept_on_ctx_is_read_after_this_backward_accumulates_into_it(backend):
    # ctx.G is p.grad; eager's AccumulateGrad for p adds into it in place before the
    # Function's backward reads it. No hooks: AccumulateGrad ran after the graph, and the
    # backward read the old grad. It now runs in the graph, at its eager position
    def build(log, step):
        x, p = leaf(8), leaf(8)
        p.grad = torch.randn(8)
        y = _UsesGradOnCtx.apply(x.exp(), p.grad)
        return y.sum() + (p * 3).sum(), [x, p]

    observe(build, backend=backend, background=False)


def test_a_hook_that_rebinds_a_ctx_attribute_raises():
    # eager's backward reads the new ctx.W; the traced one read the old when the backward
    # started. The last call before the node checks the ctx (Plan.ctx_checks) and raises
    def run(compiled, step):
        torch.manual_seed(step)
        x = leaf(8)
        y = _KeepsWOnCtx.apply(x, torch.randn(8))
        node = y.grad_fn
        m = y.exp()
        if step == 1:
            m.register_hook(lambda g: setattr(node, "W", torch.full((8,), 5.0)))
        else:
            m.register_hook(lambda g: None)
        if compiled:
            with ca.enable("eager", fullgraph=True):
                (m * 2).sum().backward()
        else:
            (m * 2).sum().backward()
        return [x.grad]

    assert_grads_equal(run(True, 0), run(False, 0), what="step 0", exact=True)
    run(False, 1)
    with pytest.raises(RuntimeError, match=r"a hook set ctx.W \(which the backward of _KeepsWOnCtxBackward reads\) before that node ran"):
        run(True, 1)
    s = ca.stats()
    assert (s.captures, s.hits) == (1, 1), s


def test_a_leaf_hook_that_reads_a_saved_tensor_gets_a_clear_error_on_a_hit():
    # a known limit (NOTE [Saved tensors freed as eager frees them]): hooks on leaves are not expected to read other
    # nodes' saved tensors, which a hit frees before the graph runs. The first backward
    # works; a hit raises, saying why, rather than eager's "backward through the graph a
    # second time"
    def run():
        x, w = leaf(4, 3), leaf(3, 3)
        b = (x * 2).sin()
        w.register_hook(lambda g: b.grad_fn._saved_self.sum() and None)
        with ca.enable("eager"):
            (b @ w).sum().backward()

    run()
    with pytest.raises(RuntimeError, match="had freed before the hook ran"):
        run()
    s = ca.stats()
    assert (s.captures, s.hits, s.eager_fallbacks) == (1, 1, 0), s


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_hooks_read_the_saved_tensors_eager_still_holds(backend):
    # NOTE [Saved tensors freed as eager frees them]: a hit frees a node's saved tensors
    # after the last hook eager runs at or before that node. A tensor hook on b reads b's
    # node's saved result (alive in eager while b's hooks run), one on c the saved tensors
    # of b's node (not yet run); both must still be there on a hit, with this step's values
    def build(log, step):
        x = leaf(4, 3)
        a = x.sin()
        b = a.exp()  # ExpBackward0 saves its result
        c = b * 3.0
        b.register_hook(lambda g: log.append(("b", b.grad_fn._saved_result.clone())))
        c.register_hook(lambda g: log.append(("c", b.grad_fn._saved_result.sum())))
        return c.pow(2).sum(), [x]

    observe(build, backend)


def test_a_hook_reading_a_node_eager_already_ran_raises_on_a_hit():
    # eager frees ExpBackward0's saved result once it ran, before a's hook: reading it there
    # raises. The first backward (a capture) frees nothing early and gives the hook the
    # tensor; a hit frees it where eager does, and raises
    def run(compiled):
        x = leaf(4, 3)
        a = x.sin()
        b = a.exp()
        a.register_hook(lambda g: b.grad_fn._saved_result.sum() and None)
        b.register_hook(lambda g: None)
        loss = b.pow(2).sum()
        if compiled:
            with ca.enable("eager"):
                loss.backward()
        else:
            loss.backward()

    with pytest.raises(RuntimeError, match="already been freed"):
        run(False)
    run(True)
    with pytest.raises(RuntimeError, match="already been freed"):
        run(True)
    s = ca.stats()
    assert (s.captures, s.hits, s.eager_fallbacks) == (1, 1, 0), s


def test_a_hook_on_a_function_that_saved_nothing_may_read_the_next_nodes_saved_tensors():
    # only modules' full backward hooks (BackwardHookFunction) are taken to read no saved
    # tensor; a hook on another Function that saved nothing (a gradient scaler) may read the
    # saved tensors of a node eager runs after it, which must still be there on a hit
    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1.0

        @staticmethod
        def backward(ctx, g):
            return g * 0.5

    def build(log, step):
        x = leaf(4, 3)
        a = x.sin()  # SinBackward0 saves x
        s = Scale.apply(a)
        s.grad_fn.register_prehook(lambda go: log.append(("saved x", a.grad_fn._saved_self.sum())))
        return s.pow(2).sum(), [x]

    observe(build)


@pytest.mark.parametrize("backend", ["eager", INDUCTOR])
def test_a_hook_that_changes_a_saved_tensor_before_its_node_gets_eagers_error(backend):
    # MulBackward0 of (x * a) saved `a`; k's hook changes `a` in place before that node runs:
    # eager raises its version-counter error there. The first step's hook changes nothing
    # (captured, correct); the second step's, a hit, changes `a` and must raise as eager does
    def run(compiled, step):
        torch.manual_seed(step)
        x, w = leaf(4), leaf(4)
        a = torch.randn(4)
        k = ((x * a) * w).sin()

        def hook(g):
            if step == 1:
                with torch.no_grad():
                    a.add_(1.0)

        k.register_hook(hook)
        if compiled:
            with ca.enable(backend, fullgraph=True, background=False):
                k.sum().backward()
        else:
            k.sum().backward()
        return [x.grad, w.grad]

    assert_grads_equal(run(True, 0), run(False, 0), what="step 0", exact=backend in EXACT_BACKENDS)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(False, 1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run(True, 1)
    s = ca.stats()
    assert (s.captures, s.hits) == (1, 1), s
