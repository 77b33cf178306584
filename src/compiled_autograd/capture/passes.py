"""Passes over a captured graph: what its plan needs to know of it (which saved tensors calls
may read, which grads are the graph's own memory, which reads must come before a call, which
call arguments are shared), each rewriting the graph where the replay depends on it."""

from __future__ import annotations

import operator

import torch

from ..calls.protocol import DEFINEDNESS, HANDS_OVER, PASSES_SHIFT, CallArgs
from ..errors import Fallback
from ..nodes import FAMILIES, SLOT_KINDS
from ..nodes.function import kept_indices
from ..nodes.hooks import POST_HOOKS
from .create_graph import _aliases


class ArrivesTooLate(Fallback):
    """NOTE [Tensors whose data arrives during the backward]: read before any hook ran."""


def releases(slots, nodes) -> tuple:
    """Plan.releases: (slot, node indices) per call after which those executed nodes' saved
    variables are freed (NOTE [Saved tensors freed as eager frees them])."""
    reading = []  # (node, slot) of each call that may read saved tensors
    for s, slot in enumerate(slots):
        kind, node = slot.kind, slot.node
        if not SLOT_KINDS[kind].reads_saved:
            continue
        if SLOT_KINDS[kind].family == "hooks":
            if not FAMILIES[nodes[node].kind].hooks_read_saved:
                continue
            if nodes[node].name == "BackwardHookFunctionBackward":  # a module's full backward hooks
                continue
        reading.append((node, s))
    reading.sort()
    after: dict[int, list] = {}
    last, j = -1, 0
    for k in range(len(nodes)):
        while j < len(reading) and reading[j][0] <= k:
            last = max(last, reading[j][1])
            j += 1
        if nodes[k].execute:
            after.setdefault(last, []).append(k)
    if not reading:
        return ()  # every node's before the graph runs
    return tuple((s, tuple(ks)) for s, ks in sorted(after.items()))


def mark_fresh_grads(gm: torch.fx.GraphModule, slots: list) -> tuple:
    """Mark the ACCUMULATE calls whose grad is memory the graph itself made: an op's
    result, or a view of one, rather than (a view of) a graph input, which is a tensor
    the user or the autograd graph still holds, and that nothing else in the graph reads
    (`_read_only_here`). In the plan (the slot's `fresh`) and in
    the graph (the call's flags get HANDS_OVER: inductor's lowering of the call then
    keeps that buffer from reuse). NOTE
    [Stealing a fresh grad], nodes/accumulate.py."""
    slots = list(slots)
    marked = False
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not torch.ops.compiled_autograd.call.default:
            continue
        slot = n.args[0]
        if not SLOT_KINDS[slots[slot][0]].accumulates or not n.args[1] or not isinstance(n.args[1][0], torch.fx.Node):
            continue
        if _read_only_here(n.args[1][0], also=_own_post_hooks(n, slots)):
            slots[slot] = slots[slot]._replace(fresh=True)
            c = CallArgs.of(n)
            n.args = tuple(c._replace(flags=c.flags | HANDS_OVER))
            marked = True
    if marked:
        gm.recompile()
    return tuple(slots)


def version_checked_inputs(collected) -> frozenset:
    """The lifted indices of tensors eager checks the version of when a node unpacks them:
    saved variables of built-in nodes and custom Functions' save_for_backward (not root
    grads, tensors kept on ctx, or what unpack hooks returned)."""
    c = collected.walk
    # (0-dim ones are left out: a wrapped number, `x * 2`'s 2, reaches a call as a Python number)
    out = {i for i, t in enumerate(collected.lifted[: collected.n_native]) if isinstance(t, torch.Tensor) and t.dim() > 0}
    out -= {g for _, _, g in c.roots() if g >= 0}
    for info in collected.pynodes.values():
        out.update(i for i in info.saved if i >= 0 and collected.lifted[i].dim() > 0)
    # (a tensor also kept on ctx stays checked: the node that saved it checks it)
    out -= set(collected.up_front)
    return frozenset(out)


def passable_inputs(collected) -> frozenset:
    """The lifted indices of the tensors a call passes on when read after it (NOTE [Hooks
    may change what the graph reads]): those eager reads as they are when their node runs,
    without a version check, which a hook before may have changed: root grads, tensors kept
    on ctx, what unpack hooks returned up front (not 0-dim ones: wrapped numbers among them
    reach a call as Python numbers). Saved tensors are checked instead (`n_watch`): passing
    them on would keep each alive to the end of an inductor graph, which never frees an
    output it must not reuse (+17% peak memory on the hooked benchmark)."""
    out = {g for _, _, g in collected.walk.roots() if g >= 0}
    out |= kept_indices(collected.pynodes, collected.lifted)
    out |= {i for i in collected.up_front if collected.lifted[i].dim() > 0}
    return frozenset(out | collected.arriving)


