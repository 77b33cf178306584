"""Turning a captured FX graph into something callable.

Every backend receives the traced aten-level `GraphModule` and example inputs
(the real lifted tensors for a static graph; fake tensors and SymInts for a
dynamic one), and returns a callable taking the graph inputs positionally and
returning the list of graph outputs.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import logging
import operator
import os
import threading
from typing import Callable, Sequence

import torch

from ..replay import calls as ops
from ..config import BackendLike
from ..values import BOXED

_lock = threading.RLock()  # one of our compiles at a time (NOTE [One compile at a time])


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

    original = getattr(convert_frame, "_compile", None)
    if original is None or getattr(original, "_compiled_autograd", False):
        return  # (None: a torch whose dynamo compiles frames elsewhere; nothing to wrap)

    @functools.wraps(original)
    def _compile(*args, **kwargs):
        if _tracing_here():
            return original(*args, **kwargs)
        with _lock:
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
_trace_lock = threading.RLock()
_fx_traces = threading.local()  # .depth: fx traces running in this thread


def _tracing_here() -> bool:
    return getattr(_fx_traces, "depth", 0) > 0


def _confined(new_fn, original):
    owner = threading.get_ident()

    @functools.wraps(new_fn)
    def confined(*args, **kwargs):
        if threading.get_ident() == owner:
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

    original = Tracer.trace
    if getattr(original, "_compiled_autograd", False):
        return

    @functools.wraps(original)
    def trace(self, *args, **kwargs):
        with _trace_lock:
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
    if hasattr(fx_trace, "_is_fx_tracing_flag"):  # a process-global flag (torch 2.13; later a thread-local one)
        replacements: dict = {}
        exec(_FLAG_FUNCTIONS, vars(fx_trace), replacements)
        for name, fn in replacements.items():
            getattr(fx_trace, name).__code__ = fn.__code__
    _Patcher.patch, _Patcher.patch_method = confined_patch, confined_patch_method
    trace._compiled_autograd = True
    Tracer.trace = trace


_serialize_fx_traces()


def may_steal(backend: BackendLike) -> bool:
    """Whether the code `backend` compiles leaves a grad handed to AccumulateGrad alone
    (NOTE [Stealing a fresh grad] in replay/calls.py): the eager graph and aot_eager run functional
    aten ops; inductor, with our lowering of the call (below). A user's backend is unknown."""
    return isinstance(backend, str) and backend in ("eager", "aot_eager", "inductor")


