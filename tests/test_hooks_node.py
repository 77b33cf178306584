"""Node hooks inside the compiled graph: pre- and post-hooks, modules' full backward hooks,
multi-grad hooks, DDP's C++ hooks, and hooks that block a gradient by returning None (NOTE
[Undefined grads of opaque nodes]). Compared with eager by helpers.observe where they can be.
"""

import warnings

import pytest
import torch
import torch.nn as nn

import compiled_autograd as ca
from helpers import INDUCTOR, assert_grads_equal, compare, grads_of, leaf, observe


def test_node_pre_and_post_hooks():
    def build(log, step):
        a, b = leaf(3), leaf(3)
        y = a * b
        y.grad_fn.register_prehook(lambda gouts: log.append(("pre", gouts[0].clone())) or (gouts[0] * 2,))

        def post(grad_inputs, grad_outputs):
            log.append(("post", grad_inputs[0].clone(), grad_inputs[1].clone(), grad_outputs[0].clone()))
            return (grad_inputs[0] + 1, grad_inputs[1])

        y.grad_fn.register_hook(post)
        return y.pow(2).sum(), [a, b]

    observe(build)


def test_ddp_reducer_cpp_hooks_run_in_the_graph():
    """DDP's reducer registers C++ post hooks on AccumulateGrad and finalizes
    with queue_callback: both must work from inside the compiled graph."""
    import socket

    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed not available")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        ref.load_state_dict(base.state_dict())
        ddp = nn.parallel.DistributedDataParallel(base, bucket_cap_mb=0.0001)
        for step in range(3):
            x = torch.randn(5, 8)
            ref.zero_grad()
            ref(x).pow(2).sum().backward()
            ddp.zero_grad()
            with ca.enable("aot_eager", fullgraph=True):
                ddp(x).pow(2).sum().backward()  # a skipped reducer hook fails the next step
            assert_grads_equal([p.grad for p in base.parameters()], [q.grad for q in ref.parameters()], what=f"step {step}", exact=True)
        s = ca.stats()
        assert (s.captures, s.hits, s.eager_fallbacks) == (1, 2, 0)
    finally:
        dist.destroy_process_group()


# --- hooks that return None for a gradient (NOTE [Undefined grads of opaque nodes]) ---


class _Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return None if g is None else g * 3


def _blockable(step, hook):
    """a's gradient passes through a tensor hook on `ap`; on step 1 a post hook blocks it"""
    a, b = leaf(3), leaf(3)
    ap = _Probe.apply(a)
    ap.register_hook(hook)
    y = ap * b
    y.grad_fn.register_hook(lambda gi, go: (None, gi[1]) if step == 1 else None)
    return (y * 2).sum() + b.sum(), [a, b]


def test_post_hook_returning_none_blocks_that_gradient_and_later_hooks_see_none():
    # the hook blocks a's path on step 1 only: one graph follows both. The tensor hook on the
    # way gets None then, and its None keeps it None; on step 0 the tensor it returns
    # replaces the gradient (the graph has no definedness flag for a tensor hook's result:
    # it is defined as its input was)
    def build(log, step):
        return _blockable(step, lambda g: log.append(("ap hook", g)) or (None if g is None else g * 2))

    runs = observe(build, n_opaque=1)  # Probe: its backward may now see None
    assert runs[1][2][0].grad is None  # step 1: a's only gradient was blocked


def test_a_tensor_hook_giving_a_blocked_gradient_raises_eagers_error():
    def run(compiled, step):
        torch.manual_seed(step)
        loss, leaves = _blockable(step, lambda g: torch.ones(3) if g is None else None)
        if compiled:
            with ca.enable("eager", fullgraph=True):
                loss.backward()
        else:
            loss.backward()
        return [t.grad for t in leaves]

    assert_grads_equal(run(True, 0), run(False, 0), exact=True)
    with pytest.raises(RuntimeError, match="can't replace a None gradient with a non-None value"):
        run(False, 1)
    with pytest.raises(RuntimeError, match="can't replace a None gradient with a non-None value"):
        run(True, 1)
    s = ca.stats()
    assert (s.captures, s.hits, s.eager_fallbacks) == (1, 1, 0), s


