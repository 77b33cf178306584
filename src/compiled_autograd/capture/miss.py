"""A graph we do not have yet: its one owner (NOTE [A miss]).

NOTE [A miss]
A backward whose key the in-memory cache does not hold gets its graph in one sequence, here:

  1. the disk cache (cache/disk.py): a graph an earlier process of this user captured, keyed
     by the graph's key, its sizes and what earlier backwards taught its trace;
  2. its package (compile/package.py): that graph compiled ahead of time, loaded without
     inductor; or, where inductor's caches hold its compile (NOTE [A graph known compiled]),
     compiled from them now;
  3. the capture (capture/entry.py): the backward traced on fakes or recorded live;
  4. the compile: now, or in the background (compile/background.py: a child process for a
     static inductor graph), the traced graph serving meanwhile;
  5. the install, once the graph ran this backward (runtime.py runs it): the in-memory cache,
     the disk cache and its compiled marker, and the background compile's start.

runtime.py runs the first run between 4 and 5 (it holds the backward's state); everything else
of a miss is this module's.
"""

from __future__ import annotations

import logging
import warnings

from ..cache import disk as diskcache
from ..cache import learning
from ..cache.dynamic import plan_capture
from ..cache.memory import CACHE
from ..compile import background, child, package
from ..errors import LearnLayouts
from ..nodes.function import CHURN_LIMIT, note_capture
from ..nodes.learned import LEARNED

log = logging.getLogger("compiled_autograd")


class Miss:
    """One backward's miss: `graph()` gets its graph (and, where a live record made it, this
    backward's results); `install(entry, ...)` keeps it once it ran."""

    def __init__(self, cfg, key, fam, collected, create_graph: bool):
        self.cfg, self.key, self.fam, self.collected, self.create_graph = cfg, key, fam, collected, create_graph
        mask, reason = plan_capture(cfg, fam, collected)
        reason = learning.next_reason(key, reason)
        if create_graph:
            mask, reason = None, reason + (" (create_graph=True: static shapes)" if mask else " (create_graph=True)")
        self.mask, self.reason = mask, reason
        self.layouts = LEARNED.layouts.of(key)
        static = cfg.disk_cache and mask is None and not create_graph
        self.pkey = diskcache.portable_key(key, collected.sizes, self.layouts) if static else None
        self.slot = self.fingerprint = None
        self.stored = False  # the graph came from the disk cache

    def graph(self):
        """(entry, first results or None): from the disk cache, else captured."""
        got = self._from_disk()
        if got is None or not got.compiled:  # (a compile ahead: NOTE [A compile worker started ahead], compile/child.py)
            child.prestart(self.cfg)
        return (got, None) if got is not None else self._capture()

    def _from_disk(self):
        """Steps 1 and 2: the stored graph, compiled from its package or inductor's caches where
        those have it, else compiled as any new graph is."""
        if self.pkey is None:
            return None
        from .stored import entry_from_disk

        cfg, pkey = self.cfg, self.pkey
        record = diskcache.load(pkey)
        # NOTE [Compiled graphs loaded without inductor] (compile/package.py): read before anything imports inductor
        self.slot = diskcache.package_slot(pkey, package.fingerprint(cfg))
        packaged = package.load(self.slot, record["graph"]) if record is not None and self.slot is not None else None
        self.fingerprint = child.fingerprint(cfg) if packaged is None and child.applies_to(cfg) else None
        if record is None:
            return None
        # NOTE [A graph known compiled] (cache/disk.py): loaded at once where a process compiled it before
        warm = self.fingerprint is not None and diskcache.known_compiled(pkey, self.fingerprint) and child.caches_present()
        entry = entry_from_disk(cfg, self.collected, self.key, record, self.reason, warm, packaged, self.slot if warm else None)
        if not warm and self.fingerprint is not None:
            background.mark_when_compiled(entry, diskcache.compiled_marker(pkey, self.fingerprint), self.slot)
        self.stored = True
        return entry

    def _capture(self):
        """Steps 3 and 4: trace this backward and compile it (a dynamic capture that fails is
        made again with static shapes)."""
        from .entry import capture_and_compile

        cfg, fam = self.cfg, self.fam
        try:
            history = tuple(e.sizes for e in fam.entries()) if fam is not None else ()
            got = capture_and_compile(cfg, self.collected, self.key, self.mask, self.reason, history, self.create_graph, self.layouts)
        except LearnLayouts:
            raise
        except Exception:
            if self.mask is None or cfg.fullgraph:
                raise
            log.info("dynamic capture failed, capturing static shapes", exc_info=True)
            got = capture_and_compile(cfg, self.collected, self.key, None, self.reason + "; dynamic capture failed", layouts=self.layouts)
        return got.entry, got.results

    def failed(self, entry) -> None:
        """The graph's first run raised: its background compile starts anyway (a graph that
        ran part way is still the graph of this structure)."""
        background.start_compile_of(entry, run=False)

    def install(self, entry, observed: dict, resumed: bool) -> None:
        """Step 5, after the graph ran this backward: cached (unless what its calls returned
        teaches a new trace: NOTE [Layouts of call outputs]), stored on disk, compiled."""
        cfg, key = self.cfg, self.key
        store = self.pkey is not None and not self.stored and entry.dynamic is None
        if observed and learning.learn_layouts(key, observed, copied=not resumed):
            background.start_compile_of(entry, run=False)  # (not cached: the next backward captures again)
            store = False
        else:
            CACHE.family(key, create=True).add(entry)  # only graphs that ran
        CACHE.evict(cfg.cache_size_limit)
        if not self.stored and self.collected.pynodes:
            for name in note_capture(self.collected):
                warnings.warn(
                    f"compiled_autograd: {name}'s ctx values (or the Python state its backward reads) "
                    f"changed in more than {CHURN_LIMIT} captures; it now runs as is, opaquely, instead of "
                    "a new capture per value (NOTE [Functions whose values change every step])",
                    stacklevel=7,
                )
        if store:
            diskcache.store(self.pkey, entry)
            if self.fingerprint is not None:  # NOTE [A graph known compiled] (cache/disk.py)
                background.mark_when_compiled(entry, diskcache.compiled_marker(self.pkey, self.fingerprint), self.slot)
        background.start_compile_of(entry)  # NOTE [Background compile]
