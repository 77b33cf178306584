"""torch.compile'd forwards: their AOTAutograd backwards inlined into our graph.

NOTE [Inlining AOTAutograd backwards] (nodes/compiled_region.py). Each test compares with eager autograd on two
different inputs through one cache entry (helpers.parity), eager first: eager's backward
compiles the region's backward itself before ours traces it.
"""

import pytest
import torch

import compiled_autograd as ca
from helpers import tolerance, assert_grads_equal, grads_of, parity


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 4)
    )


def _inlined_ops(entry) -> set:
    return {str(n.target) for n in entry.graph.graph.nodes if n.op == "call_function"}


def test_a_compiled_regions_backward_runs_inside_the_graph():
    model = _mlp()
    compiled = torch.compile(model, backend="aot_eager")
    parity(lambda x: compiled(x).pow(2).sum(), model.parameters(), lambda s: (torch.randn(5, 8),), backend="aot_eager")
    s = ca.stats()
    assert s.opaque_nodes == 0, s.opaque_reasons
    (entry,) = ca.graphs()
    assert not entry.plan.slots  # no opaque call: the region's aten ops are ours
    assert len(entry.plan.accumulate) == len(list(model.parameters()))  # after the graph, as without hooks
    assert "aten.mm.default" in _inlined_ops(entry)


def test_regions_between_eager_ops_and_custom_functions():
    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            return x * w

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g * w, (g * x).sum(0)

    torch.manual_seed(0)
    w1 = torch.randn(6, 6, requires_grad=True)
    w2 = torch.randn(6, requires_grad=True)
    w3 = torch.randn(6, 3, requires_grad=True)
    first = torch.compile(lambda x: torch.tanh(x @ w1), backend="aot_eager")
    second = torch.compile(lambda h: (h @ w3).softmax(-1), backend="aot_eager")

    def loss(x):
        h = first(x.exp())  # an eager op, then a region
        h = Scale.apply(h, w2)  # a custom Function between two regions
        return second(h * 2).log().sum()

    parity(loss, [w1, w2, w3], lambda s: (torch.randn(4, 6),), backend="aot_eager")
    assert ca.stats().opaque_nodes == 0, ca.stats().opaque_reasons


def test_a_dynamic_region_compiles_once_for_new_batch_sizes():
    # a region compiled with dynamic shapes saves its batch size for the backward (ctx.symints):
    # one of our sizes, which a dynamic capture makes symbolic
    model = _mlp()
    model.eval()
    compiled = torch.compile(model, backend="aot_eager", dynamic=True)
    params = list(model.parameters())
    for b in (5, 7, 9, 11):
        x = torch.randn(b, 8)
        runs = []
        for ours in (False, True):
            for p in params:
                p.grad = None
            loss = compiled(x).pow(2).sum()
            if ours:
                with ca.enable("aot_eager"):
                    loss.backward()
            else:
                loss.backward()
            runs.append(grads_of(params))
        assert_grads_equal(runs[1], runs[0], what=f"batch {b}", exact=True)
    s = ca.stats()
    assert (s.captures, s.dynamic_captures, s.hits, s.opaque_nodes) == (2, 1, 2, 0), s


def test_create_graph_runs_a_region_as_is():
    # AOTAutograd has no double backward: under create_graph its backward runs as is (an opaque
    # node), and the create_graph graph runs as traced, in grad mode (NOTE [create_graph with an
    # opaque node]; before: the whole backward in eager)
    torch.manual_seed(0)
    w = torch.randn(5, 5, requires_grad=True)
    region = torch.compile(lambda x: (x @ w).sin(), backend="aot_eager")
    for step in range(2):
        x = torch.randn(3, 5)
        (want,) = torch.autograd.grad(region(x).sum(), w, create_graph=True)
        with ca.enable("aot_eager"):
            (got,) = torch.autograd.grad(region(x).sum(), w, create_graph=True)
        assert_grads_equal([got], [want], what=f"step {step}", exact=True)
        assert got.requires_grad == want.requires_grad
    s = ca.stats()
    assert (s.captures, s.hits, s.eager_fallbacks) == (1, 1, 0), s


@pytest.mark.inductor
def test_an_inductor_compiled_region():
    # inductor's forward: its partitioner's backward, with the view-to-reshape rewrite. The
    # reference runs the region's backward with inductor's fused kernels, our aot_eager graph
    # runs that backward graph with eager's kernels: equal within inductor's rounding only
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    compiled = torch.compile(model, backend="inductor")
    parity(
        lambda x: compiled(x.view(2, 5, 8)).pow(2).sum(),
        model.parameters(),
        lambda s: (torch.randn(10, 8),),
        backend="aot_eager",
        **tolerance("inductor"),
    )
    assert ca.stats().opaque_nodes == 0, ca.stats().opaque_reasons