def _register_inductor_lowering() -> None:
    """Inductor's lowering of compiled_autograd::call: the generic fallback kernel, and,
    for a call that hands its grad over (flags & ops.HANDS_OVER), that grad's buffer is
    never reused: inductor would otherwise write the next same-sized result into it
    (`buf3 = buf1; del buf1  # reuse`) while it is the parameter's `.grad`."""
    import torch.utils._pytree as pytree
    from torch._inductor import ir
    from torch._inductor.lowering import lowerings, register_lowering
    from torch._inductor.virtualized import V

    op = torch.ops.compiled_autograd.call.default
    if op in lowerings:
        return

    @register_lowering(op, type_promotion_kind=None)
    def _call(slot, args, meta, flags):
        start = len(V.graph.operations)
        out = ir.FallbackKernel.create(op, slot, args, meta, flags)
        # NOTE [Calls run in eager's order]: hooks and opaque nodes must run in the traced
        # order, whatever data flows between them. The call is ORDERED-effectful, and
        # inductor's with_effects lowering adds a dependency of each effectful op on the
        # one before, but keys it by buffer name where its scheduler looks it up by
        # operation name (torch 2.13): the dependency is lost, and inductor ran a call whose
        # outputs were needed early before the call traced ahead of it. So each call's
        # operations also depend on the previous call's, keyed as the scheduler reads them
        previous = getattr(V.graph, "_compiled_autograd_last_call", None)
        created = V.graph.operations[start:]
        for operation in created:
            if isinstance(operation, ir.FallbackKernel) and not V.graph.cpp_wrapper and not getattr(V.graph, "fx_wrapper", False):
                # the generated Python code calls the kernel directly (ops.call_direct): not
                # through the dispatcher, whose boxing of the arguments and redispatch to our
                # Python kernel cost ~10 us a call
                operation.python_kernel_name = ops.DIRECT_KERNEL_NAME
        if previous is not None:
            for operation in created:
                V.graph.additional_star_deps[operation.get_operation_name()].add(previous.get_name())
        if created:
            V.graph._compiled_autograd_last_call = created[-1]
        if flags & ops.KEEPS_INPUTS or flags >> ops.PASSES_SHIFT:
            # a hook may keep a tensor it is given (a logging hook storing its grad), and
            # return it unchanged as its output (NOTE [Outputs the graph owns]): no buffer of
            # its inputs or outputs may be reused for another result. A call that passes
            # graph inputs on returns them (NOTE [Hooks may change what the graph reads]):
            # its outputs are not inductor's to reuse
            for operation in V.graph.operations[start:]:
                if isinstance(operation, ir.FallbackKernel) and flags & ops.KEEPS_INPUTS:
                    for inp in operation.inputs:
                        if isinstance(inp, ir.IRNode) and inp.maybe_get_name() is not None:
                            _never_reuse(inp.get_name())
                elif isinstance(operation, ir.MultiOutput):
                    _never_reuse(operation.get_name())
        if flags & ops.HANDS_OVER:
            # the grad is the first argument (the others only order the call: NOTE
            # [Hooks may change what the graph reads] in capture/trace.py)
            for operation in V.graph.operations[start:]:
                if isinstance(operation, ir.FallbackKernel) and operation.inputs:
                    inp = operation.inputs[0]
                    if isinstance(inp, ir.IRNode) and inp.maybe_get_name() is not None:
                        _never_reuse(inp.get_name())
        return pytree.tree_map(_wrap_for_lowering, out)


def _wrap_for_lowering(x):
    """A fallback kernel's output as its lowering returns it (`wrap_for_lowering`, torch 2.13;
    a TensorBox before)."""
    from torch._inductor import ir

    if not isinstance(x, ir.IRNode):
        return x
    wrap = getattr(x, "wrap_for_lowering", None)
    return wrap() if wrap is not None else ir.TensorBox.create(x)


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
    _isa_probes_patched = True
    try:
        from torch._inductor.cpu_vec_isa import VecISA
    except ImportError:  # pragma: no cover
        return
    original = getattr(VecISA, "_probe_load", None)
    if original is None:  # pragma: no cover - another torch
        return

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


def _never_reuse(name: str) -> None:
    """NOTE [Freed, never reused]: inductor must not write another result into this buffer
    (a hook or AccumulateGrad may hold it), but it may drop its own reference at the
    buffer's last use. Inductor's `never_reuse_buffers` does the first and, as a side
    effect, never frees such a buffer (`codegen_free` returns early for it, torch 2.13): a
    hook's grads and a pass-through's tensors lived to the end of the graph (a tensor hook
    on every activation: 1.8x eager's peak memory, a module full backward hook on every
    layer: 3.5x). Our patch of `codegen_free` writes a plain `del` for these buffers."""
    from torch._inductor.virtualized import V

    V.graph.never_reuse_buffers.add(name)
    mine = getattr(V.graph, "_compiled_autograd_no_reuse", None)
    if mine is None:
        mine = V.graph._compiled_autograd_no_reuse = set()
    mine.add(name)


def _patch_codegen_free() -> None:
    """NOTE [Freed, never reused]."""
    from torch._inductor.codegen.wrapper import FreeLine, PythonWrapperCodegen
    from torch._inductor.virtualized import V

    original = PythonWrapperCodegen.codegen_free
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


_inductor_compile = threading.local()  # .ours: this thread is compiling one of our graphs with inductor
_background = threading.local()  # .active: this thread is one of our background compiles