# NOTE [Hooks may change what the graph reads]
# A hook can change a tensor the graph reads: the optimizer-in-backward recipe steps
# each parameter in place from its post-accumulate-grad hook, as soon as its grad is
# ready. In eager, every node the engine ran before the hook read the old values (a
# node after it that saved the tensor raises: its version changed). The traced graph
# has eager's order, but a compiler only keeps what the data flow and the calls'
# ORDERED effect require: inductor moved a layer's `grad @ W` past the hook that
# steps W (the weights were off by 10 after 3 steps). So every op that reads a graph
# input (a lifted tensor: saved tensors, parameters; directly or through a view) and
# comes before a call in the traced order becomes an argument of that call, unused by
# it, which orders the read before the call, as the unpack calls' arguments do (the
# last `n_after` arguments: the kernel drops them; `order_reads_before_calls`). Calls are ordered among themselves,
# so each call needs only the reads since the one before it.
# Reads after a call: a saved tensor that a hook changed before its node runs is eager's
# version-counter error: the last call before a saved tensor's last read also takes it
# (`n_watch`, `Plan.watch`; `watch_saved_reads`) and raises that error if its version is not the one it had
# when the backward started (versions only grow, so one check covers every call before).
# A graph input eager reads without that check (a tensor kept on a custom Function's
# ctx, a root grad) is read as it is when its node runs, changes included. So an op that
# reads one after a hook or opaque call reads it from that call: the last such call
# before the op takes the tensor as an argument and returns it as an output (the last
# `flags >> PASSES_SHIFT` of each; the same tensor with eager, aot_eager and inductor,
# whose lowering keeps the call's output buffers from reuse (they are graph inputs); a copy
# with a user's backend), so the read depends on the call (`passable`, `pass_inputs_through_hooks`). Unpack calls are
# not hooks and pass nothing. (A saved tensor changed through `.data`, which bumps no
# version, may still be read before the hook by inductor.)
# Each call's arguments are then laid out as capture/lint.py checks: its own, its
# definedness, `n_after`, `n_watch`, the passed inputs.
#
# NOTE [Tensors whose data arrives during the backward]
# FSDP2 frees each block's unsharded parameters after the block's forward (their storage
# resized to nothing) and all-gathers them back in a hook that runs, in the backward, before
# the block's first node; the nodes saved them (`weight.t()` for a linear layer), so the
# backward starts with saved tensors whose storage is empty. Such a tensor is lifted as it is
# (its sizes and strides are its own; the key marks it), and read as a passable input above:
# every read of it comes from the last hook call before the read, which returns the tensor
# once the hook has refilled it. Its reads are ordered before later calls as any read (the
# hook after the block that frees it again comes after them). A read before any hook call
# would read nothing: that graph falls back (`ArrivesTooLate`), and a call that passes on a
# tensor whose storage is still empty raises (eager would read nothing there either).
# torch's built-in compiled autograd lifts such a tensor as a plain graph input and counts on
# the refill happening in place, on the same tensor, before its compiled code reads it (its
# dynamo traces FSDP2's hooks into the graph or breaks the graph there); nothing in its graph
# ties the read to the hook. Here the read depends on the hook's call by a data edge, which no
# backend can reorder. (benchmarks/distributed.py runs both: docs/distributed.md.)


class _Inputs:
    """The graph's tensor inputs, and the views of them, as a pass walks the graph in order:
    node -> (its placeholder, the placeholder's position among the graph's inputs)."""

    def __init__(self):
        self.of: dict = {}
        self.position = 0

    def walk(self, graph: torch.fx.Graph):
        """The graph's op nodes in order, noting its tensor inputs on the way."""
        for n in graph.nodes:
            if n.op == "placeholder":
                if isinstance(n.meta.get("val"), torch.Tensor):
                    self.of[n] = (n, self.position)
                self.position += 1
            elif n.op == "call_function":
                yield n

    def reads(self, n) -> list:
        """(placeholder, position) of each graph input `n` reads."""
        return [self.of[a] for a in n.all_input_nodes if a in self.of]

    def view(self, n) -> bool:
        """Whether `n` is a view of a graph input (then it stands for that input from now on)."""
        if _aliases(n) and n.args and n.args[0] in self.of:
            self.of[n] = self.of[n.args[0]]
            return True
        return False


