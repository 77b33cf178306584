"""One backward call, through the package's stages in order:

  walk/     the native walk in the engine's order: node rows, the key, the lifted tensors
  cache/    the look-up: the compiled entries by key (cache/memory.py)
  capture/  a miss: its one owner (capture/miss.py) gets the graph -- disk, package, capture,
            compile -- and installs it once it ran
  replay/   the graph run on the lifted tensors (a call may stop it: capture/resumed.py goes on
            in eager's order), its results applied with eager's semantics, the graph freed

Anything this path does not handle runs in eager autograd instead, counted in
`stats().eager_fallbacks` with its reason.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import Counter
from typing import Any, Callable, Sequence

from . import native
from .cache import learning
from .cache.memory import CACHE
from .compile import background, repro, share
from .config import Config
from .errors import BackendOutputError, CompiledAutogradError, Fallback, LearnLayouts, OpaqueSubclasses
from .observe import captures, reasons
from .observe.stats import LOCK, STATS
from .replay.run import GCPause, apply, check_outputs, run_graph
from .values import BOXED, CacheKey
from .errors import Unkeyable
from .nodes.saved_tensors import Learn
from .walk.collect import collect
from .walk.precheck import global_state, opaque_subclasses, precheck

log = logging.getLogger("compiled_autograd")

UNUSED_INPUT_ERROR = (
    "The differentiated Tensor at index {} appears to not have been used in the graph. "
    "Set allow_unused=True if this is the desired behavior."
)


MAX_CAPTURE_FAILURES = 2  # then that key runs eagerly without tracing it again


class _Refusals:
    """What earlier backwards decided against: the keys whose capture falls back, the captures
    that raised, the fallback reasons already warned about."""

    def __init__(self):
        self.unsupported: dict[tuple, str] = {}  # key -> why its capture fell back (not traced again)
        self.failures: Counter = Counter()  # key -> captures (trace, compile or first run) that raised
        self.warned: set[str] = set()

    def mark_unsupported(self, key, reason: str) -> None:
        if len(self.unsupported) < 1024:
            self.unsupported[key] = reason

    def clear(self) -> None:
        self.unsupported.clear()
        self.failures.clear()
        self.warned.clear()


REFUSALS = _Refusals()


def reset_runtime() -> None:
    REFUSALS.clear()
    captures.reset()
    learning.reset()
    background.reset()


def _fall_back(cfg: Config, reason: str, eager: Callable[[], Any], user_error: bool = False):
    if cfg.fullgraph and not user_error:
        raise CompiledAutogradError(
            f"compiled_autograd: cannot compile this backward ({reason}); use fullgraph=False to run it in eager autograd instead"
        )
    result = eager()  # eager raises the user's error itself where there is one
    with LOCK:
        STATS.eager_fallbacks += 1
        reasons.count(STATS.fallback_reasons, STATS.fallback_details, reason, reasons.FALLBACKS)
    if reason not in REFUSALS.warned:
        REFUSALS.warned.add(reason)
        warnings.warn(f"compiled_autograd: running a backward in eager autograd: {reason}", stacklevel=4)
    log.info("eager fallback: %s", reason)
    return result


def run_backward(*args):
    """One backward through compiled_autograd; the arguments are
    `_run_backward`'s (cfg, eager, roots, grads, keep_graph, create_graph,
    inputs, allow_unused, accumulate_grad), run with the collector paused
    (NOTE [No garbage collection on a hit])."""
    if share._current is not None:  # NOTE [The compile's share of a busy machine] (compile/share.py)
        share.step()
    pause = GCPause()
    try:
        return _run_backward(*args, pause=pause)
    finally:
        pause.resume()


def _run_backward(
    cfg: Config,
    eager: Callable[[], Any],
    roots: Sequence[Any],
    grads: Sequence[Any],
    keep_graph: bool,
    create_graph: bool,
    inputs: Sequence[Any],
    allow_unused: bool,
    accumulate_grad: bool,
    pause: GCPause,
):
    reason, user_error = precheck(roots, grads, create_graph, inputs, accumulate_grad)
    if reason is not None:
        pause.resume()
        return _fall_back(cfg, reason, eager, user_error)

    try:
        C = native.load()
    except native.Unavailable as e:  # NOTE [Torch versions] (native/__init__.py)
        pause.resume()
        return _fall_back(cfg, str(e), eager)
    opaque = opaque_subclasses(grads)
    while True:
        try:
            walk = C.GraphWalk(list(roots), list(grads), list(inputs), accumulate_grad, opaque)
        except RuntimeError as e:  # misuse (freed graph, modified saved tensor): eager raises the same error
            pause.resume()
            if "NestedTensor support not implemented" in str(e):
                # torch's CompiledNodeArgs::collect(InputMetadata) refused a nested tensor (ours keys
                # a nested edge itself: NOTE [Values passed by reference]); no misuse of the user's
                return _fall_back(cfg, "tensor subclass: a nested tensor in the graph", eager)
            return _fall_back(cfg, f"collection error: {str(e).splitlines()[0][:120]}", eager, user_error=True)
        try:
            out = _after_walk(cfg, eager, walk, keep_graph, create_graph, allow_unused, accumulate_grad, pause)
        finally:
            walk.restore_saved_hooks()  # NOTE [Handing unpacked tensors to their saved variables] (native helper)
        if out is not _WALK_AGAIN or opaque:
            return out
        opaque = True  # (a subclass without __tensor_flatten__: its nodes opaque, NOTE [Values passed by reference])


_WALK_AGAIN = object()  # _after_walk's answer: walk again with every subclass's nodes opaque


def _after_walk(cfg, eager, walk, keep_graph, create_graph, allow_unused, accumulate_grad, pause):
    """After the walk: collect, look up, then a hit or a miss, and apply (or run in eager)."""
    collected, reason, user_error = _collect(walk, keep_graph, create_graph)
    if reason is _WALK_AGAIN:
        walk.clear()
        return reason
    if reason is not None or isinstance(collected, Learn):
        walk.clear()
        pause.resume()
        if reason is not None:
            return _fall_back(cfg, reason, eager, user_error)
        return learning.learn_in_eager(collected, eager)

    key = CacheKey(cfg.backend_key, global_state(collected.subclasses), cfg.opaque, create_graph, collected.key)
    reason = REFUSALS.unsupported.get(key) if REFUSALS.unsupported else None
    fam = CACHE.family(key)
    if reason is None and fam is not None and fam.payback.verdict and not cfg.fullgraph:
        reason = fam.payback.verdict  # NOTE [A compiled graph slower than eager] (cache/memory.py)
    if create_graph and reason is None and fam is None:
        # (hooks, opaque nodes and saved-tensor hooks are in the key: checked once per key)
        from .capture.entry import create_graph_unsupported

        reason = create_graph_unsupported(collected)
        if reason is not None:
            REFUSALS.mark_unsupported(key, reason)
    if reason is not None:
        collected = None  # (eager frees the saved tensors as it goes: nothing of ours may hold them)
        walk.clear()
        pause.resume()
        return _fall_back(cfg, reason, eager)
    if fam is None and not create_graph:
        watch = learning.opaque_outputs_to_learn(cfg, key, collected)
        if watch:  # NOTE [Layouts of call outputs] (calls/kernel.py)
            collected = None
            walk.clear()
            pause.resume()
            return learning.learn_node_layouts(key, watch, eager)
    walk.grad_mode = create_graph  # AccumulateGrad applies the results as under create_graph
    run = _OneBackward(cfg, key, fam, collected, walk, keep_graph, create_graph)
    del collected  # (the run holds the lifted tensors, and lets go of them before applying)
    if run.entry is not None and run.entry.compiling:
        fam.payback.compiling()  # NOTE [Steps while a graph compiles]
        with LOCK:
            STATS.eager_while_compiling += 1
        del run  # (eager frees the saved tensors as it goes: nothing of ours may hold them)
        return _eager_instead(walk, eager, pause)
    turn = fam.payback.turn(run.entry) if run.entry is not None and not cfg.fullgraph else None
    if turn == "eager":  # NOTE [A compiled graph slower than eager] (cache/memory.py)
        with LOCK:
            STATS.eager_turns += 1
    t0 = time.perf_counter()
    if turn == "eager":
        del run
        out = _eager_instead(walk, eager, pause)
    else:
        try:
            results = run.hit() if run.entry is not None else run.miss(pause)
        except Exception as e:
            return run.failed(e, eager, pause)
        out = run.finish(results, accumulate_grad, allow_unused)
    if turn is not None and fam.payback.note(turn, time.perf_counter() - t0):
        log.info("%s", fam.payback.verdict)
    return out


def _eager_instead(walk, eager, pause):
    """This backward in eager autograd, though its graph is cached (the caller let go of what it collected)."""
    walk.clear()
    pause.resume()
    return eager()


def _collect(walk, keep_graph, create_graph):
    """(Collected or Learn or None, why to run in eager or None, whether eager is there to raise
    the user's error). (The try decides only: an eager backward run inside it would run again,
    from the start, if it raised a RuntimeError -- its own, or a hook's.)"""
    try:
        if walk.unsupported:
            return None, walk.unsupported, False
        # create_graph=True with saved-tensor hooks runs in eager (create_graph_unsupported),
        # whose unpack hooks must not have run already
        collected = collect(walk, run_unpack_hooks=not create_graph, keep_graph=keep_graph)
        if collected is None:
            return None, "create_graph=True with saved-tensor hooks", False
        if isinstance(collected, Learn):
            walk.learn_unpacks(sorted(collected.keys), collected.report)
        elif create_graph and collected.subclasses:
            return None, "create_graph=True with tensor subclasses (not yet: docs/design/subclasses.md)", False
        return collected, None, False
    except RuntimeError as e:  # misuse (freed graph, modified saved tensor): eager raises the same error
        return None, f"collection error: {str(e).splitlines()[0][:120]}", True
    except Unkeyable as e:
        # an unpack hook returned a tensor we cannot lift (a subclass, a sparse tensor)
        return None, f"saved-tensor hook returned a {e}", False
    except OpaqueSubclasses:
        return None, _WALK_AGAIN, False
    except Fallback as e:  # (a tensor subclass the graph does not take: docs/design/subclasses.md)
        return None, e.reason, False


class _Resume:
    """What a run of `entry` that stopped at a call returns: the rest of the backward run in
    eager's order (NOTE [A call output not as traced], capture/resume.py); `stopped`: the stop."""

    __slots__ = ("entry", "collected", "stopped")

    def __init__(self, entry, collected):
        self.entry, self.collected, self.stopped = entry, collected, None

    def __call__(self, stop, args):
        from .capture.resumed import resume_at  # (a hit imports tracing only where a call stopped it)

        self.stopped = stop
        return resume_at(self.entry, self.collected, stop, args)


class _OneBackward:
    """One compiled backward after its key: a hit or a miss, then its results applied."""

    def __init__(self, cfg, key, fam, collected, walk, keep_graph, create_graph):
        self.cfg, self.key, self.fam, self.collected, self.walk = cfg, key, fam, collected, walk
        self.keep_graph, self.create_graph = keep_graph, create_graph
        self.lifted = collected.lifted
        self.entry, self.extra = fam.lookup(collected.sizes, self.lifted) if fam is not None else (None, [])
        self.missed = self.entry is None
        self.released = False  # the saved tensors were handed to the graph (a boxed hit)
        self.recorded = False  # the results are a live record's: the entry's function did not run
        self.observed: dict = {}  # NOTE [Layouts of call outputs] (calls/kernel.py)

    def miss(self, pause):
        """A graph we do not have yet (NOTE [A miss], capture/miss.py): got, run once, installed."""
        from .capture.miss import Miss  # (a hit never imports tracing)

        pause.resume()  # tracing and compiling make garbage cycles
        m = Miss(self.cfg, self.key, self.fam, self.collected, self.create_graph)
        entry, first = m.graph()
        self.entry = entry
        resume = None
        try:
            self.extra = entry.dynamic.extra_args(self.collected.sizes) if entry.dynamic else []
            if first is not None:
                # NOTE [Recording on the real tensors] (capture/record.py): the record ran this
                # backward; the entry's function has not run yet (its first run is checked)
                results, self.recorded = first, True
                del first
            else:
                resume = _Resume(entry, self.collected)
                results = run_graph(
                    entry,
                    self.walk,
                    self.lifted,
                    self.extra,
                    self.collected.hooks,
                    free_on_failure=not self.keep_graph,
                    observed=self.observed,
                    keep_graph=self.keep_graph,
                    resume=resume,
                )
                self.recorded = resume.stopped is not None  # (its results are the resumed steps': not the function's)
        except BaseException:
            m.failed(entry)
            raise
        m.install(entry, self.observed, resumed=resume is not None and resume.stopped is not None)
        return results

    def hit(self):
        entry, walk, collected = self.entry, self.walk, self.collected
        with LOCK:
            STATS.hits += 1
        resume = _Resume(entry, collected)
        if not self.keep_graph and getattr(entry.fn, BOXED, False):
            # NOTE [Boxed graphs free their inputs]: the graph gets the only
            # references to the saved tensors, and frees each after its last
            # use, once the nodes' saved variables are freed too: before the graph,
            # or after the last call that may read them (NOTE [Saved tensors freed as
            # eager frees them], values.py; an unpack hook's packed value is held by
            # `collected.hooks`)
            args = self.lifted + self.extra
            self.lifted.clear()
            walk.drop_lifted(bool(entry.plan.resume))  # (kept where a call may stop the graph)
            releases = entry.plan.releases
            if not releases:
                walk.release()
            elif releases[0][0] == -1:
                walk.release_nodes(releases[0][1])
            self.released = True
            results = run_graph(
                entry, walk, args, [], collected.hooks, releases, observed=self.observed, keep_graph=self.keep_graph, resume=resume
            )
        else:
            results = run_graph(
                entry,
                walk,
                self.lifted,
                self.extra,
                collected.hooks,
                free_on_failure=not self.keep_graph,
                observed=self.observed,
                keep_graph=self.keep_graph,
                resume=resume,
            )
        if resume.stopped is not None:  # NOTE [A call output not as traced] (capture/resume.py)
            self.recorded = True  # (the resumed steps' results: not the function's, not checked)
        if self.observed and learning.learn_layouts(self.key, self.observed, copied=resume.stopped is None):
            self.fam.remove(entry)  # the next backward captures again, with what was seen
        return results

    def failed(self, e: Exception, eager, pause):
        """Raise, or run this backward in eager autograd where nothing of it ran yet."""
        cfg, key, entry, walk = self.cfg, self.key, self.entry, self.walk
        if isinstance(e, BackendOutputError):  # (create_graph's first run: its graph checks itself)
            CACHE.discard(key, entry)
            walk.clear()
            raise e
        if self.released or (entry is not None and entry.plan.slots):
            # opaque calls (hooks, nodes) may have run, or the saved tensors are
            # gone: never run the backward twice
            if self.released and "already been freed" in str(e):
                raise RuntimeError(
                    "compiled_autograd: a hook read a saved tensor of this backward (e.g. "
                    "`grad_fn._saved_self`), which compiled_autograd had freed before the hook ran: "
                    "it frees a node's saved tensors once no hook eager runs before that node may read "
                    "them, taking hooks on leaves, AccumulateGrad and module full-backward hooks to read "
                    "none (NOTE [Saved tensors freed as eager frees them]). Read what the hook "
                    f"needs in the forward, or run this backward without compiled_autograd. ({e})"
                ) from e
            raise e
        if isinstance(e, LearnLayouts):  # NOTE [Nodes made opaque by their trace] (cache/learning.py)
            watch = [(i, walk.node_object(i)) for i in e.idxs]
            self.lifted = self.collected = None
            walk.clear()
            pause.resume()
            return learning.learn_node_layouts(key, watch, eager)
        self.lifted = self.collected = None  # (eager frees the saved tensors as it goes)
        walk.clear()
        pause.resume()
        if isinstance(e, Fallback):
            REFUSALS.mark_unsupported(key, e.reason)
            return _fall_back(cfg, e.reason, eager)
        if cfg.fullgraph:
            raise e
        log.debug("capture failed", exc_info=True)
        reason = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        if self.missed and not STATS.compiles_pending:
            # (not while a background compile runs: torch.fx's tracer keeps its patching
            # state in a process global, and two traces at once can fail one of them)
            REFUSALS.failures[key] += 1
            if REFUSALS.failures[key] >= MAX_CAPTURE_FAILURES:
                REFUSALS.mark_unsupported(key, reason)
        return _fall_back(cfg, reason, eager)

    def finish(self, results, accumulate_grad, allow_unused):
        """Apply the results with eager semantics, free the graph, return grad()'s results."""
        entry, walk = self.entry, self.walk
        if not entry.checked and not self.recorded:  # NOTE [A compiled graph's outputs are checked on its first run] (replay/validate.py)
            try:
                check_outputs(self.key, entry, walk, results, self.collected.sizes)
            except BackendOutputError as e:  # NOTE [A graph you can run]: the file that shows it, named in the error
                path = repro.write_failed(entry)
                raise BackendOutputError(f"{e} A script that reproduces it: {path}") if path is not None else e from None
        if entry.plan.opaque:
            with LOCK:
                STATS.opaque_nodes += len(entry.plan.opaque)
                for _, name, why in entry.plan.opaque:
                    reasons.count(STATS.opaque_reasons, STATS.opaque_details, why, reasons.OPAQUES, f"{name}: {why}")
        self.lifted = self.collected = None
        captured = apply(entry, walk, results)
        del results
        if not self.keep_graph:
            walk.release()
        walk.clear()
        if accumulate_grad:
            return ()
        if not allow_unused:
            for i, g in enumerate(captured):
                if g is None:
                    raise RuntimeError(UNUSED_INPUT_ERROR.format(i))
        return tuple(captured)
