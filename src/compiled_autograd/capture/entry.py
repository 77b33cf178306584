"""A miss: capture the backward (or load it from the disk cache) and compile it into a
CompiledBackward."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace
from typing import NamedTuple

from ..cache.memory import CompiledBackward, Dynamic
from ..compile.background import compile_in_background
from ..compile import backends, repro
from ..compile.backends import may_steal
from ..config import Config
from ..nodes import compiled_region
from ..nodes.learned import LEARNED
from ..errors import Fallback, LearnLayouts
from ..observe.captures import describe_dynamic, log_capture, node_keys
from ..observe.logs import compile_status
from ..observe.stats import LOCK, STATS
from ..graph_task import in_graph_task
from ..replay.validate import expected_outputs
from ..values import NodeSummary
from .create_graph import split_joint
from ..errors import NotTwiceDifferentiable
from .fakes import guards_of
from .stored import described_fakes, unpacked_up_front
from .create_graph import leaf_hooks_only
from .trace import capture_backward

log = logging.getLogger("compiled_autograd")


def create_graph_unsupported(collected) -> str | None:
    """Why this backward cannot run compiled with create_graph=True (NOTE [create_graph])."""
    if collected.unpacked:
        return "create_graph=True with saved-tensor hooks"
    for n in collected.nodes:
        if n.hooks.any and not leaf_hooks_only(n):  # NOTE [A leaf's hooks under create_graph]
            return "create_graph=True with hooks"
    return None


def _untraced_user_function(collected, idx, name, why) -> bool:
    """Whether opaque node `idx` is a custom Function of the user's whose backward the trace
    could not run (nodes/function.py), so that nothing told how its grads are laid out: it may
    return one in any layout (a sparse one). Not a torch.compile'd region's, whose grads are
    dense; not one made opaque for another reason after its trace ran."""
    info = collected.pynodes.get(idx)
    return (
        info is not None
        and " backward not traceable: " in why
        and not compiled_region.is_compiled_function(collected.walk.node_object(idx)._forward_cls)
    )


class Miss(NamedTuple):
    """A capture's outcome: its entry, and `results`, this backward's graph results where the
    capture computed them and they serve, else None (NOTE [Recording on the real tensors] in
    capture/record.py)."""

    entry: CompiledBackward
    results: list | None


def capture_and_compile(cfg: Config, collected, key, mask, reason: str, history=(), create_graph=False, layouts=None) -> Miss:
    t0 = time.perf_counter()
    background = cfg.background_compile and not cfg.fullgraph
    # a live record's results serve as this backward's while the graph compiles in the
    # background, and for the eager backend, whose function is the graph; a backend compiling
    # now runs this backward itself, its outputs checked as on every compile's first run (NOTE
    # [A compiled graph's outputs are checked on its first run]): no ops to run for real then
    live = background or cfg.backend == "eager"
    try:
        late = not may_steal(cfg.backend)  # (a user's backend: leaves whose hooks alone are called accumulate after it)
        captured = in_graph_task(lambda: capture_backward(collected, cfg.opaque, mask, history, create_graph, layouts, live, late))
    except NotTwiceDifferentiable as e:
        raise Fallback(f"create_graph=True through a node eager cannot differentiate twice ({e})") from e
    # NOTE [create_graph with an opaque node] (replay/run.py): the traced graph runs in grad mode, not compiled
    in_grad_mode = create_graph and bool(captured.plan.slots)
    if captured.results is None:
        # (a live record's results are this backward's: it ran; it makes no node opaque)
        unseen = LEARNED.layouts.unlearned_opaque(key, [o for o in captured.plan.opaque if _untraced_user_function(collected, *o)])
        if unseen:  # NOTE [Nodes made opaque by their trace] (cache/learning.py)
            raise LearnLayouts(unseen)
    vjp, how = _second_order(captured, create_graph, in_grad_mode)
    t1 = time.perf_counter()
    names = tuple(n.name for n in collected.nodes)
    is_dynamic = captured.mask is not None and any(captured.mask)
    what = f"compiling a {'dynamic ' if is_dynamic else ''}backward graph of {len(names)} nodes with {cfg.backend_name}"
    # (read before the backend sees the graph: it may rewrite it)
    expected = expected_outputs(captured.graph, *((collected, captured.size_inputs) if is_dynamic else ()))
    if background or in_grad_mode:
        fn = captured.graph  # replay the traced graph as is until the compiled one is ready (or for good)
    else:
        fn = _compile_now(cfg, captured, collected, reason, what, is_dynamic)
    t2 = time.perf_counter()
    nodes = tuple(NodeSummary(n.name, n.kind, n.hooks, opaque_reason_of(captured.plan, i), n.edges) for i, n in enumerate(collected.nodes))
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
        dynamic=dynamic_of(captured, collected.sizes) if is_dynamic else None,
        nodes=nodes,
        node_keys=node_keys(collected.walk),
        compiled=not background and not in_grad_mode,
        compiling=background and not in_grad_mode,
        vjp=vjp,
        expected=expected,
    )
    with LOCK:
        STATS.captures += 1
        STATS.dynamic_captures += is_dynamic
        STATS.trace_seconds += t1 - t0
        STATS.compile_seconds += t2 - t1
    first, captured.results = captured.results, None
    if first is not None:
        with LOCK:
            STATS.live_records += 1
    logged = log_capture(
        dict(
            reason=reason,
            nodes=len(names),
            backend=cfg.backend_label,
            opaque=[o[1:] for o in captured.plan.opaque],
            trace_seconds=t1 - t0,
            compile_seconds=t2 - t1,
            inputs=len(collected.lifted),
            dynamic=describe_dynamic(collected, entry.dynamic),
            guards=entry.dynamic.guard_source if entry.dynamic else None,
            background=background,
            create_graph=how,
            traced=captured.how + (" (its grads were this backward's)" if first is not None else ""),
            **unpacked_up_front(collected),
        )
    )
    log.info("captured %d nodes (%s): trace %.2fs, compile %.2fs", len(names), reason, t1 - t0, t2 - t1)
    if background and not in_grad_mode:
        # (the trace's own fakes: static ones for a static graph, in a mode with a ShapeEnv,
        # with no reference to the user's tensors; making them again took 70 ms of the
        # transformer's first backward. A live record made none: the compile's thread makes
        # them from the lifted tensors' geometry, as the child process does)
        example = described_fakes(collected.lifted) if first is not None else captured.example_inputs
        compile_in_background(cfg, key, entry, example, what, logged, lambda: dynamic_of(captured, entry.sizes))
    return Miss(entry, first)


def _second_order(captured, create_graph: bool, in_grad_mode: bool) -> tuple:
    """(the vjp graph or None, how the second order is had) of a create_graph capture: its
    graph split into a forward that also returns what the vjp reads, where it can be."""
    vjp, how = None, None
    if create_graph:
        how = "no result requires grad: applied in grad mode, nothing to differentiate"
    if in_grad_mode:
        how = "an opaque node: the traced graph runs in grad mode, eager's kernels recording their history"
    elif create_graph and any(captured.plan.differentiable):
        try:
            split = in_graph_task(lambda: split_joint(captured.graph, captured.example_inputs, captured.plan.differentiable))
        except Exception:  # the second order then reruns the graph: slower, as right
            log.info("could not split a create_graph graph into forward and vjp", exc_info=True)
            split = None
        how = "the second order reruns this graph in grad mode (not split)"
        if split is not None:
            captured.graph, vjp, n_saved = split
            how = (
                f"{sum(captured.plan.differentiable)} differentiable results; the graph also returns {n_saved} "
                f"tensors its vjp graph reads (the second order recomputes nothing)"
            )
    return vjp, how


def _compile_now(cfg: Config, captured, collected, reason: str, what: str, is_dynamic: bool):
    """The backend's compile of the captured graph; where it raises, a script that reproduces it
    is written and named with the error (NOTE [A graph you can run], compile/repro.py)."""
    example = _example_inputs(captured, collected)
    try:
        with compile_status(what):
            return backends.compile_graph(cfg.backend, captured.graph, example, dynamic=is_dynamic, patches=cfg.inductor_patches)
    except Exception as e:
        failed = SimpleNamespace(
            graph=captured.graph, node_names=tuple(n.name for n in collected.nodes), reason=reason, backend=cfg.backend_name, inputs=None
        )
        path = repro.write_failed(failed, None if is_dynamic else example)
        if path is not None:
            e.add_note(f"compiled_autograd: a script that reproduces it: {path}")
            log.warning("backend %s failed to compile a backward graph; a script that reproduces it: %s", cfg.backend_name, path)
        raise


def _example_inputs(captured, collected):
    # a static graph compiles against the real tensors; a dynamic one against
    # the fakes carrying its symbols
    if captured.mask is not None and any(captured.mask):
        return captured.example_inputs
    if captured.plan.stand_ins:  # (tensor subclasses: an empty tensor in their place, as at replay)
        from ..replay.run import stand_in

        inputs = list(collected.lifted)
        stand_in(inputs, captured.plan.stand_ins)
        return inputs
    return collected.lifted


def dynamic_of(captured, sizes) -> Dynamic:
    source, guard = guards_of(captured)
    return Dynamic(
        mask=captured.mask,
        static=tuple(None if m else v for m, v in zip(captured.mask, sizes)),
        size_inputs=captured.size_inputs,
        guard_source=source,
        guard=guard,
    )


def opaque_reason_of(plan, idx):
    for i, _, why in plan.opaque:
        if i == idx:
            return why
    return None
