"""NOTE [Recording a static trace]: the recorded graph is make_fx's, and what the recorder does
not take is traced by make_fx -- never an opaque node or a fallback instead."""

import pytest
import torch

import compiled_autograd as ca
from compiled_autograd.capture import record, trace
from helpers import leaf, parity


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


MODELS = {"mlp": _mlp, "conv": _conv, "transformer": _transformer, "multi_output_and_hooks": _multi_output_and_hooks,
          "custom_function": _custom_function}


def _structure(gm) -> list:
    """The graph's nodes in order: op, target and arguments, a node argument as its position
    (the names aside: make_fx may skip a number)."""
    nodes = list(gm.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    arg = lambda a: torch.fx.node.map_arg(a, lambda n: ("node", at[n]))  # noqa: E731
    return [(n.op, str(n.target) if n.op != "placeholder" else None, arg(n.args), arg(n.kwargs)) for n in nodes]


def _captured_structure(loss, monkeypatch, recording: bool):
    monkeypatch.setattr(trace, "RECORD", recording)
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