@contextlib.contextmanager
def in_background():
    """Mark this thread as one of our background compiles (NOTE [A background compile leaves
    the random state alone])."""
    _patch_preserve_rng_state()
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

    original = getattr(dynamo_utils, "preserve_rng_state", None)
    if original is None or getattr(original, "_compiled_autograd", False):
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
    for name, module in list(sys.modules.items()):
        if name.startswith("torch.") and getattr(module, "preserve_rng_state", None) is original:
            module.preserve_rng_state = preserve_rng_state


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
    so does this, for the graphs we compile, on releases before 2.14."""
    from torch._inductor.dependencies import StarDep, WeakDep
    from torch._inductor.scheduler import SchedulerNode

    original = SchedulerNode.recompute_size_and_body
    if getattr(original, "_compiled_autograd", False) or torch.torch_version.TorchVersion(torch.__version__) >= (2, 14):
        return

    def recompute_size_and_body(self, *args, **kwargs):
        fake = any(isinstance(d, (WeakDep, StarDep)) for d in self.read_writes.reads)
        original(self, *args, **kwargs)
        if not fake and self.mutation_renames and getattr(_inductor_compile, "ours", False):
            self.set_read_writes(self.read_writes.rename(self.mutation_renames))

    recompute_size_and_body._compiled_autograd = True
    SchedulerNode.recompute_size_and_body = recompute_size_and_body


def _with_effects_direct(token, op, *args, **kwargs):
    return (token, ops.direct(*args, **kwargs))


def _direct_calls(graph: torch.fx.Graph) -> None:
    """Our calls in a graph we run as generated Python code go straight to the kernel
    (ops.call_direct): no dispatcher, and no `with_effects` higher-order op, whose Python
    dispatch (pytree flattening of the arguments, a new token tensor per call) cost about
    60 us a call, half a hook call's time. The call stays where the graph has it, and the
    graph runs in order (the token only threads that order through)."""
    op = torch.ops.compiled_autograd.call.default
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        if n.target is op:
            n.target = ops._native().call_direct
        elif n.target is torch.ops.higher_order.with_effects and len(n.args) > 1 and n.args[1] is op:
            n.target = _with_effects_direct


def _direct_calls_nop(fx_g: torch.fx.GraphModule, example_inputs):
    """aot_eager's compiler (boxed_nop), with our calls direct (_direct_calls)."""
    from torch._dynamo.backends.debugging import boxed_nop

    _direct_calls(fx_g.graph)
    return boxed_nop(fx_g, example_inputs)


def compile_graph(
    backend: BackendLike,
    gm: torch.fx.GraphModule,
    example_inputs: Sequence,
    dynamic: bool = False,
    patches: dict | None = None,
) -> Callable:
    # Compile as an inference graph: the compiled graph is never differentiated
    # itself (under create_graph=True the traced FX graph is: NOTE [create_graph]
    # in capture/create_graph.py). One compile at a time: inductor
    # is not thread-safe, and background compiles run in threads. `patches`:
    # inductor config (enable(mode=..., options=...)), set for this compile only.
    with _lock, torch.no_grad():
        if backend == "eager":
            return _boxed_graph_module(gm)
        if backend == "aot_eager":
            from torch._dynamo.backends.debugging import aot_eager

            # (as inductor's: against fakes of a mode with a ShapeEnv, in which an op whose
            # output shape depends on data -- a boolean-mask index in a grad formula -- gets an
            # unbacked size; AOTAutograd's own fake mode for real inputs has no ShapeEnv, and
            # raised DynamicOutputShapeException)
            compile = functools.partial(aot_eager, fw_compiler=_direct_calls_nop)
            return _compile_on_static_fakes(compile, gm, example_inputs, static=not dynamic)
        if backend == "inductor":
            from torch._inductor.compile_fx import compile_fx

            from torch._inductor import config as inductor_config

            _register_inductor_lowering()
            _patch_codegen_free()
            _patch_mutation_renames()
            _remember_vec_isa_probes()

            # NOTE [No size asserts]: inductor's code checks every input's sizes and
            # strides on every call (`assert_size_stride`, ~0.45 us per input: 0.6 ms
            # of a 2000-node chain's 4-6 ms hit). Our cache key already fixes every
            # lifted tensor's sizes and strides (or their symbols and guards), so a
            # graph is only ever called with the geometry it was compiled for.
            with inductor_config.patch({"size_asserts": False, **(patches or {})}), (
                _size_class_agnostic_reductions() if dynamic else contextlib.nullcontext()
            ), _cache_tag(dynamic) as tagged:
                # NOTE [Inductor's FX graph cache for our graphs]
                _inductor_compile.ours = True
                try:
                    return _compile_on_static_fakes(compile_fx, gm, example_inputs, static=tagged and not dynamic)
                finally:
                    _inductor_compile.ours = False
        return backend(gm, list(example_inputs))


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
    boxed = torch.fx.GraphModule(gm, graph)
    setattr(boxed, BOXED, True)
    return boxed


