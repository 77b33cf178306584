"""Python state a custom Function's backward reads (NOTE [Python state a backward reads]):
globals, lists, modules and values on ctx, global and closure tensors (NOTE [Tensors a
backward reads from globals and closures]), hooks that rebind them, and Functions whose ctx
values change every step (NOTE [Functions whose values change every step])."""

import contextlib
import warnings

import pytest
import torch
from torch.autograd.function import once_differentiable

import compiled_autograd as ca
from helpers import assert_grads_equal, leaf


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
                with pytest.raises(
                    RuntimeError,
                    match=f"a hook set {'_KERNEL' if what == 'tensor' else '_SCALE'} "
                    rf"\(which the backward of {fn.__name__}Backward reads\) before that node ran",
                ):
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
        assert (s.learning_backwards, s.captures, s.hits, s.opaque_nodes, s.eager_fallbacks) == (
            learning,
            1,
            2 - learning,
            3 - learning,
            0,
        ), s
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