def _is_call(n) -> bool:
    return n.op == "call_function" and n.target is torch.ops.compiled_autograd.call.default


def reorder_for_calls(gm: torch.fx.GraphModule, slots: tuple, checked=frozenset(), passable=frozenset(), arriving=frozenset()) -> tuple:
    """NOTE [Hooks may change what the graph reads], its three passes in turn (each appends
    its arguments after the last one's, as the kernel takes them off); the slots and
    Plan.watch."""
    slots = list(slots)
    changed = order_reads_before_calls(gm, slots, arriving)
    watch = watch_saved_reads(gm, slots, checked)
    changed = pass_inputs_through_hooks(gm, slots, passable) or changed or bool(watch)
    if changed:
        gm.recompile()
    return tuple(slots), watch


def order_reads_before_calls(gm: torch.fx.GraphModule, slots: list, arriving: frozenset = frozenset()) -> bool:
    """Every op that reads a graph input before a call becomes one of that call's last
    `n_after` arguments (NOTE [Hooks may change what the graph reads]); a read of a tensor
    whose data arrives during the backward before any hook falls back (NOTE [Tensors whose
    data arrives during the backward]). Whether the graph changed."""
    inputs, pending, hook_call, changed = _Inputs(), [], None, False
    for n in inputs.walk(gm.graph):
        if _is_call(n):
            args = list(n.args[1])
            direct = {a for a in args if isinstance(a, torch.fx.Node)}
            after = [r for r in dict.fromkeys(pending) if r not in direct]
            if after:
                n.args = (n.args[0], args + after, *n.args[2:])
                slots[n.args[0]] = slots[n.args[0]]._replace(n_after=len(after))
                changed = True
            pending = []
            if not SLOT_KINDS[slots[n.args[0]].kind].ordering_args:
                hook_call = n
            continue
        read = inputs.reads(n)
        if not read:
            continue
        if hook_call is None and not _aliases(n) and any(lifted in arriving for _, lifted in read):
            raise ArrivesTooLate("a tensor whose data arrives during the backward is read before any hook")
        if inputs.view(n):
            continue  # (a view: read by the ops that take it)
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            pending.append(n)
        elif isinstance(val, (tuple, list)):  # a multi-output op: any of its tensors orders it
            pending.extend([u for u in n.users if u.target is operator.getitem and isinstance(u.meta.get("val"), torch.Tensor)][:1])
    return changed


def watch_saved_reads(gm: torch.fx.GraphModule, slots: list, checked: frozenset = frozenset()) -> tuple:
    """The last call before each version-checked saved tensor's last read takes it as one of
    its `n_watch` arguments, which it checks (NOTE [Hooks may change what the graph reads]);
    Plan.watch."""
    inputs, calls, last_call = _Inputs(), [], {}  # checked placeholder -> the last call before its last read
    for n in inputs.walk(gm.graph):
        if _is_call(n):
            calls.append(n)
            continue
        read = inputs.reads(n)
        if not read or inputs.view(n):
            continue
        if calls:
            for placeholder, lifted in read:
                if lifted in checked:
                    last_call[placeholder] = (calls[-1], lifted)
    by_call: dict = {}
    for placeholder, (c, lifted) in last_call.items():
        by_call.setdefault(c, []).append((placeholder, lifted))
    watch = []
    for c, items in by_call.items():
        slot = c.args[0]
        c.args = (slot, list(c.args[1]) + [p for p, _ in items], *c.args[2:])
        slots[slot] = slots[slot]._replace(n_watch=len(items))
        watch.append((slot, tuple(i for _, i in items)))
    return tuple(watch)


