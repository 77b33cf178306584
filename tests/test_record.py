"""NOTE [Recording a static trace]: the recorded graph is make_fx's, and what the recorder does
not take is traced by make_fx -- never an opaque node or a fallback instead."""

import contextlib

import pytest
import torch

import compiled_autograd as ca
from compiled_autograd.capture import record
from helpers import compare, leaf, parity


def _net(net, *shape):
    return list(net.parameters()), lambda x: net(x).pow(2).mean(), lambda step: (torch.randn(*shape),)


def _mlp():
    return _net(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)), 5, 8)


def _conv():
    return _net(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.MaxPool2d(2)), 2, 3, 8, 8)


def _transformer():
    return _net(torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2, 5, 16)


def _multi_output_and_hooks():
    w = leaf(6, 4)

    def loss_of(x):
        y = w * x
        a, b, c = y.split(2)  # a formula with several inputs' grads, a tensor hook (an opaque call)
        a.register_hook(lambda g: g * 2)
        return (a * b).sum() + torch.stack(y.unbind(1)).tanh().sum() + c.sum()

    return [w], loss_of, lambda step: (torch.randn(6, 4),)


class _Scaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, s):
        ctx.save_for_backward(x)
        ctx.s = s
        return x * s

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * ctx.s + x.sin(), None


def _custom_function():
    w = leaf(3, 4)
    return [w], lambda x: _Scaled.apply(w * x, 1.5).exp().sum(), lambda step: (torch.randn(3, 4),)


MODELS = {
    "mlp": _mlp,
    "conv": _conv,
    "transformer": _transformer,
    "multi_output_and_hooks": _multi_output_and_hooks,
    "custom_function": _custom_function,
}


