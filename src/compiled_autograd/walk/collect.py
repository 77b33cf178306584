"""Collect: what one backward call's graph is made of, as a key and lifted inputs.

The native collector (native/_C.cpp) walks the graph and keys every built-in
node. This module adds what only Python can see:
  * custom autograd.Function nodes: the Function class, needs_input_grad, the
    materialize flags, every non-tensor ctx attribute by value (but sizes kept
    on ctx go to the sizes vector: NOTE [Sizes kept on ctx]), tensors saved
    with save_for_backward or stored on ctx (lifted). A ctx attribute we cannot
    key by value makes that node opaque (it runs as is, inside the graph), and
    an opaque node keys none of its state (NOTE [Opaque nodes keep their state
    out of the key]).
  * saved tensors that carry saved_tensors_hooks: unpacked inside the graph,
    at the node that uses them, when what the hook will return is known
    beforehand (NOTE [Unpacking in the graph]) or was learned from an eager
    backward of the same graph (NOTE [Unpack metadata learned from the last
    backward]); otherwise their unpack hooks run now, when the backward starts,
    and the unpacked tensors are lifted.

NOTE [Unpacking in the graph]
Eager unpacks a saved tensor when its node runs: non-reentrant checkpointing
recomputes a region's activations when the backward reaches the region, and
they are freed as the region's nodes finish. Unpacking every hooked tensor when
the backward starts would hold all regions' activations at once: no memory
saved. So a hooked tensor becomes a `compiled_autograd::call(UNPACK)` at its
node's position in the graph (the native tracer asks for it when the node's
formula unpacks it). The graph must be traced before the hook runs, and a cache
hit decided without running it, so this needs the unpacked tensor's shape,
dtype and device from what was packed, exactly:
  * torch.utils.checkpoint (non-reentrant, default determinism check): the
    checkpoint records each packed tensor's shape, dtype and device, and its
    recomputation raises if a recomputed tensor differs from them;
  * save_on_cpu: it returns the packed CPU tensor moved to the recorded device.
Those predictions are part of the key (shapes in the sizes vector, so a
dynamic graph can make them symbolic). At replay the call checks what the hook
returned against the prediction, and raises rather than misread a tensor.

NOTE [Unpack metadata learned from the last backward]
Any other hook (activation offloading, compression, a user's stash) gives no
such prediction: what its packed value holds is its own business. The first
backward of a graph and sizes with such hooks runs in eager autograd
(`stats().learning_backwards`), each hook at its node as eager runs it, with
the saved variable's hooks wrapped so that what each returns is reported
(NOTE [Handing unpacked tensors to their saved variables], native helper).
What it returned is remembered under the graph's native key, its sizes, the
tensor's position, the hook's code and the shapes of the tensors in the
packed value (`_packed_meta`). Every later backward of the same graph and
sizes predicts the same metadata, is traced (or hits) with each tensor
unpacked in the graph when its node runs, as eager does: offloading and
compression keep their memory saving from the first backward on, and a
hook's in-place change to a stashed tensor before its node runs is seen. A
hook that then returns something else raises (the graph ran part way: it
cannot fall back) and that tensor is unpacked when the backward starts from
then on, and so is one that returned something other than a plain strided
tensor, or that eager did not unpack (its node's formula did not need it).
Sizes that change every step (a stream of sequence lengths) would make every
backward a learning one. So what is learned is also generalized, by one
rule only: the unpacked tensor has the shape of the one tensor in the packed
value that had its shape (offloading and compression keep the shape), with the
dtype and device it had. A rule seen to hold at two different sizes of the same
graph, position, hook and packed structure (ranks, dtypes, devices) predicts the
tensor at any other sizes (`_Learned.by_rule`; sizes or packed shapes, as an
index_fill's index length is not a size of the graph); it is checked at replay
as any prediction is, and dropped for good when it fails.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import math
import sys
import threading
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ..values import NodeKind, NodeRow

from ..nodes import compiled_region as aot
from ..replay.graph_task import in_graph_task

PYNODE_KIND = NodeKind.PYNODE


class Unkeyable(Exception):
    """A value the key cannot hold (the runtime falls back when a saved-tensor hook's
    result is one)."""


@dataclass
class PyNodeInfo:
    flags: tuple  # (materialize_grads, materialize_non_diff_grads, boxed_grads_call, is_variable_input)
    saved: tuple  # lifted index of each saved tensor
    # (name, value): ctx attributes holding tensors, or sizes (then `_SIZE` in their places:
    # NOTE [Sizes kept on ctx])
    attrs: tuple
    opaque_reason: str | None = None
    symints: tuple | None = None  # an inlined AOTAutograd backward's ctx.symints (NOTE [Inlining AOTAutograd backwards])
    # (id of the globals dict or closure cell, name, lifted index): the tensors its backward reads from
    # globals and closures (NOTE [Tensors a backward reads from globals and closures])
    read: tuple = ()
    aot_start: int = 0  # where its ints (`symints` or `ctx_ints`) sit among the Collected's `aot` sizes
    ctx_ints: tuple = ()  # the sizes kept on its ctx, in `attrs` order (NOTE [Sizes kept on ctx])


@dataclass
class Collected:
    """One backward's graph: `key` (structure, constants, tensor metadata and
    layouts) and `sizes` (the node SymInts, then each lifted tensor's dims)
    together identify a static graph; a dynamic graph matches `key`, the
    sizes it keeps static, and its guards."""

    capture: Any
    key: tuple
    sizes: tuple
    n_size_inputs: int
    lifted: list
    n_native: int
    unpacked: tuple  # per hooked saved tensor: its lifted index (unpacked up front), or -1 when unpacked in the graph
    pynodes: dict = field(default_factory=dict)
    hooks: list = field(default_factory=list)  # (unpack_hook, packed, learned key or None) per hooked saved tensor
    in_graph: tuple = ()  # an InGraph per saved tensor unpacked in the graph
    grad_on_ctx: bool = False  # a leaf's .grad, accumulated into by this backward, is kept on ctx

    # ints saved by torch.compile'd regions for their inlined backwards, and sizes kept on custom
    # Functions' ctx (NOTE [Sizes kept on ctx]), in `sizes` before those shapes
    n_aot: int = 0

    @property
    def in_graph_start(self) -> int:
        """Where the shapes of the tensors unpacked in the graph start in `sizes` (they end it)."""
        return len(self.sizes) - sum(u.dim for u in self.in_graph)

    @property
    def aot_start(self) -> int:
        """Where the ints of the inlined AOTAutograd backwards start in `sizes`."""
        return self.in_graph_start - self.n_aot

    @property
    def up_front(self) -> list:
        """The lifted index of every tensor unpacked when the backward started."""
        return [i for i in self.unpacked if i >= 0]

    @functools.cached_property
    def tensor_positions(self) -> tuple:
        """For each lifted tensor, where its geometry sits in `sizes`: (start, dim, strides
        included); then comes its storage offset."""
        out, pos = [], self.n_size_inputs
        for t in self.lifted:
            with_strides = not isinstance(layout_signature(t), str)
            out.append((pos, t.dim(), with_strides))
            pos += t.dim() * (2 if with_strides else 1) + 1
        return tuple(out)

    @functools.cached_property
    def nodes(self) -> tuple:
        """A NodeRow per node, in the engine's order."""
        return NodeRow.rows(self.capture)


class InGraph(NamedTuple):
    """A saved tensor unpacked inside the graph, at its node (NOTE [Unpacking in the graph])."""

    hid: int  # its position among the saved tensors with hooks
    dtype: torch.dtype
    device: torch.device
    dim: int  # its shape is in the sizes vector (Collected.in_graph_start on)
    order: tuple  # its dims from outermost to innermost in memory (ops.OutputMeta.dense)


class Learn:
    """A backward whose user unpack hooks return what no earlier backward of this graph and
    sizes has shown (NOTE [Unpack metadata learned from the last backward]): it runs in
    eager autograd, each hook at its node, and `report` learns what each returned."""

    def __init__(self, capture, keys: dict):
        self.capture = capture
        self.keys = keys  # hooked tensor position -> learned key
        self.reported: set = set()

    def report(self, i, t) -> None:
        self.reported.add(i)
        if LEARNED.learn(self.keys[i], t) is None:
            LEARNED.mark_unpredictable(self.keys[i])

    def finish(self) -> None:
        """After the backward: a tensor eager did not unpack (its node's formula did not need
        it) gives nothing to learn; it is unpacked when the backward starts from then on."""
        for i, key in self.keys.items():
            if i not in self.reported:
                LEARNED.mark_unpredictable(key)


def layout_signature(t: torch.Tensor):
    """What a tensor's strides are, as far as the key is concerned: 'C' or
    channels-last when they follow from its sizes, else the strides."""
    if t.is_contiguous():
        return "C"
    if t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last):
        return "L"
    if t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d):
        return "M"
    return t.stride()


