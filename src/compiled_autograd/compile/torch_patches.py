"""Every patch of torch's internals, in one table (`PATCHES`: what each replaces, why, the
releases it was written for, how to tell it is still needed), installed from here only. The
patches of fx, dynamo and the engine are written here; inductor's in inductor_patches.py.

Each patch is installed once, when the first thing that needs it happens (`install(when)`):
at import, when a background compile is scheduled, when inductor first compiles one of our
graphs; two are in force only while a dynamic graph compiles (`scoped`). Each marks what it
installed (`_compiled_autograd = True`). A patch is installed only on the releases it was
written for (`releases.WRITTEN_FOR`, NOTE [Torch versions] in native/__init__.py); one that
finds torch laid out otherwise raises `LayoutDiffers`, naming what differs, and leaves torch
alone: at import, every backward then runs in eager with that reason; later, the compile that
needed it fails with it (a patch for speed only is then left out, logged).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from dataclasses import dataclass
from typing import Callable

import torch

from .. import releases
from ..calls import kernel
from .inductor_patches import (
    _patch_codegen_free,
    _patch_mutation_renames,
    _remember_vec_isa_probes,
    _size_class_agnostic_reductions,
    _symbolic_range_simplification,
)

log = logging.getLogger("compiled_autograd")

from .patching import LayoutDiffers, _attr  # noqa: F401 (LayoutDiffers: torch_patches.LayoutDiffers)


compile_lock = threading.RLock()  # one of our compiles at a time (NOTE [One compile at a time])


# NOTE [One compile at a time]
# Torch's compilers keep state in process globals: fx's node-meta state
# (`torch.fx.traceback.current_meta` and `should_preserve_node_meta`, which
# `preserve_node_meta()` sets and restores around inductor's and AOTAutograd's
# work), dynamo's and inductor's own. Two compiles in two threads corrupt each
# other: with a background compile of ours running, the user's torch.compile'd
# training function failed in most compiles ("Expected current_level > 0": its
# joint graph's backward found the node meta the other thread had restored). So
# our compiles hold one lock, and once a background compile has been scheduled,
# dynamo's compile of a frame (`convert_frame._compile`) in any thread takes it
# too: the user's new frame waits for our compile to end (seconds), never runs
# beside it. (Not inside one of our fx traces: a compile waiting there on a
# compile that waits on that trace would never end.)
def serialize_dynamo_compiles() -> None:
    import torch._dynamo.convert_frame as convert_frame

    original = _attr(convert_frame, "_compile")
    if getattr(original, "_compiled_autograd", False):
        return

    @functools.wraps(original)
    def _compile(*args, **kwargs):
        if _tracing_here():
            return original(*args, **kwargs)
        with compile_lock:
            return original(*args, **kwargs)

    _compile._compiled_autograd = True
    convert_frame._compile = _compile


# NOTE [One fx trace at a time]
# torch.fx's tracer (make_fx uses it) patches `nn.Module.__call__` and
# `__getattr__` for the length of a trace and keeps the patcher in a process
# global (`torch.fx._symbolic_trace.CURRENT_PATCHER`), and it sets a process
# global "an fx trace is running" flag (`_is_fx_tracing_flag`), saved and
# restored around the trace. Two traces in two threads -- ours in the user's
# thread, AOTAutograd's in a background compile -- corrupt both: one fails with
# "CURRENT_PATCHER is None in finally block" (seen in the create_graph
# conformance run with inductor), one trace's patches can stay installed, and
# the flag can be restored to True by the trace that started second and ended
# last, after which every torch.compile'd function in the process raises
# "Detected that you are using FX to symbolically trace a dynamo-optimized
# function". So every fx trace in the process (`Tracer.trace`, which the
# tracers' own `trace` methods call) holds one reentrant lock: a trace in one
# thread waits for the other's to end (a trace, not a whole compile).
#
# The lock does not stop the user's thread from running its next forward while
# a background compile traces: there, a torch.compile'd module raised that same
# error (the flag is set) and every module call ran through the other thread's
# tracer (the patched `__call__`). So both are confined to the tracing thread:
# the patches fx makes call the original in any other thread, and fx's "is a
# trace running" functions answer for the calling thread (their code is
# replaced in place: dynamo binds `is_fx_symbolic_tracing` when it wraps a
# function, possibly before this module was imported).
trace_lock = threading.RLock()


_fx_traces = threading.local()  # .depth: fx traces running in this thread


def _tracing_here() -> bool:
    return getattr(_fx_traces, "depth", 0) > 0


def _confined(new_fn, original):
    owner = threading.get_ident()

    @functools.wraps(new_fn)
    def confined(*args, **kwargs):
        # (dynamo, tracing a user's torch.compile'd module in another thread while ours traces,
        # takes the original as it reads is_compiling() as True: no graph break on get_ident,
        # whose resumed frames once ran a TP block's views on the wrong shapes)
        if not torch.compiler.is_compiling() and threading.get_ident() == owner:
            return new_fn(*args, **kwargs)
        return original(*args, **kwargs)

    return confined


_FLAG_FUNCTIONS = """
def is_fx_tracing():
    is_fx_tracing_warning()
    return _is_fx_tracing_flag and _compiled_autograd_tracing_here()

