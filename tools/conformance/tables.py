"""The cases of torch's tables: every sample input of an OpInfo (`run_op`) and every
ModuleInput of a ModuleInfo (`run_module`), and which entries a run takes."""

from __future__ import annotations

import sys
import warnings
from typing import Any, Sequence

import torch

from .case import Subject, _exc_line, run_case
from .report import CaseResult
from .tensors import _unique, _walk

# --------------------------------------------------------------------------- ops


def _leafify(obj: Any, memo: dict) -> Any:
    """The same structure with every non-leaf tensor that requires grad replaced by a leaf
    with the same values and geometry (a detached view). A sample's non-leaf input carries a
    graph that the eager run would free and the compiled run would then reach again; as a
    leaf, its own gradient is compared too."""
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad and not obj.is_leaf:
            if id(obj) not in memo:
                memo[id(obj)] = obj.detach().requires_grad_()
            return memo[id(obj)]
        return obj
    if type(obj) in (list, tuple):
        return type(obj)(_leafify(x, memo) for x in obj)
    if type(obj) is dict:
        return {k: _leafify(x, memo) for k, x in obj.items()}
    return obj


class OpSubject(Subject):
    def __init__(self, op, sample):
        self.op, self.sample = op, sample
        memo: dict = {}
        self.input = _leafify(sample.input, memo)
        self.args = _leafify(tuple(sample.args), memo)
        self.kwargs = _leafify(dict(sample.kwargs), memo)
        items = list(_walk(self.input, "input")) + list(_walk(list(self.args), "args"))
        items += list(_walk(self.kwargs, "kwargs"))
        self.items = _unique(items)

    def forward(self):
        out = self.op(self.input, *self.args, **self.kwargs)
        return self.sample.output_process_fn_grad(out)

    def targets(self):
        return [(l, t) for l, t in self.items if t.requires_grad and t.is_leaf]

    def perturbables(self):
        return [t for _, t in self.items if _perturbable(t)]


def _perturbable(t: torch.Tensor) -> bool:
    return (t.is_floating_point() or t.is_complex()) and t.is_leaf and t.layout == torch.strided


def _import_db(which: str):
    argv = sys.argv
    sys.argv = argv[:1]  # torch's test utilities parse the command line
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if which == "ops":
                from torch.testing._internal.common_methods_invocations import op_db

                return op_db
            from torch.testing._internal.common_modules import module_db

            return module_db
    finally:
        sys.argv = argv