class _Lifter:
    """Lifts the tensors only Python sees (a custom Function's saved tensors and ctx
    attributes) after the native ones: each one's key entries and its geometry (the sizes
    vector) as the native collector writes them (`tensor_key`, native helper)."""

    def __init__(self, lifted: list):
        from .. import native

        self._key = native.load().tensor_key
        self.lifted = lifted
        self.index = {id(t): i for i, t in enumerate(lifted)}
        self.extra_keys: list = []
        self.geometry: list = []

    def __call__(self, t: torch.Tensor) -> int:
        i = self.index.get(id(t))
        if i is None:
            try:
                if type(t) not in (torch.Tensor, torch.nn.Parameter):
                    raise ValueError("tensor subclass")
                key, geometry = self._key(t)
            except ValueError as e:  # (the native helper's reason)
                raise Unkeyable(str(e)) from None
            self.extra_keys.append(key)
            self.geometry += geometry
            i = self.index[id(t)] = len(self.lifted)
            self.lifted.append(t)
        return i

    def mark(self) -> tuple:
        return len(self.lifted), len(self.extra_keys), len(self.geometry)

    def rollback(self, mark: tuple) -> None:
        """Forget what was lifted since `mark` (a node that turned out to run opaquely: what it
        holds is not the graph's business, NOTE [Opaque nodes keep their state out of the key])."""
        n, k, g = mark
        for t in self.lifted[n:]:
            del self.index[id(t)]
        del self.lifted[n:], self.extra_keys[k:], self.geometry[g:]


_SCALARS = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device,
            torch.layout, torch.memory_format, enum.Enum)
_BY_IDENTITY = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type, types.ModuleType,
                torch.nn.Module)


def _exact(v):
    """The key of an immutable value, telling apart what `==` does not: -0.0 from 0.0 (a
    backward dividing by it gives -inf or inf) and NaN from itself (never equal: a miss
    every time)."""
    if isinstance(v, (float, complex)):
        return (type(v), repr(v))
    if type(v) is tuple:
        return (tuple, tuple(_exact(x) for x in v))
    return (type(v), v)


def _value_key(v, lift: _Lifter, user: bool = True):
    """A hashable description of a ctx attribute: scalars by value, tensors by
    lifted position, functions/classes/modules by identity (a user's Function's
    modules and classes, and functions that read state, are unkeyable: NOTE [Python
    state a backward reads])."""
    if isinstance(v, torch.Tensor):
        return ("T", lift(v))
    if v is _SIZE:  # NOTE [Sizes kept on ctx]: its value is in the sizes vector
        return ("Z",)
    if type(v) is _SizeTemplate:
        return ("S", tuple(_value_key(x, lift, user) for x in v.items))
    if isinstance(v, _SCALARS):
        return _exact(v)
    if isinstance(v, torch.Size):
        return ("S", tuple(v))
    if isinstance(v, (tuple, list)):
        return (type(v), tuple(_value_key(x, lift, user) for x in v))
    if isinstance(v, dict):
        try:
            items = sorted(v.items(), key=lambda kv: repr(kv[0]))
        except Exception as e:  # pragma: no cover
            raise Unkeyable(str(e))
        return ("D", tuple((k, _value_key(x, lift, user)) for k, x in items))
    if user and isinstance(v, torch.nn.Module):
        # its attributes are state a backward may read (NOTE [Python state a backward reads])
        raise Unkeyable(f"ctx.{type(v).__name__} (a module: its attributes are not keyed)")
    if user and isinstance(v, type) and not _pure_module(getattr(v, "__module__", "") or ""):
        raise Unkeyable(f"ctx.{v.__qualname__} (a class: its attributes are not keyed)")
    if user and isinstance(v, types.FunctionType):
        why, values = state_key(v)
        if why is not None:
            raise Unkeyable(f"a function on ctx reads {why}")
        return ("fn", v, values)
    if isinstance(v, _BY_IDENTITY):
        return ("id", v)
    raise Unkeyable(f"ctx.{type(v).__name__} value")


# NOTE [Python state a backward reads]
# A custom Function's backward is traced once per key: a Python number it reads
# from anywhere but ctx (a global, a class attribute, a closure, an attribute of
# a module kept on ctx: a gradient-reversal lambda or a temperature annealed
# between steps) becomes a constant of the graph, and the next step's hit would
# use the old value. ctx's own attributes are keyed by value; for the rest the
# backward's code is read (and that of the user functions it calls, a few levels
# deep): names that resolve to modules, functions and classes of torch and the
# standard library are fine; globals, closure cells and class attributes holding
# immutable values (numbers, strings, dtypes, tuples of them) are read again at
# every collect and keyed by value, as ctx's attributes are; plain tensors the
# backward's own code reads from globals and closures are graph inputs (below); a
# backward that writes a global or a closure cell (a count of its calls) would do it
# once per trace and never on a hit; anything else is state, and the node runs
# opaquely (as is, every step). An nn.Module or user class kept on ctx is state too
# (its attributes are not keyed).
#
# NOTE [Tensors a backward reads from globals and closures]
# A Function made by a factory closes over a tensor (a kernel, a mask); a module-level
# constant tensor is read by name. A trace would freeze the tensor's values as a
# constant, and the user may change them in place or rebind the name between steps.
# Torch's built-in compiled autograd lifts them (dynamo makes globals graph inputs);
# we lift them too: at every collect the name is read again, its tensor is lifted like
# a ctx tensor (its metadata in the key, its data a graph input), and the trace calls
# a copy of the backward (`swapped`) whose globals and closure cells give the tracer's
# stand-in for it -- a copy, so no other thread ever sees the stand-in. Only the
# backward's own code and the functions it reaches through closure cells (a
# decorator's: once_differentiable) are copied; a tensor read by a function it calls
# through a global, a module or a class is still state. Like a tensor kept on ctx,
# eager reads it without a version check when the node runs, after the hooks before
# it: it is passed on by a hook's call (NOTE [Hooks may change what the graph reads]);
# a backward that changes it in place runs opaquely (as for ctx tensors).
_PURE_MODULES = ("torch", "math", "cmath", "operator", "functools", "itertools", "numbers", "typing",
                 "builtins", "collections", "enum", "warnings", "numpy", "compiled_autograd", "_pytest")