@pytest.mark.parametrize("backend", ["aot_eager", INDUCTOR])
def test_a_tensor_hook_on_a_gradient_that_is_none_compiles(backend):
    # the hook's call has no tensor but its flag output (a compiler places a call by its
    # tensors' device: inductor's lowering failed and every backward fell back)
    class NoGradForA(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            return a * 2 + b

        @staticmethod
        def backward(ctx, g):
            return None, g

    def build(log, step):
        x, w = leaf(4, 3), leaf(3)
        y = x.sin()
        y.register_hook(lambda g: log.append(("y", g)))
        return NoGradForA.apply(y, w * 1.0).sum(), [x, w]

    observe(build, backend, background=False)


def test_full_backward_hook_returning_none_blocks_the_module_input_gradient():
    def build(log, step):
        torch.manual_seed(0)
        first, second = nn.Linear(4, 4), nn.Linear(4, 2)
        second.register_full_backward_hook(lambda m, gi, go: log.append(("gi", gi[0])) or (None,))
        x = leaf(3, 4)
        return second(torch.tanh(first(x))).pow(2).sum(), [x, *first.parameters(), *second.parameters()]

    runs = observe(build)
    (_, _, leaves) = runs[1]
    assert all(t.grad is None for t in leaves[:3])  # x and the first layer: blocked
    assert all(t.grad is not None for t in leaves[3:])


def test_pre_hook_returning_none_for_a_grad():
    def build(log, step):
        a, b = leaf(3), leaf(3)
        z = (a * b).sin()
        z.grad_fn.register_prehook(lambda go: (None,) if step == 0 else None)
        return (z + a).sum(), [a, b]

    observe(build)


def test_hook_giving_a_gradient_where_none_was_raises_eagers_error():
    x = leaf(3)
    y = x.exp()
    w = torch.randn(3)  # no grad: MulBackward0's second grad is None
    z = y * w
    z.grad_fn.register_hook(lambda gi, go: (gi[0], torch.ones(3)))
    with pytest.raises(RuntimeError, match="can't replace a None gradient with a non-None value"):
        with ca.enable("eager", fullgraph=True):
            z.sum().backward()


def test_a_blocked_gradient_that_a_formula_turns_into_nan_adds_nothing():
    # sqrt's backward at 0 is 0 / 0: on the zeros standing in for the blocked gradient it is
    # NaN, which summed with x's other gradient would be NaN; eager adds nothing (_sum masks)
    def build(log, step):
        x = torch.tensor([0.0, 4.0 + step], requires_grad=True)
        s = x.sqrt() * 1.0
        s.grad_fn.register_hook(lambda gi, go: (None, None))
        return (s + x * 3).sum(), [x]

    observe(build)


def test_a_blocked_gradient_beside_another_runs_that_node_as_eager():
    # var_mean of one element with correction 1: the var term is 2 / 0 * grad; with grad_var
    # blocked, eager skips the term, zeros would make it NaN: VarMeanBackward0 runs opaquely
    def build(log, step):
        x = leaf(1)
        v, m = torch.var_mean(x, correction=1)
        v2 = v * 1.0
        v2.grad_fn.register_hook(lambda gi, go: (None, None))
        return v2 + m * 3, [x]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # var_mean of one element warns (degrees of freedom <= 0)
        observe(build, n_opaque=1)


@pytest.mark.parametrize("filtered", [False, True])
def test_multi_grad_hook_all_mode_fires_as_eager(filtered):
    # register_multi_grad_hook(mode="all") counts the calls it waits for with
    # torch._C._will_engine_execute_node, asked from inside our graph's run (NOTE [Engine
    # queries from hooks]); it never fired. Under backward(inputs=[x]) c's branch
    # does not run, and eager calls fn with None for it
    def build(log, step):
        x, y = leaf(4), leaf(4)
        a, b, c = x.exp(), x.sin(), y.cos()
        torch.autograd.graph.register_multi_grad_hook(
            (a, b, c), lambda gs: log.append(tuple(g.clone() if g is not None else "none" for g in gs))
        )
        return (a * b).sum() + c.sum(), [x, y]

    def run(step, scope):
        torch.manual_seed(step)
        log = []
        loss, leaves = build(log, step)
        kwargs = {"inputs": [leaves[0]]} if filtered else {}
        with scope:
            loss.backward(**kwargs)
        assert len(log) == 1
        return grads_of(leaves), log

    compare(run, "eager", captures=1, hits=1)
