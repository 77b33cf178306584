"""A hit (and a capture's first run): run the compiled graph with its calls' context, then
apply its results with eager semantics."""

from __future__ import annotations

import gc
import weakref

import torch

from ..calls import kernel
from ..graph_task import in_graph_task
from ..errors import ResumeHere
from ..values import BOXED
from ..nodes import SLOT_KINDS
from ..nodes.state import read_state, state_reads
from .differentiable import DifferentiableGraph
from ..cache.memory import CACHE, CompiledBackward
from .validate import backend_output_error, mismatches


def run_graph(
    entry: CompiledBackward, capture, lifted, extra, hooks, releases=(), free_on_failure=False, observed=None, keep_graph=True, resume=None
):
    """Run the entry's function on the lifted tensors; its results. `resume(stop, args)`: the
    results where a call stops the run (a ResumeHere: NOTE [A call output not as traced] in
    capture/resume.py), given the graph's inputs still alive (None where one was freed)."""
    # root grads held by reference, taken before their stand-ins replace them (NOTE [Values passed by reference])
    held = [(("lifted", i), lifted[i]) for i in entry.plan.held] if entry.plan.held else None
    if entry.plan.stand_ins:
        stand_in(lifted, entry.plan.stand_ins)
    if entry.plan.differentiable is not None and not entry.plan.slots and any(entry.plan.differentiable):
        with torch.enable_grad():  # the engine's grad mode under create_graph
            outs = list(DifferentiableGraph.apply(entry, extra, *lifted))
        return _fresh_leaves(outs, entry.plan.differentiable)
    args = list(lifted) + extra if extra else lifted

    # NOTE [Stealing a fresh grad] (nodes/accumulate.py): the storages of the graph's inputs, which a
    # stolen grad must not share (a compiler may turn a no-op on an input into the input)
    steal = kernel.input_storages(args) if entry.steals and entry.plan.steals else None

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
    # a run that may stop at a call: the inputs, weakly where the graph frees them as it goes
    inputs = None
    if resume is not None and entry.plan.resume:
        inputs = [weakref.ref(a) if isinstance(a, torch.Tensor) else a for a in args] if getattr(entry.fn, BOXED, False) else list(args)

    def run():
        after = entry.plan.release_after if releases else None
        frame = kernel.replaying(
            capture, entry.plan.slots, hooks, steal, entry.steals, versions, ctx, after, observed, dict(held) if held else None
        )
        try:
            # NOTE [create_graph with an opaque node]: the traced graph in grad mode, as eager's engine runs
            with frame, torch.set_grad_enabled(entry.plan.differentiable is not None):
                try:
                    outs = list(entry(args))
                except ResumeHere as stop:
                    if inputs is None:
                        raise
                    alive = [a() if isinstance(a, weakref.ref) else a for a in inputs]
                    return resume(stop, alive)  # (what a call handed on by reference is in them as it came)
            for r, src in entry.plan.by_reference:  # NOTE [Values passed by reference] (nodes/references.py)
                outs[r] = frame.refs.get(src)
            return outs
        except BaseException:
            if free_on_failure:
                release_completed(capture, entry.plan, frame.failed_at)
            raise

    if entry.plan.slots:
        # hooks and opaque nodes run inside: give them the engine context they
        # expect (graph task id, queue_callback), as eager does
        return in_graph_task(run, keep_graph)
    return run()


_STAND_INS: dict = {}


def stand_in(args: list, slots) -> None:
    """Each tensor subclass among `args` (at `slots`, Plan.stand_ins) replaced, in place, by an
    empty tensor of its dtype and device: the graph reads its inner tensors, which follow it."""
    for i in slots:
        t = args[i]
        key = (t.dtype, t.device)
        e = _STAND_INS.get(key)
        if e is None:
            e = _STAND_INS[key] = torch.empty(0, dtype=t.dtype, device=t.device)
        args[i] = e