def _pure_module(name: str) -> bool:
    return name.split(".")[0] in _PURE_MODULES


def _state_in(v, depth: int, seen: set, keyed: list, liftable: bool = False) -> str | None:
    """Why reading `v` (a global, closure or ctx value) is reading state, or None."""
    if isinstance(v, types.ModuleType):
        return None if _pure_module(v.__name__) else f"module {v.__name__}"
    if isinstance(v, (types.BuiltinFunctionType, types.BuiltinMethodType, torch._ops.OpOverloadPacket,
                      torch._ops.OpOverload, type(None), bool, str, bytes, torch.dtype, torch.device)):
        return None
    if isinstance(v, type):
        if _pure_module(getattr(v, "__module__", "") or "") or issubclass(v, torch.autograd.Function):
            return None
        return f"class {v.__qualname__}"
    if isinstance(v, types.FunctionType):
        if _pure_module(getattr(v, "__module__", "") or ""):
            return None
        return _code_reads_state(v, depth + 1, seen, keyed, liftable)
    if isinstance(v, (staticmethod, classmethod)):
        return _state_in(v.__func__, depth, seen, keyed)
    return f"a {type(v).__name__}"


def _immutable(v) -> bool:
    return isinstance(v, _SCALARS) or (type(v) is tuple and all(_immutable(x) for x in v))


def _code_reads_state(fn, depth: int = 0, seen: set | None = None, keyed: list | None = None,
                      liftable: bool = True) -> str | None:
    """Why `fn`'s code reads Python state a trace would freeze, or None (NOTE [Python
    state a backward reads]). The reads of globals, closure cells and class attributes
    that hold immutable values (numbers, strings, dtypes, tuples of them) go to `keyed`
    as (container, name): their values are part of the key. `liftable`: `fn` is the
    function itself or reached from it through closure cells only (a decorator's
    wrapped function), so a copy of it can read other values (`swapped`): its reads of
    globals and closure cells holding plain tensors go to `keyed` as (container, name,
    True) (NOTE [Tensors a backward reads from globals and closures])."""
    seen = set() if seen is None else seen
    keyed = [] if keyed is None else keyed
    if fn in seen:
        return None
    seen.add(fn)
    if depth > 3:
        return f"{fn.__qualname__} (calls nested too deep to read)"
    import builtins
    import dis

    code = fn.__code__
    cells = dict(zip(code.co_freevars, (c.cell_contents if _cell_full(c) else None for c in fn.__closure__ or ())))
    codes = [code]
    while codes:
        c = codes.pop()
        instructions = list(dis.get_instructions(c))
        for i, ins in enumerate(instructions):
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_CLASSDEREF"):
                name, closure = ins.argval, ins.opname in ("LOAD_DEREF", "LOAD_CLASSDEREF")
                if closure:
                    if name not in cells:
                        continue  # a local cell of this function
                    v = cells[name]
                elif name in fn.__globals__:
                    v = fn.__globals__[name]
                elif hasattr(builtins, name):
                    continue
                else:
                    return f"global {name}"
                what = f"{'closure' if closure else 'global'} {name}"
                where = (fn.__closure__[code.co_freevars.index(name)], None) if closure else (fn.__globals__, name)
                if _immutable(v):
                    keyed.append(where)
                    continue
                if liftable and type(v) in (torch.Tensor, torch.nn.Parameter):
                    keyed.append((*where, True))
                    continue
                why = _state_in(v, depth, seen, keyed, liftable and closure)
                if why is None and isinstance(v, type) and not _pure_module(getattr(v, "__module__", "") or ""):
                    why = _class_attr_state(v, instructions[i + 1 : i + 2], keyed)  # MyFunction.scale
                if why is not None:
                    return f"{what} ({why})"
            elif ins.opname in ("STORE_GLOBAL", "DELETE_GLOBAL") or (
                ins.opname in ("STORE_DEREF", "DELETE_DEREF") and ins.argval in cells
            ):  # (a count of calls: a trace runs it once, a hit never)
                return f"a write to {'global' if 'GLOBAL' in ins.opname else 'closure'} {ins.argval}"
            elif ins.opname == "IMPORT_NAME" and not _pure_module(ins.argval):
                return f"import {ins.argval}"
        codes.extend(k for k in c.co_consts if isinstance(k, types.CodeType))  # nested functions, lambdas
    return None


def _class_attr_state(cls, following, keyed: list) -> str | None:
    """A user class's attribute read right after loading the class: state unless a
    function, or an immutable value (keyed)."""
    import inspect

    for ins in following:
        if ins.opname in ("LOAD_ATTR", "LOAD_METHOD"):
            try:
                v = inspect.getattr_static(cls, ins.argval)
            except AttributeError:
                return f"attribute {ins.argval}"
            if _immutable(v):
                keyed.append((cls, ins.argval))
            elif not isinstance(v, (types.FunctionType, staticmethod, classmethod, property, types.BuiltinFunctionType,
                                    types.MethodDescriptorType, types.WrapperDescriptorType, types.ClassMethodDescriptorType)):
                return f"class attribute {ins.argval}"
    return None


