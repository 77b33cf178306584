"""A static trace without make_fx: the aten ops the backward dispatches on its fakes, recorded
into an FX graph (NOTE [Recording a static trace]).

NOTE [Recording a static trace]
make_fx spends about 0.8 ms of Python per aten op around the op itself (its proxy mode:
pytrees, tensor tracking, metadata; its torch-function mode): 0.25 s of the 0.33 s that the
transformer's 300-op backward took to trace, the largest part of a first backward's cost (the
fakes alone run those ops in 0.08 s). A static capture without grad mode needs none of what that
buys: no symbols to track, no autograd to record. So it is recorded by a plain dispatch mode
above the fake mode, as make_fx's proxy mode sits (both see the ops that reach the Python key,
with the Python dispatcher on, as make_fx has it): each op runs on the fakes, and becomes one
`call_function` node of the same target, its fake result in `meta["val"]`, tensors in its
result reached through `getitem` nodes, an in-place op's result rebinding its tensor. The graph
is make_fx's for the same ops.

Whatever it does not expect -- an argument that is not a fake it made or was given (a real
constant, a fake of another mode, a SymInt), an output that is not a tensor or a plain value, a
higher-order operator, a tensor subclass -- raises `Unrecordable`, and the capture traces with
make_fx instead (counted in `stats().make_fx_traces`): this recorder takes the common case and
leaves make_fx's to make_fx, so that it never records a graph make_fx would have recorded
differently. A formula that raised because of it (the native helper turns that into a node
that needs to run opaquely) is told apart by `failed`."""

from __future__ import annotations

import operator
from typing import Any, Callable, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

_PLAIN = (int, float, bool, str, complex, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


class Unrecordable(Exception):
    """Something the recorder leaves to make_fx."""


class Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.graph = torch.fx.Graph()
        self.node_of: dict[int, torch.fx.Node] = {}  # id(fake) -> the node that made it
        self.alive: list = []  # every fake bound, so that ids stay unique while recording
        self.failed: str | None = None

    def _fail(self, why: str):
        self.failed = why
        raise Unrecordable(why)

    def _bind(self, t: torch.Tensor, node: torch.fx.Node) -> None:
        self.node_of[id(t)] = node
        self.alive.append(t)

    def _arg(self, a):
        if isinstance(a, torch.Tensor):
            node = self.node_of.get(id(a))
            if node is None:
                self._fail(f"a tensor the trace did not make ({type(a).__name__})")
            return node
        if isinstance(a, list):
            return [self._arg(x) for x in a]
        if isinstance(a, tuple):
            return tuple(self._arg(x) for x in a)
        if isinstance(a, _PLAIN):
            return a
        self._fail(f"an argument of type {type(a).__name__}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.failed is not None:
            raise Unrecordable(self.failed)
        if not isinstance(func, torch._ops.OpOverload):
            self._fail(f"{func} is not an aten-style operator")
        if not all(issubclass(t, FakeTensor) for t in types):
            self._fail(f"{func} on a tensor subclass")
        node_args, node_kwargs = self._arg(args), {k: self._arg(v) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        node = self.graph.create_node("call_function", func, node_args, node_kwargs, name=func.overloadpacket.__name__)
        node.meta["val"] = out
        if isinstance(out, torch.Tensor):
            self._bind(out, node)
        elif isinstance(out, (tuple, list)):
            for i, o in enumerate(out):
                if isinstance(o, torch.Tensor):
                    item = self.graph.create_node("call_function", operator.getitem, (node, i), {}, name="getitem")
                    item.meta["val"] = o
                    self._bind(o, item)
                elif not isinstance(o, _PLAIN):
                    self._fail(f"{func} returned a {type(o).__name__}")
        elif not isinstance(out, _PLAIN):
            self._fail(f"{func} returned a {type(out).__name__}")
        return out


def record(fn: Callable[..., Sequence[Any]], fakes: Sequence[torch.Tensor], recorder: Recorder) -> torch.fx.GraphModule:
    """`fn(*fakes)` recorded as a GraphModule returning its list of tensors (in the fakes' mode,
    which the caller has entered)."""
    from torch._dispatch.python import enable_python_dispatcher

    graph = recorder.graph
    for i, f in enumerate(fakes):
        if not isinstance(f, FakeTensor):
            recorder._fail(f"input {i} is a {type(f).__name__}")
        node = graph.placeholder(f"arg{i}_1")
        node.meta["val"] = f
        recorder._bind(f, node)
    with enable_python_dispatcher(), recorder:
        results = fn(*fakes)
    graph.output([recorder._arg(r) for r in results])
    return torch.fx.GraphModule(torch.nn.Module(), graph)