def _structure(gm) -> list:
    """The graph's nodes in order: op, target and arguments, a node argument as its position
    (the names aside: make_fx may skip a number)."""
    nodes = list(gm.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    arg = lambda a: torch.fx.node.map_arg(a, lambda n: ("node", at[n]))  # noqa: E731
    return [(n.op, str(n.target) if n.op != "placeholder" else None, arg(n.args), arg(n.kwargs)) for n in nodes]


def _captured_structure(loss, monkeypatch, recording: bool):
    monkeypatch.setenv("COMPILED_AUTOGRAD_RECORD", "1" if recording else "0")
    ca.reset()
    with ca.enable("eager", fullgraph=True):
        loss.backward()
    (entry,) = ca.graphs()
    return _structure(entry.graph), ca.stats()


@pytest.mark.parametrize("name", MODELS)
def test_recorded_graph_is_the_graph_make_fx_traces(name, monkeypatch):
    torch.manual_seed(0)
    _, loss_of, make_input = MODELS[name]()
    x = make_input(0)
    recorded, stats = _captured_structure(loss_of(*x), monkeypatch, True)
    assert stats.make_fx_traces == 0 and stats.captures == 1, stats
    traced, stats = _captured_structure(loss_of(*x), monkeypatch, False)
    assert stats.make_fx_traces == 0 and stats.captures == 1, stats
    assert recorded == traced


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("name", MODELS)
def test_recorded_graph_is_bitwise_eager(name, backend):
    """The recorded graph, captured on one input and hit with another: eager's grads, bitwise."""
    torch.manual_seed(0)
    leaves, loss_of, make_input = MODELS[name]()
    parity(loss_of, leaves, make_input, backend=backend)  # (one capture, one hit, no fallback)
    assert ca.stats().make_fx_traces == 0, ca.stats()


def test_what_the_recorder_leaves_is_traced_by_make_fx():
    """A tensor constant made in a custom backward (a real tensor the recorder did not make):
    make_fx traces that capture; the grads are eager's, and nothing runs opaquely."""

    class ConstantInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * x.cos() * torch.tensor([2.0, 3.0, 4.0])

    w = leaf(3)
    parity(lambda x: ConstantInBackward.apply(w * x).sum(), [w], lambda step: (torch.randn(3),), fullgraph=True)
    s = ca.stats()
    assert s.make_fx_traces == 1 and s.opaque_nodes == 0, s


def test_a_formula_the_recorder_failed_in_is_not_made_opaque(monkeypatch):
    """The recorder refusing an op inside a built-in formula (the native helper hands the formula's
    error on as a node that needs to run opaquely): make_fx traces the capture, and the node stays
    in the graph."""
    recorded = record.Recorder.__torch_dispatch__

    def refuse_cos(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.cos.default:
            self._fail("refused by the test")
        return recorded(self, func, types, args, kwargs)

    monkeypatch.setattr(record.Recorder, "__torch_dispatch__", refuse_cos)
    w = leaf(4)
    parity(lambda x: (x * w).sin().sum(), [w], lambda step: (torch.randn(4),), fullgraph=True)
    s = ca.stats()
    assert s.make_fx_traces == 1 and s.opaque_nodes == 0, s
    code = ca.graphs()[0].graph.code
    assert "aten.cos" in code and "compiled_autograd.call" not in code


# -- NOTE [Recording on the real tensors] -------------------------------------------------

LIVE_MODELS = ["mlp", "conv", "transformer"]  # (built-in formulas only: recorded live)


def _grads_of_two_inputs(leaves, loss_of, inputs, scope):
    out = []
    for x in inputs:
        for t in leaves:
            t.grad = None
        loss = loss_of(*x)
        with scope():
            loss.backward()
        ca.synchronize()  # (the background compile lands before the next backward)
        out.append([(t.grad.clone(), t.grad.stride()) for t in leaves])
    return out


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("name", LIVE_MODELS)
def test_a_live_record_is_the_first_backward_and_its_graph_serves_the_next(name, backend):
    """The first backward's grads are the live record's (the eager backend's graph, or while
    aot_eager compiles in the background): eager's, bitwise, with eager's strides; the second
    input is a hit through the entry's function (the recorded graph, or aot_eager's compile
    of it, made from fakes of the lifted tensors' geometry), eager's too."""
    torch.manual_seed(0)
    leaves, loss_of, make_input = MODELS[name]()
    inputs = [make_input(0), make_input(1)]
    want = _grads_of_two_inputs(leaves, loss_of, inputs, contextlib.nullcontext)
    ca.reset()
    got = _grads_of_two_inputs(leaves, loss_of, inputs, lambda: ca.enable(backend, background=backend != "eager"))
    for step, (g, w) in enumerate(zip(got, want)):
        for i, ((a, sa), (b, sb)) in enumerate(zip(g, w)):
            assert torch.equal(a, b), f"step {step} leaf {i}: not bitwise eager's"
            assert sa == sb, f"step {step} leaf {i}: strides {sa} vs eager's {sb}"
    s = ca.stats()
    assert (s.captures, s.hits, s.live_records, s.live_refusals) == (1, 1, 1, 0), s
    assert s.eager_fallbacks == 0 and s.eager_while_compiling == 0 and s.make_fx_traces == 0, s


def test_a_wrapped_number_is_not_baked_into_a_live_record():
    """`x * 2.0` saves 2.0 as a wrapped number, which reaches a dispatch mode as a Python
    number: recorded live, the graph would multiply by this backward's 2.0 forever (a hit with
    3.0 was wrong: found by tests/test_cache.py). The record refuses it; the capture is
    traced on fakes, where the saved value is a graph input."""
    x = leaf(3, 4)
    parity(lambda s: (x * s).pow(2).sum(), [x], lambda step: (2.0 + step,), steps=3)
    s = ca.stats()
    assert s.live_records == 0 and s.live_refusals == 1, s


def test_hooks_and_custom_functions_are_not_recorded_live():
    for name in ("multi_output_and_hooks", "custom_function"):
        ca.reset()
        torch.manual_seed(0)
        leaves, loss_of, make_input = MODELS[name]()
        parity(loss_of, leaves, make_input)
        s = ca.stats()
        assert s.live_records == 0 and s.live_refusals == 0, (name, s)


class _Sub(torch.Tensor):
    pass


@pytest.mark.parametrize(
    "fn, why",
    [
        pytest.param(lambda x: [x.add_(x.exp())], "writes into a lifted tensor", id="write_into_input"),
        pytest.param(lambda x: [x[1:].mul_(x[1:].exp())], "writes into a lifted tensor", id="write_into_a_view_of_input"),
        pytest.param(
            lambda x: [x.exp().copy_(x), torch.zeros(2).copy_(x[0, :2]), x.t_()], "writes into a lifted tensor", id="inplace_view_of_input"
        ),
        pytest.param(lambda x: [x.exp(), torch.rand_like(x)], "nondeterministic_seeded", id="random"),
        pytest.param(lambda x: [x.nonzero()], "dynamic_output_shape", id="data_dependent_shape"),
        pytest.param(lambda x: [x.exp(), x.sum().item()], "data_dependent_output", id="data_dependent_value"),
        pytest.param(lambda x: [x.exp(), torch.ops.aten.is_same_size(x, x)], "not a tensor", id="returns_a_number"),
        pytest.param(lambda x: [x * 2.0], "wrapped number", id="wrapped_number"),
        pytest.param(lambda x: [torch.ops.prims.neg(x)], "not an aten op", id="not_aten"),
        pytest.param(lambda x: [x + x.exp().as_subclass(_Sub)], "_Sub", id="subclass"),
    ],
)
def test_a_live_record_refuses_before_the_op_runs(fn, why):
    """What a live record refuses, it refuses before running it: the input keeps its value and
    geometry, the generator its state."""
    x = torch.randn(3, 4)
    before, rng = (x.clone(), x.stride()), torch.get_rng_state()
    recorder = record.Recorder(live=True)
    with torch.no_grad(), pytest.raises(record.Unrecordable):
        record.record(fn, [x], recorder)
    assert why in recorder.failed, recorder.failed
    assert torch.equal(x, before[0]) and x.stride() == before[1] and x.shape == (3, 4)
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_live_record_records_what_ran():
    """The graph of a live record computes, run again on the same inputs, what the record did;
    its nodes carry fakes of their results' geometry, with no reference to the real tensors."""
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    recorder = record.Recorder(live=True)
    with torch.no_grad():
        gm = record.record(lambda a, b: [(a @ b).relu().sum(0), b.t().mm(a.t()).tanh()[1]], [x, w], recorder)
        want = [(x @ w).relu().sum(0), w.t().mm(x.t()).tanh()[1]]
    got = gm(x, w)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    from torch._subclasses.fake_tensor import FakeTensor

    for n in gm.graph.nodes:
        if n.op != "output":
            v = n.meta["val"]
            assert isinstance(v, FakeTensor) and v.device == x.device, n
    assert len(recorder.node_of) <= 3  # (intermediates are held weakly: the inputs, the results)


def test_a_live_record_shares_shadows_and_generates_its_code_where_it_first_runs():
    """NOTE [Shadows of a live record]: results of one geometry share one fake (each still of
    its own geometry), and the module generates its code on its first run, which computes what
    the record did."""
    x = torch.randn(4, 3)
    recorder = record.Recorder(live=True)
    with torch.no_grad():
        gm = record.record(lambda a: [a.exp() * a.sin(), a.t().cos(), a.tanh()], [x], recorder)
    vals = {n: n.meta["val"] for n in gm.graph.nodes if n.op != "output"}
    assert len({id(v) for v in vals.values()}) == 2  # (4, 3) and its transpose's (3, 4)
    for n, v in vals.items():
        want = (3, 4) if n.target is torch.ops.aten.t.default or n.target is torch.ops.aten.cos.default else (4, 3)
        assert tuple(v.shape) == want, n
    assert type(gm)._needs_recompile()  # (no code yet)
    got = gm(x)
    assert not type(gm)._needs_recompile()
    assert all(torch.equal(a, b) for a, b in zip(got, [x.exp() * x.sin(), x.t().cos(), x.tanh()]))


def test_explain_says_how_each_graph_was_traced():
    """explain(): a live record, and a refused one with the refusal's reason."""
    torch.manual_seed(0)
    leaves, loss_of, make_input = MODELS["mlp"]()
    parity(loss_of, leaves, make_input)
    text = str(ca.explain(file=None))
    assert "traced: recorded on the real tensors (its grads were this backward's)" in text, text
    ca.reset()
    x = leaf(3, 4)
    parity(lambda s: (x * s).pow(2).sum(), [x], lambda step: (2.0 + step,))
    text = str(ca.explain(file=None))
    assert "traced: recorded on fakes; the live record refused: aten.mul.Tensor: a number where it takes a tensor" in text, text


def _empty_circular_pad(seed, scope):
    """grad() through a circular pad (CopySlices) of a tensor with no elements."""
    torch.manual_seed(seed)
    x = torch.randn(0, 3, 3, dtype=torch.float64, requires_grad=True)
    y = torch.nn.functional.pad(x, (1, 2), mode="circular")
    loss = (y * torch.randn(y.shape, dtype=y.dtype)).sum()
    with scope:
        return list(torch.autograd.grad(loss, [x], allow_unused=True))


def test_an_empty_input_is_recorded_live_and_its_grad_is_a_tensor():
    """issue 36 item 2: a circular pad of a tensor with no elements. Its CopySlices' copy_ went
    into a storage with no data, whose pointer (0) every empty lifted tensor shares: the record
    took it for a write into a lifted tensor and refused, and the refusal, raised inside the
    C++ formula as a Python error with an empty message, was dropped there (NOTE [Deferred
    trace errors]): the node's grads came back undefined and the graph returned None where
    eager returns a (0, 3, 3) gradient. Recorded live now, two inputs through one entry."""
    compare(_empty_circular_pad, "eager", steps=2, captures=1, hits=1)
    s = ca.stats()
    assert s.live_records == 1 and s.live_refusals == 0, s


def test_an_error_inside_a_formula_is_never_dropped(monkeypatch):
    """A record that refuses an op inside a C++ node (here every copy_, which CopySlices runs
    through the tracing interface) must reach the capture as a refusal, never as undefined
    grads: the refusal reaches C++ as a Python error with an empty message, which read as no
    error (before: the 0-element pad's grad was None, a larger one's raised a SystemError
    that ended the record by chance). The capture is traced on fakes; the grads are eager's."""
    monkeypatch.setitem(record._LIVE_RULES, torch.ops.aten.copy_.default, record.LiveRules("copy_: refused by the test", (), ()))
    compare(_empty_circular_pad, "eager", steps=2, captures=1, hits=1)
    s = ca.stats()
    assert s.live_records == 0 and s.live_refusals == 1, s


def test_complex_tensors_are_not_recorded_live():
    """Under a dispatch mode, as the recorder is, a formula's lazily conjugated views are
    materialized at other points than in eager: recorded live, complex linalg.lstsq's grads
    came out in other last bits (found by an audit of formulas under modes). The live record
    refuses complex tensors; traced on fakes, the graph replays eager's ops."""

    def step(seed, scope):
        torch.manual_seed(seed)
        a = torch.randn(4, 3, dtype=torch.complex64, requires_grad=True)
        b = torch.randn(4, 2, dtype=torch.complex64, requires_grad=True)
        x = torch.linalg.lstsq(a, b).solution
        loss = (x.real * torch.full(x.shape, 1.3)).sum() + (x.imag * torch.full(x.shape, 0.7)).sum()
        with scope:
            return list(torch.autograd.grad(loss, [a, b]))

    compare(step, "eager", steps=2, captures=1, hits=1)
    s = ca.stats()
    assert s.live_records == 0 and s.live_refusals == 1, s