def _cell_full(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _scan(fn) -> tuple:
    """(why `fn` reads state, or None; its keyed reads), cached per function."""
    cached = _STATE_READS.get(fn, _MISSING)
    if cached is _MISSING:
        keyed: list = []
        try:
            why = _code_reads_state(fn, keyed=keyed)
        except Exception as e:  # another Python's bytecode
            why = f"code that could not be read ({type(e).__name__})"
        cached = _STATE_READS[fn] = (why, tuple(keyed))
    return cached


def state_key(fn, tensors: list | None = None) -> tuple:
    """(why `fn` reads Python state a trace would freeze, or None; the current values of
    the immutable globals, closure cells and class attributes it reads: for the key).
    With `tensors`, the plain tensors its own code reads from globals and closures go
    there as (container, name, tensor), for the caller to lift; without, they are state."""
    why, keyed = _scan(fn)
    if why is not None:
        return why, ()
    values = []
    for container, name, *is_tensor in keyed:
        v = read_state(container, name)
        if is_tensor:
            if tensors is None or type(v) not in (torch.Tensor, torch.nn.Parameter):
                return f"{name or 'a closure value'} (a {type(v).__name__})", ()
            values.append(("T",))
            tensors.append((container, name, v))
            continue
        if not _immutable(v):
            return f"{name or 'a closure value'} (now a {type(v).__name__})", ()
        values.append(_exact(v))
    return None, tuple(values)


def read_state(container, name):
    """The value now in a global (container: the globals dict), a closure cell (name None)
    or a class attribute."""
    if name is None:
        return container.cell_contents if _cell_full(container) else _MISSING
    if isinstance(container, dict):
        return container.get(name, _MISSING)
    return getattr(container, name, _MISSING)


def state_reads(cls) -> tuple:
    """(container, name) of the globals, closure cells and class attributes a traced custom
    Function's backward reads (keyed by value, or lifted): a hook may rebind one before the
    node runs (Plan.ctx_checks)."""
    if _pure_module(getattr(cls, "__module__", "") or ""):
        return ()
    fn = user_backward(cls)
    if not isinstance(fn, types.FunctionType):
        return ()
    reads = _READS_OF.get(fn)
    if reads is None:  # (once per function: the hits of graphs with hooks ask per node)
        why, keyed = _scan(fn)
        reads = _READS_OF[fn] = () if why is not None else tuple((c, n) for c, n, *_ in keyed)
    return reads


def user_backward(cls):
    """The function a custom Function's PyNode calls: vjp where overridden, else backward
    (as `BackwardCFunction._get_user_fn`)."""
    vjp = getattr(cls, "vjp", None)
    fn = vjp if vjp is not None and vjp is not torch.autograd.Function.vjp else getattr(cls, "backward", None)
    return getattr(fn, "__func__", fn)


def backward_state_key(cls, tensors: list | None = None) -> tuple:
    """`state_key` of the function a custom Function's PyNode calls. Torch's and ours
    (create_graph's) read none."""
    if _pure_module(getattr(cls, "__module__", "") or ""):
        return None, ()
    fn = user_backward(cls)
    if not isinstance(fn, types.FunctionType):
        return "a backward that is not a function", ()
    return state_key(fn, tensors)


def swapped(fn, values: dict):
    """A copy of `fn` whose reads of the globals and closure cells in `values` ((id of
    the globals dict or cell, name) -> value; a cell's name is None) give those values,
    as do the copies of the functions its closure cells hold: only the caller of the
    copy sees them (NOTE [Tensors a backward reads from globals and closures])."""

    def copy(f, depth):
        g = f.__globals__
        mine = {name: v for (where, name), v in values.items() if where == id(g)}
        if mine:
            g = {**g, **mine}
        cells = []
        for cell in f.__closure__ or ():
            if (id(cell), None) in values:
                cell = types.CellType(values[(id(cell), None)])
            elif depth < 3 and _cell_full(cell) and isinstance(cell.cell_contents, types.FunctionType) \
                    and not _pure_module(getattr(cell.cell_contents, "__module__", "") or ""):
                cell = types.CellType(copy(cell.cell_contents, depth + 1))  # (a decorator's function)
            cells.append(cell)
        new = types.FunctionType(f.__code__, g, f.__name__, f.__defaults__, tuple(cells) or None)
        new.__kwdefaults__ = f.__kwdefaults__
        new.__dict__.update(f.__dict__)
        return new

    return copy(fn, 0)


_MISSING = object()
_STATE_READS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_READS_OF: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # fn -> `state_reads`


# NOTE [Functions whose values change every step]
# A custom Function's ctx values and the Python state its backward reads are keyed by value
# (NOTE [Python state a backward reads]): each new value is a new graph. A gradient-reversal
# layer whose lambda is annealed every step (ctx.lam), a temperature, a loss weight: every
# backward was a capture and a compile (seconds each under inductor), for ever. So the
# captures are counted per Function class: once a class has been captured with more than
# CHURN_LIMIT different sets of values (the values of all its nodes in one graph: a model
# that applies it with twelve fixed scales is one set), its nodes run as they are, opaquely,
# and the rest of the graph is captured once more and then hits. (As dynamo's recompile
# limit; the node's own backward, run eagerly, reads each step's values.)
CHURN_LIMIT = 8


class _Churn:
    def __init__(self):
        self.sets: dict = {}  # cls -> the distinct sets of its values, one per capture
        self.opaque: dict = {}  # cls -> the reason its nodes now run opaquely
        self.lock = threading.Lock()

    def note_capture(self, collected) -> list[str]:
        """Count the custom Functions a new graph traced; the names of those that just went opaque."""
        pykeys = collected.key[1] if len(collected.key) > 1 else ()
        per_cls: dict = {}
        for _, k in pykeys:
            if len(k) == 7:  # ("py", cls, flags, needs_input_grad, saved, attrs, state): traced
                per_cls.setdefault(k[1], set()).add((_values_only(k[5]), _values_only(k[6])))
        went = []
        with self.lock:
            for cls, values in per_cls.items():
                sets = self.sets.setdefault(cls, set())
                sets.add(frozenset(values))
                if len(sets) > CHURN_LIMIT and cls not in self.opaque:
                    self.opaque[cls] = (
                        f"its ctx values or the Python state its backward reads changed in {len(sets)} captures "
                        "(NOTE [Functions whose values change every step]): it runs as is instead of a capture per value"
                    )
                    went.append(cls.__qualname__)
        return went

    def clear(self):
        with self.lock:
            self.sets.clear()
            self.opaque.clear()


CHURN = _Churn()


def _values_only(key):
    """A ctx attributes' key without the lifted positions of their tensors, which change with
    the graph around the node, not with the values (`_value_key`: ("T", position))."""
    if type(key) is tuple:
        if len(key) == 2 and key[0] == "T" and type(key[1]) is int:
            return ("T",)
        return tuple(_values_only(x) for x in key)
    return key


# NOTE [Sizes kept on ctx]
# A custom Function often keeps a size on ctx (`ctx.shape = x.shape`, `ctx.n = x.size(0)`) and
# its backward computes with it (`g * ctx.shape[0]`, `g.expand(ctx.shape)`). Keyed by value, as
# any ctx constant, every new size was a new key: a capture per size, where a built-in node's
# saved sizes are size inputs that the dynamic-shape policy makes symbolic after the first
# change. So the ints on ctx (alone, or in tuples, lists, dicts and torch.Size) that equal a
# size or the numel of one of the node's tensors (its saved tensors and those on ctx, its
# forward outputs, the inputs it sends grads to) when it is collected, 0 and 1 aside (always
# specialized), are taken out of the key (a ("Z",) there) and put in the sizes vector, among
# the `aot` ints (`PyNodeInfo.ctx_ints`, in `attrs` order); `attrs` holds the attribute with
# `_SIZE` where each was, and the trace puts each back (`fill_sizes`): the int itself in a
# static graph, its SymInt in a dynamic one (the trace swaps the attribute as it swaps ctx
# tensors for fakes). Whether an int is taken depends on this collect's values only: one that
# equals a size by chance in one step and not in the next just has another key.
#
# What keeps this from giving a wrong gradient: a symbolic trace keeps the graph right for ints
# that flow into tensor ops and sizes (computed from the graph's inputs at every run) and for
# ints the backward turns into Python values (`if ctx.n > 3`, `range(ctx.n)`, `float(ctx.n)`, an
# int argument such as a `dim`): each reads the SymInt's value through a guard, checked before
# every hit, whose failure is a miss and a new capture (specialized, after a few, as any size).
# A backward that cannot run on a SymInt at all (it hashes it, hands it to a numpy ufunc)
# becomes an opaque node of that dynamic graph (it runs as is, on the real values). But Python
# code can also tell a SymInt from an int with no guard at all, and then take another branch in
# the trace than eager takes, silently: `isinstance(ctx.k, int)`, `type(ctx.k)`, `str(ctx.k)`
# and f-strings (which read the trace's value: measured, a wrong gradient on the next hit). So
# ints are taken only when the backward's code, and the user functions it reaches (through
# globals, closure cells, class attributes, functions kept on ctx: what `_code_reads_state`
# follows), does none of that: no isinstance/issubclass/type/str/repr/format/id/hash/vars/dir,
# no f-string or %-formatting, no `__class__`, no class pattern (`_tells_symints_apart`);
# otherwise they stay constants of the key, as before. Torch's own Python code (a wrapper such
# as once_differentiable's) is trusted: it runs under symbolic tracing as make_fx, AOTAutograd
# and export run it. Left open: an `is` between two ints (small ints are one object in eager,
# two SymInts never are), and code reached only through an object's attribute other than a
# class attribute (a user module's function: that is state, the node runs opaquely anyway).
#
# Why only ints that are sizes, not every int: a flag or a mode kept as an int is not a size
# the backward computes with; as a constant of the key it is never symbolic, and one that
# changes every step (a step count) stays counted by NOTE [Functions whose values change every
# step] instead of making a graph per guard failure.
class _SizeTemplate:
    """A torch.Size on ctx with the sizes taken out of it (`_SIZE` in their places)."""

    __slots__ = ("items",)

    def __init__(self, items: tuple):
        self.items = items


class _SizeMark:
    def __repr__(self) -> str:
        return "<size kept on ctx>"


_SIZE = _SizeMark()


def _has_int(v) -> bool:
    if type(v) is int:
        return v >= 2
    if type(v) in (tuple, list, torch.Size):
        return any(_has_int(x) for x in v)
    if type(v) is dict:
        return any(_has_int(x) for x in v.values())
    return False


def _node_sizes(capture, idx: int, node, saved) -> set:
    """The sizes (and numels) of a custom Function node's tensors, 0 and 1 aside."""
    shapes = [t.shape for t in saved if t is not None]
    shapes += [t.shape for v in vars(node).values() for t in _tensors(v)]
    shapes += [m[0] for m in capture.input_metadata(idx) if m is not None]
    for fn, nr in node.next_functions:
        if fn is not None:
            try:
                shapes.append(fn._input_metadata[nr].shape)
            except (AttributeError, IndexError, RuntimeError):
                pass
    out = set()
    for shape in shapes:
        out.update(shape)
        out.add(math.prod(shape))
    return {v for v in out if v >= 2}


def _take_sizes(v, sizes: set, out: list):
    """`v` with its ints that are in `sizes` replaced by `_SIZE` (their values appended to
    `out`); `v` itself when it holds none."""
    if type(v) is int:
        if v in sizes:
            out.append(v)
            return _SIZE
        return v
    if type(v) is torch.Size:
        items = tuple(_take_sizes(x, sizes, out) for x in v)
        return _SizeTemplate(items) if any(x is _SIZE for x in items) else v
    if type(v) in (tuple, list):
        items = [_take_sizes(x, sizes, out) for x in v]
        return type(v)(items) if any(a is not b for a, b in zip(items, v)) else v
    if type(v) is dict:
        items = {k: _take_sizes(x, sizes, out) for k, x in v.items()}
        return items if any(items[k] is not x for k, x in v.items()) else v
    return v


def fill_sizes(v, ints):
    """A ctx attribute from `attrs` with its sizes put back, from the iterator `ints` (ints,
    or SymInts in a dynamic trace) (NOTE [Sizes kept on ctx])."""
    if v is _SIZE:
        return next(ints)
    if type(v) is _SizeTemplate:
        return torch.Size([fill_sizes(x, ints) for x in v.items])
    if type(v) in (tuple, list):
        items = [fill_sizes(x, ints) for x in v]
        return type(v)(items) if any(a is not b for a, b in zip(items, v)) else v
    if type(v) is dict:
        items = {k: fill_sizes(x, ints) for k, x in v.items()}
        return items if any(items[k] is not x for k, x in v.items()) else v
    return v


# NOTE [Opaque nodes keep their state out of the key]
# A node that runs opaquely runs its own backward, as is, with the values it holds when it
# runs: the graph bakes in none of its Python state (its ctx values, the identity of a closure
# it keeps), only its outputs' metadata (the native key holds it). So its key is its class and
# the reason it is opaque, nothing it holds: no ctx value is keyed, no tensor of it lifted
# (what was lifted before the reason was found is forgotten, `_Lifter.rollback`). Reentrant
# checkpointing (torch.utils.checkpoint.CheckpointFunction, Hugging Face's gradient
# checkpointing with use_reentrant=True) is known opaque by its class, before its ctx is read:
# its backward recomputes the region and runs a backward inside (compiled on its own), which no
# trace can inline; keyed, its `run_function` (a new lambda or functools.partial each step)
# made every step a capture.
REENTRANT_CHECKPOINT = "reentrant checkpoint: runs eagerly inside the graph"


def _is_reentrant_checkpoint(cls) -> bool:
    ckpt = sys.modules.get("torch.utils.checkpoint")  # (not imported: no such node exists)
    return ckpt is not None and cls is getattr(ckpt, "CheckpointFunction", None)


_TELLS_APART_NAMES = frozenset({"isinstance", "issubclass", "type", "str", "repr", "ascii", "format", "id", "hash",
                                "vars", "dir"})
_TELLS_APART_ATTRS = frozenset({"format", "format_map", "__class__", "__str__", "__repr__", "__format__", "__hash__",
                                "__dict__"})
_TELLS_APART_OPS = frozenset({"FORMAT_VALUE", "FORMAT_SIMPLE", "FORMAT_WITH_SPEC", "CONVERT_VALUE", "BUILD_STRING",
                              "MATCH_CLASS"})
_TELLS_APART: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # fn -> `_tells_symints_apart`


def _tells_symints_apart(fn, depth: int = 0, seen: set | None = None) -> str | None:
    """What in `fn`'s code, or in a user function it reaches, may tell a SymInt from an int
    without a guard (NOTE [Sizes kept on ctx]); None when nothing does."""
    if depth == 0:
        cached = _TELLS_APART.get(fn, _MISSING)
        if cached is not _MISSING:
            return cached
    seen = set() if seen is None else seen
    if fn in seen:
        return None
    seen.add(fn)
    if depth > 3:
        return f"{fn.__qualname__} (calls nested too deep to read)"
    import dis
    import inspect

    trusted = _pure_module(getattr(fn, "__module__", "") or "")  # (its user callees are still read)
    code = fn.__code__
    cells = dict(zip(code.co_freevars, (c.cell_contents if _cell_full(c) else None for c in fn.__closure__ or ())))
    why, codes = None, [code]
    try:
        while codes and why is None:
            c = codes.pop()
            percent = any(isinstance(k, str) and "%" in k for k in c.co_consts)
            instructions = list(dis.get_instructions(c))
            for i, ins in enumerate(instructions):
                op, name = ins.opname, ins.argval
                if not trusted:
                    if op in _TELLS_APART_OPS:
                        why = f"{fn.__qualname__}: {op}"
                    elif op in ("LOAD_GLOBAL", "LOAD_NAME") and name in _TELLS_APART_NAMES and name not in fn.__globals__:
                        why = f"{fn.__qualname__}: {name}()"
                    elif op in ("LOAD_ATTR", "LOAD_METHOD") and name in _TELLS_APART_ATTRS:
                        why = f"{fn.__qualname__}: .{name}"
                    elif op in ("BINARY_OP", "BINARY_MODULO", "INPLACE_MODULO") and percent and "%" in (ins.argrepr or "%"):
                        why = f"{fn.__qualname__}: % formatting"
                    if why is not None:
                        break
                if op not in ("LOAD_GLOBAL", "LOAD_NAME", "LOAD_DEREF", "LOAD_CLASSDEREF"):
                    continue
                if op in ("LOAD_DEREF", "LOAD_CLASSDEREF"):
                    if name not in cells:
                        continue
                    v = cells[name]
                elif name in fn.__globals__:
                    v = fn.__globals__[name]
                else:
                    continue  # a builtin (or a NameError eager raises too)
                if isinstance(v, type) and not _pure_module(getattr(v, "__module__", "") or ""):
                    # a user class's function attribute (`MyFunction.helper(ctx.n)`)
                    nxt = instructions[i + 1] if i + 1 < len(instructions) else None
                    if nxt is None or nxt.opname not in ("LOAD_ATTR", "LOAD_METHOD"):
                        continue
                    try:
                        v = inspect.getattr_static(v, nxt.argval)
                    except AttributeError:
                        continue
                if isinstance(v, (staticmethod, classmethod)):
                    v = v.__func__
                if isinstance(v, types.FunctionType) and not _pure_module(getattr(v, "__module__", "") or ""):
                    why = _tells_symints_apart(v, depth + 1, seen)
                    if why is not None:
                        break
            codes.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    except Exception as e:  # another Python's bytecode
        why = f"code that could not be read ({type(e).__name__})"
    if depth == 0:
        _TELLS_APART[fn] = why
    return why


def _sizes_may_be_symbolic(cls, values) -> bool:
    """Whether a custom Function's backward cannot tell its ctx ints from SymInts without a
    guard (NOTE [Sizes kept on ctx]): its code and the user functions it reaches, and the
    functions it keeps on ctx (it may call them with its ints)."""
    fn = user_backward(cls)
    if not isinstance(fn, types.FunctionType) or _tells_symints_apart(fn) is not None:
        return False
    for v in values:
        for x in _leaves(v):
            if isinstance(x, types.FunctionType):
                if _tells_symints_apart(x) is not None:
                    return False
            elif callable(x) and not isinstance(x, torch.Tensor):
                return False
    return True


def _leaves(v) -> list:
    if isinstance(v, (tuple, list)):
        return [y for x in v for y in _leaves(x)]
    if isinstance(v, dict):
        return [y for x in v.values() for y in _leaves(x)]
    return [v]


def _collect_pynode(capture, idx: int, lift: _Lifter, keep_graph: bool) -> tuple[tuple, PyNodeInfo]:
    node = capture.node_object(idx)
    m, mnd, boxed, is_var = capture.pynode_flags(idx)
    flags = (m, mnd, boxed, tuple(is_var))
    cls = node._forward_cls
    info = PyNodeInfo(flags=flags, saved=(), attrs=())
    if flags[2]:
        # AOTAutograd's CompiledFunction is the one boxed Function we trace (NOTE [Inlining
        # AOTAutograd backwards], nodes/compiled_region.py); any other runs as is
        why = aot.inline_reason(cls, node) if aot.is_compiled_function(cls) else "boxed_grads_call Function"
        if why is not None:
            info.opaque_reason = why
            return ("py", cls, "opaque", why), info
        if keep_graph:
            aot.check_keep_graph(cls)  # (eager's error: a RuntimeError, eager raises it again)
        saved = list(node.saved_tensors)
        capture.hand_over_saved(idx, saved, keep_graph)
        info.saved = tuple(lift(t) if t is not None else -1 for t in aot.saved_tensors(node, saved))
        info.symints = tuple(node.symints)
        return ("py", cls, flags, tuple(node.needs_input_grad), info.saved, aot.key(info.symints)), info
    # reading saved_tensors runs eager's own checks (freed graph, version
    # counter) and saved-tensor unpack hooks
    saved = node.saved_tensors
    # what their unpack hooks returned serves the rest of this backward: the node may yet run
    # its own backward (opaque), or eager its own (a fallback)
    capture.hand_over_saved(idx, list(saved), keep_graph)
    if _is_reentrant_checkpoint(cls):  # NOTE [Opaque nodes keep their state out of the key]
        info.opaque_reason = REENTRANT_CHECKPOINT
        return ("py", cls, "opaque", REENTRANT_CHECKPOINT), info
    user = not _pure_module(getattr(cls, "__module__", "") or "")
    churned = CHURN.opaque.get(cls)
    if churned is not None:
        info.opaque_reason = churned
        return ("py", cls, "opaque", churned), info
    read: list = []  # NOTE [Tensors a backward reads from globals and closures]
    why, state = backward_state_key(cls, read)
    if why is not None:
        if why.startswith("a write to"):
            info.opaque_reason = f"its backward makes {why}, which a trace would make once and a cache hit never"
        else:
            info.opaque_reason = f"its backward reads {why}, which a trace would freeze"
        return ("py", cls, "opaque", info.opaque_reason), info
    mark = lift.mark()
    try:
        info.saved = tuple(lift(t) if t is not None else -1 for t in saved)
        info.read = tuple((id(where), name, lift(t)) for where, name, t in read)
        attrs = []
        attr_keys = []
        ints: list = []  # NOTE [Sizes kept on ctx]
        items = sorted(vars(node).items())
        sizes = ()
        if any(_has_int(v) for _, v in items) and _sizes_may_be_symbolic(cls, [v for _, v in items]):
            sizes = _node_sizes(capture, idx, node, saved)
        for name, value in items:
            kept = _take_sizes(value, sizes, ints) if sizes else value
            attr_keys.append((name, _value_key(kept, lift, user)))
            if kept is not value or _tensors(value):
                attrs.append((name, kept))
        info.attrs = tuple(attrs)
    except Unkeyable as e:
        # NOTE [Opaque nodes keep their state out of the key]
        lift.rollback(mark)
        info.saved, info.read = (), ()
        info.opaque_reason = str(e)
        return ("py", cls, "opaque", info.opaque_reason), info
    info.ctx_ints = tuple(ints)
    key = ("py", cls, flags, tuple(node.needs_input_grad), info.saved, tuple(attr_keys), state + tuple(("T", i) for _, _, i in info.read))
    return key, info


def collect(capture, run_unpack_hooks: bool = True, keep_graph: bool = True) -> Collected | None:
    """None when the graph has saved-tensor hooks and `run_unpack_hooks` is False: the caller
    falls back to eager, which must be the first to run them (a hook may pop what it stashed).
    A tensor unpacked here is handed to its saved variable (NOTE [Handing unpacked tensors to
    their saved variables], native helper): nothing else in this backward runs its hook again;
    with `keep_graph`, the caller puts the hooks back (`capture.restore_saved_hooks()`)."""
    saved_hooks = capture.take_saved_hooks()
    if saved_hooks and not run_unpack_hooks:
        return None
    pynode_indices = capture.pynode_indices()
    if not saved_hooks and not pynode_indices:
        lifted = capture.lifted()
        return Collected(
            capture=capture,
            key=(capture.key(),),
            sizes=tuple(capture.sizes()),
            n_size_inputs=capture.num_size_inputs(),
            lifted=lifted,
            n_native=len(lifted),
            unpacked=(),
        )
    # unpack hooks may key state by the current graph task (non-reentrant
    # checkpointing recomputes once per backward): run them inside one (~60 us: not when
    # no unpack hook runs here)
    if not saved_hooks and not capture.pynodes_have_saved_hooks(pynode_indices):
        return _collect_python(capture, saved_hooks, pynode_indices, keep_graph)
    return in_graph_task(lambda: _collect_python(capture, saved_hooks, pynode_indices, keep_graph))


def _collect_python(capture, saved_hooks, pynode_indices, keep_graph) -> Collected | Learn:
    predict = _Predictor()
    metas, learn, native_key = [], {}, None
    for i, (hook, packed) in enumerate(saved_hooks):
        meta, learned = predict(hook, packed), None
        if meta is None or meta[3] is None:
            if native_key is None:  # (a digest: the table must not hold every graph's key)
                native_key = (hashlib.blake2b(capture.key(), digest_size=16).digest(), tuple(capture.sizes()))
            learned = (native_key, i, _hook_code(hook), _packed_meta(packed))
        if meta is not None and meta[3] is None:
            # a checkpoint's recomputed tensor: its layout is learned (NOTE [Layouts of call
            # outputs], replay/calls.py), from an eager backward when no backward showed it yet
            order = LEARNED.order(learned)
            if order is None and not LEARNED.is_unpredictable(learned):
                learn[i] = learned
            meta, learned = (*meta[:3], order or tuple(range(len(meta[0])))), None
        elif meta is None:
            meta = LEARNED.get(learned)
            if meta is None and not LEARNED.is_unpredictable(learned):
                meta = LEARNED.by_rule(learned)
                if meta is None:
                    learn[i] = learned
        metas.append((meta, learned))
    if learn:
        return Learn(capture, learn)
    lifted = list(capture.lifted())
    n_native = len(lifted)
    lift = _Lifter(lifted)
    unpacked, in_graph, shapes, hooks = [], [], [], []
    for i, ((hook, packed), (meta, learned)) in enumerate(zip(saved_hooks, metas)):
        if meta is None:  # unpredictable: unpacked now, a graph input
            t = unpack(hook, packed)
            capture.hand_over(i, t, keep_graph)
            unpacked.append(lift(t))
            hooks.append(None)
            continue
        shape, dtype, device, order = meta
        unpacked.append(-1)
        in_graph.append(InGraph(i, dtype, device, len(shape), order))
        shapes.extend(shape)
        hooks.append((hook, packed, learned))
    pykeys = []
    pynodes = {}
    for idx in pynode_indices:
        k, info = _collect_pynode(capture, idx, lift, keep_graph)
        pykeys.append((idx, k))
        pynodes[idx] = info
    grad_on_ctx = _grad_on_ctx(capture, pynodes, lifted)
    key = (capture.key(), tuple(pykeys), tuple(unpacked), tuple(in_graph), tuple(lift.extra_keys), grad_on_ctx)
    aot_ints: list = []  # sizes, as a dynamic capture may make them symbolic
    for info in pynodes.values():
        if info.symints is not None:
            info.aot_start = len(aot_ints)
            aot_ints += [s for s in info.symints if type(s) is int]
        elif info.ctx_ints:  # NOTE [Sizes kept on ctx]
            info.aot_start = len(aot_ints)
            aot_ints += info.ctx_ints
    sizes = tuple(capture.sizes()) + tuple(lift.geometry) + tuple(aot_ints) + tuple(shapes)
    return Collected(
        capture=capture,
        key=key,
        sizes=sizes,
        n_size_inputs=capture.num_size_inputs(),
        lifted=lifted,
        n_native=n_native,
        unpacked=tuple(unpacked),
        pynodes=pynodes,
        hooks=hooks if in_graph else [],
        in_graph=tuple(in_graph),
        grad_on_ctx=grad_on_ctx,
        n_aot=len(aot_ints),
    )


def _grad_on_ctx(capture, pynodes, lifted) -> bool:
    """Whether a custom Function keeps on ctx (or its backward reads from a global or a
    closure) the `.grad` of a leaf this backward accumulates into: eager's AccumulateGrad
    adds into it in place, before a later node reads it, so AccumulateGrad then runs in the
    graph at its eager position (not after the graph)."""
    kept = {id(lifted[i]) for i in kept_indices(pynodes, lifted)}
    return bool(kept) and any(id(g) in kept for g in capture.accumulated_grads())


def kept_indices(pynodes, lifted) -> set:
    """The lifted indices of the tensors custom Functions keep on ctx, and of those their
    backwards read from globals and closures: eager reads them as they are when the node
    runs, without a version check."""
    index = {id(t): i for i, t in enumerate(lifted)}
    out = {index[id(t)] for info in pynodes.values() for _, v in info.attrs for t in _tensors(v) if id(t) in index}
    return out | {i for info in pynodes.values() for _, _, i in info.read}


def _tensors(v) -> list:
    """The tensors in a ctx attribute: a tensor, or lists, tuples and dicts of them."""
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (tuple, list)):
        return [t for x in v for t in _tensors(x)]
    if isinstance(v, dict):
        return [t for x in v.values() for t in _tensors(x)]
    return []


