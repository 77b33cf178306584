"""Custom autograd.Functions traced into the graph: saved tensors and ctx attributes (and what
of them is in the cache key), outputs, non-differentiable and unmaterialized grads,
once_differentiable, untraceable backwards run opaquely, lifted tensors without data, and
in-place updates of views (CopySlices). Compared with eager by helpers.observe."""

import numpy as np
import pytest
import torch
from torch.autograd.function import once_differentiable

import compiled_autograd as ca
from helpers import leaf, observe


class Scale(torch.autograd.Function):
    """save_for_backward, non-tensor ctx attributes, a tensor stored on ctx."""

    @staticmethod
    def forward(ctx, x, w, k):
        ctx.save_for_backward(x, w)
        ctx.k = k
        ctx.shape = x.shape
        ctx.extra = x.detach() * 2  # a tensor stored directly on ctx
        return x * w * k

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = g * w * ctx.k + ctx.extra * 0.01 if ctx.needs_input_grad[0] else None
        gw = g * x * ctx.k if ctx.needs_input_grad[1] else None
        return gx, gw, None


def test_function_with_saved_tensors_and_ctx_attributes():
    def build(log, step):
        x, w = leaf(3, 4), leaf(4)
        return Scale.apply(x, w, 2.5).sum(), [x, w]

    observe(build)


def test_function_ctx_constant_is_in_the_key():
    x, w = leaf(3), leaf(3)
    for k in (2.0, 3.0, 2.0):
        with ca.enable("eager", fullgraph=True):
            Scale.apply(x, w, k).sum().backward()
    assert (ca.stats().captures, ca.stats().hits) == (2, 1)
    torch.testing.assert_close(w.grad, x.detach() * 7.0)


def test_function_needs_input_grad_is_in_the_key():
    x = leaf(3)
    for w in (leaf(3), torch.randn(3), leaf(3)):
        w.grad = None
        with ca.enable("eager", fullgraph=True):
            Scale.apply(x, w, 2.0).sum().backward()
    assert (ca.stats().captures, ca.stats().hits) == (2, 1)


class _UnusedOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, n):
        return x * 2, x.new_zeros(n, x.shape[0])

    @staticmethod
    def backward(ctx, gy, gaux):
        # gaux: zeros shaped like the unused output (PyNode materializes it), then summed
        # back to x's shape by the engine
        return gy * 2 + gaux.sum(0) + gaux.shape[0], None


class _NOutputs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, n):
        return tuple(x * 1 for _ in range(n))

    @staticmethod
    def backward(ctx, *gs):
        return gs[0] * len(gs), None


@pytest.mark.parametrize("fn", [_UnusedOutput, _NOutputs])
def test_function_outputs_are_in_the_key(fn):
    # an unused output has no edge whose metadata would key it; the trace bakes in its
    # shape (the zeros standing in for its grad) and how many grads the backward takes: a
    # capture with n=1 was hit with n=4 (wrong grads). Sizes vary past the static graphs,
    # so the later ones run a dynamic graph, whose zeros are shaped symbolically
    for n in (1, 4, 5, 6, 7, 4):
        x = leaf(3)
        with ca.enable("eager", fullgraph=True):
            fn.apply(x, n)[0].sum().backward()
        want = 2.0 + n if fn is _UnusedOutput else float(n)
        torch.testing.assert_close(x.grad, torch.full((3,), want), msg=f"n={n}")
    s = ca.stats()
    if fn is _UnusedOutput:
        # n=1 static; from n=4 one dynamic graph, whose zeros take n as a symbol, serves the rest
        assert (s.captures, s.dynamic_captures, s.hits, s.eager_fallbacks) == (2, 1, 4, 0), s
    else:
        # the number of outputs is structure: a graph per n, the repeated n=4 hits
        assert (s.captures, s.hits, s.eager_fallbacks) == (5, 1, 0), s


