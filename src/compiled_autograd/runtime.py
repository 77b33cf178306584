"""One backward call: collect -> look up -> (capture + compile) -> run -> apply.

The lifecycle of a backward, named as the code names it:
  collect  the native walker visits the graph in engine order and builds the key
  capture  on a miss: trace the whole backward into one FX graph (trace.py)
  compile  hand that graph to the backend (backends.py), store it (cache.py)
  replay   run the compiled graph on the lifted tensors, then apply its outputs
           with eager semantics (AccumulateGrad itself) and free the graph.
Anything this path does not handle runs in eager autograd instead, counted in
`stats().eager_fallbacks` with its reason.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import threading
import time
import warnings
from collections import Counter
from typing import Any, Callable, Sequence

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import diskcache, native
from .backends import BOXED, compile_graph, in_background, may_steal, serialize_dynamo_compiles, static_fakes
from .cache import CACHE, CompiledBackward, Dynamic
from .config import Config
from .stats import LOCK, STATS
from .values import NodeSummary
from .values import NodeSummary
from . import ops
from .collect import CHURN, CHURN_LIMIT, LEARNED, Learn, Unkeyable, collect, read_state, state_reads
from .logs import compile_status
from .graph_task import in_graph_task
from .trace import ACCUMULATE_KIND, NotTwiceDifferentiable, capture_backward, guards_of, tensor_positions
from .create_graph import DifferentiableGraph, split_joint
from .validate import expected_outputs, mismatches

log = logging.getLogger("compiled_autograd")

UNUSED_INPUT_ERROR = (
    "The differentiated Tensor at index {} appears to not have been used in the graph. "
    "Set allow_unused=True if this is the desired behavior."
)


class CompiledAutogradError(RuntimeError):
    """Raised under `fullgraph=True` when a backward cannot be compiled."""


class BackendOutputError(CompiledAutogradError):
    """A backend's compiled graph returned outputs that differ from the traced graph's: too
    few or too many, or one of another shape, dtype, device or layout (NOTE [A compiled
    graph's outputs are checked on its first run], validate.py)."""


class _Fallback(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


_warned: set[str] = set()
_capture_log: list[dict] = []
MAX_CAPTURE_LOG = 256  # the capture log keeps the newest this many entries
_unsupported: dict[tuple, str] = {}  # key -> why its capture fell back (not traced again)
_failures: Counter = Counter()  # key -> captures (trace, compile or first run) that raised
MAX_CAPTURE_FAILURES = 2  # then that key runs eagerly without tracing it again


def _mark_unsupported(key, reason: str) -> None:
    if len(_unsupported) < 1024:
        _unsupported[key] = reason


def capture_log() -> list[dict]:
    return list(_capture_log)


def _log_capture(record: dict) -> dict:
    """Append record to the capture log, dropping the oldest beyond MAX_CAPTURE_LOG, and
    return it: a background compile updates its record by reference, not by position."""
    _capture_log.append(record)
    if len(_capture_log) > MAX_CAPTURE_LOG:
        del _capture_log[: len(_capture_log) - MAX_CAPTURE_LOG]
    return record


def reset_runtime() -> None:
    _warned.clear()
    _capture_log.clear()
    _unsupported.clear()
    _failures.clear()
    LEARNED.clear()
    CHURN.clear()
    LAYOUTS.clear()
    NODE_LAYOUTS.clear()
    _relayouts.clear()
    _layout_reasons.clear()
    with LOCK:
        _deferred.clear()


def _global_state() -> tuple:
    # process state a traced formula may branch on; a backward run inside an autocast region
    # runs its formulas autocast (the engine runs CPU work on the calling thread, and a CUDA
    # device thread takes the caller's autocast state): the dtype per device type, or None
    return (
        torch.get_default_dtype(),
        torch.are_deterministic_algorithms_enabled(),
        torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None,
        torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None,
    )


def _is_edge(e) -> bool:
    """A GradientEdge (node, output_nr, ...); the native side checks the node."""
    return isinstance(e, torch.autograd.graph.GradientEdge) and type(e[1]) is int


def _precheck(roots, grads, create_graph, inputs, accumulate_grad) -> tuple[str | None, bool]:
    """(reason to run eagerly, whether eager is only there to raise the user's error)."""
    for r in roots:
        if not isinstance(r, torch.Tensor):
            if not _is_edge(r):
                return "root neither a tensor nor a GradientEdge", True
        elif r.grad_fn is None and not r.requires_grad:
            return "root does not require grad", True
    for t in inputs:
        if not isinstance(t, torch.Tensor):
            if not _is_edge(t):
                return "input neither a tensor nor a GradientEdge", True
        elif not t.requires_grad:
            return "input does not require grad", True
        elif accumulate_grad and t.grad_fn is not None:
            t.retain_grad()  # what eager does for a non-leaf input of backward(): its grad lands in .grad
    if torch.is_anomaly_enabled() and (torch.is_anomaly_check_nan_enabled() or not STATS.compiles_pending):
        # (aot autograd turns anomaly mode on, without NaN checks, while it
        # compiles; that global flag is not the user's while ours compile)
        return "anomaly mode", False
    if torch._C._are_functorch_transforms_active() or any(_is_functorch_wrapped(t) for t in (*roots, *inputs, *grads)):
        # (torch.func.vjp's function runs the engine on its transform's tensors, outside it)
        return "functorch transform active", False
    if any(g is not None and _is_vmapped(g) for g in grads):
        return "grads batched by vmap (is_grads_batched=True)", False
    if _get_current_dispatch_mode() is not None:
        return "TorchDispatchMode active", False
    for g in grads:
        if g is not None and type(g) not in (torch.Tensor, torch.nn.Parameter):
            return "tensor subclass root grad", False
    return None, False


def _is_functorch_wrapped(t) -> bool:
    return isinstance(t, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(t)


def _is_vmapped(t) -> bool:
    """A grad batched by the vmap that `grad(..., is_grads_batched=True)` runs the engine in."""
    check = getattr(torch._C._functorch, "is_legacy_batchedtensor", None)
    return bool(check is not None and isinstance(t, torch.Tensor) and check(t))


def _fall_back(cfg: Config, reason: str, eager: Callable[[], Any], user_error: bool = False):
    if cfg.fullgraph and not user_error:
        raise CompiledAutogradError(
            f"compiled_autograd: cannot compile this backward ({reason}); "
            "use fullgraph=False to run it in eager autograd instead"
        )
    result = eager()  # eager raises the user's error itself where there is one
    with LOCK:
        STATS.eager_fallbacks += 1
        STATS.fallback_reasons[reason] += 1
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"compiled_autograd: running a backward in eager autograd: {reason}", stacklevel=4)
    log.info("eager fallback: %s", reason)
    return result


def _learn_in_eager(learn: Learn, eager: Callable[[], Any]):
    """NOTE [Unpack metadata learned from the last backward] (collect.py): this backward runs
    in eager autograd, its user unpack hooks reporting what they return (`learn_unpacks`, before
    the capture let go of the graph); the next one of this graph and sizes is compiled."""
    log.info("eager backward to learn what %d saved-tensor unpack hooks return", len(learn.keys))
    result = eager()
    learn.finish()
    with LOCK:
        STATS.learning_backwards += 1
    return result


def _create_graph_unsupported(collected) -> str | None:
    """Why this backward cannot run compiled with create_graph=True (NOTE [create_graph])."""
    if collected.unpacked:
        return "create_graph=True with saved-tensor hooks"
    for n in collected.nodes:
        if n.hooks.any:
            return "create_graph=True with hooks"
        if n.opaque:
            return "create_graph=True with an opaque node"
    if any(info.opaque_reason for info in collected.pynodes.values()):
        return "create_graph=True with an opaque node"
    return None


def _capture_and_compile(cfg: Config, collected, key, mask, reason: str, history=(), create_graph=False, layouts=None) -> CompiledBackward:
    t0 = time.perf_counter()
    try:
        captured = in_graph_task(lambda: capture_backward(collected, cfg.opaque, mask, history, create_graph, layouts))
    except NotTwiceDifferentiable as e:
        raise _Fallback(f"create_graph=True through a node eager cannot differentiate twice ({e})") from e
    if create_graph and captured.plan.slots:
        raise _Fallback("create_graph=True with an opaque node")
    vjp, how = None, None
    if create_graph:
        how = "no result requires grad: applied in grad mode, nothing to differentiate"
    if create_graph and any(captured.plan.differentiable):
        try:
            split = in_graph_task(lambda: split_joint(captured.graph, captured.example_inputs, captured.plan.differentiable))
        except Exception:  # the second order then reruns the graph: slower, as right
            log.info("could not split a create_graph graph into forward and vjp", exc_info=True)
            split = None
        how = "the second order reruns this graph in grad mode (not split)"
        if split is not None:
            captured.graph, vjp, n_saved = split
            how = (f"{sum(captured.plan.differentiable)} differentiable results; the graph also returns {n_saved} "
                   f"tensors its vjp graph reads (the second order recomputes nothing)")
    t1 = time.perf_counter()
    names = tuple(n.name for n in collected.nodes)
    is_dynamic = captured.mask is not None and any(captured.mask)
    what = f"compiling a {'dynamic ' if is_dynamic else ''}backward graph of {len(names)} nodes with {cfg.backend_name}"
    # (read before the backend sees the graph: it may rewrite it)
    expected = expected_outputs(captured.graph, *((collected, captured.size_inputs) if is_dynamic else ()))
    background = cfg.background_compile and not cfg.fullgraph
    if background:
        fn = captured.graph  # replay the traced graph as is until the compiled one is ready
    else:
        with compile_status(what):
            fn = compile_graph(cfg.backend, captured.graph, _example_inputs(captured, collected), dynamic=is_dynamic, patches=cfg.inductor_patches)
    t2 = time.perf_counter()
    nodes = tuple(NodeSummary(n.name, n.kind, n.hooks, _opaque_reason(captured.plan, i), n.edges) for i, n in enumerate(collected.nodes))
    entry = CompiledBackward(
        fn=fn,
        graph=captured.graph,
        plan=captured.plan,
        backend=cfg.backend_name,
        steals=may_steal(cfg.backend),
        node_names=names,
        num_inputs=len(collected.lifted),
        reason=reason,
        trace_seconds=t1 - t0,
        compile_seconds=t2 - t1,
        sizes=collected.sizes,
        dynamic=_dynamic(captured, collected.sizes) if is_dynamic else None,
        nodes=nodes,
        node_keys=_node_keys(collected.capture),
        compiled=not background,
        vjp=vjp,
        expected=expected,
    )
    with LOCK:
        STATS.captures += 1
        STATS.dynamic_captures += is_dynamic
        STATS.trace_seconds += t1 - t0
        STATS.compile_seconds += t2 - t1
    logged = _log_capture(
        dict(reason=reason, nodes=len(names), backend=cfg.backend_label, opaque=[o[1:] for o in captured.plan.opaque],
             trace_seconds=t1 - t0, compile_seconds=t2 - t1, inputs=len(collected.lifted),
             dynamic=_describe_dynamic(collected, entry.dynamic), guards=entry.dynamic.guard_source if entry.dynamic else None,
             background=background, create_graph=how, **_unpacked_up_front(collected))
    )
    log.info("captured %d nodes (%s): trace %.2fs, compile %.2fs", len(names), reason, t1 - t0, t2 - t1)
    if background:
        example = captured.example_inputs if is_dynamic else _static_fakes(collected.lifted)
        _compile_in_background(cfg, key, entry, example, what, logged, captured)
    return entry


def _entry_from_disk(cfg: Config, collected, key, record, reason: str) -> CompiledBackward:
    """A graph this user's compiled_autograd stored in an earlier process:
    no trace; the compile comes from the backend's own caches."""
    t0 = time.perf_counter()
    gm = record["graph"]
    expected = expected_outputs(gm)  # (no metadata: the number of outputs)
    background = cfg.background_compile and not cfg.fullgraph
    what = f"compiling a stored backward graph of {len(record['node_names'])} nodes with {cfg.backend_name}"
    if background:
        fn = gm
    else:
        with compile_status(what):
            fn = compile_graph(cfg.backend, gm, collected.lifted, patches=cfg.inductor_patches)
    entry = CompiledBackward(
        fn=fn,
        graph=gm,
        plan=record["plan"],
        backend=cfg.backend_name,
        steals=may_steal(cfg.backend),
        node_names=record["node_names"],
        num_inputs=record["num_inputs"],
        reason=reason + " (graph loaded from the disk cache)",
        trace_seconds=0.0,
        compile_seconds=time.perf_counter() - t0,
        sizes=collected.sizes,
        nodes=record["nodes"],
        node_keys=record["node_keys"],
        compiled=not background,
        expected=expected,
    )
    with LOCK:
        STATS.disk_hits += 1
        STATS.compile_seconds += entry.compile_seconds
    logged = _log_capture(
        dict(reason=entry.reason, nodes=len(entry.node_names), backend=cfg.backend_label, opaque=[o[1:] for o in entry.plan.opaque],
             trace_seconds=0.0, compile_seconds=entry.compile_seconds, inputs=entry.num_inputs, dynamic=[], guards=None,
             background=background, **_unpacked_up_front(collected))
    )
    if background:
        _compile_in_background(cfg, key, entry, _static_fakes(collected.lifted), what, logged)
    return entry


def _unpacked_up_front(collected) -> dict:
    """How many tensors saved-tensor hooks unpacked when this backward started, and their
    size: eager unpacks each when its node runs, so these are alive together here, longer
    than in eager; and how many are unpacked in the graph instead (NOTE [Unpacking in the graph])."""
    tensors = [collected.lifted[i] for i in collected.up_front]
    storages = {}
    for t in tensors:
        try:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):  # no storage to count
            pass
    nbytes = sum(storages.values())
    if tensors:
        log.info("%d tensors (%.1f MB) unpacked by saved-tensor hooks when the backward started", len(tensors), nbytes / 2**20)
    return dict(unpacked=len(tensors), unpacked_mb=nbytes / 2**20, in_graph=len(collected.in_graph))


def _static_fakes(tensors):
    """Fake copies for a static graph's background compile (no reference to the user's
    tensors): static shapes, in a mode with a ShapeEnv for inductor's FX graph cache
    (NOTE [Inductor's FX graph cache for our graphs], backends.py)."""
    return static_fakes(tensors)[1]


def _example_inputs(captured, collected):
    # a static graph compiles against the real tensors; a dynamic one against
    # the fakes carrying its symbols
    return captured.example_inputs if captured.mask is not None and any(captured.mask) else collected.lifted


def _dynamic(captured, sizes) -> Dynamic:
    source, guard = guards_of(captured)
    return Dynamic(
        mask=captured.mask,
        static=tuple(None if m else v for m, v in zip(captured.mask, sizes)),
        size_inputs=captured.size_inputs,
        guard_source=source,
        guard=guard,
    )


# NOTE [Background compile]
# With a slow backend (inductor: seconds to minutes per graph) the first
# backward of a new graph does not wait: it replays the traced FX graph as is
# (the same aten ops eager runs), while a thread compiles. When the compile is
# done, the cache entry is replaced by one running the compiled code. A
# dynamic graph's guards are recomputed after the compile, since the compiler
# may add its own; until then the entry keeps the trace's guards, which are
# all the FX graph needs. The thread starts once that first replay is done (a
# graph whose first run raised is not compiled): started before, it took the GIL
# from the replay's many small ops in 5 ms slices, and the transformer's first
# backward took 2.4 s instead of 1.4 (its compile waits for a replay of ~0.2 s).
_pending: set[threading.Thread] = set()
_compiling: set[int] = set()  # idents of the compile threads inside their compile (cancellable at exit)
_deferred: dict[int, Callable[[], None]] = {}  # id(entry) -> start its compile, until its first replay ran


def _start_compile_of(entry: CompiledBackward, run: bool = True) -> None:
    with LOCK:
        start = _deferred.pop(id(entry), None)
    if start is not None and run:
        start()


def _compile_in_background(cfg: Config, key, entry: CompiledBackward, example, what: str, logged: dict, captured=None) -> None:
    # `example`: fake tensors only; the thread must not keep the user's tensors alive
    is_dynamic = entry.dynamic is not None
    graph = entry.graph

    def work():
        t0 = time.perf_counter()
        me = threading.get_ident()
        try:
            with LOCK:
                _compiling.add(me)  # may be cancelled at exit from here (NOTE [Background compiles at exit])
            try:
                with compile_status(what + " (in the background)"), in_background():
                    fn = compile_graph(cfg.backend, graph, example, dynamic=is_dynamic, patches=cfg.inductor_patches)
            finally:
                with LOCK:
                    _compiling.discard(me)
            dynamic = _dynamic(captured, entry.sizes) if is_dynamic else None
            done = dataclasses.replace(
                entry, fn=fn, dynamic=dynamic, compiled=True, compile_seconds=time.perf_counter() - t0
            )
            CACHE.replace(key, entry, done)
            with LOCK:
                STATS.compile_seconds += time.perf_counter() - t0
            logged["compile_seconds"] = time.perf_counter() - t0  # its own record: the log may be trimmed
            if dynamic is not None:
                logged["guards"] = dynamic.guard_source
        except CompileCancelled:  # NOTE [Background compiles at exit]
            log.debug("background compile cancelled by the interpreter's exit")
        except Exception as e:  # the traced graph keeps serving this backward
            with LOCK:
                STATS.compile_failures += 1
            if not _exiting():
                log.warning("background compile failed, the traced graph stays in use: %s", e, exc_info=True)
            else:  # torch's executors refuse work, its modules are torn down under the compile
                log.debug("background compile ended by the interpreter's exit: %s", e)
        finally:
            with LOCK:
                STATS.compiles_pending -= 1
                _pending.discard(threading.current_thread())

    def start():
        serialize_dynamo_compiles()  # NOTE [One compile at a time] (backends.py)
        _wait_at_exit.register()
        # (not a daemon: NOTE [Background compiles at exit])
        thread = threading.Thread(target=work, name="compiled_autograd compile", daemon=False)
        with LOCK:
            STATS.compiles_pending += 1
            _pending.add(thread)
        thread.start()

    with LOCK:
        _deferred[id(entry)] = start


# NOTE [Background compiles at exit]
# A compile thread that the interpreter abandons at exit (a daemon thread) is
# killed where it next takes the GIL: inside C++ code (a torch op, pybind11's
# GIL release) that unwinds through a noexcept frame, and the process aborts
# ("terminate called without an active exception", exit status 134). So
# compile threads are not daemons (the interpreter joins them), and threading's
# shutdown, before it joins them and before the executors' exit hooks make
# them refuse work, first runs `_wait_at_exit`: it waits for the pending
# compiles up to COMPILED_AUTOGRAD_EXIT_WAIT seconds (default 10; "inf": to the
# end; a finished compile also fills inductor's caches for the next process),
# then cancels the rest: a CompileCancelled raised in each compile thread,
# which Python delivers between bytecodes -- never inside C++ code, which
# finishes the call it is in first -- and repeated until the thread ends.
EXIT_WAIT_DEFAULT = 10.0


class CompileCancelled(BaseException):
    """Raised in a background compile thread to cancel it at exit (a BaseException: code in
    the compiler that catches Exception lets it through)."""


def _exit_wait() -> float | None:
    raw = os.environ.get("COMPILED_AUTOGRAD_EXIT_WAIT", "")
    try:
        wait = float(raw) if raw.strip() else EXIT_WAIT_DEFAULT
    except ValueError:
        log.warning("COMPILED_AUTOGRAD_EXIT_WAIT=%r is not a number of seconds; waiting %gs", raw, EXIT_WAIT_DEFAULT)
        wait = EXIT_WAIT_DEFAULT
    if wait != wait or wait == float("inf"):
        return None
    return max(0.0, wait)


class _WaitAtExit:
    def __init__(self):
        self.registered = False

    def register(self) -> None:
        if self.registered:
            return
        # (their exit hooks first, so that ours runs before: threading runs them in reverse)
        import concurrent.futures.process  # noqa: F401
        import concurrent.futures.thread  # noqa: F401

        try:
            threading._register_atexit(self)
        except (AttributeError, RuntimeError):  # (no such hook; or the shutdown has begun: joined anyway)
            pass
        self.registered = True

    def __call__(self) -> None:
        with LOCK:
            if not _pending:
                return
        wait = _exit_wait()
        if wait is None or wait > 0:
            log.info("waiting for %d background compile(s) before exiting", len(_pending))
            if synchronize(wait):
                return
        with LOCK:
            threads = [t for t in _pending if t.is_alive()]
        log.info("cancelling %d background compile(s) at exit", len(threads))
        while threads:
            with LOCK:  # (only inside the compile: a thread's own bookkeeping is not interrupted)
                for t in threads:
                    if t.ident in _compiling:
                        _cancel(t)
            for t in threads:
                t.join(1.0)  # (again while one is still compiling: its code may have caught it)
            threads = [t for t in threads if t.is_alive()]


_wait_at_exit = _WaitAtExit()


def _cancel(thread: threading.Thread) -> None:
    import ctypes

    if thread.ident is not None and thread.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(CompileCancelled))


def _exiting() -> bool:
    """Whether the interpreter is exiting: threading's shutdown has begun (it first runs the
    executors' exit hooks, after which they refuse new work), or the main thread has ended."""
    return getattr(threading, "_SHUTTING_DOWN", False) or not threading.main_thread().is_alive()


def synchronize(timeout: float | None = None) -> bool:
    """Wait for background compiles to finish; True when none is pending."""
    deadline = None if timeout is None else time.perf_counter() + timeout
    while True:
        with LOCK:
            threads = list(_pending)
        if not threads:
            return True
        for t in threads:
            t.join(None if deadline is None else max(0.0, deadline - time.perf_counter()))
        if deadline is not None and time.perf_counter() >= deadline:
            with LOCK:
                return not _pending


def _opaque_reason(plan, idx):
    for i, _, why in plan.opaque:
        if i == idx:
            return why
    return None


def _eligible(collected) -> list[bool]:
    """Size positions that may become symbolic: all of them (a tensor whose
    strides do not follow from its sizes gets symbolic strides and offset)."""
    return [True] * len(collected.sizes)


MAX_DYNAMIC_PER_KEY = 3


def _plan_capture(cfg: Config, fam, collected) -> tuple[tuple | None, str]:
    """(which sizes to make symbolic, or None for a static graph; why this capture).

    Policy (the reference's): the first graph of a key is static. When the key
    comes back with other sizes, the positions that differ from what is cached
    become symbolic, together with those already symbolic in earlier dynamic
    graphs of the key; the rest stay static, so kernels stay specialized where
    nothing varies. When a dynamic graph's guards fail on sizes it covers (the
    trace or the compiler assumed something, e.g. divisibility), the same
    positions are captured again with the new sizes as hints, a few times at
    most; after that, static graphs."""
    if fam is None or not len(fam):
        reason = _new_key_reason(collected)
        if cfg.dynamic is True:
            return tuple(_eligible(collected)), reason + " (dynamic=True)"
        return None, reason
    if cfg.dynamic is False:
        return None, "same structure, new sizes (dynamic=False)"
    sizes = collected.sizes
    covered = [False] * len(sizes)
    changed = [False] * len(sizes)
    for e in fam.entries():
        for i, v in enumerate(sizes):
            if e.dynamic is not None and e.dynamic.mask[i]:
                covered[i] = True
            elif e.sizes[i] != v:
                changed[i] = True
    # a position a dynamic graph already covers did not change in the sense that matters:
    # that graph's guards failed (it specialized: a backward that turns a size into a
    # Python number), which is bounded below, not a reason for yet another dynamic graph
    changed = [c and not cov for c, cov in zip(changed, covered)]
    mask = tuple(a or b for a, b in zip(covered, changed))
    if not any(changed):
        if len(fam.dynamic) >= MAX_DYNAMIC_PER_KEY:
            return None, "guards of the dynamic graphs failed; static graph"
        return mask, "guards of the dynamic graph failed; dynamic again with these sizes"
    return mask, f"same structure, new sizes: {sum(mask)} sizes symbolic"


def _node_keys(capture) -> tuple:
    key, offsets = capture.key(), capture.node_key_offsets()
    return tuple(key[a:b] for a, b in zip(offsets, offsets[1:])) + (key[offsets[-1]:] if offsets else key,)


def _new_key_reason(collected) -> str:
    """Why a key is new: the first node whose part of the key differs from the
    nearest cached graph with the same nodes, or that the nodes differ."""
    entries = CACHE.entries()
    if not entries:
        return "first backward"
    names = tuple(n.name for n in collected.nodes)
    same = [e for e in entries if e.node_names == names]
    if not same:
        return "new graph structure (nodes differ from every cached graph)"
    mine = _node_keys(collected.capture)
    best = None
    for e in same:
        diff = [i for i, (a, b) in enumerate(zip(mine, e.node_keys)) if a != b]
        if best is None or len(diff) < len(best):
            best = diff
    if not best:
        return "same nodes as a cached graph; custom Function state, saved-tensor hooks or backend options differ"
    i = best[0]
    if i == len(names):
        what = "the lifted tensors' dtype, device, layout or requires_grad"
    else:
        what = f"node #{i} {names[i]}: a saved constant, hook count or the metadata of its edges"
    more = f" (and {len(best) - 1} more)" if len(best) > 1 else ""
    return f"same nodes as a cached graph, but {what} differ{more}"


def _describe_dynamic(collected, dynamic) -> list[str]:
    """Human names of the symbolic sizes of a dynamic capture."""
    if dynamic is None:
        return []
    starts = [(n.size_start, n.name) for n in collected.nodes]
    in_graph = [f"unpacked#{u.hid}.shape[{d}]" for u in collected.in_graph for d in range(u.dim)]
    out = []
    for i in dynamic.symbolic:
        if i >= collected.in_graph_start:
            out.append(in_graph[i - collected.in_graph_start])
            continue
        if i >= collected.aot_start:
            out.append(f"torch.compile'd region's saved int #{i - collected.aot_start}")
            continue
        if i < collected.n_size_inputs:
            owner = max((s for s in starts if s[0] <= i), default=(0, "?"), key=lambda s: s[0])[1]
            out.append(f"{owner} size#{i}")
            continue
        for k, (start, dim, with_strides) in enumerate(tensor_positions(collected)):
            end = start + dim * (2 if with_strides else 1) + 1
            if start <= i < end:
                r = i - start
                what = f"shape[{r}]" if r < dim else ("offset" if i == end - 1 else f"stride[{r - dim}]")
                out.append(f"input{k}.{what}")
                break
    return out


def _replay(entry: CompiledBackward, capture, lifted, extra, hooks, releases=(), free_on_failure=False, observed=None):
    if entry.plan.differentiable is not None and any(entry.plan.differentiable):
        with torch.enable_grad():  # the engine's grad mode under create_graph
            return list(DifferentiableGraph.apply(entry, extra, *lifted))
    args = list(lifted) + extra if extra else lifted

    # NOTE [Stealing a fresh grad] (ops.py): the storages of the graph's inputs, which a
    # stolen grad must not share (a compiler may turn a no-op on an input into the input)
    steal = ops.input_storages(args) if entry.steals and entry.plan.steals else None

    # NOTE [Hooks may change what the graph reads]: the versions of the saved tensors that
    # calls check, as the backward starts (the collect checked them against the nodes')
    versions = {slot: [args[i]._version for i in idx] for slot, idx in entry.plan.watch} or None
    # Plan.ctx_checks: custom Functions' ctx attributes as the trace read them
    ctx = {
        slot: [
            (obj, list(vars(obj).items()), [(c, n, read_state(c, n)) for c, n in state_reads(obj._forward_cls)])
            for obj in map(capture.node_object, idxs)
        ]
        for slot, idxs in entry.plan.ctx_checks
    } or None

    def run():
        after = entry.plan.release_after if releases else None
        frame = ops.replaying(capture, entry.plan.slots, hooks, steal, entry.steals, versions, ctx, after, observed)
        try:
            with frame, torch.no_grad():
                return list(entry(args))
        except BaseException:
            if free_on_failure:
                _release_completed(capture, entry.plan, frame.failed_at)
            raise

    if entry.plan.slots:
        # hooks and opaque nodes run inside: give them the engine context they
        # expect (graph task id, queue_callback), as eager does
        return in_graph_task(run)
    return run()


LAYOUTS: dict = {}  # key -> {(slot, output): dim order seen at run time} (NOTE [Layouts of call outputs], ops.py)
_relayouts: Counter = Counter()  # key -> captures made again for a layout seen
_layout_reasons: dict = {}  # key -> the reason of its next capture
MAX_RELAYOUTS = 3  # then a key keeps its graph and copies what comes in another layout


def _learn_layouts(key, observed: dict) -> bool:
    """Count the outputs a replay copied into their traced layout; remember the dense layouts
    they had. True when that is new for this key: its graph is then dropped and the next
    backward captures again, in those layouts (NOTE [Layouts of call outputs], ops.py)."""
    with LOCK:
        STATS.layout_copies += len(observed)
    seen = {where: order for where, order in observed.items() if order is not None}
    table = LAYOUTS.get(key, {})
    new = {where: order for where, order in seen.items() if table.get(where) != order}
    if not new or _relayouts[key] >= MAX_RELAYOUTS:
        return False
    if key not in LAYOUTS and len(LAYOUTS) >= 1024:
        LAYOUTS.pop(next(iter(LAYOUTS)))
    LAYOUTS[key] = {**table, **new}
    _relayouts[key] += 1
    _layout_reasons[key] = f"{len(new)} call outputs came back in another layout than traced: captured again in those layouts"
    log.info("%d call outputs in another layout than traced: the next backward captures again", len(new))
    return True


NODE_LAYOUTS: dict = {}  # key -> {(node, output): layout seen}: the opaque nodes' outputs


def _layouts(key) -> dict:
    """What the trace of this key predicts from earlier backwards: (slot, output) -> layout
    for calls seen in another layout, ("node", index, output) -> layout for opaque nodes."""
    nodes = NODE_LAYOUTS.get(key) or {}
    return {**{("node", *where): layout for where, layout in nodes.items()}, **LAYOUTS.get(key, {})}


def _opaque_outputs_to_learn(cfg, key, collected) -> list:
    """The opaque nodes of a graph not seen before whose outputs' layouts no backward has
    shown: (index, node) each (NOTE [Layouts of call outputs], ops.py)."""
    if key in NODE_LAYOUTS:
        return []
    capture = collected.capture
    idxs = [i for i, n in enumerate(collected.nodes) if n.execute and (n.opaque or (n.name in cfg.opaque and n.kind != ACCUMULATE_KIND))]
    idxs += [i for i, info in collected.pynodes.items() if info.opaque_reason is not None and i not in idxs]
    if not idxs:
        NODE_LAYOUTS[key] = {}
        return []
    return [(i, capture.node_object(i)) for i in idxs]


def _learn_node_layouts(key, watch, eager):
    """Run this backward in eager autograd, with a post hook on each opaque node that notes
    how its outputs are laid out (a custom Function may return a sparse or a transposed
    grad); the next backward is traced with them."""
    seen: dict = {}

    def observer(idx):
        def post(grad_inputs, grad_outputs):
            for k, g in enumerate(grad_inputs):
                if isinstance(g, torch.Tensor):
                    seen[(idx, k)] = ops.observed_layout(g)

        return post

    handles = [node.register_hook(observer(idx)) for idx, node in watch]
    del watch
    log.info("eager backward to learn the layouts of %d opaque nodes' outputs", len(handles))
    try:
        result = eager()
    finally:
        for h in handles:
            h.remove()
    if len(NODE_LAYOUTS) >= 1024:
        NODE_LAYOUTS.pop(next(iter(NODE_LAYOUTS)))
    NODE_LAYOUTS[key] = seen
    with LOCK:
        STATS.learning_backwards += 1
    return result


def _release_completed(capture, plan, slot) -> None:
    """NOTE [A backward that raised part way]
    When a hook or an opaque node raises, eager's engine has already run the nodes before
    it, and, without retain_graph, freed their saved tensors: a second `backward()` of the
    same graph raises "Trying to backward through the graph a second time" instead of
    accumulating the grads that reached `.grad` before the error once more. A graph of ours
    that raised part way (a call raised: its slot is the last one started) frees the same
    nodes: those eager ran before that call's node, and the node itself when the call was
    one of its post hooks (eager applied it). A hit of a boxed graph has freed every node
    before running (NOTE [Boxed graphs free their inputs]), so a retry raises there even
    where eager's would not (a hook on the root raising before any node ran)."""
    if slot is None:
        return
    s = plan.slots[slot]
    capture.release_nodes(list(range(s.at + (1 if s.completes_node else 0))))


def _check_outputs(key, entry: CompiledBackward, capture, results: list, sizes: tuple) -> None:
    """The first run of an entry's fn: its results must be what the traced graph returns,
    before any is applied; a graph that fails leaves the cache (the next backward of this
    structure captures and compiles again)."""
    if entry.expected is not None:
        grad_mode = entry.plan.differentiable is not None and any(entry.plan.differentiable)
        problems = mismatches(entry.expected, results, sizes, entry.plan.num_results if grad_mode else None)
        if problems:
            CACHE.discard(key, entry)
            capture.clear()
            raise backend_output_error(entry, problems)
    object.__setattr__(entry, "checked", True)  # (a frozen entry; this flag is no part of its value)


def backend_output_error(entry: CompiledBackward, problems: list[str]) -> BackendOutputError:
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    return BackendOutputError(
        f"compiled_autograd: the backward graph compiled by backend {entry.backend!r} returned outputs "
        f"that differ from the traced graph's: {'; '.join(problems[:3])}{more}. No gradient was "
        "applied, and the graph was dropped from the cache: the next backward of this structure "
        "captures and compiles it again."
    )


def _apply(entry: CompiledBackward, capture, results: list):
    """Apply a graph's results with eager semantics; return grad()'s results."""
    plan = entry.plan
    acc = []
    for node, r, f in plan.accumulate:
        if f < 0 or bool(results[f]):
            acc.append((node, r))
    captured = [r if (f < 0 or bool(results[f])) else -1 for r, f in plan.captured]
    return capture.apply_results(results, acc, captured)


class _GCPause:
    """NOTE [No garbage collection on a hit]
    A hit allocates one Python object per lifted tensor (the compiled
    callable takes a list of tensors) and frees them before returning. With
    the collector on, those allocations trigger collections (on the
    2000-node chain about one young-generation collection per hit, 0.2 ms of
    a 6 ms backward; much more when many graphs are alive, since older
    generations then get traversed too). So a hit runs with the collector
    paused: what it allocates it frees (net zero for the collector's
    counters), so no collection is skipped, only not triggered by us (cycles
    that hooks called from the graph make are collected after the backward).
    Misses (tracing and compiling make cycles) and eager fallbacks resume it
    first. A backward started while it is already off (by the user, or an
    outer backward's hook) leaves it alone."""

    __slots__ = ("paused",)

    def __init__(self):
        self.paused = gc.isenabled()
        if self.paused:
            gc.disable()

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            gc.enable()


def run_backward(*args):
    """One backward through compiled_autograd; the arguments are
    `_run_backward`'s (cfg, eager, roots, grads, keep_graph, create_graph,
    inputs, allow_unused, accumulate_grad), run with the collector paused
    (NOTE [No garbage collection on a hit])."""
    pause = _GCPause()
    try:
        return _run_backward(*args, pause=pause)
    finally:
        pause.resume()


def _run_backward(
    cfg: Config,
    eager: Callable[[], Any],
    roots: Sequence[Any],
    grads: Sequence[Any],
    keep_graph: bool,
    create_graph: bool,
    inputs: Sequence[Any],
    allow_unused: bool,
    accumulate_grad: bool,
    pause: _GCPause,
):
    reason, user_error = _precheck(roots, grads, create_graph, inputs, accumulate_grad)
    if reason is not None:
        pause.resume()
        return _fall_back(cfg, reason, eager, user_error)

    try:
        C = native.load()
    except native.Unavailable as e:  # NOTE [Torch versions] (native/__init__.py)
        pause.resume()
        return _fall_back(cfg, str(e), eager)
    try:
        capture = C.GraphCapture(list(roots), list(grads), list(inputs), accumulate_grad)
    except RuntimeError as e:  # misuse (freed graph, modified saved tensor): eager raises the same error
        pause.resume()
        return _fall_back(cfg, f"collection error: {str(e).splitlines()[0][:120]}", eager, user_error=True)
    try:
        return _run_capture(cfg, eager, capture, keep_graph, create_graph, allow_unused, accumulate_grad, pause)
    finally:
        capture.restore_saved_hooks()  # NOTE [Handing unpacked tensors to their saved variables] (native helper)


def _run_capture(cfg, eager, capture, keep_graph, create_graph, allow_unused, accumulate_grad, pause):
    # (the try decides only: an eager backward run inside it would run again, from the
    # start, if it raised a RuntimeError -- its own, or a hook's)
    reason, user_error, collected = None, False, None
    try:
        if capture.unsupported:
            reason = capture.unsupported
        else:
            # create_graph=True with saved-tensor hooks runs in eager (_create_graph_unsupported),
            # whose unpack hooks must not have run already
            collected = collect(capture, run_unpack_hooks=not create_graph, keep_graph=keep_graph)
            if collected is None:
                reason = "create_graph=True with saved-tensor hooks"
            elif isinstance(collected, Learn):
                capture.learn_unpacks(sorted(collected.keys), collected.report)
    except RuntimeError as e:  # misuse (freed graph, modified saved tensor): eager raises the same error
        reason, user_error = f"collection error: {str(e).splitlines()[0][:120]}", True
    except Unkeyable as e:
        # an unpack hook returned a tensor we cannot lift (a subclass, a sparse tensor)
        reason = f"saved-tensor hook returned a {e}"
    if reason is not None or isinstance(collected, Learn):
        capture.clear()
        pause.resume()
        if reason is not None:
            return _fall_back(cfg, reason, eager, user_error)
        return _learn_in_eager(collected, eager)

    key = (cfg.backend_key, _global_state(), cfg.opaque, create_graph, collected.key)
    reason = _unsupported.get(key) if _unsupported else None
    if create_graph and reason is None and CACHE.family(key) is None:
        # (hooks, opaque nodes and saved-tensor hooks are in the key: checked once per key)
        reason = _create_graph_unsupported(collected)
        if reason is not None:
            _mark_unsupported(key, reason)
    if reason is not None:
        capture.clear()
        pause.resume()
        return _fall_back(cfg, reason, eager)
    fam = CACHE.family(key)
    if fam is None and not create_graph:
        watch = _opaque_outputs_to_learn(cfg, key, collected)
        if watch:  # NOTE [Layouts of call outputs] (ops.py)
            capture.clear()
            pause.resume()
            return _learn_node_layouts(key, watch, eager)
    capture.grad_mode = create_graph  # AccumulateGrad applies the results as under create_graph
    lifted = collected.lifted
    entry, extra = fam.lookup(collected.sizes, lifted) if fam is not None else (None, [])
    missed = entry is None
    released = False
    observed: dict = {}  # NOTE [Layouts of call outputs] (ops.py)
    try:
        if entry is None:
            pause.resume()  # tracing and compiling make garbage cycles
            mask, reason = _plan_capture(cfg, fam, collected)
            reason = _layout_reasons.pop(key, reason)
            if create_graph:
                mask, reason = None, reason + (" (create_graph=True: static shapes)" if mask else " (create_graph=True)")
            pkey = diskcache.portable_key(key, collected.sizes) if cfg.disk_cache and mask is None and not create_graph else None
            record = diskcache.load(pkey) if pkey is not None else None
            if record is not None:
                entry = _entry_from_disk(cfg, collected, key, record, reason)
                pkey = None  # already stored
            else:
                try:
                    history = tuple(e.sizes for e in fam.entries()) if fam is not None else ()
                    entry = _capture_and_compile(cfg, collected, key, mask, reason, history, create_graph, _layouts(key))
                except Exception:
                    if mask is None or cfg.fullgraph:
                        raise
                    log.info("dynamic capture failed, capturing static shapes", exc_info=True)
                    entry = _capture_and_compile(cfg, collected, key, None, reason + "; dynamic capture failed", layouts=_layouts(key))
            try:
                extra = entry.dynamic.extra_args(collected.sizes) if entry.dynamic else []
                results = _replay(entry, capture, lifted, extra, collected.hooks, free_on_failure=not keep_graph, observed=observed)
            except BaseException:
                _start_compile_of(entry, run=False)
                raise
            if observed and _learn_layouts(key, observed):
                # (not cached: the next backward captures again, in the layouts seen)
                _start_compile_of(entry, run=False)
                pkey = None
            else:
                CACHE.family(key, create=True).add(entry)  # only graphs that ran
            CACHE.evict(cfg.cache_size_limit)
            if record is None and collected.pynodes:
                for name in CHURN.note_capture(collected):
                    warnings.warn(f"compiled_autograd: {name}'s ctx values (or the Python state its backward reads) "
                                  f"changed in more than {CHURN_LIMIT} captures; it now runs as is, opaquely, instead of "
                                  "a new capture per value (NOTE [Functions whose values change every step])", stacklevel=4)
            _start_compile_of(entry)  # NOTE [Background compile]
            if pkey is not None and entry.dynamic is None:
                diskcache.store(pkey, entry)
        else:
            with LOCK:
                STATS.hits += 1
            if not keep_graph and getattr(entry.fn, BOXED, False):
                # NOTE [Boxed graphs free their inputs]: the graph gets the only
                # references to the saved tensors, and frees each after its last
                # use, once the nodes' saved variables are freed too: before the graph,
                # or after the last call that may read them (NOTE [Saved tensors freed as
                # eager frees them], trace.py; an unpack hook's packed value is held by
                # `collected.hooks`)
                args = lifted + extra
                lifted.clear()
                capture.drop_lifted()
                releases = entry.plan.releases
                if not releases:
                    capture.release()
                elif releases[0][0] == -1:
                    capture.release_nodes(releases[0][1])
                released = True
                results = _replay(entry, capture, args, [], collected.hooks, releases, observed=observed)
            else:
                results = _replay(entry, capture, lifted, extra, collected.hooks, free_on_failure=not keep_graph, observed=observed)
            if observed and _learn_layouts(key, observed):
                fam.remove(entry)  # the next backward captures again, in the layouts seen
    except Exception as e:
        if isinstance(e, BackendOutputError):  # (create_graph's first run: its graph checks itself)
            CACHE.discard(key, entry)
            capture.clear()
            raise
        if released or (entry is not None and entry.plan.slots):
            # opaque calls (hooks, nodes) may have run, or the saved tensors are
            # gone: never run the backward twice
            if released and "already been freed" in str(e):
                raise RuntimeError(
                    "compiled_autograd: a hook read a saved tensor of this backward (e.g. "
                    "`grad_fn._saved_self`), which compiled_autograd had freed before the hook ran: "
                    "it frees a node's saved tensors once no hook eager runs before that node may read "
                    "them, taking hooks on leaves, AccumulateGrad and module full-backward hooks to read "
                    "none (NOTE [Saved tensors freed as eager frees them]). Read what the hook "
                    f"needs in the forward, or run this backward without compiled_autograd. ({e})"
                ) from e
            raise
        capture.clear()
        pause.resume()
        if isinstance(e, _Fallback):
            _mark_unsupported(key, e.reason)
            return _fall_back(cfg, e.reason, eager)
        if cfg.fullgraph:
            raise
        log.debug("capture failed", exc_info=True)
        reason = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        if missed and not STATS.compiles_pending:
            # (not while a background compile runs: torch.fx's tracer keeps its patching
            # state in a process global, and two traces at once can fail one of them)
            _failures[key] += 1
            if _failures[key] >= MAX_CAPTURE_FAILURES:
                _mark_unsupported(key, reason)
        return _fall_back(cfg, reason, eager)
    if not entry.checked:  # NOTE [A compiled graph's outputs are checked on its first run] (validate.py)
        _check_outputs(key, entry, capture, results, collected.sizes)
    if entry.plan.opaque:
        with LOCK:
            STATS.opaque_nodes += len(entry.plan.opaque)
            for _, name, why in entry.plan.opaque:
                STATS.opaque_reasons[f"{name}: {why}"] += 1
    del lifted, collected
    captured = _apply(entry, capture, results)
    del results
    if not keep_graph:
        capture.release()
    capture.clear()
    if accumulate_grad:
        return ()
    if not allow_unused:
        for i, g in enumerate(captured):
            if g is None:
                raise RuntimeError(UNUSED_INPUT_ERROR.format(i))
    return tuple(captured)