def _nested_code(fn, name: str):
    for c in fn.__code__.co_consts:
        if isinstance(c, types.CodeType) and c.co_name == name:
            return c
    return None


def _closure(fn) -> dict:
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))


@functools.cache
def _known_unpack_hooks():
    """The code objects of checkpoint's and save_on_cpu's unpack hooks."""
    import torch.utils.checkpoint as ckpt

    return (
        _nested_code(ckpt._checkpoint_hook.__init__, "unpack_hook"),
        _nested_code(torch.autograd.graph.save_on_cpu.__init__, "unpack_from_cpu"),
    )


class _Predictor:
    """What an unpack hook will return, (shape, dtype, device), for the hooks
    whose result is known from what was packed (NOTE [Unpacking in the graph]);
    None for any other."""

    def __init__(self):
        import torch.utils.checkpoint as ckpt

        self._ckpt = ckpt
        self._ckpt_unpack, self._cpu_unpack = _known_unpack_hooks()
        self._holders: dict[int, dict] = {}  # id(checkpoint frame) -> {id(holder): position}

    def __call__(self, hook, packed):
        code = getattr(hook, "__code__", None)
        if code is None:
            return None
        try:
            if code is self._ckpt_unpack:
                return self._checkpointed(_closure(hook)["frame"], packed)
            if code is self._cpu_unpack:
                device, t = packed
                if isinstance(device, torch.device) and type(t) is torch.Tensor and t.layout == torch.strided:
                    # (it packed a contiguous copy, and unpacks that, moved)
                    return tuple(t.shape), t.dtype, device, tuple(range(t.dim()))
        except (KeyError, AttributeError, TypeError, ValueError):  # another torch's internals
            return None
        return None

    def _checkpointed(self, frame, holder):
        # the recomputation raises unless each recomputed tensor has the shape,
        # dtype and device recorded here when it was packed (the default check)
        if frame.metadata_fn is not getattr(self._ckpt, "_default_meta_extractor", None) or frame.ignore_saved_mismatch:
            return None
        index = self._holders.get(id(frame))
        if index is None:
            index = self._holders[id(frame)] = {id(r()): i for i, r in enumerate(frame.weak_holders)}
        i = index.get(id(holder))
        if i is None or i >= len(frame.x_metadatas):
            return None
        meta = frame.x_metadatas[i]
        if not isinstance(meta, dict) or not isinstance(meta.get("device"), torch.device):
            return None
        return tuple(meta["shape"]), meta["dtype"], meta["device"], None  # (its layout is learned)


