"""Fake inputs for a capture: the lifted tensors as fakes, static or with symbols where sizes
change (NOTE [One symbol per size class]); the guards a dynamic capture's assumptions make."""

from __future__ import annotations

from typing import Any

import sympy
import torch
from torch._dynamo.source import LocalSource, TensorProperty, TensorPropertySource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import (
    SYMPY_INTERP,
    DimDynamic,
    ShapeEnv,
    StatelessSymbolicContext,
)

from ..values import Collected
from ..compile.boxed import fakeable  # (NOTE [Views that change the dtype])


class _SizeEnv(ShapeEnv):
    """The ShapeEnv of a dynamic capture: it decides, per size position, what
    each size, stride and storage offset of the lifted tensors becomes.

    NOTE [One symbol per size class]
    Positions that did not change across the backwards of this key stay
    static, so kernels keep their constant dims (a head dim of 16, a d_model
    of 64): only what changed becomes symbolic. By default every symbolic
    position would get its own symbol: the batch dim of each saved tensor,
    each saved `sym_sizes`, each stride. They are one size of the model, but a
    compiler that cannot prove them equal emits indexing with divisions and
    modulos over several symbols and no vectorization (a transformer's
    select_backward kernel: 15 ms against 0.5 ms static). So positions that
    held equal values in every backward seen so far (this one and each cached
    entry of the key) form a class and share one symbol; the equalities become
    guards (duck sizing, with a history instead of one value, so that a
    coincidence in one backward does not merge two sizes). A guard that fails
    is a miss, and the next capture, with one more backward of history,
    splits the class."""

    def __init__(self, classes: dict[str, Any]):
        super().__init__()
        self._classes = classes  # source name -> class, or None: static
        self._symbol_of_class: dict[Any, Any] = {}

    def create_symbol(self, val, source, dynamic_dim=DimDynamic.DUCK, *args, **kwargs):
        name = source.name
        if name not in self._classes or dynamic_dim is DimDynamic.STATIC or not isinstance(val, int):
            return super().create_symbol(val, source, dynamic_dim, *args, **kwargs)
        cls = self._classes[name]
        if cls is None:
            return sympy.Integer(val)
        # duck sizing keyed by our class instead of by the value alone
        self.val_to_var.pop(val, None)
        if cls in self._symbol_of_class:
            self.val_to_var[val] = self._symbol_of_class[cls]
        try:
            r = super().create_symbol(val, source, DimDynamic.DUCK, *args, **kwargs)
        finally:
            self.val_to_var.pop(val, None)
        if isinstance(r, sympy.Symbol):
            self._symbol_of_class.setdefault(cls, r)
        return r


def _size_classes(collected: Collected, mask, history) -> dict[str, Any]:
    """Source name of every size position -> None where `mask` keeps it
    static, else its class: its value in this backward and in each of
    `history` (the sizes of earlier backwards of the key)."""
    sizes = collected.sizes
    names = [LocalSource(f"size{j}").name for j in range(collected.n_size_inputs)]
    for i, (start, dim, with_strides) in enumerate(collected.tensor_positions):
        base = LocalSource(f"lifted{i}")
        names += [TensorPropertySource(base, TensorProperty.SIZE, d).name for d in range(dim)]
        if with_strides:
            names += [TensorPropertySource(base, TensorProperty.STRIDE, d).name for d in range(dim)]
        names.append(TensorPropertySource(base, TensorProperty.STORAGE_OFFSET).name)
    names += [source.name for source in _aot_sources(collected)]
    names += [source.name for source in _in_graph_sources(collected)]
    assert len(names) == len(sizes), (len(names), len(sizes))
    history = [h for h in history if len(h) == len(sizes)]
    return {name: ((sizes[p],) + tuple(h[p] for h in history) if mask[p] else None) for p, name in enumerate(names)}


def _aot_sources(collected: Collected) -> list:
    """A source per int an inlined AOTAutograd backward reads (NOTE [Inlining AOTAutograd backwards])."""
    return [LocalSource(f"aot{k}") for k in range(collected.n_aot)]


def _in_graph_sources(collected: Collected) -> list:
    """A source per dim of the tensors unpacked in the graph (NOTE [Unpacking in the graph])."""
    return [LocalSource(f"unpacked{u.hid}_{d}") for u in collected.in_graph for d in range(u.dim)]