def is_fx_symbolic_tracing():
    return _is_fx_tracing_flag and _compiled_autograd_tracing_here() and not torch.compiler.is_compiling()
"""


def _serialize_fx_traces() -> None:
    import builtins

    import torch.fx._symbolic_trace as fx_trace
    from torch.fx._symbolic_trace import Tracer, _Patcher

    original = _attr(Tracer, "trace")
    if getattr(original, "_compiled_autograd", False):
        return
    _attr(_Patcher, "patch"), _attr(_Patcher, "patch_method")

    @functools.wraps(original)
    def trace(self, *args, **kwargs):
        with trace_lock:
            _fx_traces.depth = getattr(_fx_traces, "depth", 0) + 1
            try:
                return original(self, *args, **kwargs)
            finally:
                _fx_traces.depth -= 1

    patch, patch_method = _Patcher.patch, _Patcher.patch_method

    def confined_patch(self, frame_dict, name, new_fn, deduplicate=True):
        current = frame_dict[name] if name in frame_dict else getattr(builtins, name, None)
        if current is None or getattr(current, "_Patcher__fx_already_patched", False):
            return patch(self, frame_dict, name, new_fn, deduplicate)
        return patch(self, frame_dict, name, _confined(new_fn, current), deduplicate)

    def confined_patch_method(self, cls, name, new_fn, deduplicate=True):
        current = getattr(cls, name)
        if getattr(current, "_Patcher__fx_already_patched", False):
            return patch_method(self, cls, name, new_fn, deduplicate)
        return patch_method(self, cls, name, _confined(new_fn, current), deduplicate)

    fx_trace._compiled_autograd_tracing_here = _tracing_here
    if hasattr(fx_trace, "_is_fx_tracing_flag"):  # a process-global flag (torch 2.13; a thread-local one from 2.14)
        replacements: dict = {}
        exec(_FLAG_FUNCTIONS, vars(fx_trace), replacements)
        for name, fn in replacements.items():
            getattr(fx_trace, name).__code__ = fn.__code__
    _Patcher.patch, _Patcher.patch_method = confined_patch, confined_patch_method
    trace._compiled_autograd = True
    Tracer.trace = trace


_background = threading.local()  # .active: this thread is one of our background compiles


@contextlib.contextmanager
def in_background():
    """Mark this thread as one of our background compiles (NOTE [A background compile leaves
    the random state alone]; the patch is installed when the first is scheduled)."""
    _background.active = True
    try:
        yield
    finally:
        _background.active = False


def _patch_preserve_rng_state() -> None:
    """NOTE [A background compile leaves the random state alone]
    AOTAutograd and inductor wrap their work in dynamo's `preserve_rng_state`: the global
    generators' states are saved at the start and set back at the end. In the thread that
    compiles, nothing else runs meanwhile. In our background compile the user's thread goes
    on training, and its dropout masks and random draws of the 10 s a compile takes were
    undone when it ended: the next steps drew the same numbers again, which eager never does
    (found while testing the fuzzer in threads). Compiles run on fake tensors and draw no
    random numbers (the test checks the user's stream is eager's), so in our background
    threads that wrapper does nothing; everywhere else it is torch's. (Not exact under
    max-autotune: inductor's autotuning benchmarks on random inputs, and those draws then
    move the user's stream forward, where before the patch they moved it back.)"""
    import sys

    import torch._dynamo.utils as dynamo_utils

    original = _attr(dynamo_utils, "preserve_rng_state")
    if getattr(original, "_compiled_autograd", False):
        return

    @contextlib.contextmanager
    def preserve_rng_state():
        if getattr(_background, "active", False):
            yield
        else:
            with original():
                yield

    preserve_rng_state._compiled_autograd = True
    # (modules that imported the name, and dynamo's own, read at call time by the rest)
    # (each module's own dict: getattr on ~2000 modules, some with a module __getattr__, took
    # 3.4 ms of the first backward)
    for name, module in list(sys.modules.items()):
        if name.startswith("torch.") and getattr(module, "__dict__", {}).get("preserve_rng_state") is original:
            module.preserve_rng_state = preserve_rng_state


