"""Backwards that must not be captured again: sizes kept on a custom Function's ctx (NOTE
[Sizes kept on ctx]) and the Python state of nodes that run opaquely (NOTE [Opaque nodes keep
their state out of the key]), both in walk/collect.py."""

import functools

import pytest
import torch
import torch.utils.checkpoint as checkpoint

import compiled_autograd as ca
from compiled_autograd.nodes.function import REENTRANT_CHECKPOINT


class ScaleBySize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.shape = x.shape  # a torch.Size on ctx
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * ctx.shape[0]


class MeanOfRows(torch.autograd.Function):
    """An int, a tuple of ints and a numel on ctx, used as sizes and as a divisor."""

    @staticmethod
    def forward(ctx, x):
        ctx.n = x.size(0)
        ctx.shape = tuple(x.shape)
        ctx.numel = x.numel()
        return x.sum(0) / ctx.n

    @staticmethod
    def backward(ctx, g):
        return g.unsqueeze(0).expand(ctx.shape) / ctx.n + ctx.numel * 1e-3


def _steps(fn, make_x, sizes, backend):
    for n in sizes:
        x = make_x(n)
        want = torch.autograd.grad(fn(x).sin().sum(), x)[0]
        y = fn(x).sin().sum()
        with ca.enable(backend, fullgraph=True):
            y.backward()
        assert torch.equal(x.grad, want), f"size {n}"


SIZES = (10, 100, 10, 15, 20, 25)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_size_kept_on_ctx_follows_the_dynamic_shape_policy(backend):
    # static first (10), dynamic when 100 comes (the size on ctx symbolic, as the tensors'),
    # then hits: 10 the static graph, 15, 20 and 25 the dynamic one
    _steps(ScaleBySize.apply, lambda n: torch.randn(n, requires_grad=True), SIZES, backend)
    s = ca.stats()
    assert (s.captures, s.dynamic_captures, s.hits, s.eager_fallbacks, s.opaque_nodes) == (2, 1, 4, 0, 0), s


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_ints_tuples_and_numels_kept_on_ctx_are_sizes(backend):
    _steps(MeanOfRows.apply, lambda n: torch.randn(n, 3, requires_grad=True), SIZES, backend)
    s = ca.stats()
    assert (s.captures, s.dynamic_captures, s.hits, s.eager_fallbacks, s.opaque_nodes) == (2, 1, 4, 0, 0), s


class Threshold(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.n = x.shape[0]
        return x * 1

    @staticmethod
    def backward(ctx, g):
        if ctx.n > 12:  # Python control flow on a size kept on ctx: a guard of the dynamic graph
            return g * 2
        return g * 3


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_size_on_ctx_in_control_flow_crossing_its_threshold(backend):
    # the dynamic graph traced at 20 guards n > 12: 11 and 5 fail it (a miss, another capture
    # with the other branch), never a hit with the wrong branch
    sizes = (10, 20, 30, 11, 5, 40, 12, 13)
    _steps(Threshold.apply, lambda n: torch.randn(n, requires_grad=True), sizes, backend)
    s = ca.stats()
    # static (10); dynamic at 20 (guard n >= 13); 11 fails it: dynamic again (guard n <= 12)
    assert (s.captures, s.dynamic_captures, s.hits, s.eager_fallbacks, s.opaque_nodes) == (3, 2, 5, 0, 0), s


class TellsIntsApart(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.n = x.shape[0]
        return x * 1

    @staticmethod
    def backward(ctx, g):
        # a SymInt is no int: a trace would take the other branch without a guard
        return g * (ctx.n if isinstance(ctx.n, int) else 1) + len(f"{ctx.n}")


def test_a_backward_that_could_tell_a_symint_from_an_int_keeps_its_ints_in_the_key():
    sizes = (10, 100, 15, 20)
    _steps(TellsIntsApart.apply, lambda n: torch.randn(n, requires_grad=True), sizes, "eager")
    s = ca.stats()
    assert (s.captures, s.dynamic_captures, s.hits) == (4, 0, 0), s


class Flag(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mode):
        ctx.mode = mode  # an int that is no size of the node: a constant of the key
        return x * 1

    @staticmethod
    def backward(ctx, g):
        return g * ctx.mode, None


def test_an_int_on_ctx_that_is_no_size_stays_in_the_key():
    for mode in (7, 9, 7):
        x = torch.randn(4, requires_grad=True)
        with ca.enable("eager", fullgraph=True):
            Flag.apply(x, mode).sum().backward()
        assert torch.equal(x.grad, torch.full((4,), float(mode)))
    s = ca.stats()
    assert (s.captures, s.dynamic_captures, s.hits) == (2, 0, 1), s


# -- opaque nodes: their Python state is not in the key ----------------------------------


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))


@pytest.mark.parametrize("closure", ["lambda", "partial", "bound method"])
def test_reentrant_checkpoint_with_a_new_closure_each_step_captures_once(closure):
    block, head = _mlp(), torch.nn.Linear(8, 1)
    params = list(block.parameters()) + list(head.parameters())

    def loss(x):
        if closure == "lambda":
            fn = lambda h: block(h)  # noqa: E731  (a new function object each step)
        elif closure == "partial":  # as Hugging Face's gradient checkpointing passes it
            fn = functools.partial(block.__call__)
        else:
            fn = block.__call__  # (a new bound method object each step)
        return head(checkpoint.checkpoint(fn, x.sin(), use_reentrant=True)).pow(2).sum()

    for step in range(4):
        x = torch.randn(4, 8, requires_grad=True)
        runs = []
        for compiled in (False, True):
            x.grad = None
            for p in params:
                p.grad = None
            y = loss(x)
            if compiled:
                with ca.enable("eager", fullgraph=True):
                    y.backward()
            else:
                y.backward()  # (reentrant checkpointing refuses autograd.grad)
            runs.append([x.grad] + [p.grad for p in params])
        want, got = runs
        assert all(torch.equal(a, b) for a, b in zip(got, want)), f"step {step}"
    s = ca.stats()
    # the outer backward: first in eager, learning how the opaque checkpoint node lays out its
    # grads (NOTE [Layouts of call outputs]), then 1 capture, 2 hits; the backward the
    # checkpoint runs inside it, when it recomputes the block, is compiled too: 1 capture, 3 hits
    assert (s.learning_backwards, s.captures, s.hits, s.eager_fallbacks) == (1, 2, 5, 0), s
    assert s.opaque_details == {f"CheckpointFunctionBackward: {REENTRANT_CHECKPOINT}": 3}, s.opaque_details
    assert s.opaque_reasons == {"reentrant checkpoint": 3}, s.opaque_reasons
