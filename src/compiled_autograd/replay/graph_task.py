"""Running Python code inside an eager autograd graph task.

Some code that runs during a backward expects to be inside the engine:
`Variable._execution_engine.queue_callback` (DDP's reducer finalizes the
backward that way) raises outside a backward, and code keyed by
`torch._C._current_graph_task_id()` (non-reentrant checkpointing recomputes
once per id) would see every call as a new backward. `in_graph_task(fn)` runs
`fn` from a hook of a one-node eager backward, so all of it is one graph task
with the grad mode of a backward (off), and callbacks it queues run when `fn`
returns, as they would at the end of an eager backward. Its exec_info is
empty, whatever backward we are nested in: a node asked for its gradients
inside computes all of them, as in a fresh eager backward.
"""

from __future__ import annotations

import threading

import torch

_pool = threading.local()  # per thread: the one-node graphs not running now


def _one_node_graph():
    """A one-node graph whose root's hook runs `box["fn"]`, kept (retain_graph) and reused:
    made once per thread and nesting depth, not per backward (its tensors and hook cost
    ~90 us a backward once the backward's own work has evicted them from the caches)."""
    roots = getattr(_pool, "roots", None)
    if roots is None:
        roots = _pool.roots = []
    if roots:
        return roots.pop()
    seed = torch.zeros((), requires_grad=True)
    with torch.enable_grad():
        root = seed.clone()
    box: dict = {}

    def hook(grad):
        box["value"] = box.pop("fn")()
        return grad

    root.register_hook(hook)
    return root, torch.ones(()), box


def in_graph_task(fn):
    graph = _one_node_graph()
    root, one, box = graph
    box["fn"] = fn
    try:
        # The eager engine itself, not torch.autograd's (routed) global. A plain
        # backward (no `inputs`): its exec_info is empty, so nodes run inside
        # compute every gradient their edges need (task_should_compute_output),
        # and reentrant checkpointing accepts it. (The seed's .grad counts the runs.)
        torch.autograd.graph._engine_run_backward((root,), (one,), True, False, (), True, True)
        return box["value"]
    finally:
        box.clear()
        _pool.roots.append(graph)
