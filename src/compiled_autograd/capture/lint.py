"""A captured graph's lint: the layout of each call's arguments that the passes make and the
kernel (calls/kernel.py) and the native helper read back by position.

NOTE [The layout of a call's arguments]
A `compiled_autograd::call` node's `args` are, in this order: the call's own (the grads or
tensors it runs on); with `Slot.in_flags`, one bool tensor saying which of them are defined;
`Slot.n_after` values only there to order it (capture/passes.py order_reads_before_calls);
`Slot.n_watch` saved tensors it checks (watch_saved_reads: graph inputs); `Slot.n_resume`
values the graph holds at the call (capture/resume.py pass_values: NOTE [A call output not as
traced]); `flags >> PASSES_SHIFT` graph inputs it returns as its last outputs
(pass_inputs_through_hooks). The
kernel takes them off from the end, so a pass that appends in another order, or a count in the
slot that differs from the graph, makes a hook run on the wrong tensors. `lint` checks each
call against its slot, and that each slot is called once; behind a flag (COMPILED_AUTOGRAD_LINT=1,
which the tests set), as it walks every graph once more.
"""

from __future__ import annotations

import torch

from ..calls.protocol import DEFINEDNESS, DIRECT, PASSES_SHIFT, CallArgs
from ..nodes import SLOT_KINDS


class GraphLintError(RuntimeError):
    """A captured graph whose calls are not laid out as their slots say."""


def lint(gm: torch.fx.GraphModule, slots) -> None:
    """Raise GraphLintError naming the first call laid out otherwise than its slot says
    (NOTE [The layout of a call's arguments]), with the graph's code."""
    seen: dict = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not torch.ops.compiled_autograd.call.default:
            continue
        c = CallArgs.of(n)
        if not 0 <= c.slot < len(slots):
            _fail(gm, n, f"slot {c.slot} is not one of the plan's {len(slots)}", "each call's slot indexes Plan.slots")
        if c.slot in seen:
            _fail(
                gm,
                n,
                f"slot {c.slot} is called again (first by {seen[c.slot].name})",
                "a pass that copies a call must give the copy its own slot",
            )
        seen[c.slot] = n
        _lint_call(gm, n, c, slots[c.slot])
    missing = [i for i in range(len(slots)) if i not in seen]
    if missing:
        _fail(gm, None, f"slots {missing} have no call in the graph", "a pass that drops a call must drop its slot")


def _lint_call(gm, n, c: CallArgs, slot) -> None:
    row = SLOT_KINDS.get(slot.kind)
    if row is None:
        _fail(
            gm, n, f"slot kind {slot.kind!r} is no family's (nodes/__init__.py SLOT_KINDS)", "register the kind in its family's SLOT_KINDS"
        )
    if slot.fresh and not row.accumulates:
        _fail(gm, n, f"a {slot.kind} call is marked fresh", "only a call that hands its grad to AccumulateGrad may be (Plan.steals)")
    if not c.flags & DIRECT:
        _fail(gm, n, "its flags lack DIRECT", "the trace sets DIRECT on every call (calls/protocol.py)")
    n_passed = c.flags >> PASSES_SHIFT
    own = len(c.args) - slot.in_flags - slot.n_after - slot.n_watch - max(slot.n_resume, 0) - n_passed
    if own < 0:
        _fail(
            gm,
            n,
            f"{len(c.args)} arguments, fewer than its slot's in_flags {int(slot.in_flags)} + n_after {slot.n_after} "
            f"+ n_watch {slot.n_watch} + n_resume {max(slot.n_resume, 0)} + passed {n_passed}",
            "a pass that appends arguments must count them in the slot",
        )
    if slot.in_flags:
        flag = c.args[own]
        val = flag.meta.get("val") if isinstance(flag, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or val.dtype != torch.bool or val.numel() != own:
            _fail(
                gm,
                n,
                f"argument {own} is not the definedness of its {own} own arguments",
                "append ordering, watched and passed arguments after it",
            )
    end_watch = len(c.args) - n_passed - max(slot.n_resume, 0)
    watched = c.args[end_watch - slot.n_watch : end_watch]
    for a in watched:
        if not isinstance(a, torch.fx.Node) or a.op != "placeholder":
            _fail(gm, n, f"watched argument {a} is not a graph input", "n_watch counts the saved tensors appended by watch_saved_reads")
    for a in c.args[len(c.args) - n_passed :]:
        if not isinstance(a, torch.fx.Node):
            _fail(
                gm,
                n,
                f"passed argument {a!r} is not a graph value",
                "flags >> PASSES_SHIFT counts the inputs appended by pass_inputs_through_hooks",
            )
    val = n.meta.get("val")
    if isinstance(val, (list, tuple)):
        want = c.n_outputs + (1 if c.flags & DEFINEDNESS else 0) + n_passed
        if len(val) != want:
            _fail(
                gm,
                n,
                f"{len(val)} outputs traced where its meta, flags and passed inputs make {want}",
                "a pass that passes an input on adds its output to meta['val']",
            )


def _fail(gm, n, what: str, how: str) -> None:
    where = f"call {n.name} (slot {n.args[0]})" if n is not None else "the graph"
    raise GraphLintError(f"compiled_autograd graph lint: {where}: {what}; {how} (NOTE [The layout of a call's arguments])\n{gm.code}")
