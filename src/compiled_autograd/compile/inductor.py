"""Inductor for our graphs: its lowering of compiled_autograd::call, and the compile itself
(inductor's config for our graphs, the patches it needs, its on-disk cache's key)."""

from __future__ import annotations

import contextlib
import functools

import torch

from ..calls import kernel, protocol
from . import inductor_patches, torch_patches
from .boxed import compile_on_static_fakes


def compile_inductor(gm, example_inputs, dynamic: bool, patches: dict | None):
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    _register_inductor_lowering()
    torch_patches.install(torch_patches.INDUCTOR)
    # NOTE [No size asserts]: inductor's code checks every input's sizes and
    # strides on every call (`assert_size_stride`, ~0.45 us per input: 0.6 ms
    # of a 2000-node chain's 4-6 ms hit). Our cache key already fixes every
    # lifted tensor's sizes and strides (or their symbols and guards), so a
    # graph is only ever called with the geometry it was compiled for.
    isa = isa_patches()  # NOTE [The machine's vector ISAs, probed once]
    # NOTE [Graphs with calls in inductor's caches]: a graph whose calls (hooks, opaque nodes, in-graph
    # AccumulateGrad) AOTAutograd wraps in `with_effects` was never cached ("Can't cache
    # HigherOrderOperator: with_effects"): a child's compile of it was lost, the training process
    # compiled it again in full (a DDP graph: its reducer hooks), and no later process or rank found
    # it. The op it wraps is ours, its lowering keyed by our code (_cache_tag): marked cacheable,
    # keyed by that code's digest.
    cacheable = {**inductor_config.unsafe_marked_cacheable_functions, "torch.ops.higher_order.with_effects": _code_digest()}
    with (
        inductor_config.patch({"size_asserts": False, "unsafe_marked_cacheable_functions": cacheable, **isa, **(patches or {})}),
        torch_patches.scoped(torch_patches.DYNAMIC_INDUCTOR) if dynamic else contextlib.nullcontext(),
        _cache_tag(dynamic) as tagged,
    ):
        # NOTE [Inductor's FX graph cache for our graphs]
        inductor_patches.compiling_ours.active = True
        try:
            return compile_on_static_fakes(compile_fx, gm, example_inputs, static=tagged and not dynamic)
        finally:
            inductor_patches.compiling_ours.active = False
            if not isa:
                _note_isa_verdict()


# NOTE [The machine's vector ISAs, probed once]
# Before its first C++ kernel, inductor finds which vector instruction sets (AVX-512 VNNI,
# AVX-512, AVX2, ...) this machine's CPU and compiler can use: for each one the CPU's flags
# allow it builds a test program with g++ and loads it in a new Python process. That is cached
# in inductor's cache directory only, so each new cache directory pays it again: 10 s of the
# 31 s from a 2-layer transformer's first backward to its compiled graph, with a fresh inductor
# cache on 2 cores (benchmarks/compile_cost.py). What it finds belongs to the machine, not the
# cache: so once inductor probed them all and every ISA the CPU's flags allow passed, that is
# written in our own cache directory (native.cache_root(), keyed by the torch release, the
# compiler's path, size and time, and the CPU's flags), and from then on each compile tells
# inductor that the ISAs the flags allow are fine (`cpp.vec_isa_ok`: it builds no test program).
# The decision is taken once per process (`isa_patches`), and the child and the training process
# key a compile alike: a parent that has decided hands its decision to the child with the graph;
# one that has not (taking it finds the C++ compiler: inductor's codecache imported, `g++ --version` run,
# in a training process beside its first steps: +0.25 s over the D=1024 MLP's first
# 60 steps) leaves it to the child, which sends back what it decided (`.isa` beside the graph's
# file), and takes that before it loads the compiled graph. Where a probe failed,
# or elsewhere than x86-64 Linux, nothing is written and inductor probes as before.
_isa: dict | None = None


def isa_patches() -> dict:
    """The inductor config this process's compiles use for the vector ISAs (NOTE above)."""
    global _isa
    if _isa is None:
        _isa = {"cpp.vec_isa_ok": True} if _isa_verdict() else {}
    return _isa


def decided_isa_patches() -> dict | None:
    """This process's decision, where it has taken one; None before (taking it finds the compiler:
    a training process leaves that to its compile child, NOTE above)."""
    return None if _isa is None else dict(_isa)


def set_isa_patches(patches: dict) -> None:
    """A compile child takes its parent's decision, a parent its child's (NOTE above)."""
    global _isa
    _isa = dict(patches)


def _isa_key() -> str | None:
    import hashlib
    import os
    import platform
    import shutil
    import sys

    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
        from torch._inductor.cpu_vec_isa import x86_isa_checker

        compiler = get_cpp_compiler()
        path = shutil.which(compiler) or compiler
        st = os.stat(path)
        flags = sorted(x86_isa_checker())
    except Exception:
        return None
    return hashlib.sha256(repr((torch.__version__, path, st.st_size, int(st.st_mtime), flags)).encode()).hexdigest()[:24]


