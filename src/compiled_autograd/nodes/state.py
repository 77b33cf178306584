"""The Python state a custom Function's backward reads: its globals, closure cells and class
attributes, found in its bytecode and the user functions it calls; read at every backward,
keyed or lifted (NOTE [Python state a backward reads], NOTE [Tensors a backward reads from
globals and closures])."""

from __future__ import annotations

import enum
import types
import weakref

import torch

from ..errors import Unkeyable


_SCALARS = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format, enum.Enum)


_BY_IDENTITY = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type, types.ModuleType, torch.nn.Module)


def _exact(v):
    """The key of an immutable value, telling apart what `==` does not: -0.0 from 0.0 (a
    backward dividing by it gives -inf or inf) and NaN from itself (never equal: a miss
    every time)."""
    if isinstance(v, (float, complex)):
        return (type(v), repr(v))
    if type(v) is tuple:
        return (tuple, tuple(_exact(x) for x in v))
    return (type(v), v)


def _value_key(v, lift, user: bool = True):
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
    key = _distributed_key(v, lift, user)
    if key is not None:
        return key
    raise Unkeyable(f"ctx.{type(v).__name__} value")


def _distributed_key(v, lift, user):
    """NOTE [Keys of a tensor subclass's metadata]
    What DTensor's flatten metadata and its own custom Functions' ctx hold (DTensorSpec,
    TensorMeta, placements, the DeviceMesh), and a user's subclass metadata made of
    dataclasses, keyed by value (docs/design/subclasses.md section 6). A dataclass by every one
    of its fields (compared or not: the trace may read any): torch's own, or a user's that is
    frozen, holds nothing but its fields and defines no methods of its own (state a backward
    could read through them would not be keyed; such a one stays unkeyable). A placement (C++
    objects in 2.13, hashable and equal by value) as itself. A DeviceMesh by what a graph bakes
    in of it: its ranks, its shape, its dim names and the process groups' names (the functional
    collectives' `group_name` argument), computed once per mesh (a mesh does not change).
    Named tuples (TensorMeta, ShardOrderEntry) are tuples above. The object itself stays by
    reference in the trace (the mesh is not a tensor the graph could hold). None: not one of
    these."""
    import dataclasses

    t = type(v)
    module = getattr(t, "__module__", "") or ""
    if dataclasses.is_dataclass(v):
        fields = dataclasses.fields(v)
        if not module.startswith("torch.") and not _plain_frozen_dataclass(v, fields):
            return None
        return ("dc", t, tuple((f.name, _value_key(getattr(v, f.name), lift, user)) for f in fields))
    if module.startswith("torch.distributed.tensor.placement_types"):
        return ("placement", v)
    if t.__name__ == "FakeScriptObject" and module.startswith("torch._library"):
        # a DeviceMesh (an opaque object in 2.13) as a torch.compile'd region's DTensor outputs
        # carry it: torch's stand-in, wrapping the real mesh (`real_obj`): keyed as that mesh
        real = getattr(v, "real_obj", None)
        return _distributed_key(real, lift, user) if type(real).__name__ == "DeviceMesh" else None
    if t.__name__ == "DeviceMesh" and module.startswith("torch.distributed"):
        seen = _MESH_KEYS.get(id(v))
        if seen is not None and seen[0]() is v:
            return seen[1]
        groups = tuple(v.get_group(d).group_name for d in range(v.ndim))
        key = ("mesh", v.device_type, tuple(v.mesh.flatten().tolist()), tuple(v.mesh.shape), v.mesh_dim_names, groups)
        try:
            _MESH_KEYS[id(v)] = (weakref.ref(v, lambda _, i=id(v): _MESH_KEYS.pop(i, None)), key)
        except TypeError:  # (not weakly referenceable: computed each time)
            pass
        return key
    return None


# id(mesh) -> (a weak reference to it, its key): by identity, not by DeviceMesh's `==`, which
# need not compare the process groups' names the key holds
_MESH_KEYS: dict = {}


def _plain_frozen_dataclass(v, fields) -> bool:
    names = {f.name for f in fields}
    own = [k for k, x in vars(type(v)).items() if callable(x) and not (k.startswith("__") and k.endswith("__"))]
    return type(v).__dataclass_params__.frozen and set(getattr(v, "__dict__", {})) <= names and not own


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
_PURE_MODULES = (
    "torch",
    "math",
    "cmath",
    "operator",
    "functools",
    "itertools",
    "numbers",
    "typing",
    "builtins",
    "collections",
    "enum",
    "warnings",
    "numpy",
    "compiled_autograd",
    "_pytest",
)


value_key = _value_key  # (public: walk/subclasses.py keys a subclass's metadata with it)


def _pure_module(name: str) -> bool:
    return name.split(".")[0] in _PURE_MODULES


def _state_in(v, depth: int, seen: set, keyed: list, liftable: bool = False) -> str | None:
    """Why reading `v` (a global, closure or ctx value) is reading state, or None."""
    if isinstance(v, types.ModuleType):
        return None if _pure_module(v.__name__) else f"module {v.__name__}"
    if isinstance(
        v,
        (
            types.BuiltinFunctionType,
            types.BuiltinMethodType,
            torch._ops.OpOverloadPacket,
            torch._ops.OpOverload,
            type(None),
            bool,
            str,
            bytes,
            torch.dtype,
            torch.device,
        ),
    ):
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


def _code_reads_state(fn, depth: int = 0, seen: set | None = None, keyed: list | None = None, liftable: bool = True) -> str | None:
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
            elif not isinstance(
                v,
                (
                    types.FunctionType,
                    staticmethod,
                    classmethod,
                    property,
                    types.BuiltinFunctionType,
                    types.MethodDescriptorType,
                    types.WrapperDescriptorType,
                    types.ClassMethodDescriptorType,
                ),
            ):
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
            elif (
                depth < 3
                and _cell_full(cell)
                and isinstance(cell.cell_contents, types.FunctionType)
                and not _pure_module(getattr(cell.cell_contents, "__module__", "") or "")
            ):
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


def _nested_code(fn, name: str):
    for c in fn.__code__.co_consts:
        if isinstance(c, types.CodeType) and c.co_name == name:
            return c
    return None


def _closure(fn) -> dict:
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))


# markers in a keyed ctx value where a size kept on ctx was (NOTE [Sizes kept on ctx], nodes/ctx_sizes.py)
class _SizeTemplate:
    """A torch.Size on ctx with the sizes taken out of it (`_SIZE` in their places)."""

    __slots__ = ("items",)

    def __init__(self, items: tuple):
        self.items = items


class _SizeMark:
    def __repr__(self) -> str:
        return "<size kept on ctx>"


_SIZE = _SizeMark()


def _leaves(v) -> list:
    if isinstance(v, (tuple, list)):
        return [y for x in v for y in _leaves(x)]
    if isinstance(v, dict):
        return [y for x in v.values() for y in _leaves(x)]
    return [v]


def _tensors(v) -> list:
    """The tensors in a ctx attribute: a tensor, or lists, tuples and dicts of them."""
    if isinstance(v, torch.Tensor):
        return [v]
    if isinstance(v, (tuple, list)):
        return [t for x in v for t in _tensors(x)]
    if isinstance(v, dict):
        return [t for x in v.values() for t in _tensors(x)]
    return []