def _patch_will_engine_execute_node() -> None:
    """NOTE [Engine queries from hooks] (calls/kernel.py): a graph of ours running its calls
    answers `torch._C._will_engine_execute_node` (kernel.will_engine_execute_node); anything
    else gets eager's answer."""
    original = _attr(torch._C, "_will_engine_execute_node")
    if getattr(original, "_compiled_autograd", False):
        return
    ours = kernel.will_engine_execute_node

    def will_engine_execute_node(node):
        answer = ours(node)
        return original(node) if answer is None else answer

    will_engine_execute_node._compiled_autograd = True
    torch._C._will_engine_execute_node = will_engine_execute_node


# -- the table ------------------------------------------------------------------------------

FIRST_USE = "first use"  # when a scope of compiled_autograd is first entered (importing it changes nothing in torch)
BACKGROUND = "background compile"  # when a background compile is first scheduled
INDUCTOR = "inductor compile"  # when inductor first compiles one of our graphs
DYNAMIC_INDUCTOR = "dynamic inductor compile (scoped)"  # only while inductor compiles a dynamic graph of ours


@dataclass(frozen=True)
class Patch:
    """One patch of torch's internals."""

    name: str  # its row in `releases.WRITTEN_FOR`: the torch releases it was written for
    replaces: str  # what it replaces
    why: str  # the NOTE that says why
    still_needed: str  # how to tell it is still needed
    when: str  # FIRST_USE, BACKGROUND, INDUCTOR: installed then, once; DYNAMIC_INDUCTOR: `scoped`
    install: Callable  # installs it (or, scoped, a context manager that holds it)
    for_speed: bool = False  # only for speed: where torch's layout differs, left out (logged)

    @property
    def releases(self) -> str:
        return releases.describe(releases.WRITTEN_FOR[self.name])