def _isa_file():
    from .. import native

    return native.cache_root() / "vec_isa_ok"


def _isa_verdict() -> bool:
    key = _isa_key()
    if key is None:
        return False
    try:
        return key in _isa_file().read_text().split()
    except OSError:
        return False


def _note_isa_verdict() -> None:
    """After a compile that probed the ISAs: remember, for the machine, that all passed."""
    try:
        from torch._inductor import cpu_vec_isa

        key = _isa_key()
        if key is None or _isa_verdict():
            return
        flags = cpu_vec_isa.x86_isa_checker()
        allowed = [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(f in flags for f in str(isa).split())]
        if allowed and len(cpu_vec_isa.valid_vec_isa_list()) == len(allowed):
            path = _isa_file()
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write(key + "\n")
    except Exception:  # (nothing lost: the next cache directory probes again)
        pass


def _register_inductor_lowering() -> None:
    """Inductor's lowering of compiled_autograd::call: the generic fallback kernel, and,
    for a call that hands its grad over (flags & protocol.HANDS_OVER), that grad's buffer is
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
        # operations also depend on the previous call's, keyed as the scheduler reads them:
        # through `additional_star_deps` (a StarDep; 2.13, 2.14), from torch 2.15 through
        # `additional_buffer_deps` (an ordering-only WeakDep, which 2.15's with_effects uses,
        # keyed right), the one of the two this torch has
        previous = getattr(V.graph, "_compiled_autograd_last_call", None)
        created = V.graph.operations[start:]
        for operation in created:
            if isinstance(operation, ir.FallbackKernel) and not V.graph.cpp_wrapper and not getattr(V.graph, "fx_wrapper", False):
                # the generated Python code calls the kernel directly (calls/kernel.py direct): not
                # through the dispatcher, whose boxing of the arguments and redispatch to our
                # Python kernel cost ~10 us a call
                operation.python_kernel_name = kernel.DIRECT_KERNEL_NAME
        if previous is not None:
            deps = _ordering_deps(V.graph)
            for operation in created:
                deps[operation.get_operation_name()].add(previous.get_name())
        if created:
            V.graph._compiled_autograd_last_call = created[-1]
        if flags & protocol.KEEPS_INPUTS or flags >> protocol.PASSES_SHIFT:
            # a hook may keep a tensor it is given (a logging hook storing its grad), and
            # return it unchanged as its output (NOTE [Outputs the graph owns]): no buffer of
            # its inputs or outputs may be reused for another result. A call that passes
            # graph inputs on returns them (NOTE [Hooks may change what the graph reads]):
            # its outputs are not inductor's to reuse
            for operation in V.graph.operations[start:]:
                if isinstance(operation, ir.FallbackKernel) and flags & protocol.KEEPS_INPUTS:
                    for inp in operation.inputs:
                        if isinstance(inp, ir.IRNode) and inp.maybe_get_name() is not None:
                            _never_reuse(inp.get_name())
                elif isinstance(operation, ir.MultiOutput):
                    _never_reuse(operation.get_name())
        if flags & protocol.HANDS_OVER:
            # the grad is the first argument (the others only order the call: NOTE
            # [Hooks may change what the graph reads] in capture/trace.py)
            for operation in V.graph.operations[start:]:
                if isinstance(operation, ir.FallbackKernel) and operation.inputs:
                    inp = operation.inputs[0]
                    if isinstance(inp, ir.IRNode) and inp.maybe_get_name() is not None:
                        _never_reuse(inp.get_name())
        return pytree.tree_map(_wrap_for_lowering, out)


def _ordering_deps(graph) -> dict:
    """The scheduler's extra dependencies of an operation, by name (NOTE [Calls run in eager's
    order] above); `LayoutDiffers` naming both where this torch has neither."""
    for name in ("additional_buffer_deps", "additional_star_deps"):  # torch 2.15; 2.13, 2.14
        deps = getattr(graph, name, None)
        if deps is not None:
            return deps
    raise torch_patches.LayoutDiffers(
        f"inductor's GraphLowering has neither additional_buffer_deps nor additional_star_deps in this torch "
        f"release ({torch.__version__}): the calls of a graph could not be kept in eager's order"
    )


def _wrap_for_lowering(x):
    """A fallback kernel's output as its lowering returns it (`wrap_for_lowering`, torch 2.13;
    a TensorBox before)."""
    from torch._inductor import ir

    if not isinstance(x, ir.IRNode):
        return x
    wrap = getattr(x, "wrap_for_lowering", None)
    return wrap() if wrap is not None else ir.TensorBox.create(x)


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