def op_full_name(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def select_ops(filter: str | None = None, every: int = 1, names: Sequence[str] | None = None) -> list:
    ops = [o for o in _import_db("ops") if o.supports_autograd]
    if names is not None:
        wanted = set(names)
        ops = [o for o in ops if op_full_name(o) in wanted or o.name in wanted]
    if filter:
        ops = [o for o in ops if filter in op_full_name(o)]
    return ops[:: max(1, every)]


def _seed_for(*parts) -> int:
    h = 0
    for p in parts:
        for ch in str(p):
            h = (h * 131 + ord(ch)) % 1_000_003
    return h


def _has_empty_tensor(sample) -> bool:
    """Whether a sample input holds a tensor with no elements (in its input, args or kwargs)."""
    items = list(_walk(sample.input, "input")) + list(_walk(list(sample.args), "args"))
    items += list(_walk(dict(sample.kwargs), "kwargs"))
    return any(t.numel() == 0 for _, t in items)


def run_op(
    op,
    *,
    backend: str,
    dtypes: Sequence[torch.dtype],
    sample_limit: int | None,
    modes=("backward", "grad_subset"),
    disk_cache: bool = False,
    empty: bool = False,
) -> list[CaseResult]:
    """The op's cases: its first `sample_limit` samples; with `empty`, every sample that holds a
    tensor with no elements instead (wherever it stands among the samples)."""
    name = op_full_name(op)
    results: list[CaseResult] = []
    try:
        supported = op.supported_backward_dtypes("cpu")
    except Exception:
        supported = op.supported_dtypes("cpu")
    for dtype in dtypes:
        if dtype not in supported:
            continue
        dname = str(dtype).replace("torch.", "")
        torch.manual_seed(_seed_for(name, dname))
        try:
            samples = op.sample_inputs("cpu", dtype, requires_grad=True)
            it = iter(samples)
            i = 0
            while empty or sample_limit is None or i < sample_limit:
                torch.manual_seed(_seed_for(name, dname, i))
                try:
                    sample = next(it)
                except StopIteration:
                    break
                if empty and not _has_empty_tensor(sample):
                    i += 1
                    continue
                subject = OpSubject(op, sample)
                for mode in modes:
                    if mode == "grad_subset" and len(subject.targets()) < 2:
                        continue
                    if mode == "create_graph" and not op.supports_gradgrad:
                        continue  # eager's own double backward is not defined for it
                    seed = _seed_for(name, dname, i, mode)
                    meta = dict(kind="op", name=name, variant=sample.name or "", sample=i)
                    results.append(run_case(subject, backend=backend, mode=mode, dtype=dtype, seed=seed, meta=meta, disk_cache=disk_cache))
                del subject, sample
                i += 1
        except Exception as e:
            results.append(
                CaseResult(
                    kind="op",
                    name=name,
                    variant="",
                    mode="-",
                    dtype=dname,
                    sample=-1,
                    status="skipped_eager_error",
                    reason=f"sample_inputs raised: {_exc_line(e)}",
                )
            )
    return results


# --------------------------------------------------------------------------- modules


class ModuleSubject(Subject):
    def __init__(self, module: torch.nn.Module, forward_input):
        self.m = module
        memo: dict = {}
        self.args = _leafify(tuple(forward_input.args), memo)
        self.kwargs = _leafify(dict(forward_input.kwargs), memo)
        self.items = _unique(list(_walk(list(self.args), "args")) + list(_walk(self.kwargs, "kwargs")))
        self.buffers = {k: b.detach().clone() for k, b in module.named_buffers()}

    def before_forward(self):
        # buffers (running stats) updated by a training forward: every run starts the same
        with torch.no_grad():
            for k, b in self.m.named_buffers():
                if k in self.buffers and b.shape == self.buffers[k].shape:
                    b.copy_(self.buffers[k])

    def forward(self):
        return self.m(*self.args, **self.kwargs)

    def targets(self):
        params = [(f"param {k}", p) for k, p in self.m.named_parameters() if p.requires_grad]
        inputs = [(l, t) for l, t in self.items if t.requires_grad and t.is_leaf]
        return _unique(params + inputs)

    def perturbables(self):
        ps = [p for _, p in self.m.named_parameters() if _perturbable(p)]
        ins = [t for _, t in self.items if _perturbable(t)]
        return [t for _, t in _unique([("", t) for t in ps + ins])]


def select_modules(filter: str | None = None, every: int = 1, names: Sequence[str] | None = None) -> list:
    mods = list(_import_db("modules"))
    if names is not None:
        mods = [m for m in mods if m.name in set(names)]
    if filter:
        mods = [m for m in mods if filter in m.name]
    return mods[:: max(1, every)]


def _has_lazy(m: torch.nn.Module) -> bool:
    from torch.nn.parameter import is_lazy

    return any(is_lazy(p) for p in m.parameters()) or any(is_lazy(b) for b in m.buffers())


def run_module(
    info,
    *,
    backend: str,
    dtypes: Sequence[torch.dtype],
    sample_limit: int | None,
    modes=("backward", "grad_subset"),
    disk_cache: bool = False,
) -> list[CaseResult]:
    name = info.name
    results: list[CaseResult] = []
    for dtype in dtypes:
        if dtype not in info.dtypes:
            continue
        dname = str(dtype).replace("torch.", "")
        torch.manual_seed(_seed_for(name, dname))
        try:
            inputs = info.module_inputs_func(info, device="cpu", dtype=dtype, requires_grad=True, training=True)
        except Exception as e:
            results.append(
                CaseResult(
                    kind="module",
                    name=name,
                    variant="",
                    mode="-",
                    dtype=dname,
                    sample=-1,
                    status="skipped_eager_error",
                    reason=f"module_inputs_func raised: {_exc_line(e)}",
                )
            )
            continue
        if sample_limit is not None:
            inputs = inputs[:sample_limit]
        for i, mi in enumerate(inputs):
            for mode in modes:
                seed = _seed_for(name, dname, i, mode)
                meta = dict(kind="module", name=name, variant=mi.desc or "", sample=i)
                torch.manual_seed(seed)
                try:
                    ci, fi = mi.constructor_input, mi.forward_input
                    m = info.module_cls(*ci.args, **ci.kwargs)
                    m = m.to(device="cpu", dtype=dtype)
                    m.train(True)
                    if _has_lazy(m):
                        with torch.no_grad():
                            torch.manual_seed(seed)
                            m(*fi.args, **fi.kwargs)
                    subject = ModuleSubject(m, fi)
                except Exception as e:
                    results.append(
                        CaseResult(
                            status="skipped_eager_error",
                            mode=mode,
                            dtype=dname,
                            reason=f"constructing the module raised: {_exc_line(e)}",
                            **meta,
                        )
                    )
                    continue
                if mode == "grad_subset" and len(subject.targets()) < 2:
                    continue
                if mode == "create_graph" and not getattr(info, "supports_gradgrad", True):
                    continue
                results.append(run_case(subject, backend=backend, mode=mode, dtype=dtype, seed=seed, meta=meta, disk_cache=disk_cache))
                del subject, m
    return results