def _packed_meta(packed):
    """What a packed value shows of its tensors (shape, dtype, device): part of the learned
    key, so that a saved tensor packed with another shape, where nothing else in the graph
    changed (index_fill's index), is not predicted from the last one (a hook that packs a
    key into its own stash shows nothing: that case raises, NOTE [Unpack metadata learned
    from the last backward])."""
    if isinstance(packed, torch.Tensor):
        return (tuple(packed.shape), packed.dtype, packed.device)
    if isinstance(packed, (tuple, list)):
        return tuple(_packed_meta(p) if isinstance(p, torch.Tensor) else type(p) for p in packed)
    return type(packed)


def _without_shapes(packed_meta):
    """_packed_meta's structure without its shapes: each tensor's rank, dtype and device."""
    if isinstance(packed_meta, tuple) and len(packed_meta) == 3 and isinstance(packed_meta[1], torch.dtype):
        shape, dtype, device = packed_meta
        return (len(shape), dtype, device)
    if isinstance(packed_meta, tuple):
        return tuple(_without_shapes(p) for p in packed_meta)
    return packed_meta


def _packed_shapes(packed_meta) -> list:
    """The shapes of the tensors in a _packed_meta, in order."""
    if isinstance(packed_meta, tuple) and len(packed_meta) == 3 and isinstance(packed_meta[1], torch.dtype):
        return [packed_meta[0]]
    if isinstance(packed_meta, tuple):
        return [s for p in packed_meta for s in _packed_shapes(p)]
    return []