def _fresh_leaves(outs: list, differentiable: tuple) -> list:
    """NOTE [Results differentiable through a leaf the backward made]
    Under create_graph a backward may return a tensor whose history starts at a tensor it made
    itself requiring grad (`torch.ones_like(g, requires_grad=True) * 3`): eager's result
    requires grad, and so does the `.grad` it is accumulated into (old + new, out of place),
    which a meta-learning step differentiates. DifferentiableGraph's outputs require grad only
    through its inputs, so where no input does, such a result came out as a plain tensor and
    `.grad` lost its history. The trace knows (Plan.differentiable): such a result is made a
    leaf that requires grad, as the one the backward made is. (A second backward into it
    reaches only that leaf, as eager's reaches only the backward's own: no user tensor.)"""
    for i, d in enumerate(differentiable):
        if d and isinstance(outs[i], torch.Tensor) and not outs[i].requires_grad:
            outs[i] = outs[i].detach().requires_grad_()
    return outs


def release_completed(capture, plan, slot) -> None:
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
    capture.release_nodes(list(range(s.at + (1 if SLOT_KINDS[s.kind].completes_node else 0))))


def check_outputs(key, entry: CompiledBackward, capture, results: list, sizes: tuple) -> None:
    """The first run of an entry's fn: its results must be what the traced graph returns,
    before any is applied; a graph that fails leaves the cache (the next backward of this
    structure captures and compiles again)."""
    if entry.expected is not None:
        grad_mode = entry.plan.differentiable is not None and any(entry.plan.differentiable)
        held = {r for r, _ in entry.plan.by_reference}  # (values held by reference replaced their tokens)
        problems = mismatches(entry.expected, results, sizes, entry.plan.num_results if grad_mode else None, held)
        if problems:
            CACHE.discard(key, entry)
            capture.clear()
            raise backend_output_error(entry, problems)
    object.__setattr__(entry, "checked", True)  # (a frozen entry; this flag is no part of its value)


def apply(entry: CompiledBackward, capture, results: list):
    """Apply a graph's results with eager semantics; return grad()'s results."""
    plan = entry.plan
    for r, spec in plan.wrapped:  # (docs/design/subclasses.md section 4)
        results[r] = spec.rebuild(results[r : r + len(spec.names)])
    acc = []
    for node, r, f in plan.accumulate:
        if f < 0 or bool(results[f]):
            acc.append((node, r))
    captured = [r if (f < 0 or bool(results[f])) else -1 for r, f in plan.captured]
    if plan.leaf_hooks:
        # NOTE [A leaf's hooks under create_graph] (capture/create_graph.py): in engine order,
        # each leaf's tensor hooks (in grad mode, as the engine runs them then) and its
        # AccumulateGrad, on the differentiable result
        hooked = set(plan.leaf_hooks)
        for node, r in acc:
            if node in hooked:
                with torch.set_grad_enabled(capture.grad_mode):
                    results[r] = capture.call_tensor_pre_hooks(node, [results[r]])[0]
            capture.apply_results(results, [(node, r)], [])
        acc = []
    return capture.apply_results(results, acc, captured)


class GCPause:
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


# NOTE [create_graph with an opaque node]
# Under create_graph=True a graph is differentiated again, which its compiled code cannot be
# through a call: what an opaque node computes (a user's backward) has no formula the graph
# knows. So a create_graph backward with an opaque node (a custom Function whose backward cannot
# be traced on fakes, a C++ node) runs its traced graph as it is, for real, in grad mode, as
# eager's engine runs the nodes then: each aten op of the formulas records its own history, and
# the call runs the node in grad mode (GraphWalk.call_node; the kernel is called directly,
# calls/kernel.py _fast_path), so what it returns carries the history its backward built. The
# results require grad where eager's do, and a backward through them is autograd's over the
# same ops (the first order bitwise; the second within the create_graph contract). Not compiled:
# such a graph is a cache hit that runs eager's kernels. Hooks other than a leaf's still run the
# backward in eager (capture/entry.py create_graph_unsupported).