PATCHES = (
    Patch(
        "fx traces",
        "torch.fx Tracer.trace, _Patcher.patch/patch_method, and the code of is_fx_tracing / is_fx_symbolic_tracing",
        "NOTE [One fx trace at a time]",
        "a capture beside a background compile fails with 'CURRENT_PATCHER is None' (tests/test_interop.py threads)",
        FIRST_USE,
        _serialize_fx_traces,
    ),
    Patch(
        "engine queries",
        "torch._C._will_engine_execute_node",
        "NOTE [Engine queries from hooks] (calls/kernel.py)",
        "register_multi_grad_hook(mode='all') in a compiled graph never calls its function (tests/test_hooks_node.py)",
        FIRST_USE,
        _patch_will_engine_execute_node,
    ),
    Patch(
        "dynamo compiles",
        "torch._dynamo.convert_frame._compile",
        "NOTE [One compile at a time]",
        "a torch.compile'd training step beside a background compile fails: 'Expected current_level > 0'",
        BACKGROUND,
        serialize_dynamo_compiles,
    ),
    Patch(
        "random state",
        "torch._dynamo.utils.preserve_rng_state (and the name in every torch.* module that imported it)",
        "NOTE [A background compile leaves the random state alone]",
        "dropout masks repeat after a background compile ends (tests/test_background.py)",
        BACKGROUND,
        _patch_preserve_rng_state,
    ),
    Patch(
        "freed buffers",
        "torch._inductor.codegen.wrapper.PythonWrapperCodegen.codegen_free",
        "NOTE [Freed, never reused] (inductor.py)",
        "a tensor hook on every activation: peak memory 1.8x eager's (tests/test_memory.py)",
        INDUCTOR,
        _patch_codegen_free,
    ),
    Patch(
        "mutation renames",
        "torch._inductor.scheduler.SchedulerNode.recompute_size_and_body",
        "NOTE [Mutation renames after a loop recompute] (inductor_patches.py)",
        "topk's backward beside a layer norm reads a buffer before its scatter: a wrong gradient",
        INDUCTOR,
        _patch_mutation_renames,
    ),
    Patch(
        "vector-ISA probes",
        "torch._inductor.cpu_vec_isa.VecISA._probe_load",
        "NOTE [Remembered vector-ISA probes] (inductor_patches.py)",
        "a warm process's first backward spends ~0.9 s probing ISAs (benchmarks/repro/disk_cache_sizes.py)",
        INDUCTOR,
        _remember_vec_isa_probes,
        for_speed=True,
    ),
    Patch(
        "reduction helper",
        "torch._inductor.codegen.cpp.CppKernel.need_use_acc_helper",
        "NOTE [One dynamic graph per size range] (inductor_patches.py)",
        "a dynamic graph compiles twice across a reduction size of 4096 (tests/test_dynamic.py)",
        DYNAMIC_INDUCTOR,
        _size_class_agnostic_reductions,
        for_speed=True,
    ),
    Patch(
        "reshape indexing",
        "torch._inductor.sizevars.SizeVarAllocator._simplify_with_ranges",
        "NOTE [Indexing of dynamic reshapes] (inductor_patches.py)",
        "a dynamic transformer's reshape kernels keep their modulos: scalar, 5x slower (tests/test_dynamic.py)",
        DYNAMIC_INDUCTOR,
        _symbolic_range_simplification,
        for_speed=True,
    ),
)
assert {p.name for p in PATCHES} <= set(releases.WRITTEN_FOR), "every patch has its row in releases.WRITTEN_FOR"

_installed: set = set()
_install_lock = threading.Lock()
_failed: dict = {}  # moment -> the LayoutDiffers of its first install (raised again each time)


def _differs(patch: Patch, e: Exception) -> LayoutDiffers:
    first = (str(e).strip().splitlines() or [""])[0][:200]
    return LayoutDiffers(
        f"the patch of {patch.replaces} ({patch.why}; written for torch {patch.releases}) does not "
        f"fit this torch release ({torch.__version__}): {type(e).__name__}: {first}"
    )


def install(when: str) -> None:
    """Install the patches of this moment that are in force on this torch, once each;
    `LayoutDiffers` where one (not only for speed) finds torch laid out otherwise."""
    if when in _installed:
        if when in _failed:
            raise _failed[when]
        return
    with _install_lock:
        if when not in _installed:
            for patch in PATCHES:
                if patch.when != when or not releases.in_force(patch.name):
                    continue
                try:
                    patch.install()
                except (LayoutDiffers, AttributeError, ImportError, TypeError) as e:
                    err = _differs(patch, e)
                    if patch.for_speed:
                        log.warning("%s; left out (it is only for speed)", err)
                    elif when not in _failed:
                        _failed[when] = err
                        releases.LAYOUT_DIFFERS[patch.name] = str(err)
            _installed.add(when)
    if when in _failed:
        raise _failed[when]


@contextlib.contextmanager
def scoped(when: str = DYNAMIC_INDUCTOR):
    """Hold the scoped patches of this moment that are in force on this torch, for the length
    of the block (they are only for speed: one that finds torch laid out otherwise is left out)."""
    with contextlib.ExitStack() as stack:
        for patch in PATCHES:
            if patch.when != when or not releases.in_force(patch.name):
                continue
            try:
                stack.enter_context(patch.install())
            except (LayoutDiffers, AttributeError, ImportError, TypeError) as e:
                log.warning("%s; left out (it is only for speed)", _differs(patch, e))
        yield
