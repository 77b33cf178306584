"""Dynamic shapes: one symbolic capture serves many sizes; guards never let a
graph run on sizes it was not valid for."""

import math
import random

import pytest
import torch
import torch.nn as nn

import compiled_autograd as ca
from helpers import INDUCTOR, assert_grads_equal, parity


def stream(model, shapes, backend="eager", **options):
    """helpers.parity over a stream of input shapes, one step each: every grad equals eager's,
    no fallback; the other counters (returned) are the test's to check."""

    def inputs(i):
        torch.manual_seed(i)
        return (torch.randn(*shapes[i]),)

    parity(lambda x: model(x).float().pow(2).mean(), model.parameters(), inputs, backend, steps=len(shapes), captures=None, **options)
    return ca.stats()


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))


def transformer():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True, norm_first=True)
    return nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)


def shuffled(n, low, high, seed=0):
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(n)]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_mlp_many_batch_sizes_two_captures(backend):
    shapes = [(b, 16) for b in [7] + shuffled(9, 3, 64)]
    s = stream(mlp(), shapes, backend)
    assert (s.captures, s.dynamic_captures) == (2, 1)
    assert s.hits == len(shapes) - 2


@pytest.mark.slow
def test_transformer_batch_and_sequence_two_captures():
    rng = random.Random(1)
    shapes = [(rng.randint(3, 64), rng.randint(5, 128), 16) for _ in range(8)]
    s = stream(transformer(), shapes, "aot_eager")
    assert (s.captures, s.dynamic_captures) == (2, 1)


def test_cnn_image_sizes():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 5),
    )
    shapes = [(2, 3, 16, 16), (3, 3, 20, 12), (3, 3, 9, 17), (2, 3, 32, 32), (4, 3, 11, 11)]
    s = stream(model, shapes, "eager")
    assert (s.captures, s.dynamic_captures) == (2, 1)


def test_dynamic_true_captures_symbolic_from_the_start():
    s = stream(mlp(), [(5, 16), (9, 16), (33, 16)], "eager", dynamic=True)
    assert (s.captures, s.dynamic_captures, s.hits) == (1, 1, 2)


def test_dynamic_false_keeps_every_size_static():
    s = stream(mlp(), [(5, 16), (9, 16), (33, 16), (9, 16)], "eager", dynamic=False)
    assert (s.captures, s.dynamic_captures, s.hits) == (3, 0, 1)


def test_only_the_sizes_that_changed_become_symbolic():
    stream(mlp(), [(5, 16), (9, 16)], "eager")
    (dyn,) = [e for e in ca.graphs() if e.dynamic is not None]
    static = [e for e in ca.graphs() if e.dynamic is None][0]
    # symbolic exactly where the batch (5 -> 9) showed: dims, numels, saved sizes
    assert dyn.dynamic.mask == tuple(a != b for a, b in zip(static.sizes, dyn.sizes))
    assert 0 < sum(dyn.dynamic.mask) < len(dyn.sizes)
    assert "symbolic sizes" in ca.explain()


def test_a_size_outside_the_guards_is_a_miss_not_a_wrong_graph():
    # 0/1 specialization: the dynamic graph assumes a batch of at least 2
    s = stream(mlp(), [(5, 16), (9, 16), (1, 16), (12, 16), (1, 16)], "eager")
    assert s.captures == 3  # static 5, dynamic, and batch 1 on its own
    assert s.hits == 2


def test_view_sizes_saved_by_nodes_follow_the_batch():
    # ViewBackward / SumBackward save sizes: the symbolic trace must use them
    w = torch.randn(12, 6, requires_grad=True)

    class M(nn.Module):
        def parameters(self):
            return iter([w])

        def forward(self, x):
            b = x.shape[0]
            h = (x.view(b, 3, 4) * 2).sum(1)  # view + sum(dim)
            return h.view(b * 4, 1).expand(b * 4, 6) * w[:4].repeat(b, 1)

    s = stream(M(), [(2, 12), (5, 12), (7, 12), (3, 12)], "eager")
    assert (s.captures, s.dynamic_captures) == (2, 1)


