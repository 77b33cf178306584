"""Sizes a custom Function keeps on ctx, taken out of the key into the sizes vector.

NOTE [Sizes kept on ctx]
A custom Function often keeps a size on ctx (`ctx.shape = x.shape`, `ctx.n = x.size(0)`) and
its backward computes with it (`g * ctx.shape[0]`, `g.expand(ctx.shape)`). Keyed by value, as
any ctx constant, every new size was a new key: a capture per size, where a built-in node's
saved sizes are size inputs that the dynamic-shape policy makes symbolic after the first
change. So the ints on ctx (alone, or in tuples, lists, dicts and torch.Size) that equal a
size or the numel of one of the node's tensors (its saved tensors and those on ctx, its
forward outputs, the inputs it sends grads to) when it is collected, 0 and 1 aside (always
specialized), are taken out of the key (a ("Z",) there) and put in the sizes vector, among
the `aot` ints (`PyNodeInfo.ctx_ints`, in `attrs` order); `attrs` holds the attribute with
`_SIZE` where each was, and the trace puts each back (`fill_sizes`): the int itself in a
static graph, its SymInt in a dynamic one (the trace swaps the attribute as it swaps ctx
tensors for fakes). Whether an int is taken depends on this collect's values only: one that
equals a size by chance in one step and not in the next just has another key.

What keeps this from giving a wrong gradient: a symbolic trace keeps the graph right for ints
that flow into tensor ops and sizes (computed from the graph's inputs at every run) and for
ints the backward turns into Python values (`if ctx.n > 3`, `range(ctx.n)`, `float(ctx.n)`, an
int argument such as a `dim`): each reads the SymInt's value through a guard, checked before
every hit, whose failure is a miss and a new capture (specialized, after a few, as any size).
A backward that cannot run on a SymInt at all (it hashes it, hands it to a numpy ufunc)
becomes an opaque node of that dynamic graph (it runs as is, on the real values). But Python
code can also tell a SymInt from an int with no guard at all, and then take another branch in
the trace than eager takes, silently: `isinstance(ctx.k, int)`, `type(ctx.k)`, `str(ctx.k)`
and f-strings (which read the trace's value: measured, a wrong gradient on the next hit). So
ints are taken only when the backward's code, and the user functions it reaches (through
globals, closure cells, class attributes, functions kept on ctx: what `_code_reads_state`
follows), does none of that: no isinstance/issubclass/type/str/repr/format/id/hash/vars/dir,
no f-string or %-formatting, no `__class__`, no class pattern (`_tells_symints_apart`);
otherwise they stay constants of the key, as before. Torch's own Python code (a wrapper such
as once_differentiable's) is trusted: it runs under symbolic tracing as make_fx, AOTAutograd
and export run it. Left open: an `is` between two ints (small ints are one object in eager,
two SymInts never are), and code reached only through an object's attribute other than a
class attribute (a user module's function: that is state, the node runs opaquely anyway).

Why only ints that are sizes, not every int: a flag or a mode kept as an int is not a size
the backward computes with; as a constant of the key it is never symbolic, and one that
changes every step (a step count) stays counted by NOTE [Functions whose values change every
step] instead of making a graph per guard failure.
"""

from __future__ import annotations

import math
import types
import weakref

import torch

from .state import _MISSING, _SIZE, _cell_full, _leaves, _pure_module, _SizeTemplate, _tensors, user_backward


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


_TELLS_APART_NAMES = frozenset({"isinstance", "issubclass", "type", "str", "repr", "ascii", "format", "id", "hash", "vars", "dir"})


_TELLS_APART_ATTRS = frozenset({"format", "format_map", "__class__", "__str__", "__repr__", "__format__", "__hash__", "__dict__"})


_TELLS_APART_OPS = frozenset({"FORMAT_VALUE", "FORMAT_SIMPLE", "FORMAT_WITH_SPEC", "CONVERT_VALUE", "BUILD_STRING", "MATCH_CLASS"})


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
