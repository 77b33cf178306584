"""Custom autograd.Functions, saved-tensor hooks, checkpointing, in-place views."""

import contextlib
import warnings

import numpy as np
import pytest
import torch
import torch.utils.checkpoint as checkpoint
from torch.autograd.function import once_differentiable

import compiled_autograd as ca
from helpers import assert_grads_equal, grads_of, leaf, observe


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


def test_opaque_node_returning_a_tensor_it_keeps_is_not_overwritten_by_the_graph():
    # NOTE [Outputs the graph owns]: inductor would reuse the node's output buffer in place
    kept = torch.ones(16, 16)

    def build(log, step):
        a = leaf(16, 16)
        y = ReturnsKept.apply(a.sin(), kept)
        return (y * 3).sum(), [a]

    observe(build, backend="inductor", n_opaque=1)
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

    observe(build, n_opaque=2)
    assert any("DataDependentBackward" in r for r in ca.stats().opaque_details)


def test_opaque_node_returning_none_keeps_grad_none():
    a = torch.ones(3, requires_grad=True)
    b = torch.ones(3, requires_grad=True)
    for sign in (1.0, -1.0):
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
    assert (s.captures, s.hits, s.opaque_nodes) == (1, 1, 2)


def test_mark_opaque_by_node_name():
    def build(log, step):
        x = leaf(3, 4)
        return (x.exp() * x.sin()).sum(), [x]

    observe(build, n_opaque=1, opaque=("ExpBackward0",), steps=3, learning=1)


# -- saved tensor hooks and checkpointing ---------------------------------------


def test_saved_tensors_hooks():
    def build(log, step):
        def pack(t):
            log.append(("pack", tuple(t.shape)))
            return t * 1

        def unpack(t):
            log.append(("unpack", tuple(t.shape)))
            return t

        x = leaf(3, 4)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            y = (x.exp() * x).sum()
        return y, [x]

    observe(build, steps=3, learning=1)
    # what a user's hook returns is not known before it runs: the first backward runs in eager
    # and learns it (NOTE [Unpack metadata learned from the last backward]); the capture and
    # the hit unpack each when its node runs
    explained = ca.explain()
    assert "saved-tensor hooks: 3 tensors unpacked in the graph, each when its node runs (as in eager)" in explained
    assert "learning_backwards=1" in explained and "unpacked when the backward started" not in explained


def test_each_hooked_tensor_is_unpacked_by_position():
    # a user's unpack hook returning shared tensors: [T1, T1, T2, T3] then [T1, T2, T2, T3].
    # Each is unpacked by its own call in the graph (not lifted and wired by identity), so
    # the second backward hits the first's graph and reads what its hooks return
    table = [torch.randn(3) for _ in range(3)]
    order = [[0, 0, 1, 2], [0, 1, 1, 2], [2, 1, 0, 0]]  # (the first backward learns, in eager)

    def build(log, step):
        a, b, c = leaf(3), leaf(3), leaf(3)
        positions = iter(range(4))
        with torch.autograd.graph.saved_tensors_hooks(lambda t: next(positions), lambda i: table[order[step][i]]):
            y = (a * b) * c  # saves a, b, then a * b, c
        return y.sum(), [a, b, c]

    observe(build, steps=3, learning=1)


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


def test_an_unpack_hook_returning_a_sparse_tensor_falls_back():
    # a tensor we cannot lift: the backward runs in eager, counted (the internal error escaped)
    def run(step, compiled):
        torch.manual_seed(step)
        x, w = leaf(4, 3), leaf(3, 3)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach().to_sparse() if t.shape == (3, 3) else t, lambda t: t):
            loss = (x @ w).tanh().sum()
        with ca.enable("aot_eager") if compiled else contextlib.nullcontext():
            loss.backward()
        return [x.grad, w.grad]

    for step in range(3):
        assert_grads_equal(run(step, True), run(step, False), what=f"step {step}", exact=True)
    s = ca.stats()
    # the first backward learns (in eager) that the hook returns what cannot be predicted; the
    # next ones unpack it up front, and cannot lift it
    assert (s.captures, s.learning_backwards, s.eager_fallbacks) == (0, 1, 2), s
    assert s.fallback_details["saved-tensor hook returned a non-strided lifted tensor"] == 2
    assert s.fallback_reasons["unliftable tensor"] == 2


