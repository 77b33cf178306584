"""Why a backward ran in eager autograd, and why a node ran opaquely: a fixed set of kinds,
each with a detail string (NOTE [Reasons are kinds with details]).

NOTE [Reasons are kinds with details]
The counters `stats().fallback_reasons` and `stats().opaque_reasons` are keyed by a kind from
the tables below, so their keys are bounded and documented; the text that says exactly what
happened (an exception's first line, the node's name, the ctx attribute) is the detail, kept
in `stats().fallback_details` / `stats().opaque_details` (detail -> count, at most MAX_DETAILS
distinct details; later new ones count under "<kind>: (other details)"), and
printed by `ca.explain()`. A reason is classified where it is counted, from the text its
source wrote (the native helper's and torch's texts included), by the first kind whose
markers it contains; a text no kind claims counts as "other", with its text as the detail.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple


class Kind(NamedTuple):
    name: str
    means: str  # what it means, for the docs and explain()
    markers: tuple  # substrings of the texts of this kind, checked in table order


# why a whole backward ran in eager autograd (stats().fallback_reasons)
FALLBACKS = (
    Kind(
        "misuse",
        "eager raised its own error for the user's call (a freed graph, a root that needs no grad, ...)",
        ("collection error", "does not require grad", "neither a tensor nor a GradientEdge"),
    ),
    Kind("anomaly mode", "torch.autograd.detect_anomaly is on", ("anomaly mode",)),
    Kind("functorch", "a functorch transform (grad, vmap, jacrev, vjp) runs the engine", ("functorch", "batched by vmap")),
    Kind("dispatch mode", "a TorchDispatchMode is active", ("TorchDispatchMode",)),
    Kind("tensor subclass", "a root grad or a lifted tensor is a tensor subclass", ("subclass",)),
    Kind(
        "torch release",
        "the native helper is not available for this torch, or a patch of its internals does not fit it (NOTE [Torch versions])",
        ("native helper", "torch release", "COMPILED_AUTOGRAD_UNTESTED_TORCH"),
    ),
    Kind("CUDA streams", "a node's forward ran on another CUDA stream (NOTE [Streams])", ("stream",)),
    Kind(
        "unliftable tensor",
        "a tensor the graph would take as input cannot be one (sparse, no data, non-strided)",
        ("non-strided", "without data", "saved-tensor hook returned", "sparse", "meta tensor", "layout", "data arrives"),
    ),
    Kind(
        "create_graph",
        "create_graph=True with what its graphs cannot take (hooks, opaque nodes, saved-tensor hooks, "
        "a node eager cannot differentiate twice)",
        ("create_graph=True",),
    ),
    Kind(
        "slower than eager",
        "its compiled graph ran slower than eager's backward in this run (NOTE [A compiled graph slower than eager], cache/memory.py)",
        ("slower than eager",),
    ),
    Kind("capture failed", "capturing, compiling or first running the graph raised (after two, the key is not traced again)", ()),
)

# why a node ran opaquely, as is, inside a compiled graph (stats().opaque_reasons)
OPAQUES = (
    Kind(
        "tensor subclass",
        "it takes or returns a grad that is a tensor subclass the graph cannot hold (a nested tensor; one an "
        "opaque node returned), passed by reference (NOTE [Values passed by reference]), or it saves one (NOTE [Nodes that "
        "save what a graph cannot hold], native helper)",
        ("passed by reference", "tensor subclass"),
    ),
    Kind("marked opaque", "named in enable(opaque=...)", ("marked opaque",)),
    Kind("reentrant checkpoint", "torch.utils.checkpoint(use_reentrant=True): runs its backward itself", ("reentrant checkpoint",)),
    Kind(
        "changing values",
        "a custom Function captured with more different ctx values than the limit (NOTE [Functions whose values change every step])",
        ("changed in more than", "values change"),
    ),
    Kind(
        "Python state",
        "its backward reads or writes Python state a trace would freeze (NOTE [Python state a backward reads])",
        ("reads ", "makes ", "ctx.", "a closure", "a global"),
    ),
    Kind("undefined grads", "a grad that may be None at run time where its backward may branch on it", ("may be None",)),
    Kind("in-place on saved", "its backward changes in place a tensor it saved or keeps on ctx", ("changes in place",)),
    Kind(
        "compiled region",
        "a torch.compile'd region's backward that cannot be inlined (NOTE [Inlining AOTAutograd backwards])",
        ("torch.compile'd region",),
    ),
    Kind("tensor without data", "it keeps a tensor without data (NOTE [Lifted tensors without data])", ("without data", "meta")),
    Kind("C++ node", "a node whose state torch does not expose (a C++ custom Function)", ("CppNode", "C++", "no compiled_args")),
    Kind(
        "another path when traced",
        "its formula rounds otherwise on traced tensors than eager's (NOTE [Formulas that take "
        "another path when traced], nodes/builtin.py)",
        ("another path when traced",),
    ),
    Kind(
        "not traceable",
        "its backward cannot run on fake tensors (data-dependent shapes, .item(), numpy, a missing meta kernel)",
        ("not traceable", "backward returned", "gradient for a non-tensor"),
    ),
)

MAX_DETAILS = 256


def classify(text: str, table=FALLBACKS) -> str:
    for kind in table:
        if any(m in text for m in kind.markers):
            return kind.name
    if table is FALLBACKS:
        return "capture failed"
    return "other"


def count(kinds: Counter, details: Counter, text: str, table=FALLBACKS, detail: str | None = None, n: int = 1) -> str:
    """Count `text` under its kind, and its detail (`text`, or `detail`; bounded); the kind."""
    kind = classify(text, table)
    kinds[kind] += n
    detail = text if detail is None else detail
    if detail in details or len(details) < MAX_DETAILS:
        details[detail] += n
    else:
        details[f"{kind}: (other details)"] += n
    return kind
