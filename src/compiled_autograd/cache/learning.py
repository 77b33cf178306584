"""The learning backwards: an eager backward run to learn what a graph's hooks or opaque nodes
return, and what a replay taught about the layouts of call outputs (NOTE [Layouts of call
outputs], calls/kernel.py). What they learn is kept in nodes/learned.py's store."""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from .. import values
from ..nodes import FAMILIES
from ..nodes.builtin import other_path
from ..nodes.learned import LEARNED
from ..nodes.saved_tensors import Learn
from ..observe.stats import LOCK, STATS

log = logging.getLogger("compiled_autograd")


def learn_in_eager(learn: Learn, eager: Callable[[], Any]):
    """NOTE [Unpack metadata learned from the last backward] (nodes/saved_tensors.py): this backward runs
    in eager autograd, its user unpack hooks reporting what they return (`learn_unpacks`, before
    the capture let go of the graph); the next one of this graph and sizes is compiled."""
    log.info("eager backward to learn what %d saved-tensor unpack hooks return", len(learn.keys))
    result = eager()
    learn.finish()
    with LOCK:
        STATS.learning_backwards += 1
    return result


def learn_layouts(key, observed: dict, copied: bool = True) -> bool:
    """Count the outputs a replay copied into their traced layout (`copied`: not where the run
    stopped at them instead, NOTE [A call output not as traced] in
    capture/resume.py); remember the dense layouts they had. True when that is new for this
    key: its graph is then dropped and the next backward captures again, in those layouts
    (NOTE [Layouts of call outputs], calls/kernel.py)."""
    with LOCK:
        STATS.layout_copies += len(observed) if copied else 0
    new = LEARNED.layouts.learn_calls(key, {where: order for where, order in observed.items() if order is not None})
    if not new:
        return False
    log.info("%d call outputs in another layout than traced: the next backward captures again", new)
    return True


def next_reason(key, reason: str) -> str:
    """Why this key's next capture is made: a layout seen (learn_layouts), else `reason`."""
    return LEARNED.layouts.reasons.pop(key, reason)


# NOTE [Nodes made opaque by their trace]
# `opaque_outputs_to_learn` watches the nodes known to be opaque before the capture (C++
# Functions, those `enable(opaque=...)` names, Functions whose state no key can hold). A node
# can also become opaque while the capture traces it: a custom Function whose backward fails
# on fakes (`torch.sparse_coo_tensor` with `check_sparse_tensor_invariants` enabled reads its
# indices' data). Its outputs were predicted contiguous, and a replay copied what came in
# another layout into that one: a sparse grad became a dense one, which eager never gives
# (hooks got a dense tensor, a sparse `.grad` turned dense). So a capture that made a user's
# Function opaque because its backward could not be traced, where no backward has shown its
# outputs yet, is not compiled: this backward runs in eager autograd to learn them
# (`learn_node_layouts`, counted in learning_backwards) and the next is captured with them
# (capture/entry.py, LEARNED.layouts.unlearned_opaque). (A built-in formula or a torch.compile'd
# region that its trace made opaque returns dense grads, and a Function made opaque for another
# reason was traced: a strided layout other than predicted is copied and learned from the
# replay, as a hook's.)


def opaque_outputs_to_learn(cfg, key, collected) -> list:
    """The opaque nodes of a graph not seen before whose outputs' layouts no backward has
    shown: (index, node) each (NOTE [Layouts of call outputs], calls/kernel.py)."""
    layouts = LEARNED.layouts
    if key in layouts.nodes:
        return []
    capture = collected.walk
    idxs = [
        i for i, n in enumerate(collected.nodes) if n.execute and (n.opaque or (n.name in cfg.opaque and FAMILIES[n.kind].opaque_by_name))
    ]
    idxs += [i for i, info in collected.pynodes.items() if info.opaque_reason is not None and i not in idxs]
    idxs += [i for i in other_path(collected, False) if i not in idxs]  # NOTE [Formulas that take another path when traced]
    if not idxs:
        layouts.nodes[key] = {}
        return []
    return [(i, capture.node_object(i)) for i in idxs]


def learn_node_layouts(key, watch, eager):
    """Run this backward in eager autograd, with a post hook on each opaque node that notes
    how its outputs are laid out (a custom Function may return a sparse or a transposed
    grad); the next backward is traced with them (NOTE [Nodes made opaque by their trace])."""
    seen: dict = {}

    def observer(idx):
        def post(grad_inputs, grad_outputs):
            for k, g in enumerate(grad_inputs):
                if isinstance(g, torch.Tensor):  # (a subclass: held by reference, NOTE [A call output not as traced])
                    seen[(idx, k)] = values.observed_layout(g) if values.is_plain(g) else values.REFERENCE

        return post

    handles = [node.register_hook(observer(idx)) for idx, node in watch]
    idxs = {idx for idx, _ in watch}
    del watch
    log.info("eager backward to learn the layouts of %d opaque nodes' outputs", len(handles))
    try:
        result = eager()
    finally:
        for h in handles:
            h.remove()
    LEARNED.layouts.learn_nodes(key, seen, idxs)
    with LOCK:
        STATS.learning_backwards += 1
    return result


def reset() -> None:
    LEARNED.reset()