def pass_inputs_through_hooks(gm: torch.fx.GraphModule, slots: list, passable: frozenset = frozenset()) -> bool:
    """An op that reads a passable graph input (or a view of one) after a hook or opaque call
    reads it from the last such call before it, which returns it as one of its last
    `flags >> PASSES_SHIFT` outputs (NOTE [Hooks may change what the graph reads]). Whether
    the graph changed."""
    inputs = _Inputs()
    hook_call = None  # the last call that is not an unpack
    passes: dict = {}  # call -> {what it passes on: its output}
    since: dict = {}  # a view or passed input -> the hook call before it (None: before any)
    changed = False

    def passed(c, a):
        """`a` (an unchecked graph input, or a view of one) as call `c` returns it."""
        mine = passes.setdefault(c, {})
        if a not in mine:
            call_args = CallArgs.of(c)
            first = call_args.n_outputs + (1 if call_args.flags & DEFINEDNESS else 0)
            with gm.graph.inserting_after(c):
                g = gm.graph.call_function(operator.getitem, (c, first + len(mine)))
            g.meta["val"] = a.meta.get("val")
            inputs.of[g] = inputs.of[a]
            since[g] = c
            mine[a] = g
        return mine[a]

    for n in inputs.walk(gm.graph):
        if _is_call(n):
            if not SLOT_KINDS[slots[n.args[0]].kind].ordering_args:
                hook_call = n
            continue
        if hook_call is not None:
            for a in list(n.all_input_nodes):
                if a in inputs.of and inputs.of[a][1] in passable and since.get(a) is not hook_call:
                    n.replace_input_with(a, passed(hook_call, a))
                    changed = True
        if inputs.reads(n) and inputs.view(n):
            since[n] = hook_call
    for c, mine in passes.items():  # after the watched tensors: the kernel takes them off first
        call_args = CallArgs.of(c)
        c.args = tuple(call_args._replace(args=list(call_args.args) + list(mine), flags=call_args.flags | (len(mine) << PASSES_SHIFT)))
        if isinstance(c.meta.get("val"), (list, tuple)):
            c.meta["val"] = [*c.meta["val"], *(g.meta["val"] for g in mine.values())]
    return changed


def mark_shared_args(gm: torch.fx.GraphModule, slots: tuple) -> tuple:
    """The arguments of each hook call and opaque node call that something else in the
    graph reads too (`Slot.shared`). PyTorch's hooks must not modify their arguments
    (they may return a new gradient instead), but in eager one that does changes the
    tensor for every node the engine runs after it; a compiler may have read it before.
    the kernel raises if such an argument's version changed rather than follow either."""
    call = torch.ops.compiled_autograd.call.default
    slots = list(slots)
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not call:
            continue
        slot = slots[n.args[0]]
        if not SLOT_KINDS[slot.kind].shares_args:
            continue
        args = list(n.args[1])[: len(n.args[1]) - slot.in_flags]
        shared = tuple(
            i for i, a in enumerate(args) if isinstance(a, torch.fx.Node) and (args.count(a) > 1 or not _read_only_here(a, inputs_ok=True))
        )
        slots[n.args[0]] = slot._replace(shared=shared)
    return tuple(slots)


def _own_post_hooks(accumulate: torch.fx.Node, slots) -> frozenset:
    """The calls of the post hooks of an ACCUMULATE call's own AccumulateGrad node (DDP's
    reducer hook): eager's engine hands them the grad that AccumulateGrad stole as `.grad`
    (engine.cpp keeps a copy of the inputs for them, and AccumulateGrad expects that one
    more reference: `num_expected_refs = 1 + !post_hooks().empty()`), so their reading it
    is no reason to copy it (a copy of every parameter's grad: DDP's compiled step 1.05-1.13x
    eager's on the 4-block MLP)."""
    node = slots[accumulate.args[0]].node
    out = set()
    for u in accumulate.args[1][0].users:
        if u is not accumulate and u.op == "call_function" and u.target is torch.ops.compiled_autograd.call.default:
            slot = slots[u.args[0]]
            if slot.kind == POST_HOOKS and slot.node == node:
                out.add(u)
    return frozenset(out)


def _read_only_here(grad: torch.fx.Node, inputs_ok: bool = False, also: frozenset = frozenset()) -> bool:
    """Whether `grad` is memory the graph made (an op's result or a view of one, not a
    view of a graph input) that nothing in the graph reads but the one call taking it
    (and the calls in `also`, which may read the grad itself): no other view of it, no other
    reader of it or of its base, not a graph result. A
    hook may change `.grad` in place, which must not change what the graph computes
    afterwards; eager's AccumulateGrad copies a grad its engine still holds for another
    node (AddBackward gives both its edges one tensor)."""
    n = grad
    while True:
        if len(set(n.users) - (also if n is grad else frozenset())) != 1:
            return False
        if n.op != "call_function":
            return inputs_ok and n.op == "placeholder"  # `inputs_ok`: a graph input counts as made
        if not _aliases(n):
            return True  # the op that made it
        parent = n.args[0] if n.args else None
        if not isinstance(parent, torch.fx.Node):
            return False
        if n.target is operator.getitem and parent.op == "call_function" and not _aliases(parent):
            # one result of a multi-output op: its other results are other tensors
            return all(u is n or (u.target is operator.getitem and u.args[1] != n.args[1]) for u in parent.users)
        n = parent