def test_a_packed_tensor_of_another_shape_is_not_predicted_from_the_last():
    # index_fill saves its index; its length changes where nothing else in the graph does.
    # A hook that packs a tensor shows its shape, which keys what was learned (NOTE [Unpack
    # metadata learned from the last backward]): each length gets its own prediction
    def build(log, step):
        x = leaf(5, 3)
        idx = torch.arange([2, 3, 3, 2, 2, 3][step])
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
            y = ((x * 2).index_fill(0, idx, 1.0) ** 2).sum()
        return y, [x]

    observe(build, steps=6, captures=2, learning=2)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_checkpointed_region_is_recomputed_when_the_backward_reaches_it(backend):
    # NOTE [Unpacking in the graph]: the recompute runs at the region's first node, after
    # the hooks of the nodes before it, as in eager; not when the backward starts
    def build(log, step):
        x, w = leaf(4, 8), leaf(8, 8)

        def block(h):
            log.append("recompute" if torch._C._current_graph_task_id() != -1 else "forward")
            return (h @ w).tanh() @ w

        h = x.sin()
        y = checkpoint.checkpoint(block, h, use_reentrant=False)
        z = checkpoint.checkpoint(block, y, use_reentrant=False)
        y.register_hook(lambda g: log.append("y's grad") or g)
        z.register_hook(lambda g: log.append("z's grad") or g)
        return z.pow(2).sum(), [x, w]

    # the first backward learns the recomputed tensors' layouts in eager (NOTE [Layouts of call outputs])
    runs = observe(build, backend=backend, steps=3, learning=1)
    assert runs[-1][1] == ["forward", "forward", "z's grad", "recompute", "y's grad", "recompute"]
    assert "saved-tensor hooks: 10 tensors unpacked in the graph" in ca.explain()


def test_save_on_cpu():
    def build(log, step):
        x, w = leaf(3, 4), leaf(4, 5)
        with torch.autograd.graph.save_on_cpu():
            y = (x @ w).tanh().sum()
        return y, [x, w]

    observe(build)
    # x and w (for x @ w), the tanh's output
    assert "saved-tensor hooks: 3 tensors unpacked in the graph" in ca.explain()


def test_checkpoint_without_its_determinism_check_is_learned():
    # without the recorded metadata, what the recomputation returns is not known beforehand:
    # the first backward runs in eager and learns it, later ones unpack in the graph
    def build(log, step):
        x, w = leaf(2, 4), leaf(4, 4)
        y = checkpoint.checkpoint(lambda a: (a @ w).relu(), x, use_reentrant=False, determinism_check="none")
        return y.pow(2).sum(), [x, w]

    observe(build, steps=3, learning=1)
    assert "saved-tensor hooks: 3 tensors unpacked in the graph" in ca.explain()


def _stash_hooks():
    """An offloading-style pair: the packed value is a key into the hook's own stash."""
    stash = {}

    def pack(t):
        stash[len(stash)] = t.detach().clone()
        return len(stash) - 1

    return stash, pack, stash.pop


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_hook_that_changes_a_stashed_tensor_before_its_node_is_seen(backend):
    # NOTE [Unpack metadata learned from the last backward]: the stashed tensor is unpacked
    # when its node runs, after the tensor hook of the node before it changed it:
    # ExpBackward0's grad uses the doubled result, as in eager (the first backward learns in
    # eager, the second is a capture, the third a hit)
    def build(log, step):
        stash, pack, unpack = _stash_hooks()
        x = leaf(3, 4)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            a = x.exp()  # ExpBackward0 saves its result: stash[0]
        b = a * 2.0
        b.register_hook(lambda g: stash[0].mul_(2.0).sum() and None)
        log.append(len(stash))
        return b.sum(), [x]

    observe(build, backend, steps=3, learning=1)


def test_an_unpack_hook_returning_other_metadata_than_it_learned_raises():
    # the hit's graph was traced with what the hook returned the first time (float32); a
    # hook that then returns float64 cannot be followed mid-graph: a clear error, and from
    # the next backward on that tensor is unpacked up front again (a new capture)
    def run(compiled, dtype):
        torch.manual_seed(0)
        stash, pack, unpack = _stash_hooks()
        x = leaf(3, 4)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda k: unpack(k).to(dtype)):
            y = x.exp().sum()
        if compiled:
            with ca.enable("eager"):
                y.backward()
        else:
            y.backward()
        return x.grad

    for _ in range(2):  # the first learns, in eager; the second is the capture
        assert_grads_equal([run(True, torch.float32)], [run(False, torch.float32)], exact=True)
    want = run(False, torch.float64)  # eager: a float64 grad, cast back to x's dtype
    with pytest.raises(RuntimeError, match="the previous backward of this graph got"):
        run(True, torch.float64)
    assert_grads_equal([run(True, torch.float64)], [want], exact=True)
    assert_grads_equal([run(True, torch.float64)], [want], exact=True)
    s = ca.stats()
    assert (s.captures, s.hits, s.eager_fallbacks, s.learning_backwards) == (2, 2, 0, 1), s


def _sparse_w_stash():
    """A popping stash whose (3, 3) tensor comes back sparse: unpredictable, so unpacked when
    the backward starts (after the first backward learned that), and a lifted sparse tensor
    falls back to eager."""
    stash, calls = {}, []

    def pack(t):
        stash[len(stash)] = t.detach().to_sparse() if t.shape == (3, 3) else t.detach().clone()
        return len(stash) - 1

    def unpack(k):
        calls.append(k)
        return stash.pop(k)

    return stash, calls, pack, unpack


