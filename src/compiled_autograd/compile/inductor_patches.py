"""Inductor's patches (compile/torch_patches.py lists them in its table, with what each
replaces, why and the releases it was written for, and installs them): vector-ISA probes
remembered, buffers freed and never reused, mutation renames after a loop recompute, and, only
while a dynamic graph of ours compiles, reductions and reshape indexing that hold for every
size of a range."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import operator
import os
import threading

import torch

from .patching import _attr


# NOTE [Remembered vector-ISA probes]
# Before its first CPU compile, each process's inductor checks which vector ISAs
# (AVX2, AVX-512, VNNI, ...) the machine's compiler and loader handle: it builds a
# small library per ISA (cached on disk) and loads it in a child process, each
# child loading libtorch: ~0.15 s a probe, six probes here, ~0.9 s of a warm second
# process's ~2 s first backward, every process. A probe of the same file (path,
# size, mtime) on a CPU with the same flags that loaded once loads again, so each
# success is remembered in our private cache directory and not re-run; a failed
# probe is never remembered (it runs again next time, as before).
_isa_probes_patched = False


def _remember_vec_isa_probes() -> None:
    global _isa_probes_patched
    if _isa_probes_patched:
        return
    from torch._inductor.cpu_vec_isa import VecISA

    original = _attr(VecISA, "_probe_load")
    _isa_probes_patched = True

    @functools.wraps(original)
    def probe(self, output_path):
        try:
            st = os.stat(output_path)
            seen = f"{output_path}|{st.st_size}|{st.st_mtime_ns}|{_cpu_flags_digest()}"
        except OSError:
            return original(self, output_path)
        if seen in _probes_remembered():
            return True
        ok = original(self, output_path)
        if ok:
            _remember_probe(seen)
        return ok

    VecISA._probe_load = probe


def _probes_path():
    from .. import native

    return native.cache_root() / "vec_isa_probes.json"


@functools.cache
def _cpu_flags_digest() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    return hashlib.sha256(flags.encode()).hexdigest()[:16]


def _probes_remembered() -> set:
    try:
        return set(json.loads(_probes_path().read_text()))
    except (OSError, ValueError, TypeError):
        return set()


def _remember_probe(seen: str) -> None:
    try:
        path = _probes_path()
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        known = sorted(_probes_remembered() | {seen})[-256:]
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(known, f)
        os.replace(tmp, path)
    except OSError:  # an optimization: never fail a compile for it
        logging.getLogger("compiled_autograd").debug("could not remember a vector-ISA probe", exc_info=True)


def _patch_codegen_free() -> None:
    """NOTE [Freed, never reused]."""
    from torch._inductor.codegen.wrapper import FreeLine, PythonWrapperCodegen
    from torch._inductor.virtualized import V

    original = _attr(PythonWrapperCodegen, "codegen_free")
    if getattr(original, "_compiled_autograd", False):
        return

    def codegen_free(self, buffer):
        name = buffer.get_name()
        if name in getattr(V.graph, "_compiled_autograd_no_reuse", ()) and name not in self.freed:
            self.freed.add(name)
            self.writeline(FreeLine(self, buffer))
            return
        original(self, buffer)

    codegen_free._compiled_autograd = True
    PythonWrapperCodegen.codegen_free = codegen_free


compiling_ours = threading.local()  # .active: this thread is compiling one of our graphs with inductor


def _patch_mutation_renames() -> None:
    """NOTE [Mutation renames after a loop recompute]
    Inductor names a buffer that an op mutates (a scatter into a copy of zeros, as in
    the backward of topk, max(dim), sort or kthvalue) anew after the mutation, and each
    node that reads the result records the new name (`mutation_renames`), so that it is
    scheduled after the mutation. torch 2.11-2.13's `SchedulerNode.recompute_size_and_body`
    (run when the C++ backend fuses nodes of different loop sizes) recomputes a node's
    reads from its loop body and applies those renames only when the node also has fake
    dependencies. Otherwise the reader again depends on the buffer before the mutation,
    may be ordered before it, and reads the copy without the scattered values: a wrong
    gradient (found by the fuzzer: topk + repeat + layer_norm on one activation; the
    graph run as is, or by aot_eager, was right). torch 2.14 applies the renames always;
    so does this, for the graphs we compile, on releases before 2.14 (its range in
    `releases.WRITTEN_FOR` ends at 2.13: not installed on later releases)."""
    from torch._inductor.dependencies import StarDep, WeakDep
    from torch._inductor.scheduler import SchedulerNode

    original = _attr(SchedulerNode, "recompute_size_and_body")
    if getattr(original, "_compiled_autograd", False):
        return

    def recompute_size_and_body(self, *args, **kwargs):
        fake = any(isinstance(d, (WeakDep, StarDep)) for d in self.read_writes.reads)
        original(self, *args, **kwargs)
        if not fake and self.mutation_renames and getattr(compiling_ours, "active", False):
            self.set_read_writes(self.read_writes.rename(self.mutation_renames))

    recompute_size_and_body._compiled_autograd = True
    SchedulerNode.recompute_size_and_body = recompute_size_and_body


@contextlib.contextmanager
def _size_class_agnostic_reductions():
    """NOTE [One dynamic graph per size range]
    Inductor's CPU code generator picks a summation helper for float sums by
    guarding on `reduction size > 4096`. In a dynamic graph that guard splits
    the sizes into two ranges, each needing its own compile. When the size is
    symbolic and not known either way, we take the helper (cascade summation,
    correct and precise for every size) instead of guarding."""
    import sympy
    from torch._inductor.codegen.cpp import CppKernel
    from torch._inductor.virtualized import V

    original = _attr(CppKernel, "need_use_acc_helper")

    def need_use_acc_helper(self, reduction_type, dtype, use_scalar):
        if reduction_type == "sum" and dtype == torch.float and self.call_ranges is not None:
            size = functools.reduce(operator.mul, self.call_ranges[self.reduction_depth :], sympy.Integer(1))
            sizevars = V.graph.sizevars
            if not sizevars.statically_known_true(sympy.Le(size, 4096)):
                return True
        return original(self, reduction_type, dtype, use_scalar)

    CppKernel.need_use_acc_helper = need_use_acc_helper
    try:
        yield
    finally:
        CppKernel.need_use_acc_helper = original


@contextlib.contextmanager
def _symbolic_range_simplification():
    """NOTE [Indexing of dynamic reshapes]
    A reshape that splits one dim and merges it with another (a transformer's
    (s, 4*b, 16) -> (s, b, 64) around attention) is lowered by inductor as
    flatten-then-unflatten: `(x3 + 64*x0) // 16 % (4*b)`. With static sizes the
    modulo is dropped because the base provably stays below it; with a
    symbolic `b` inductor cannot prove `x3 + 64*x0 < 64*b` from `x0 < b`,
    keeps the divisions and modulos per element and does not vectorize the
    kernel (2.5 ms against 0.5 ms). Before inductor's own simplification we
    drop a `ModularIndexing(base, d, m)` (and a `FloorDiv(base, d)`) whose base
    is a non-negative sum of products of loop variables, sizes and integers
    whose largest value (each loop variable at its range's end) is provably
    below `d*m` (below `d`: zero). Sound: it only removes operations that are
    the identity (or zero) over the whole iteration space."""
    import sympy
    from torch._inductor.sizevars import SizeVarAllocator
    from torch.utils._sympy.functions import FloorDiv, ModularIndexing

    original = _attr(SizeVarAllocator, "_simplify_with_ranges")

    def _simplify_with_ranges(self, expr, var_ranges):
        if var_ranges and (expr.has(ModularIndexing) or expr.has(FloorDiv)):
            expr = _drop_range_identities(self, expr, var_ranges, sympy, FloorDiv, ModularIndexing)
        return original(self, expr, var_ranges)

    SizeVarAllocator._simplify_with_ranges = _simplify_with_ranges
    try:
        yield
    finally:
        SizeVarAllocator._simplify_with_ranges = original


def _drop_range_identities(sizevars, expr, var_ranges, sympy, FloorDiv, ModularIndexing):
    known = sizevars.statically_known_true

    def upper(e):
        """An upper bound of e over the iteration space, if e >= 0 there; else None."""
        if isinstance(e, sympy.Integer):
            return e if e >= 0 else None
        if isinstance(e, sympy.Symbol):
            if e in var_ranges:
                return var_ranges[e] - 1
            return e if known(sympy.Ge(e, 0)) else None
        if isinstance(e, (sympy.Add, sympy.Mul)):
            parts = [upper(a) for a in e.args]
            if any(p is None for p in parts):
                return None
            return sympy.Add(*parts) if isinstance(e, sympy.Add) else sympy.Mul(*parts)
        if isinstance(e, ModularIndexing):
            b, d, m = e.args
            return m - 1 if upper(b) is not None and known(sympy.Gt(m, 0)) else None
        if isinstance(e, FloorDiv):
            b, d = e.args
            ub = upper(b)
            return FloorDiv(ub, d) if ub is not None and known(sympy.Gt(d, 0)) else None
        return None

    def below(base, bound):
        ub = upper(base)
        return ub is not None and known(sympy.Lt(ub, bound))

    def visit_mod(base, divisor, modulus):
        if below(base, divisor * modulus):
            return FloorDiv(base, divisor)
        return ModularIndexing(base, divisor, modulus)

    def visit_div(base, divisor):
        if below(base, divisor):
            return sympy.S.Zero
        return FloorDiv(base, divisor)

    w = lambda n: sympy.Wild(n, integer=True)  # noqa: E731
    if expr.has(ModularIndexing):
        expr = expr.replace(ModularIndexing(w("base"), w("divisor"), w("modulus")), visit_mod)
    if expr.has(FloorDiv):
        expr = expr.replace(FloorDiv(w("base"), w("divisor")), visit_div)
    return expr


# -- engine queries -------------------------------------------------------------------------
