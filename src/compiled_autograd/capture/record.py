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
that needs to run opaquely) is told apart by `failed`.

NOTE [Recording on the real tensors]
A first capture of a static graph whose nodes are all built-in formulas (no hook, no custom
Function, no opaque node, no saved-tensor hook, no create_graph) is recorded `live`: on the
lifted tensors themselves, the ops running for real as the recorder records them. Its results
are the first backward's gradients, so that backward runs no fakes (making them and running
the formulas on them was most of a first backward's cost: 0.36 s of the transformer's 0.59 s)
and no graph after its trace: it costs about what eager's does. That is where the graph is what
would run next anyway: while it compiles in the background, and with the eager backend, whose
function is the graph. A backend compiling the graph at once runs that backward itself (its
outputs are checked on that first run), so there the capture is traced on fakes, which costs
no real compute. The graph is the record of what ran, so its later runs compute what the first
one did. What a live record refuses -- and
it refuses before the op runs, so that a refused record leaves nothing changed and the
capture traces on fakes as before (counted in `stats().live_refusals`):
  - an op outside aten (our opaque call, a library's op), a tensor subclass, a non-strided
    tensor, a complex tensor (under a dispatch mode, as the recorder is, a formula's lazily
    conjugated views are materialized at other points than in eager: complex linalg.lstsq's
    grads came out in other last bits; a graph traced on fakes replays eager's);
  - a number where the op takes a tensor: a wrapped number (`x * 2.0`'s saved 2.0, a lifted
    tensor) reaches the recorder as a Python number, which would bake this backward's value
    into the graph (a wrong gradient on the next hit: tests/test_cache.py);
  - an op whose output's value or shape depends on its input's data (tags
    data_dependent_output, dynamic_output_shape; a Python number out of a tensor), whose
    value a trace on fakes could not know either: a graph recorded through one would bake
    this backward's data in;
  - a random op (tag nondeterministic_seeded): a record refused after it would have drawn
    from the generator once more than eager;
  - a write into the storage of a lifted tensor (a saved tensor, a grad given to backward):
    the fake trace that follows a refusal would compute on what the write changed.
Its nodes' `meta["val"]` are fakes of the same geometry, made without a converter (no
reference to the real tensors, whose intermediates it holds only weakly: the formulas free
them as eager does)."""

from __future__ import annotations

import operator
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass_type
from torch.utils.weak import WeakIdKeyDictionary

_PLAIN = (int, float, bool, str, complex, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


class Unrecordable(Exception):
    """Something the recorder leaves to the next way to trace: a live record's to a record on
    fakes, that one's to make_fx."""


_LIVE_TYPES = (torch.Tensor, torch.nn.Parameter)
_NUMBERS = (int, float, bool, complex)
_REFUSED_TAGS = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape, torch.Tag.nondeterministic_seeded)


_SHADOW_MODE: list = []


def _shadow_mode():
    """The fake mode of every live record's shadows, made once: they are geometry, never run on
    (a FakeTensorMode records its creation's stack, 2 ms of a first backward)."""
    if not _SHADOW_MODE:
        from torch._subclasses.fake_tensor import FakeTensorMode

        _SHADOW_MODE.append(FakeTensorMode())
    return _SHADOW_MODE[0]


def _tensor_return(t) -> bool:
    """Whether a schema return type is a tensor, an optional tensor or a list of tensors."""
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    if isinstance(t, torch.ListType):
        t = t.getElementType()
    return isinstance(t, torch.TensorType)