def _popped_once(seed, compiled, make_hooks, **options):
    """x @ w, tanh, under popping hooks (`make_hooks()`: stash, calls, pack, unpack): each of the
    3 saved tensors unpacked once, as in eager; the grads."""
    torch.manual_seed(seed)
    x, w = leaf(4, 3), leaf(3, 3)
    stash, calls, pack, unpack = make_hooks()
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss = (x @ w).tanh().sum()
    with ca.enable("aot_eager", **options) if compiled else contextlib.nullcontext():
        loss.backward()
    assert sorted(calls) == [0, 1, 2] and not stash
    return [x.grad, w.grad]


def test_a_fallback_after_unpacking_up_front_does_not_unpack_again():
    # NOTE [Handing unpacked tensors to their saved variables]: the sparse tensor is unpacked
    # when the backward starts, and the fallback's engine would run its popping hook a second
    # time (KeyError); it gets the tensor already unpacked, the other hooks run once as in eager
    for seed in range(3):
        assert_grads_equal(_popped_once(seed, True, _sparse_w_stash), _popped_once(seed, False, _sparse_w_stash), what=f"seed {seed}", exact=True)
    s = ca.stats()
    assert (s.learning_backwards, s.eager_fallbacks) == (1, 2), s


def test_an_opaque_node_with_a_popping_hook_runs_it_once():
    # the first backward learns in eager (each hook once, at its node), the second the opaque
    # node's output layouts (NOTE [Layouts of call outputs]); then the opaque TanhBackward0
    # runs its own apply, which unpacks its saved result itself
    def hooks():
        stash, pack, pop = _stash_hooks()
        calls = []
        return stash, calls, pack, lambda k: calls.append(k) or pop(k)

    for seed in range(4):
        got = _popped_once(seed, True, hooks, opaque=("TanhBackward0",))
        assert_grads_equal(got, _popped_once(seed, False, hooks), what=f"seed {seed}", exact=True)
    s = ca.stats()
    assert (s.learning_backwards, s.captures, s.hits, s.eager_fallbacks, s.opaque_nodes) == (2, 1, 1, 0, 2), s


def test_retain_graph_runs_the_unpack_hooks_again_on_the_next_backward():
    # what collect unpacked (or learned through) serves its backward only: with retain_graph
    # the user's hooks are back for the next one (eager runs them once per backward); without,
    # the graph is freed. Seed 0's first backward learns in eager; seed 1's unpacks the sparse
    # tensor up front and falls back
    for seed in range(2):
        torch.manual_seed(seed)
        x, w = leaf(4, 3), leaf(3, 3)
        stash, calls, pack, _ = _sparse_w_stash()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda k: calls.append(k) or stash[k]):
            loss = (x @ w).tanh().sum()
        with ca.enable("aot_eager"):
            loss.backward(retain_graph=True)
        assert sorted(calls) == [0, 1, 2]
        loss.backward(retain_graph=True)  # eager
        assert len(calls) == 6
        with ca.enable("aot_eager"):
            loss.backward()
        assert len(calls) == 9
        want = torch.autograd.grad((x @ w).tanh().sum(), [x, w])  # (no hooks)
        torch.testing.assert_close(x.grad, 3 * want[0])
        torch.testing.assert_close(w.grad, 3 * want[1])
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            loss.backward()
    s = ca.stats()
    assert (s.learning_backwards, s.eager_fallbacks) == (1, 3), s


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_checkpoint_with_retain_graph_recomputes_for_each_backward(backend):
    calls = []

    def block(a, w):
        calls.append(1)
        return (a @ w).tanh() @ w

    x, w = leaf(4, 8), leaf(8, 8)
    for step in range(2):  # one cache entry, two inputs
        with torch.no_grad():
            x.copy_(torch.randn(4, 8))
        grads = []
        for compiled in (False, True):
            x.grad = w.grad = None
            loss = checkpoint.checkpoint(block, x, w, use_reentrant=False).pow(2).sum()
            with ca.enable(backend, fullgraph=True) if compiled else contextlib.nullcontext():
                loss.backward(retain_graph=True)
                loss.backward()
            grads.append(grads_of([x, w]))
        assert_grads_equal(grads[1], grads[0], what=f"step {step}", exact=True)
    assert len(calls) == 2 * 2 * 3  # steps x (eager, compiled) x (forward, two recomputes)
    s = ca.stats()
    # the first backward learns the layouts in eager (retaining the graph), the second captures
    assert (s.learning_backwards, s.captures, s.hits, s.eager_fallbacks) == (1, 1, 2, 0)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_selective_checkpoint_with_dropout(backend):
    # selective checkpointing (mm saved, the rest recomputed) and dropout, whose mask the
    # recompute reproduces from the RNG state checkpoint stashed: unpacked in the graph
    import functools

    def policy(ctx, op, *args, **kwargs):
        if op == torch.ops.aten.mm.default:
            return checkpoint.CheckpointPolicy.MUST_SAVE
        return checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

    def build(log, step):
        x, w = leaf(4, 8), leaf(8, 8)

        def block(a):
            return torch.nn.functional.dropout((a @ w).tanh(), 0.3, training=True) @ w

        selective = functools.partial(checkpoint.create_selective_checkpoint_contexts, policy)
        y = checkpoint.checkpoint(block, x, use_reentrant=False, context_fn=selective)
        z = checkpoint.checkpoint(block, y, use_reentrant=False)
        return z.pow(2).sum(), [x, w]

    observe(build, backend=backend, steps=3, learning=1)
    assert "saved-tensor hooks: 12 tensors unpacked in the graph" in ca.explain()


