"""A graph stored by an earlier process, made an entry without tracing (cache/disk.py): its
compiled package loaded, or compiled from the backend's caches, or in the background. Imports
nothing of tracing, nor inductor (NOTE [Compiled graphs loaded without inductor])."""

from __future__ import annotations

import logging
import time

from ..compile import backends, child
from ..compile.background import compile_in_background, package_later
from ..compile.backends import may_steal
from ..config import Config
from ..observe.captures import log_capture
from ..observe.logs import compile_status
from ..observe.stats import LOCK, STATS
from ..cache.memory import CompiledBackward
from ..replay.validate import expected_outputs

log = logging.getLogger("compiled_autograd")


def entry_from_disk(cfg: Config, collected, key, record, reason: str, warm: bool = False, packaged=None, slot=None) -> CompiledBackward:
    """A graph this user's compiled_autograd stored in an earlier process: no trace; the
    compile comes from its package (`packaged`: NOTE [Compiled graphs loaded without
    inductor], compile/package.py) or the backend's own caches (then packaged at `slot` after
    exit)."""
    t0 = time.perf_counter()
    gm = record["graph"]
    expected = expected_outputs(gm)  # (no metadata: the number of outputs)
    # a graph known compiled (NOTE [A graph known compiled], cache/disk.py) loads now, from the
    # backend's caches: the second step runs it (a load in the background held the GIL against
    # the steps meanwhile: 0.5 s steps, against one wait of about a second here)
    background = cfg.background_compile and not cfg.fullgraph and not warm and packaged is None
    what = f"compiling a stored backward graph of {len(record['node_names'])} nodes with {cfg.backend_name}"
    if packaged is not None:
        fn = packaged
        reason += " (its compiled package loaded)"
        with LOCK:
            STATS.packages_loaded += 1
    elif background:
        fn = gm
    else:
        with compile_status(what):
            fn = backends.compile_graph(cfg.backend, gm, collected.lifted, patches=cfg.inductor_patches)
        package_later(gm, record["plan"], collected.lifted, slot, cfg.inductor_patches)
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
        compiling=background,
        expected=expected,
        inputs=described_fakes(collected.lifted),
    )
    with LOCK:
        STATS.disk_hits += 1
        STATS.compile_seconds += entry.compile_seconds
    logged = log_capture(
        dict(
            reason=entry.reason,
            nodes=len(entry.node_names),
            backend=cfg.backend_label,
            opaque=[o[1:] for o in entry.plan.opaque],
            trace_seconds=0.0,
            compile_seconds=entry.compile_seconds,
            inputs=entry.num_inputs,
            dynamic=[],
            guards=None,
            background=background,
            **unpacked_up_front(collected),
        )
    )
    if background:
        compile_in_background(cfg, key, entry, described_fakes(collected.lifted), what, logged)
    return entry


def unpacked_up_front(collected) -> dict:
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


def described_fakes(tensors):
    """The lifted tensors' geometry (child.Described), made into static fakes in the compile's
    thread once the child process is done with it (no reference to the user's tensors)."""
    return child.Described(tensors)
