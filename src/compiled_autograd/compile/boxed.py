"""How our graphs are compiled and called, whatever the backend: boxed (NOTE [Boxed graphs free
their inputs]), against static fakes of a mode with a ShapeEnv (NOTE [Inductor's FX graph cache
for our graphs]), with our calls going straight to their kernel."""

from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch

from .. import calls
from ..calls import kernel
from ..values import BOXED


def _with_effects_direct(token, op, *args, **kwargs):
    return (token, kernel.direct(*args, **kwargs))


def _direct_calls(graph: torch.fx.Graph) -> None:
    """Our calls in a graph we run as generated Python code go straight to the kernel
    (calls/kernel.py direct): no dispatcher, and no `with_effects` higher-order op, whose Python
    dispatch (pytree flattening of the arguments, a new token tensor per call) cost about
    60 us a call, half a hook call's time. The call stays where the graph has it, and the
    graph runs in order (the token only threads that order through)."""
    op = torch.ops.compiled_autograd.call.default
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is op:
            n.target = kernel.native_calls().direct
        elif n.target is torch.ops.higher_order.with_effects and len(n.args) > 1 and n.args[1] is op:
            n.target = _with_effects_direct


def _direct_calls_nop(fx_g: torch.fx.GraphModule, example_inputs):
    """aot_eager's compiler (boxed_nop), with our calls direct (_direct_calls)."""
    from torch._dynamo.backends.debugging import boxed_nop

    _direct_calls(fx_g.graph)
    return boxed_nop(fx_g, example_inputs)


def _boxed_graph_module(gm: torch.fx.GraphModule) -> Callable:
    """The FX graph itself, run with the boxed calling convention (a copy of
    `gm`: the captured graph keeps its readable signature for dump())."""
    try:
        from torch.fx.graph import _BoxedCodeGen
    except ImportError:  # pragma: no cover - other torch versions
        return gm
    graph = copy.deepcopy(gm.graph)
    _direct_calls(graph)
    graph.set_codegen(_BoxedCodeGen())
    boxed = lazy_module(gm, graph)  # (its code generated on its first run: the next hit's)
    setattr(boxed, BOXED, True)
    return boxed


def lazy_module(root, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A GraphModule whose Python code is generated where it first runs (NOTE [Shadows of a
    live record] in capture/record.py)."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # pragma: no cover - other torch versions
        return torch.fx.GraphModule(root, graph)
    return _LazyGraphModule(root, graph)


def plain_module(gm):
    """A lazy module as a plain GraphModule of the same graph, as the child process compiles
    it: given the lazy one, AOTAutograd's cache key differed and missed the child's entry
    (tests/test_child_compile.py); anything else as it is."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # pragma: no cover - other torch versions
        return gm
    return torch.fx.GraphModule(gm, gm.graph) if isinstance(gm, _LazyGraphModule) else gm


def _as_is(flat_args):
    return flat_args


def compile_on_static_fakes(compile: Callable, gm: torch.fx.GraphModule, example_inputs: Sequence, static: bool) -> Callable:
    """Compile a static graph against static fakes of a mode with a ShapeEnv, in a tracing
    context (`_static_fake_mode`); anything else, or inputs it cannot take, as given."""
    calls.exempt_from_aliasing_check()
    fake = _static_fake_mode(example_inputs) if static else None
    if fake is None:
        return _compile_boxed(compile, gm, example_inputs)
    mode, fakes = fake
    with torch._guards.tracing(torch._guards.TracingContext(mode)):
        return _compile_boxed(compile, gm, fakes)


def _compile_boxed(compile: Callable, gm: torch.fx.GraphModule, example_inputs: Sequence) -> Callable:
    try:
        from torch._dynamo.utils import GmWrapper
    except ImportError:  # pragma: no cover - other torch versions
        return compile(gm, list(example_inputs))
    fn = compile(GmWrapper(gm, _as_is), list(example_inputs))
    setattr(fn, BOXED, True)
    return fn


def _static_fake_mode(example_inputs: Sequence):
    """NOTE [Inductor's FX graph cache for our graphs]
    Inductor stores the code it generates for a graph in its FX graph cache, and a
    later process with the same graph skips lowering and codegen (and g++). It only
    does when the compile runs in a tracing context whose fake mode has a ShapeEnv
    (its guards live there); compile_fx called on real tensors makes a fake mode
    without one, and the cache was bypassed ("No shape env"): a warm process spent
    2-3 s per graph regenerating code. A static graph is compiled against fakes of a
    mode with a ShapeEnv and static shapes: no symbol is made, so the cache's guards
    are trivially true (and AOT's float-tensorify pass finds no float symbol to
    restart on). Returns that mode and the fakes, or None when the inputs are not all
    real tensors or all fakes of one mode with a ShapeEnv (then compile as before)."""
    from torch._subclasses.fake_tensor import FakeTensor

    tensors = [t for t in example_inputs if isinstance(t, torch.Tensor)]
    fakes = [t for t in tensors if isinstance(t, FakeTensor)]
    if fakes:
        mode = fakes[0].fake_mode
        ok = len(fakes) == len(tensors) and mode.shape_env is not None and all(t.fake_mode is mode for t in fakes)
        return (mode, list(example_inputs)) if ok else None
    return static_fakes(example_inputs)


def fakeable(t: torch.Tensor) -> torch.Tensor:
    """NOTE [Views that change the dtype]
    torch 2.13 fakeifies a view by replaying it on its base's fake, and fails for
    a view of another dtype (`view_as_complex(x.view(-1, 2))` saved by `.abs()`:
    "Tensor must have a last dimension of size 2"). Such a lifted tensor is
    fakeified as what it is to the graph: a tensor of its geometry on the same
    storage (so the fakes still share a storage), not a view. The graph reads it;
    what a write into it would do to the base is not traced, but nothing in a
    backward graph writes into a lifted tensor."""
    if t._is_view() and t._base.dtype != t.dtype:
        alias = t.new_empty(0).set_(t.untyped_storage(), t.storage_offset(), t.size(), t.stride())
        return alias.requires_grad_(t.requires_grad) if t.requires_grad else alias
    return t


def static_fakes(values):
    """(mode, static fakes of `values`' tensors, the rest as is), in a mode with a ShapeEnv."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    return mode, [mode.from_tensor(fakeable(t), static_shapes=True) if isinstance(t, torch.Tensor) else t for t in values]