def test_checkpointed_node_marked_opaque_unpacks_by_itself():
    # an opaque node runs its own apply, which calls the unpack hook: no unpack call for it
    def build(log, step):
        x, w = leaf(2, 4), leaf(4, 4)
        y = checkpoint.checkpoint(lambda a: (a @ w).exp() @ w, x, use_reentrant=False)
        return y.pow(2).sum(), [x, w]

    # the first backward learns the recomputed tensors' layouts in eager, the second the opaque
    # node's output layouts (NOTE [Layouts of call outputs]); then a capture and a hit
    observe(build, n_opaque=1, opaque=("ExpBackward0",), steps=4, learning=2)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpoint_recomputes_during_backward(use_reentrant):
    calls = []

    def block(x, w):
        calls.append(1)
        return (x @ w).relu() @ w.t()

    def build(log, step):
        x, w = leaf(2, 4), leaf(4, 4)
        n0 = len(calls)
        y = checkpoint.checkpoint(block, x, w, use_reentrant=use_reentrant)
        log.append(("forward calls", len(calls) - n0))
        return y.pow(2).sum(), [x, w]

    n_before = len(calls)
    if use_reentrant:
        # the checkpoint node runs opaquely; the backward it starts inside is compiled too.
        # The outer graph's first backward learns its output layouts in eager (the inner one
        # captures), the second captures (the inner one hits), the third hits both
        observe(build, n_opaque=1, steps=3, captures=2, hits=3, learning=1)
    else:
        observe(build, steps=3, learning=1)
        # unpacked in the graph, each when its node runs: x and w (for x @ w), the relu's
        # output (for relu), the relu's output and w.t() (for ... @ w.t())
        assert "saved-tensor hooks: 5 tensors unpacked in the graph" in ca.explain()
    # every backward (eager and compiled, 3 steps) re-ran the block once
    assert len(calls) - n_before == 3 * 2 * 2  # steps x (eager, compiled) x (forward, recompute)


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
    observe(build, backend="aot_eager", n_opaque=1)
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