def _hook_code(hook):
    fn = getattr(hook, "__func__", hook)
    return getattr(fn, "__code__", None) or type(hook)


_NO_RULE = (-1, None, None, None)  # _Learned.rules: none holds, or one failed


class _Learned:
    """NOTE [Unpack metadata learned from the last backward]: (shape, dtype, device) of
    what an unpack hook returned, by (graph's native key and sizes, position, hook code)."""

    LIMIT = 1 << 17  # entries (one per hooked tensor): a graph with more than this is never compiled

    def __init__(self):
        self.metas: dict = {}
        self.unpredictable: dict = {}
        # the size-free rules (NOTE above): rule key -> (packed tensor position, dtype, device,
        # the (sizes, packed shapes) it held at: it predicts once there are two; None: it failed)
        self.rules: dict = {}
        self.orders: dict = {}  # rule key -> the dim order of what the hook returned last
        self.lock = threading.Lock()

    def get(self, key):
        return self.metas.get(key)

    @staticmethod
    def _rule_key(key):
        """A learned key without sizes: the graph's digest, position, hook code, and the packed
        value's structure (its tensors' ranks, dtypes and devices)."""
        (digest, _sizes), i, code, packed = key
        return (digest, i, code, _without_shapes(packed))

    def by_rule(self, key):
        """The metadata a confirmed rule predicts for `key` (sizes not seen before), or None."""
        rule = self.rules.get(self._rule_key(key))
        if rule is None or rule[3] is None or len(rule[3]) < 2:
            return None
        k, dtype, device, _ = rule
        shapes = _packed_shapes(key[3])
        if k >= len(shapes):
            return None
        meta = (shapes[k], dtype, device, self.orders.get(self._rule_key(key)) or tuple(range(len(shapes[k]))))
        with self.lock:  # these sizes' next backward finds it directly (checked at replay as any)
            if len(self.metas) >= self.LIMIT:
                self.metas.pop(next(iter(self.metas)))
            self.metas[key] = meta
        return meta

    def learn(self, key, t):
        """Remember what the hook returned; None if it cannot be predicted."""
        if key in self.unpredictable or type(t) is not torch.Tensor or t.layout != torch.strided:
            return None
        from ..values import dense_order

        order = dense_order(t) or tuple(range(t.dim()))  # (not dense: copied into this at replay)
        meta = (tuple(t.shape), t.dtype, t.device, order)
        with self.lock:
            if len(self.metas) >= self.LIMIT:
                self.metas.pop(next(iter(self.metas)))
            self.metas[key] = meta
            self._learn_rule(key, meta[:3])
            rk = self._rule_key(key)
            if len(self.orders) >= self.LIMIT and rk not in self.orders:
                self.orders.pop(next(iter(self.orders)))
            self.orders[rk] = order
        return meta

    def order(self, key):
        """The layout a hook at this graph's position returned last (at any sizes), or None."""
        return self.orders.get(self._rule_key(key))

    def _learn_rule(self, key, meta) -> None:
        shape, dtype, device = meta
        same = [k for k, s in enumerate(_packed_shapes(key[3])) if s == shape]
        rk = self._rule_key(key)
        rule = self.rules.get(rk)
        if rule is not None and rule[3] is None:
            return  # failed once: never again
        if len(same) != 1 or (rule is not None and rule[:3] != (same[0], dtype, device)):
            self._set_rule(rk, _NO_RULE)  # ambiguous, or not the rule it was
            return
        seen = rule[3] if rule is not None else frozenset()
        self._set_rule(rk, (same[0], dtype, device, seen | {(key[0][1], key[3])}))

    def _set_rule(self, rk, rule) -> None:
        if len(self.rules) >= self.LIMIT and rk not in self.rules:
            self.rules.pop(next(iter(self.rules)))
        self.rules[rk] = rule

    def is_unpredictable(self, key) -> bool:
        return key in self.unpredictable

    def mark_unpredictable(self, key) -> None:
        with self.lock:
            self.metas.pop(key, None)
            self._set_rule(self._rule_key(key), _NO_RULE)
            if len(self.unpredictable) >= self.LIMIT:
                self.unpredictable.pop(next(iter(self.unpredictable)))
            self.unpredictable[key] = True

    def check(self, key, t, shape, dtype, device) -> None:
        """At replay: what the hook returned against the prediction."""
        if isinstance(t, torch.Tensor) and list(t.shape) == list(shape) and t.dtype == dtype and t.device == device:
            return
        self.mark_unpredictable(key)
        with self.lock:  # the graph's other hooks may have changed too: the next backward learns again
            for k in [k for k in self.metas if k[0] == key[0]]:
                del self.metas[k]
        got = f"{tuple(t.shape)}/{t.dtype}/{t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise RuntimeError(
            f"compiled_autograd: the unpack hook of a saved tensor returned {got}, where the previous "
            f"backward of this graph got {tuple(shape)}/{dtype}/{device}; the graph, traced with that, "
            "unpacks it when its node runs, as eager does (NOTE [Unpack metadata learned from the last "
            "backward]). From the next backward on this tensor is unpacked when the backward starts, and "
            "the next one learns again what the graph's other hooks return"
        )

    def clear(self):
        with self.lock:
            self.metas.clear()
            self.unpredictable.clear()
            self.rules.clear()
            self.orders.clear()


LEARNED = _Learned()


def unpack(hook, packed):
    t = hook(packed)
    if not isinstance(t, torch.Tensor):
        raise TypeError(
            f"Output of saved tensor unpack_hook expected to be a Tensor but got result of type {type(t)}"
        )
    return t