def test_a_region_under_autocast():
    # forward and backward under autocast: the region's backward runs with the dtypes its joint
    # trace made explicit (AOTAutograd turns autocast off around it), the eager nodes with autocast
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    compiled = torch.compile(model, backend="aot_eager")

    def loss(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return (compiled(x) * x[:, :4]).float().pow(2).sum()

    def backward_under_autocast(fn):
        def run(*args):
            out = fn(*args)
            real = out.backward

            def backward(*a, **k):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    real(*a, **k)

            out.backward = backward
            return out

        return run

    parity(backward_under_autocast(loss), model.parameters(), lambda s: (torch.randn(5, 8),), backend="aot_eager")
    assert ca.stats().opaque_nodes == 0, ca.stats().opaque_reasons


def test_regions_with_buffers_mutated_and_outputs_unused_or_not_differentiable():
    # BatchNorm in train mode updates its running stats in the forward (mutated inputs, returned
    # by the region without grads); a second output the loss ignores gets a zero grad; an
    # integer output is not differentiable
    torch.manual_seed(0)
    conv, bn = torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4)

    def region(x):
        h = torch.relu(bn(conv(x)))
        return h, h.mean(dim=(2, 3)), h.flatten(1).argmax(-1)

    compiled = torch.compile(region, backend="aot_eager")

    def loss(x):
        h, unused, index = compiled(x)
        return h.pow(2).mean() + index.float().sum() * 0

    params = [*conv.parameters(), *bn.parameters()]
    parity(loss, params, lambda s: (torch.randn(2, 3, 8, 8),), backend="aot_eager")
    assert ca.stats().opaque_nodes == 0, ca.stats().opaque_reasons


def test_a_region_whose_backward_graph_has_as_strided_runs_as_is():
    # as_strided reads its input's layout, which our graph's compiler may choose differently
    torch.manual_seed(0)
    w = torch.randn(4, 4, requires_grad=True)
    region = torch.compile(lambda x: (x @ w).as_strided((2, 2), (1, 2)).exp(), backend="aot_eager")
    for step in range(2):
        x = torch.randn(4, 4)
        w.grad = None
        region(x).sum().backward()
        want = w.grad.clone()
        w.grad = None
        with ca.enable("aot_eager"):
            region(x).sum().backward()
        assert_grads_equal([w.grad], [want], what=f"step {step}", exact=True)
    s = ca.stats()
    assert (s.captures, s.hits, s.eager_fallbacks) == (1, 1, 0), s
    assert any("as_strided" in r for r in s.opaque_details), s.opaque_details


def test_retain_graph_through_a_region_with_donated_buffers_raises_as_eager():
    # found by the fuzzer: AOTAutograd's backward may reuse the memory of tensors saved for it
    # (donated buffers), so eager refuses retain_graph through such a region; ours ran its
    # inlined backward, which reads them without reusing, and did not raise
    torch.manual_seed(0)
    w = torch.randn(5, 5, requires_grad=True)
    region = torch.compile(lambda x, b: ((x @ w).sin() * b).cos(), backend="aot_eager")
    region(torch.randn(2, 5), torch.randn(2, 5)).sum().backward()  # (its dynamic recompile donates)
    x = torch.randn(3, 5), torch.randn(3, 5)
    with pytest.raises(RuntimeError, match="donated buffers") as want:
        region(*x).sum().backward(retain_graph=True)
    with ca.enable("aot_eager"):
        with pytest.raises(RuntimeError, match="donated buffers") as got:
            region(*x).sum().backward(retain_graph=True)
    assert str(got.value) == str(want.value)
    # without retain_graph, the region's backward is inlined
    w.grad = None
    parity(lambda x, b: region(x, b).sum(), [w], lambda s: (torch.randn(3, 5), torch.randn(3, 5)), backend="aot_eager")


def test_a_region_with_donated_buffers_runs_as_is_without_retain_graph():
    # a region run opaquely inside our graph runs in a graph task of ours, which kept its
    # graph: its backward refused the donated buffers that eager's (retain_graph=False) runs
    # with (NOTE in graph_task.py's in_graph_task)
    torch.manual_seed(0)
    w = torch.randn(5, 5, requires_grad=True)
    region = torch.compile(lambda x, b: ((x @ w).sin() * b).cos(), backend="aot_eager")
    region(torch.randn(2, 5), torch.randn(2, 5)).sum().backward()  # (its dynamic recompile donates)
    w.grad = None
    parity(
        lambda x, b: region(x, b).sum(),
        [w],
        lambda s: (torch.randn(3, 5), torch.randn(3, 5)),
        backend="aot_eager",
        steps=3,
        captures=None,
        opaque=("CompiledFunctionBackward",),
    )
    s = ca.stats()
    assert (s.learning_backwards, s.captures, s.hits, s.eager_fallbacks) == (1, 1, 1, 0), s
    assert s.opaque_nodes == 2, s