class _Clone(torch.autograd.Function):
    """Subclassed by the Functions below, which differ in their backward only."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()


_SCALE = 1.0
_SCALES = [1.0]


class _GlobalScale(_Clone):
    @staticmethod
    def backward(ctx, g):
        return g * _SCALE  # a global number: keyed by value


class _GlobalListScale(_Clone):
    @staticmethod
    def backward(ctx, g):
        return g * _SCALES[0]  # a global list: state a trace would freeze


class _ModuleScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, m):
        ctx.m = m  # its attributes are not keyed
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.m.scale, None


class _CtxScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale  # keyed by value: compiled, one graph per value
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


@pytest.mark.parametrize("kind", ["global", "list", "module", "ctx"])
def test_a_backward_that_reads_python_state_sees_its_current_value(kind):
    # a gradient-reversal scale annealed between steps: read from a global list or from a
    # module kept on ctx, a trace froze the first step's value into the graph and every hit
    # used it (NOTE [Python state a backward reads]); such a Function runs opaquely. A global
    # number, or a value kept on ctx, is keyed by value and stays compiled
    global _SCALE
    holder = torch.nn.Module()

    def apply(x):
        if kind == "global":
            return _GlobalScale.apply(x)
        if kind == "list":
            return _GlobalListScale.apply(x)
        if kind == "module":
            return _ModuleScale.apply(x, holder)
        return _CtxScale.apply(x, _SCALE)

    # an opaque Function's graph first learns its output layouts in eager (NOTE [Layouts of
    # call outputs]): its capture is at the second step, so the value changes after it
    for step, scale in enumerate([1.0, 1.0, 3.0, 3.0]):
        _SCALE = _SCALES[0] = holder.scale = scale
        x = leaf(4)
        apply(x).sum().backward()
        want, x.grad = x.grad, None
        loss = apply(x).sum()
        with ca.enable("eager", fullgraph=True):
            loss.backward()
        assert_grads_equal([x.grad], [want], what=f"step {step}", exact=True)
    s = ca.stats()
    assert s.eager_fallbacks == 0, s.fallback_reasons
    if kind in ("ctx", "global"):
        assert (s.captures, s.hits, s.opaque_nodes, s.learning_backwards) == (2, 2, 0, 0), s
    else:
        assert s.opaque_nodes == 3 and (s.captures, s.hits, s.learning_backwards) == (1, 2, 1), s
        # "node: reason", the node named once
        (reason,) = s.opaque_details
        name = {"global": "_GlobalScaleBackward", "list": "_GlobalListScaleBackward", "module": "_ModuleScaleBackward"}[kind]
        assert reason.startswith(f"{name}: ") and reason.count(name) == 1, reason


_KERNEL = torch.tensor([1.0, 2.0, 3.0, 4.0])
_WEIGHT = torch.tensor([0.5, -1.0, 2.0, 1.5], requires_grad=True)


class _GlobalTensor(_Clone):
    @staticmethod
    def backward(ctx, g):
        return g * _KERNEL  # a global tensor: lifted, read at every backward


class _GlobalTensorOnce(_Clone):
    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        return g * _KERNEL  # read by the function the decorator's wrapper holds in its closure


def _times_kernel(g):
    return g * _KERNEL


class _GlobalTensorInHelper(_Clone):
    @staticmethod
    def backward(ctx, g):
        return _times_kernel(g)  # read in a function it calls through a global: state


class _GlobalTensorChanged(_Clone):
    @staticmethod
    def backward(ctx, g):
        _KERNEL.add_(1.0)  # a running count kept in a global tensor
        return g * _KERNEL


class _GlobalParameter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        return g * _WEIGHT  # differentiable under create_graph, as in eager


_CALLS = 0


class _CountsCalls(_Clone):
    @staticmethod
    def backward(ctx, g):
        global _CALLS
        _CALLS += 1  # a trace would run it once and a hit never
        return g * _KERNEL


def test_a_backward_that_writes_a_global_runs_opaquely():
    for step in range(3):
        x = leaf(4)
        before = _CALLS
        _CountsCalls.apply(x).sum().backward()
        want, x.grad = x.grad, None
        loss = _CountsCalls.apply(x).sum()
        with ca.enable("eager"):
            loss.backward()
        assert_grads_equal([x.grad], [want], exact=True)
        assert _CALLS == before + 2, step
    s = ca.stats()
    # the first backward learns the opaque node's output layouts in eager (NOTE [Layouts of call outputs])
    assert (s.learning_backwards, s.captures, s.hits, s.opaque_nodes) == (1, 1, 1, 2), s
    (reason,) = s.opaque_details
    assert "a write to global _CALLS" in reason, reason


def _closure_function(t):
    class _ClosureTensor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return g * t

    return _ClosureTensor


def _rebind(kind, fn, value):
    global _KERNEL
    if kind == "closure":
        cell = fn.backward.__closure__[fn.backward.__code__.co_freevars.index("t")]
        cell.cell_contents = value
    else:
        _KERNEL = value


@pytest.mark.parametrize("kind", ["global", "once_differentiable", "closure"])
def test_a_backward_reading_a_global_or_closure_tensor_is_compiled_and_sees_its_current_value(kind):
    # NOTE [Tensors a backward reads from globals and closures]: such a Function ran opaquely;
    # now the tensor is a graph input, read again at every backward: changed in place between
    # steps, or rebound to another tensor, the hit uses what is there now
    saved = _KERNEL
    try:
        fn = {"global": _GlobalTensor, "once_differentiable": _GlobalTensorOnce}.get(kind) or _closure_function(_KERNEL.clone())
        for step in range(3):
            if step == 1:
                _rebind(kind, fn, torch.tensor([-1.0, 0.5, 4.0, 2.0]))
            if step == 2:  # in place
                (fn.backward.__closure__[0].cell_contents if kind == "closure" else _KERNEL).mul_(3.0)
            x = leaf(4)
            (fn.apply(x.sin()) * 2).sum().backward()
            want, x.grad = x.grad, None
            loss = (fn.apply(x.sin()) * 2).sum()
            with ca.enable("eager", fullgraph=True):
                loss.backward()
            assert_grads_equal([x.grad], [want], what=f"step {step}", exact=True)
        s = ca.stats()
        assert (s.captures, s.hits, s.opaque_nodes, s.eager_fallbacks) == (1, 2, 0, 0), s
    finally:
        _rebind("global", None, saved)


def test_a_global_tensor_changed_by_a_hook_before_the_node_runs():
    # eager's backward reads the tensor when its node runs, after the hook on y's consumer
    saved = _KERNEL.clone()
    try:
        for step in range(2):
            x = leaf(4)
            outs = []
            for compiled in (False, True):
                _KERNEL.copy_(saved)
                x.grad = None
                y = _GlobalTensor.apply(x.sin())
                z = y * 2
                z.register_hook(lambda g: (_KERNEL.mul_(10.0), None)[1])
                with ca.enable("aot_eager", fullgraph=True) if compiled else contextlib.nullcontext():
                    z.sum().backward()
                outs.append(x.grad)
            assert_grads_equal([outs[1]], [outs[0]], what=f"step {step}", exact=True)
        s = ca.stats()
        assert (s.captures, s.hits, s.opaque_nodes) == (1, 1, 0), s
    finally:
        _KERNEL.copy_(saved)


class _BothBackwardAndVjp(_Clone):
    @staticmethod
    def backward(ctx, g):
        return g * _KERNEL

    @staticmethod
    def vjp(ctx, g):
        return g * _KERNEL


def test_a_global_tensor_reading_function_with_backward_and_vjp_gets_eagers_error():
    # the trace calls a copy of the user's function, not node.apply: eager's check comes first
    for compiled in (False, True):
        x = leaf(4)
        with ca.enable("eager") if compiled else contextlib.nullcontext():
            with pytest.raises(RuntimeError, match="Implementing both 'backward' and 'vjp'"):
                _BothBackwardAndVjp.apply(x).sum().backward()


@pytest.mark.parametrize("what", ["tensor", "number"])
def test_a_hook_that_rebinds_a_global_the_backward_reads_raises(what):
    # eager's backward reads the new binding when its node runs; the graph read the old one
    # when the backward started: the last call before the node checks (Plan.ctx_checks)
    global _KERNEL, _SCALE
    saved = _KERNEL, _SCALE
    fn = _GlobalTensor if what == "tensor" else _GlobalScale

    def rebind(g):
        global _KERNEL, _SCALE
        if what == "tensor":
            _KERNEL = torch.full((4,), 7.0)
        else:
            _SCALE = 7.0

    try:
        for step in range(3):
            _KERNEL, _SCALE = saved
            x = leaf(4)
            z = fn.apply(x.sin()) * 2
            z.register_hook(rebind if step == 2 else (lambda g: None))
            with ca.enable("eager", fullgraph=True):
                if step < 2:
                    z.sum().backward()
                    continue
                with pytest.raises(RuntimeError, match=f"a hook set {'_KERNEL' if what == 'tensor' else '_SCALE'} "
                                   rf"\(which the backward of {fn.__name__}Backward reads\) before that node ran"):
                    z.sum().backward()
        s = ca.stats()
        assert (s.captures, s.hits) == (1, 2), s
    finally:
        _KERNEL, _SCALE = saved


@pytest.mark.parametrize("fn", [_GlobalTensorInHelper, _GlobalTensorChanged])
def test_a_global_tensor_a_trace_cannot_swap_runs_opaquely(fn):
    # read by another function than the backward (through a global), or changed in place by
    # the backward (a compiler's functional code would write it back only at the end)
    saved = _KERNEL.clone()
    try:
        for step in range(3):
            x = leaf(4)
            outs = []
            for compiled in (False, True):
                _KERNEL.copy_(saved + step)
                x.grad = None
                loss = fn.apply(x.sin()).sum()
                with ca.enable("eager") if compiled else contextlib.nullcontext():
                    loss.backward()
                outs.append([x.grad, _KERNEL.clone()])
            assert_grads_equal(outs[1], outs[0], what=f"step {step}", exact=True)
        s = ca.stats()
        # (where the node is known opaque before the trace, the first backward learns its
        # output layouts in eager: NOTE [Layouts of call outputs])
        learning = 1 if fn is _GlobalTensorInHelper else 0
        assert (s.learning_backwards, s.captures, s.hits, s.opaque_nodes, s.eager_fallbacks) == (learning, 1, 2 - learning, 3 - learning, 0), s
        (reason,) = s.opaque_details
        assert ("_times_kernel" in reason) if fn is _GlobalTensorInHelper else ("changes in place" in reason), reason
    finally:
        _KERNEL.copy_(saved)


def test_a_global_tensor_that_requires_grad_under_create_graph():
    for step in range(2):
        outs = []
        x = leaf(4)
        for compiled in (False, True):
            _WEIGHT.grad = x.grad = None
            with ca.enable("eager", fullgraph=True) if compiled else contextlib.nullcontext():
                (gx,) = torch.autograd.grad(_GlobalParameter.apply(x).pow(2).sum(), x, create_graph=True)
                (gx * (step + 1)).sum().backward()
            outs.append([gx.detach(), x.grad, _WEIGHT.grad])
        assert_grads_equal(outs[1], outs[0], what=f"step {step}", exact=True)
    s = ca.stats()
    # the graph and its vjp's graph, each captured once and hit once
    assert (s.captures, s.hits, s.opaque_nodes, s.eager_fallbacks) == (2, 2, 0, 0), s


class _ReverseGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lam):
        ctx.lam = lam
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -ctx.lam * g, None


def test_a_function_whose_ctx_value_changes_every_step_stops_being_recaptured():
    # NOTE [Functions whose values change every step]: a gradient-reversal layer whose lambda
    # is annealed every step was a capture (and a compile) per backward, for ever
    from compiled_autograd.nodes.function import CHURN_LIMIT

    w = leaf(4, 4)
    steps = CHURN_LIMIT + 5
    for step in range(steps):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        lam = 0.05 * step + 0.01
        w.grad = None
        (_ReverseGrad.apply(x @ w, lam).tanh().sum() + (x @ w).pow(2).sum()).backward()
        want, w.grad = w.grad, None
        loss = _ReverseGrad.apply(x @ w, lam).tanh().sum() + (x @ w).pow(2).sum()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with ca.enable("eager", fullgraph=True):
                loss.backward()
        assert_grads_equal([w.grad], [want], what=f"step {step}", exact=True)
        assert any("changed in more than" in str(c.message) for c in caught) == (step == CHURN_LIMIT), step
    s = ca.stats()
    # one capture per value up to the limit and past it; then, with the Function opaque, a
    # backward in eager that learns its output layouts (NOTE [Layouts of call outputs]), a
    # capture, then hits
    assert (s.captures, s.learning_backwards, s.hits) == (CHURN_LIMIT + 2, 1, steps - CHURN_LIMIT - 3), s
    (reason,) = s.opaque_details
    assert reason.startswith("_ReverseGradBackward: its ctx values") and s.opaque_nodes == steps - CHURN_LIMIT - 2, s


def test_a_function_applied_with_many_fixed_values_stays_compiled():
    # twelve layers, each with its own fixed scale: one set of values per graph, not churn
    from compiled_autograd.nodes.function import CHURN_LIMIT

    w = leaf(4, 4)
    scales = [0.1 * (i + 1) for i in range(CHURN_LIMIT + 4)]

    def loss_of(x):
        h = x @ w
        for k in scales:
            h = _ReverseGrad.apply(h, k).sin()
        return h.sum()

    for step in range(3):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        w.grad = None
        loss_of(x).backward()
        want, w.grad = w.grad, None
        loss = loss_of(x)
        with ca.enable("eager", fullgraph=True):
            loss.backward()
        assert_grads_equal([w.grad], [want], what=f"step {step}", exact=True)
    s = ca.stats()
    assert (s.captures, s.hits, s.opaque_nodes) == (1, 2, 0), s


@pytest.mark.parametrize("retain", [True, False])
def test_an_error_in_the_learning_backward_is_the_users_and_runs_nothing_twice(retain):
    # the first backward with a user unpack hook runs in eager (it learns); a hook raising in it
    # must raise as in eager: the backward was run a second time from the start (w2's grad
    # doubled, every unpack hook run again)
    def run(compiled):
        torch.manual_seed(0)
        w1, w2, x = leaf(4, 4), leaf(4, 4), torch.randn(3, 4)
        unpacks, fail = [], [True]
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach().clone(), lambda t: unpacks.append(1) or t):
            h = (x @ w1).tanh()
            loss = (h @ w2).sin().sum()

        def flaky(g):  # runs after w2's grad was accumulated
            if fail.pop():
                raise RuntimeError("transient failure")

        h.register_hook(flaky)
        with pytest.raises(RuntimeError, match="transient failure"):
            with ca.enable("aot_eager") if compiled else contextlib.nullcontext():
                loss.backward(retain_graph=retain)
        return len(unpacks), w2.grad.clone()

    (n_eager, g_eager), (n_ours, g_ours) = run(False), run(True)
    assert n_ours == n_eager
    assert_grads_equal([g_ours], [g_eager], exact=True)
    s = ca.stats()
    assert (s.captures, s.hits, s.eager_fallbacks) == (0, 0, 0), s


def test_a_learning_backward_through_nodes_that_free_their_saved_variables():
    # a Foreach node's release destroys its saved variables themselves (it clears their vector):
    # putting back hooks there read freed memory (a segfault once the vector was large)
    def run(compiled, seed, n=40):
        torch.manual_seed(seed)
        xs, ys = [leaf(2) for _ in range(n)], [leaf(2) for _ in range(n)]
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t * 1, lambda t: t + 0):
            loss = torch.stack(torch._foreach_mul(xs, ys)).sum()
        with ca.enable("aot_eager") if compiled else contextlib.nullcontext():
            loss.backward()
        return [torch.stack([x.grad for x in xs])]

    # 3000: a vector large enough to be unmapped when freed (the learning backward only: a
    # capture of 6000 unpack calls takes minutes)
    assert_grads_equal(run(True, 0, n=3000), run(False, 0, n=3000), exact=True)
    for seed in range(3):  # a smaller graph: learns in eager, then a capture, then a hit
        assert_grads_equal(run(True, seed), run(False, seed), what=f"seed {seed}", exact=True)
    s = ca.stats()
    assert (s.learning_backwards, s.captures, s.hits, s.eager_fallbacks) == (2, 1, 1, 0), s


def test_an_opaque_custom_function_with_a_popping_hook_unpacks_once():
    # collecting a custom Function reads its saved_tensors (runs the user's unpack hooks); an
    # opaque one (reentrant checkpoint) then runs its own backward, which read them again
    # (KeyError). What the hooks returned is handed to its saved variables instead
    def run(compiled):
        stash, n = {}, [0]

        def pack(t):
            stash[len(stash) + n[0]] = t.detach().clone()
            return len(stash) + n[0] - 1

        def unpack(k):
            n[0] += 1
            return stash.pop(k)

        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        out = []
        for step in range(3):
            x = torch.randn(4, 6, requires_grad=True)
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                h = checkpoint.checkpoint(lambda a: m[1](m[0](a)), x, use_reentrant=True)
                loss = m[2](h).pow(2).sum()
            m.zero_grad()
            with ca.enable("aot_eager") if compiled else contextlib.nullcontext():
                loss.backward()
            out += [n[0], m[0].weight.grad.clone(), x.grad.clone()]
        return out

    want, got = run(False), run(True)
    for i, (g, w) in enumerate(zip(got, want)):
        if isinstance(w, int):
            assert g == w, (i, g, w)
        else:
            assert_grads_equal([g], [w], what=f"output {i}", exact=True)
    s = ca.stats()  # (the checkpoint's inner backward is compiled too: one more graph)
    assert s.eager_fallbacks == 0 and s.learning_backwards >= 1 and s.hits >= 1, s


def test_a_hook_whose_result_changes_raises_once():
    # NOTE [Unpack metadata learned from the last backward]: the unpack hook switches to float64
    # after two steps; the graph traced with float32 raises once, and the next backward learns
    # again every tensor of that graph (not one raise per hooked tensor)
    double = [False]

    def run(compiled):
        torch.manual_seed(0)
        w = leaf(4, 3)
        outcome = []
        for step in range(6):
            double[0] = step >= 2
            x = torch.randn(4, 3)
            with torch.autograd.graph.saved_tensors_hooks(
                lambda t: t.detach().clone(), lambda t: t.double() if double[0] else t
            ):
                loss = (x * w).exp().sin().sum()  # 3 hooked saved tensors
            w.grad = None
            try:
                with ca.enable("aot_eager") if compiled else contextlib.nullcontext():
                    loss.backward()
                outcome.append(w.grad.clone())
            except RuntimeError as e:
                assert "the previous backward of this graph got" in str(e)
                outcome.append("raised")
        return outcome

    want, got = run(False), run(True)
    assert got.count("raised") == 1 and got[2] == "raised", got
    s = ca.stats()  # learn, capture, raise (a hit); learn again, capture, hit
    assert (s.learning_backwards, s.captures, s.hits, s.eager_fallbacks) == (2, 2, 2, 0), s
    for step, (g, w) in enumerate(zip(got, want)):
        if not isinstance(g, str):
            assert_grads_equal([g], [w], what=f"step {step}", exact=True)


def _bf16_offload():
    return torch.autograd.graph.saved_tensors_hooks(
        lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t,
        lambda t: t.float() if t.dtype == torch.bfloat16 else t,
    )


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_offloading_hooks_on_a_stream_of_sizes_learn_at_two_sizes_only(backend):
    # NOTE [Unpack metadata learned from the last backward]: an offloading hook pair returns a
    # tensor of the packed one's shape; seen to hold at two batch sizes, that rule predicts
    # every other size: no eager learning backward per new size, a dynamic graph from the fourth
    sizes = [3, 5, 7, 4, 9, 6]

    def build(log, step):
        torch.manual_seed(0)
        w = leaf(6, 8)
        b = leaf(8)
        torch.manual_seed(step)
        x = torch.randn(sizes[step], 6)
        with _bf16_offload():
            loss = torch.tanh(x @ w + b).pow(2).sum()
        return loss, [w, b]

    observe(build, backend, steps=len(sizes), captures=2, learning=2)
    assert ca.stats().dynamic_captures == 1


def test_a_hook_whose_packed_value_hides_the_shape_learns_at_every_size():
    # the rule needs the one packed tensor of the unpacked one's shape: a hook that packs a
    # flattened tensor (and the shape beside it) gives none, so each new size learns again
    sizes = [3, 5, 7]

    def build(log, step):
        torch.manual_seed(0)
        w = leaf(6, 8)
        torch.manual_seed(step)
        x = torch.randn(sizes[step], 6)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (t.flatten(), t.shape), lambda p: p[0].view(p[1])):
            loss = torch.tanh(x @ w).pow(2).sum()
        return loss, [w]

    observe(build, steps=len(sizes), captures=0, learning=3)


class _ScaleByKeptTensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.w = w  # a tensor on ctx: lifted, at a position that depends on the graph
        return x * w

    @staticmethod
    def backward(ctx, g):
        return g * ctx.w, None


def test_a_function_in_many_graphs_with_the_same_values_stays_compiled():
    # NOTE [Functions whose values change every step]: what is counted is its values, not the
    # positions its ctx tensors are lifted at, which change with the graph around it
    from compiled_autograd.nodes.function import CHURN_LIMIT

    w, k = leaf(4), torch.randn(4)
    for depth in range(CHURN_LIMIT + 3):  # a new graph each, the Function's tensor lifted elsewhere
        for seed in range(2):  # the second a hit
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
            extra = [leaf(4) for _ in range(depth)]

            def loss():
                h = x * w
                for e in extra:
                    h = h * e
                return _ScaleByKeptTensor.apply(h, k).sin().sum()

            w.grad = None
            loss().backward()
            want, w.grad = w.grad, None
            l = loss()
            with ca.enable("eager", fullgraph=True):
                l.backward()
            assert_grads_equal([w.grad], [want], what=f"depth {depth} seed {seed}", exact=True)
    s = ca.stats()
    assert (s.captures, s.hits, s.opaque_nodes) == (CHURN_LIMIT + 3, CHURN_LIMIT + 3, 0), s