class Recorder(TorchDispatchMode):
    # A higher-order operator (`run_with_rng_state` in a checkpointed region's backward) reaches
    # __torch_dispatch__, which refuses it like any other non-aten op (`failed`, so the capture
    # traces with make_fx, whose proxy mode has its rule). Without this, torch raised its own
    # "no rule registered for HigherOrderOperator" error past `_fail`: the node that ran the op
    # was made opaque as if its backward could not be traced at all.
    supports_higher_order_operators = True

    def __init__(self, live: bool = False):
        super().__init__()
        self.graph = torch.fx.Graph()
        self.live = live  # NOTE [Recording on the real tensors]
        # the node that made each tensor: by id, the fakes kept alive so that ids stay unique;
        # live, by weak reference (the formulas free their intermediates)
        self.node_of = WeakIdKeyDictionary() if live else {}
        self.alive: list = []
        self.storages: set = set()  # live: the data pointers of the inputs' storages
        self.shadows: dict = {}  # live: (shape, stride, dtype, device) -> its fake (NOTE [Shadows of a live record])
        self.failed: str | None = None

    def _fail(self, why: str):
        self.failed = why
        raise Unrecordable(why)

    def _bind(self, t: torch.Tensor, node: torch.fx.Node) -> None:
        if self.live:
            self.node_of[t] = node
            node.meta["val"] = self._shadow(t)
        else:
            self.node_of[id(t)] = node
            self.alive.append(t)
            node.meta["val"] = t

    def _shadow(self, t: torch.Tensor):
        """A fake of `t`'s geometry, for `meta["val"]` of a live record (NOTE [Shadows of a
        live record])."""
        key = (t.shape, t.stride(), t.dtype, t.device)
        fake = self.shadows.get(key)
        if fake is None:
            meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            fake = self.shadows[key] = FakeTensor(_shadow_mode(), meta, t.device)
        return fake

    def _arg(self, a):
        if isinstance(a, torch.Tensor):
            if self.live:
                if type(a) not in _LIVE_TYPES or a.layout != torch.strided or a.is_complex():
                    self._fail(f"a {type(a).__name__} of layout {a.layout} and dtype {a.dtype}")
                node = self.node_of.get(a)
            else:
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
        if self.live:
            self._check_live(func, args, kwargs)
        elif not all(issubclass(t, FakeTensor) for t in types):
            if all(issubclass(t, FakeTensor) or is_traceable_wrapper_subclass_type(t) for t in types):
                # a subclass the trace rebuilt over its fakes (docs/design/subclasses.md section 3):
                # its __torch_dispatch__ runs, and the ops it runs on the fakes come back here, as
                # make_fx's proxy mode has it (proxy_call's unrecognized types)
                return NotImplemented
            self._fail(f"{func} on a tensor subclass")
        node_args, node_kwargs = self._arg(args), {k: self._arg(v) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        node = self.graph.create_node("call_function", func, node_args, node_kwargs, name=func.overloadpacket.__name__)
        if isinstance(out, torch.Tensor):
            self._bind(out, node)
        elif isinstance(out, (tuple, list)):
            for i, o in enumerate(out):
                if isinstance(o, torch.Tensor):
                    item = self.graph.create_node("call_function", operator.getitem, (node, i), {}, name="getitem")
                    self._bind(o, item)
                elif not isinstance(o, _PLAIN):
                    self._fail(f"{func} returned a {type(o).__name__}")
            if self.live:
                vals = {u.args[1]: u.meta["val"] for u in node.users}
                node.meta["val"] = [vals.get(i) for i in range(len(out))]
        elif not isinstance(out, _PLAIN):
            self._fail(f"{func} returned a {type(out).__name__}")
        if not self.live:
            node.meta["val"] = out
        return out

    def _check_live(self, func, args, kwargs) -> None:
        """Refuse, before it runs, an op a live record must not run (NOTE [Recording on the
        real tensors])."""
        rules = _LIVE_RULES.get(func)
        if rules is None:
            rules = _LIVE_RULES[func] = _live_rules(func)
        if rules.refused is not None:
            self._fail(rules.refused)
        for i, name, kwarg_only in rules.tensor_args:
            v = args[i] if i < len(args) and not kwarg_only else kwargs.get(name)
            if any(isinstance(x, _NUMBERS) for x in (v if isinstance(v, (list, tuple)) else (v,))):
                self._fail(f"{func}: a number where it takes a tensor (a wrapped number)")
        for i, name, kwarg_only in rules.written:
            v = kwargs.get(name) if kwarg_only or i >= len(args) else args[i]
            for t in v if isinstance(v, (list, tuple)) else (v,):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.storages:
                    self._fail(f"{func} writes into a lifted tensor")


class LiveRules(NamedTuple):
    """What a live record checks of an op, read from its schema once per op (read per call, it
    was 30 us of each op); each argument as (position, name, kwarg_only)."""

    refused: str | None  # why the op is refused whatever its arguments
    tensor_args: tuple  # the arguments that take tensors (a number there is a wrapped number)
    written: tuple  # the arguments it writes


_LIVE_RULES: dict = {}  # OpOverload -> LiveRules


def _live_rules(func) -> LiveRules:
    def arg(i, a):
        return (i, a.name, a.kwarg_only)

    refused = None
    schema = func._schema
    if func.namespace != "aten":
        refused = f"{func}: not an aten op"
    else:
        tags = func.tags
        refused = next((f"{func}: {tag.name}" for tag in _REFUSED_TAGS if tag in tags), None)
    if refused is None and not all(_tensor_return(r.type) for r in schema.returns):
        refused = f"{func} returns a value that is not a tensor"
    tensor_args = tuple(arg(i, a) for i, a in enumerate(schema.arguments) if _tensor_return(a.type))
    written = tuple(
        arg(i, a) for i, a in enumerate(schema.arguments) if schema.is_mutable and a.alias_info is not None and a.alias_info.is_write
    )
    return LiveRules(refused, tensor_args, written)


def record(fn: Callable[..., Sequence[Any]], fakes: Sequence[torch.Tensor], recorder: Recorder) -> torch.fx.GraphModule:
    """`fn(*fakes)` recorded as a GraphModule returning its list of tensors (in the fakes' mode,
    which the caller has entered)."""
    from torch._dispatch.python import enable_python_dispatcher

    graph = recorder.graph
    for i, f in enumerate(fakes):
        if recorder.live:
            if type(f) not in _LIVE_TYPES or f.layout != torch.strided or f.is_complex():
                recorder._fail(f"input {i} is a {type(f).__name__} of layout {f.layout} and dtype {f.dtype}")
            ptr = f.untyped_storage().data_ptr()
            if ptr:  # (an empty storage has none: nothing to write into, and every one is 0)
                recorder.storages.add(ptr)
        elif not isinstance(f, FakeTensor):
            recorder._fail(f"input {i} is a {type(f).__name__}")
        recorder._bind(f, graph.placeholder(f"arg{i}_1"))
    with enable_python_dispatcher(), recorder:
        results = fn(*fakes)
    graph.output([recorder._arg(r) for r in results])
    graph.eliminate_dead_code()  # (before the module generates its code, which it does once)
    if recorder.live:  # NOTE [Shadows of a live record]: its code generated where it first runs
        from ..compile.boxed import lazy_module

        return lazy_module(torch.nn.Module(), graph)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


# NOTE [Shadows of a live record]
# A live record runs in the first backward, where every millisecond is the user's: of the D=1024
# MLP's 66-node record (83 ops, 30 ms of kernels), making a FakeTensor for every result's
# `meta["val"]` took 7.5 ms and the GraphModule's code 5 ms. What reads those values reads
# their geometry (the expected outputs, the passes' "is it a tensor"; the compile makes its own
# fakes), so results of one geometry share one fake: the MLP's 164 became 9. And the module
# generates its Python code where it first runs (torch's _LazyGraphModule, as inductor's
# passes use it): in the compile's thread for a background compile, which is where a live
# record's graph first runs; on its first hit for the eager backend.