@pytest.mark.inductor
def test_dynamic_with_inductor():
    shapes = [(b, 16) for b in (6, 11, 40, 3)]
    s = stream(mlp(), shapes, "inductor")
    assert (s.captures, s.dynamic_captures) == (2, 1)


def _graph_symbols(entry, tensors_only=False):
    syms = set()
    for n in entry.graph.graph.nodes:
        if n.op != "placeholder":
            continue
        v = n.meta.get("val")
        vals = (
            [v]
            if isinstance(v, torch.SymInt) and not tensors_only
            else (list(v.shape) + list(v.stride()) + [v.storage_offset()] if isinstance(v, torch.Tensor) else [])
        )
        for x in vals:
            if isinstance(x, torch.SymInt):
                syms |= x.node.expr.free_symbols
    return syms


def test_equal_sizes_share_one_symbol():
    # NOTE [One symbol per size class]: the batch dim of every saved tensor and
    # every saved size equal to it is one symbol, not one per position
    s = stream(mlp(), [(5, 16), (9, 16), (14, 16)], "eager")
    assert (s.captures, s.dynamic_captures, s.hits) == (2, 1, 1)
    (dyn,) = [e for e in ca.graphs() if e.dynamic is not None]
    assert sum(dyn.dynamic.mask) > 5
    # the lifted tensors' batch dims: one symbol (a saved numel, 4 * batch, is its own)
    assert len(_graph_symbols(dyn, tensors_only=True)) == 1, _graph_symbols(dyn)
    assert len(_graph_symbols(dyn)) <= 2, _graph_symbols(dyn)


def test_sizes_equal_by_coincidence_split_when_they_differ():
    # batch == features in both first backwards (8/8 then 12/12): one class, one
    # symbol and an equality guard; the next backward breaks the guard, which
    # is a miss (a new dynamic capture), never a graph run on the wrong sizes
    torch.manual_seed(0)
    w = torch.randn(4, requires_grad=True)

    class M(nn.Module):
        def parameters(self):
            return iter([w])

        def forward(self, x):  # x: (b, n); saves x (b, n, 1) and the sizes (b, n, 4)
            return (x.unsqueeze(-1) * w).sum(1)

    s = stream(M(), [(8, 8), (12, 12), (10, 14), (6, 17), (12, 12)], "eager")
    assert s.dynamic_captures == 2 and s.captures == 3
    first, second = [e for e in ca.graphs() if e.dynamic is not None]
    assert len(_graph_symbols(second)) == len(_graph_symbols(first)) + 1


def test_index_identities_dropped_only_where_provable():
    # NOTE [Indexing of dynamic reshapes]: the rewrite is checked against the
    # original expression at every point of the iteration space
    import itertools

    import sympy
    from torch._dynamo.source import LocalSource
    from torch._inductor.sizevars import SizeVarAllocator
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.utils._sympy.functions import FloorDiv, ModularIndexing

    from compiled_autograd.compile.inductor_patches import _drop_range_identities

    env = ShapeEnv()
    b = env.create_symbol(5, LocalSource("b"))
    sv = SizeVarAllocator(env)
    x0, x3 = sympy.symbols("x0 x3", integer=True, nonnegative=True)
    cases = [  # (expr, ranges, must the modulo go?)
        (ModularIndexing(x3 + 64 * x0, 16, 4 * b), {x0: b, x3: 64}, True),
        (ModularIndexing(x3 + 64 * x0, 64, b), {x0: b, x3: 64}, True),
        (ModularIndexing(x3 + 64 * x0, 16, 4 * b), {x0: b + 1, x3: 64}, False),  # one row too many
        (ModularIndexing(x3 + 64 * x0, 16, 4 * b), {x0: b, x3: 65}, False),
        (FloorDiv(x3, 64) + x0, {x0: b, x3: 64}, True),
        (ModularIndexing(x3 - 64 * x0, 16, 4 * b), {x0: b, x3: 64}, False),  # may be negative
    ]

    def value(e, env_vals):
        return int(e.xreplace({k: sympy.Integer(v) for k, v in env_vals.items()}))

    for expr, ranges, drops in cases:
        out = _drop_range_identities(sv, expr, ranges, sympy, FloorDiv, ModularIndexing)
        assert (out != expr) == drops, (expr, ranges, out)
        for bv in (2, 3, 7):
            rs = {k: int(sympy.sympify(v).subs(b, bv)) for k, v in ranges.items()}
            for pt in itertools.product(*(range(r) for r in rs.values())):
                vals = {**dict(zip(rs, pt)), b: bv}
                assert value(out, vals) == value(expr, vals), (expr, out, vals)