# NOTE [No item symbols for lifted scalars]
# A fake tensor made from a 0-dim CPU tensor of an int type or float64 with a
# source gets an `.item()` symbol (FakeTensorMode.from_tensor: its item_memo), as
# dynamo wants for Python scalars it passes as tensors. Ours are saved tensors
# (MulBackward0's `other` when it is a 0-dim tensor): nothing of ours guards such
# a symbol, so a formula that read the value (`.item()`) would have traced this
# backward's value unguarded; and AOTAutograd's float-tensorify pass, finding a
# float symbol it did not make, asks dynamo to restart with it specialized,
# which here failed every dynamic capture of such a graph (TensorifyScalar-
# RestartAnalysis: a new static capture per size, an error under fullgraph=True;
# found by tests/test_fuzz.py). So 0-dim lifted tensors are fakeified without a
# source: no symbol, and a formula that reads the value raises, which makes its
# node opaque.
def fake_inputs(collected: Collected, mask, history=()):
    """Fake versions of the lifted tensors, and SymInts for the size inputs
    marked in `mask`; every other size, stride and offset stays static
    (strides that follow from symbolic sizes become expressions of them).
    Marked positions equal in this backward and in every one of `history`
    share a symbol (NOTE [One symbol per size class]). Returns also the mask
    of positions that really are symbolic (a 0/1 size, for one, is
    specialized)."""
    shape_env = _SizeEnv(_size_classes(collected, mask, history) if mask else {})
    mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=False)
    sizes, n_si = collected.sizes, collected.n_size_inputs
    real_mask = [False] * len(sizes)
    fakes = []
    wrapped = {w.index for w in collected.wrappers} | set(collected.held)
    if wrapped and mask:
        raise RuntimeError("compiled_autograd: a dynamic capture with tensor subclasses (not yet: docs/design/subclasses.md)")
    for i, (t, (start, dim, with_strides)) in enumerate(zip(collected.lifted, collected.tensor_positions)):
        if i in wrapped:
            # an input the graph does not read: the trace rebuilds the subclass over its
            # inner tensors' fakes (docs/design/subclasses.md section 2), untracked, so that its
            # ops go through its __torch_dispatch__ to ops on those fakes
            with mode:  # (as the empty tensor replay/run.py's stand_in gives it)
                fakes.append(torch.empty(0, dtype=t.dtype, device=t.device))
            continue
        # with a mask every dim asks the env, which answers per position; so
        # do recorded strides (torch would otherwise infer a stride from any
        # size product of equal value, a coincidence of this one backward)
        dims = [DimDynamic.DYNAMIC if mask else DimDynamic.STATIC] * dim
        strides = [DimDynamic.DYNAMIC if mask and with_strides else DimDynamic.INFER_STRIDE] * dim
        context = StatelessSymbolicContext(dynamic_sizes=dims, dynamic_strides=strides, constraint_sizes=[None] * dim)
        # (no source for a 0-dim tensor: fakeifying a 0-dim CPU int or float64 tensor with a
        # source gives it an `.item()` symbol, whose value nothing here guards (NOTE [No
        # item symbols for lifted scalars]); it has no size or stride, and its offset stays static)
        source = LocalSource(f"lifted{i}") if dim > 0 else None
        if mask:
            f = mode.from_tensor(fakeable(t), symbolic_context=context if dim > 0 else None, source=source)
        else:  # (static: the same fake, made without asking the ShapeEnv per size: a third of the time)
            f = mode.from_tensor(fakeable(t), static_shapes=True, source=source)
        geo = list(f.shape) + (list(f.stride()) if with_strides else []) + [f.storage_offset()]
        for k, g in enumerate(geo):
            real_mask[start + k] = isinstance(g, torch.SymInt)
        fakes.append(f)
    # the node sizes, and the shapes of the tensors unpacked in the graph: ints passed in
    sources = [(j, LocalSource(f"size{j}")) for j in range(n_si)]
    sources += [(collected.aot_start + k, source) for k, source in enumerate(_aot_sources(collected))]
    sources += [(collected.in_graph_start + k, source) for k, source in enumerate(_in_graph_sources(collected))]
    symints, size_inputs = [], []
    for j, source in sources:
        if mask and mask[j]:
            v = shape_env.create_unspecified_symint_and_symbol(sizes[j], source, DimDynamic.DYNAMIC)
            if isinstance(v, torch.SymInt):
                symints.append(v)
                size_inputs.append(j)
                real_mask[j] = True
    return mode, shape_env, fakes, symints, tuple(size_inputs), tuple(real_mask) if mask else None


def guards_of(captured):
    """The guard expression of a dynamic capture, after compilation (backends
    may add guards to the same ShapeEnv) and a compiled evaluator for it."""
    if captured.mask is None:
        return None, None
    source = captured.shape_env.produce_guards_expression(captured.example_inputs)
    if source is None:
        return None, None
    code = compile(source, "<compiled_autograd guards>", "eval")
    return source, lambda L: eval(code, SYMPY_INTERP, {"L": L})
