"""What earlier backwards of a graph taught: the layouts of call outputs, learned from a replay
or an eager backward (NOTE [Layouts of call outputs], replay/calls.py); the learning backwards."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Callable

import torch

from .. import values
from ..observe.stats import LOCK, STATS
from ..values import NodeKind
from ..nodes.saved_tensors import Learn

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


LAYOUTS: dict = {}  # key -> {(slot, output): dim order seen at run time} (NOTE [Layouts of call outputs], replay/calls.py)


_relayouts: Counter = Counter()  # key -> captures made again for a layout seen


layout_reasons: dict = {}  # key -> the reason of its next capture


MAX_RELAYOUTS = 3  # then a key keeps its graph and copies what comes in another layout


def learn_layouts(key, observed: dict) -> bool:
    """Count the outputs a replay copied into their traced layout; remember the dense layouts
    they had. True when that is new for this key: its graph is then dropped and the next
    backward captures again, in those layouts (NOTE [Layouts of call outputs], replay/calls.py)."""
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
    layout_reasons[key] = f"{len(new)} call outputs came back in another layout than traced: captured again in those layouts"
    log.info("%d call outputs in another layout than traced: the next backward captures again", len(new))
    return True


NODE_LAYOUTS: dict = {}  # key -> {(node, output): layout seen}: the opaque nodes' outputs


def layouts_of(key) -> dict:
    """What the trace of this key predicts from earlier backwards: (slot, output) -> layout
    for calls seen in another layout, ("node", index, output) -> layout for opaque nodes."""
    nodes = NODE_LAYOUTS.get(key) or {}
    return {**{("node", *where): layout for where, layout in nodes.items()}, **LAYOUTS.get(key, {})}


def opaque_outputs_to_learn(cfg, key, collected) -> list:
    """The opaque nodes of a graph not seen before whose outputs' layouts no backward has
    shown: (index, node) each (NOTE [Layouts of call outputs], replay/calls.py)."""
    if key in NODE_LAYOUTS:
        return []
    capture = collected.capture
    idxs = [i for i, n in enumerate(collected.nodes) if n.execute and (n.opaque or (n.name in cfg.opaque and n.kind != NodeKind.ACCUMULATE))]
    idxs += [i for i, info in collected.pynodes.items() if info.opaque_reason is not None and i not in idxs]
    if not idxs:
        NODE_LAYOUTS[key] = {}
        return []
    return [(i, capture.node_object(i)) for i in idxs]


def learn_node_layouts(key, watch, eager):
    """Run this backward in eager autograd, with a post hook on each opaque node that notes
    how its outputs are laid out (a custom Function may return a sparse or a transposed
    grad); the next backward is traced with them."""
    seen: dict = {}

    def observer(idx):
        def post(grad_inputs, grad_outputs):
            for k, g in enumerate(grad_inputs):
                if isinstance(g, torch.Tensor):
                    seen[(idx, k)] = values.observed_layout(g)

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


def reset() -> None:
    from ..nodes.function import CHURN
    from ..nodes.saved_tensors import LEARNED

    LEARNED.clear()
    CHURN.clear()
    LAYOUTS.clear()
    NODE_LAYOUTS.clear()
    _relayouts.clear()
    layout_reasons.clear()