class Checkpointed(nn.Module):
    """Each block recomputed in the backward (NOTE [Unpacking in the graph])."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)) for _ in range(3))

    def forward(self, x):
        import torch.utils.checkpoint as checkpoint

        for b in self.blocks:
            x = checkpoint.checkpoint(b, x, use_reentrant=False)
        return x


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_checkpointed_blocks_many_batch_sizes_two_captures(backend):
    # the shapes of the tensors unpacked in the graph become symbols like any other size
    shapes = [(b, 16) for b in [7] + shuffled(7, 3, 64, seed=1)]
    s = stream(Checkpointed(), shapes, backend)
    # the first backward learns, in eager, the layouts of the recomputed tensors (NOTE
    # [Layouts of call outputs]); other sizes use what it learned
    assert (s.learning_backwards, s.captures, s.dynamic_captures) == (1, 2, 1)
    assert s.hits == len(shapes) - 3
    report = ca.explain()
    # the first block's input needs no grad: its weight is not saved (3 * 5 - 1)
    assert "saved-tensor hooks: 14 tensors unpacked in the graph" in report
    from compiled_autograd.observe.captures import capture_log

    assert "unpacked#0.shape[0]" in capture_log()[1]["dynamic"]  # their shapes are symbolic


class _SqrtOfBatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.cos() / math.sqrt(x.shape[0])  # the batch size as a Python number


def test_a_backward_that_specializes_on_a_size_gets_a_few_dynamic_graphs_then_static_ones():
    # each dynamic graph guards on the one batch size it was traced with: after
    # MAX_DYNAMIC_PER_KEY of them the key takes static graphs (before: a new dynamic graph
    # per batch size, each lookup evaluating the guards of all of them)
    w = torch.randn(4, requires_grad=True)
    for b in [3, 5, 6, 2, 8, 4, 7, 9]:
        x = torch.randn(b, 4)
        want = torch.autograd.grad(_SqrtOfBatch.apply(x * w).sum(), w)[0]
        loss = _SqrtOfBatch.apply(x * w).sum()
        with ca.enable("eager"):
            (got,) = torch.autograd.grad(loss, w)
        assert_grads_equal([got], [want], what=f"batch {b}", exact=True)
    s = ca.stats()
    assert s.eager_fallbacks == 0 and s.captures == 8, s
    assert s.dynamic_captures <= 3, s


class _ScaledByTensor(nn.Module):
    """Multiplies by 0-dim CPU tensors (float64 and int64) that MulBackward0 saves: lifted
    scalars of the backward graph."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 4)
        self.s = torch.tensor(1.5, dtype=torch.float64)
        self.n = torch.tensor(3)

    def forward(self, x):
        return (self.lin(x).double() * self.s).float() * self.n


@pytest.mark.parametrize("backend", ["aot_eager", INDUCTOR])
def test_lifted_scalar_tensors_keep_a_graph_dynamic(backend):
    # NOTE [No item symbols for lifted scalars] (capture/fakes.py): they got `.item()` symbols, which
    # AOTAutograd's float-tensorify pass answered by asking for a restart: every dynamic
    # capture failed (a new static capture per size, or an error with fullgraph=True)
    shapes = [(b, 16) for b in (3, 5, 7, 9)]
    s = stream(_ScaledByTensor(), shapes, backend, background=False)
    assert (s.captures, s.dynamic_captures) == (2, 1)
    assert s.hits == len(shapes) - 2