def _as_is(flat_args):
    return flat_args


def _compile_on_static_fakes(compile: Callable, gm: torch.fx.GraphModule, example_inputs: Sequence, static: bool) -> Callable:
    """Compile a static graph against static fakes of a mode with a ShapeEnv, in a tracing
    context (`_static_fake_mode`); anything else, or inputs it cannot take, as given."""
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


@contextlib.contextmanager
def _size_class_agnostic_reductions():
    """NOTE [One dynamic graph per size range]
    Inductor's CPU code generator picks a summation helper for float sums by
    guarding on `reduction size > 4096`. In a dynamic graph that guard splits
    the sizes into two ranges, each needing its own compile. When the size is
    symbolic and not known either way, we take the helper (cascade summation,
    correct and precise for every size) instead of guarding."""
    try:
        import sympy
        from torch._inductor.codegen.cpp import CppKernel
        from torch._inductor.virtualized import V
    except ImportError:  # pragma: no cover - other torch versions
        yield
        return
    original = CppKernel.need_use_acc_helper

    def need_use_acc_helper(self, reduction_type, dtype, use_scalar):
        if reduction_type == "sum" and dtype == torch.float and self.call_ranges is not None:
            size = functools.reduce(operator.mul, self.call_ranges[self.reduction_depth :], sympy.Integer(1))
            sizevars = V.graph.sizevars
            if not sizevars.statically_known_true(sympy.Le(size, 4096)):
                return True
        return original(self, reduction_type, dtype, use_scalar)

    CppKernel.need_use_acc_helper = need_use_acc_helper
    try:
        with _symbolic_range_simplification():
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
    try:
        import sympy
        from torch._inductor.sizevars import SizeVarAllocator
        from torch.utils._sympy.functions import FloorDiv, ModularIndexing
    except ImportError:  # pragma: no cover
        yield
        return
    original = SizeVarAllocator._simplify_with_ranges

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


@functools.lru_cache(maxsize=None)
def _code_digest() -> str:
    """A digest of the code that shapes what inductor makes of our graphs (our lowering of
    the call, the codegen patches here, the call's kernel)."""
    import hashlib
    from pathlib import Path

    h = hashlib.sha256()
    package = Path(__file__).resolve().parents[1]
    for name in ("compile", "replay"):
        for f in sorted((package / name).glob("*.py")):
            h.update(f.read_bytes())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _cache_tag(dynamic: bool):
    """Keep inductor's on-disk caches (its FX graph cache, keyed by the graph and its
    config) from serving code compiled by another version of our lowering and codegen
    patches, or for the other kind of graph: a no-op custom pass whose uuid enters the key.
    Yields whether it could (not when the user set a post-grad pass of their own)."""
    from torch._inductor import config

    if config.post_grad_custom_post_pass is not None:
        yield False
        return
    try:
        from torch._inductor.custom_graph_pass import CustomGraphPass
    except ImportError:  # pragma: no cover
        yield False
        return

    tag = f"compiled_autograd {_code_digest()}: " + (
        "dynamic: size-class agnostic reductions, range-proven index identities" if dynamic else "static"
    )

    class _Tag(CustomGraphPass):
        def __call__(self, graph):
            return None

        def uuid(self):
            return tag

    with config.patch(post_grad_custom_post_pass=_Tag()):
        yield True


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


def static_fakes(values):
    """(mode, static fakes of `values`' tensors, the rest as is), in a mode with a ShapeEnv."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from ..capture.trace import fakeable

    mode = FakeTensorMode(shape_env=ShapeEnv())
    return mode, [mode.from_tensor(fakeable(t), static_shapes=True) if isinstance(t, torch.Tensor) else t for t in values]