class _DivByCtx(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x / k

    @staticmethod
    def backward(ctx, g):
        return g / ctx.k, None


def test_a_signed_zero_on_ctx_is_in_the_key():
    # -0.0 == 0.0 (same hash): keyed by value, a backward dividing by ctx.k hit the graph
    # traced with the other sign (inf where eager gives -inf)
    for k in (0.0, -0.0, 0.0, -0.0):
        x = leaf(3)
        with ca.enable("eager", fullgraph=True):
            _DivByCtx.apply(x, k).sum().backward()
        assert torch.equal(x.grad, torch.full((3,), -float("inf") if str(k).startswith("-") else float("inf"))), k
    assert (ca.stats().captures, ca.stats().hits) == (2, 2)


class SplitNonDiff(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        idx = x.argmax(-1)
        ctx.mark_non_differentiable(idx)
        ctx.save_for_backward(x)
        return x.sin(), idx

    @staticmethod
    def backward(ctx, g, gidx):
        (x,) = ctx.saved_tensors
        return g * x.cos()


def test_mark_non_differentiable():
    def build(log, step):
        x = leaf(3, 4)
        y, idx = SplitNonDiff.apply(x)
        return (y * idx.float().unsqueeze(-1)).sum(), [x]

    observe(build)


class NoMaterialize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        return x.clone(), x.clone()

    @staticmethod
    def backward(ctx, g1, g2):
        out = torch.zeros_like(g1 if g1 is not None else g2)
        if g1 is not None:
            out = out + g1
        if g2 is not None:
            out = out + 2 * g2
        return out


def test_set_materialize_grads_false_and_unused_output():
    def build(log, step):
        x = leaf(4)
        a, b = NoMaterialize.apply(x)
        return a.sum() * 3, [x]  # b unused: its grad is None in backward

    observe(build)


class OnceDiff(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.exp()

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.exp()


class CallsAutogradOps(torch.autograd.Function):
    """A backward that itself runs autograd-recorded ops (under no_grad in backward)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return torch.nn.functional.linear(x, w)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x


def test_once_differentiable_and_backward_with_ops():
    def build(log, step):
        x, w = leaf(2, 3), leaf(5, 3)
        return (OnceDiff.apply(x).sum() + CallsAutogradOps.apply(x, w).pow(2).sum()), [x, w]

    observe(build)


class ReturnsNone(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        return a * 2 + b

    @staticmethod
    def backward(ctx, g):
        return g * 2, None  # b requires grad, but gets None


def test_backward_returning_none_for_an_input_leaves_grad_none():
    def build(log, step):
        a, b = leaf(3), leaf(3)
        return ReturnsNone.apply(a, b).sum(), [a, b]

    observe(build)


class DataDependent(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        scale = float(x.abs().max().item())  # data-dependent: cannot be traced
        return g * 2 * (1.0 + 0.0 * scale)


class ReturnsKept(torch.autograd.Function):
    """An untraceable backward whose gradient is a tensor the user keeps."""

    @staticmethod
    def forward(ctx, x, kept):
        ctx.kept = kept
        return x * 1

    @staticmethod
    def backward(ctx, g):
        assert g.abs().sum().item() >= 0  # data-dependent: runs opaquely
        return ctx.kept, None


@pytest.mark.inductor
def test_opaque_node_returning_a_tensor_it_keeps_is_not_overwritten_by_the_graph():
    # NOTE [Outputs the graph owns]: inductor would reuse the node's output buffer in place
    kept = torch.ones(16, 16)

    def build(log, step):
        a = leaf(16, 16)
        y = ReturnsKept.apply(a.sin(), kept)
        return (y * 3).sum(), [a]

    observe(build, backend="inductor", n_opaque=1, steps=3, learning=1)
    assert torch.equal(kept, torch.ones(16, 16))


class NumpyBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 3

    @staticmethod
    def backward(ctx, g):
        return torch.from_numpy(np.asarray(g.numpy()) * 3)


class NoneIfSmall(torch.autograd.Function):
    """Opaque, and returns None at replay only for some values."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a)
        return a + b

    @staticmethod
    def backward(ctx, g):
        (a,) = ctx.saved_tensors
        if a.sum().item() > 0:
            return g, g
        return g, None


def test_untraceable_backwards_run_opaquely_and_correctly():
    def build(log, step):
        x = leaf(3)
        y = DataDependent.apply(x.sin()) + NumpyBackward.apply(x.cos())
        return (y * x).sum(), [x]

    # the first backward learns the opaque nodes' output layouts in eager (NOTE [Nodes made
    # opaque by their trace])
    observe(build, n_opaque=2, steps=3, learning=1)
    assert any("DataDependentBackward" in r for r in ca.stats().opaque_details)


def test_opaque_node_returning_none_keeps_grad_none():
    a = torch.ones(3, requires_grad=True)
    b = torch.ones(3, requires_grad=True)
    for sign in (1.0, 1.0, -1.0):  # (the first learns its output layouts in eager)
        with torch.no_grad():
            a.fill_(sign)
        a.grad = b.grad = None
        with ca.enable("eager", fullgraph=True):
            NoneIfSmall.apply(a, b).sum().backward()
        torch.testing.assert_close(a.grad, torch.ones(3))
        if sign > 0:
            torch.testing.assert_close(b.grad, torch.ones(3))
        else:
            assert b.grad is None  # as in eager: the opaque node returned None
    s = ca.stats()
    assert (s.learning_backwards, s.captures, s.hits, s.opaque_nodes) == (1, 1, 1, 2)


def test_mark_opaque_by_node_name():
    def build(log, step):
        x = leaf(3, 4)
        return (x.exp() * x.sin()).sum(), [x]

    observe(build, n_opaque=1, opaque=("ExpBackward0",), steps=3, learning=1)


class _SavesAZeroTensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x, torch._efficientzerotensor(x.shape))  # no data
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        x, z = ctx.saved_tensors
        return g * x.cos() + z * 3


class _KeepsAMetaTensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.like = torch.empty(x.shape, device="meta")  # its shape only
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * 2 + g.new_zeros(ctx.like.shape)


def test_a_function_keeping_a_tensor_without_data_runs_opaquely():
    # NOTE [Lifted tensors without data]: a graph traced on such a tensor's fake reads it as an
    # ordinary tensor, and a compiled kernel would read through a null pointer
    def build(log, step):
        x = leaf(4)
        return (_SavesAZeroTensor.apply(x.sin()) * _KeepsAMetaTensor.apply(x)).sum(), [x]

    # the first backward learns the opaque nodes' output layouts in eager (NOTE [Layouts of call outputs])
    observe(build, n_opaque=2, steps=3, learning=1)
    reasons = ca.stats().opaque_details
    assert reasons["_SavesAZeroTensorBackward: a lifted tensor without data"] == 2, reasons
    assert reasons["_KeepsAMetaTensorBackward: a meta tensor among the lifted tensors"] == 2, reasons


# -- in-place updates of views (CopySlices) --------------------------------------


def test_inplace_updates_of_views():
    def build(log, step):
        x, w = leaf(4, 6), leaf(6)
        z = x * 1
        z[:, 1:3] = z[:, 1:3] * 2
        z[0].mul_(w)
        z[z.detach() > 0.5] += 1
        return z.pow(2).sum(), [x, w]

    observe(build)


def test_functions_under_aot_eager_and_hooks_together():
    def build(log, step):
        x, w = leaf(3, 4), leaf(4)
        y = Scale.apply(x, w, 1.5)
        y.register_hook(lambda g: log.append(("y", g.clone())) or g * 2)
        return (y.sin() + DataDependent.apply(y)).sum(), [x, w]

    # Scale keeps a tensor on ctx (no version check) and y's hook runs before it: its
    # backward reads that tensor as the hook's call returns it, ordered after the hook (NOTE
    # [Hooks may change what the graph reads]); DataDependent's backward is opaque
    observe(build, backend="aot_eager", n_opaque=1, steps=3, learning=1)
    assert not any(r.startswith("ScaleBackward") for r in ca.stats().opaque_details)


class SavesNone(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias):
        ctx.save_for_backward(x, None, bias)
        return x * 3 if bias is None else x * 3 + bias

    @staticmethod
    def backward(ctx, g):
        x, nothing, bias = ctx.saved_tensors
        assert nothing is None
        return g * 3, (g if bias is not None else None)


def test_function_saving_none_is_traced():
    def build(log, step):
        x = leaf(3)
        return SavesNone.apply(x, None).pow(2).sum(), [x]

    observe(build)
