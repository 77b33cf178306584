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
_ENGINE = torch.autograd.Variable._execution_engine

# NOTE [No Python object in the backward's thread-local state]
# torch's _engine_run_backward stashes the caller's contextvars context in the thread-local
# state for the engine's device threads. Work launched during the backward captures that state:
# DDP's reducer and FSDP2's reduce-scatter start collectives from hooks, and each gloo work
# holds a copy of it. When the last reference to such a work goes in a gloo worker thread, its
# state's destructor needs the GIL to drop the context. At exit, with the model still alive at
# destroy_process_group(), the main thread holds the GIL in ~Reducer -> ~ProcessGroupGloo ->
# std::thread::join while the worker waits for it in ~AsyncAllreduceWork ->
# ~ThreadLocalState: the job hangs for good (eager's too: 6 runs in 20 on a 2-core machine).
# Our graphs call hooks from the thread that called backward, inside a one-node CPU graph task
# that no device thread runs, so nothing needs that context: the engine is called directly and
# the collectives our graphs start carry no Python object
# (tests/test_hooks_calls.py::test_hooks_called_from_a_graph_see_no_python_object_in_the_thread_local_state).


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


def in_graph_task(fn, keep_graph=True):
    """`fn()` inside a one-node graph task that keeps its graph as the backward it serves does
    (`keep_graph`: its retain_graph, or create_graph): code inside reads it
    (`torch._C._autograd._get_current_graph_task_keep_graph()`). A torch.compile'd region's
    backward run as is inside our graph compiles for it, and refuses to run when its graph is
    kept and it donates buffers (AOTAutograd's "non-empty donated buffers ... requires
    retain_graph=False"), which eager runs. (The one node saves nothing: a task that does not
    keep it leaves it reusable.)"""
    graph = _one_node_graph()
    root, one, box = graph
    box["fn"] = fn
    try:
        # The eager engine itself, not torch.autograd's (routed) global. A plain
        # backward (no `inputs`): its exec_info is empty, so nodes run inside
        # compute every gradient their edges need (task_should_compute_output),
        # and reentrant checkpointing accepts it. (The seed's .grad counts the runs.)
        # Called directly, not through torch's _engine_run_backward: NOTE [No Python object
        # in the backward's thread-local state].
        _ENGINE.run_backward((root,), (one,), keep_graph, False, (), True, True)
        return box["value"]
    finally:
        box.clear()
        _pool.roots.append(graph)
