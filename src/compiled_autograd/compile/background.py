"""Background compiles: a new graph replays as traced while a thread compiles it; waiting for
them (`synchronize`) and for those still running at exit (NOTE [Background compile])."""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import os
import subprocess
import threading
import time
from typing import Callable, NamedTuple

from ..cache.memory import CACHE, CompiledBackward
from .. import config
from ..config import Config
from ..values import PackageSlot
from ..observe.logs import compile_status
from ..observe.stats import LOCK, STATS
from . import backends, boxed
from . import child, claims, package, share
from .child import exiting
from . import torch_patches
from .torch_patches import in_background

log = logging.getLogger("compiled_autograd")


# NOTE [Background compile]
# With a slow backend (inductor: seconds to minutes per graph) the first
# backward of a new graph does not wait: it replays the traced FX graph as is
# (the same aten ops eager runs), while a thread compiles. When the compile is
# done, the cache entry is replaced by one running the compiled code. A
# dynamic graph's guards are recomputed after the compile, since the compiler
# may add its own; until then the entry keeps the trace's guards, which are
# all the FX graph needs. The thread starts once that first replay is done (a
# graph whose first run raised is not compiled): started before, it took the GIL
# from the replay's many small ops in 5 ms slices, and the transformer's first
# backward took 2.4 s instead of 1.4 (its compile waits for a replay of ~0.2 s).
#
# NOTE [Steps while a graph compiles]
# A backward of a graph whose compile is still running runs in eager autograd, not as the
# traced graph (`stats().eager_while_compiling`; not a fallback): the engine's loop runs
# without the GIL, where the traced graph, run as Python, needs it for every op against a
# compile that holds it most of the time; and it is eager's result, bitwise. Nothing of the
# walk may hold the saved tensors it lifted by then (GraphWalk.clear drops them): held,
# the engine freed no activation as it went, and the transformer's steps while compiling
# took 8-10% longer than eager's (its peak 1.46x eager's on tests/test_memory.py's MLP). The compile
# thread runs at a lower CPU priority (COMPILED_AUTOGRAD_COMPILE_NICE, its own niceness on Linux): on a
# 2-core machine training's kernels take both cores, and a compile at equal priority took
# a third of them (at niceness 5 the scheduler gives it about a seventh, at 10 a twentieth).
# Measured here (4-layer MLP D=1024, batch 64, 2 threads, the machine
# shared with a test run): eager 360 ms a step; the traced graph while compiling 663 ms
# (compile 7 s); eager while compiling at equal priority 633 ms (compile 8 s), at
# niceness 10 404 ms (1.12x eager; the compile then took 65 s, getting only what training
# left). The compiled graph (336 ms) takes over when its compile is done.
# Measured again with benchmarks/time_to_train.py (forward + backward + SGD, 2 threads, load
# average ~1.5): the transformer's eager step 0.33 s, its steps while the compile ran in this
# thread at niceness 5: 0.70-0.80 s (2.2x; the forward's ~500 small ops each wait up to the GIL's
# 5 ms switch interval for the compile's Python), compile 44 s, 60 steps 52 s against eager's
# 25 s. A cold inductor compile of the D=1024 MLP's graph is 4.3 s of this process's CPU (Python,
# under the GIL) and 5.2 s of g++'s (its own processes); from inductor's warm caches, 0.3 s
# (plus 1.4 s of inductor's imports, once). So a static graph's compile now runs first in a
# child process (NOTE [Compiling in a child process] in compile/child.py), and this thread only
# loads the result.
_pending: set[threading.Thread] = set()


_compiling: set[int] = set()  # idents of the compile threads inside their compile (cancellable at exit)


_deferred: dict[int, Callable[[], None]] = {}  # id(entry) -> start its compile, until its first replay ran


# how much lower a compile thread's CPU priority is than training's (NOTE [Steps while a graph
# compiles]); COMPILED_AUTOGRAD_COMPILE_NICE=0 compiles at training's priority


def _lower_priority() -> None:
    """NOTE [Steps while a graph compiles]: the compile thread yields the CPU to training (a
    thread's own niceness, on Linux; elsewhere nothing)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), int(config.COMPILE_NICE.read()))
    except (AttributeError, OSError):  # (no per-thread priorities here)
        pass


def start_compile_of(entry: CompiledBackward, run: bool = True) -> None:
    with LOCK:
        start = _deferred.pop(id(entry), None)
    if start is not None and run:
        start()


class WhenCompiled(NamedTuple):
    """What an entry's background compile leaves for later processes once it succeeded."""

    marker: tuple | None  # (path, bytes): the disk cache's marker (cache/disk.py compiled_marker), written
    # here or by a child left to finish after this process (NOTE [A graph known compiled])
    slot: PackageSlot | None  # where its package goes (NOTE [Compiled graphs loaded without inductor])


_when_compiled: dict[int, WhenCompiled] = {}  # id(entry) ->
_to_package: list[package.Job] = []  # packaged after exit


def mark_when_compiled(entry: CompiledBackward, marker: tuple | None, slot: PackageSlot | None = None) -> None:
    """Once the entry's background compile succeeded -- here, or in a child left to finish
    after this process (NOTE [A compile finished after exit], compile/child.py) -- write
    `marker`, and package the graph at `slot` after exit."""
    if marker is not None or slot is not None:
        with LOCK:
            _when_compiled[id(entry)] = WhenCompiled(marker, slot)


def package_later(graph, plan, inputs, slot: PackageSlot | None, patches) -> None:
    """Package this compiled graph after exit (NOTE [Compiled graphs loaded without inductor]),
    where a package can hold it; `inputs`: the graph's inputs, real or fake, or a child.Described."""
    if slot is None or child.finish_after_exit() <= 0:
        return
    try:
        described = inputs.described if isinstance(inputs, child.Described) else child.describe(inputs)
    except Exception:  # (an input whose storage cannot be read: not packaged, nothing else lost)
        log.debug("a graph not packaged: its inputs cannot be described", exc_info=True)
        return
    if not package.eligible(graph, described, plan):
        return
    with LOCK:
        _to_package.append(package.Job(graph, described, slot, dict(patches or {})))
    _wait_at_exit.register()


def _compile_in_child_once(cfg: Config, graph, example, marker) -> None:
    """The child compile of a graph, once per job or machine: claimed through the process group
    (NOTE [One compile per job]) or beside the graph's marker (NOTE [One compile per machine]),
    or waited for where another process claimed it (compile/claims.py)."""
    claim = claims.path_of(marker)
    job = claims.job_claim(_job_key(cfg, graph))
    if job is not None and not job.take():
        artifacts = job.wait()
        if artifacts is not None and claims.load_artifacts(artifacts):
            with LOCK:
                STATS.shared_compiles += 1
            return
    elif job is None and claim is not None and _compiled_elsewhere(claim, marker):
        return
    artifacts = [] if job is not None else None
    in_child = child.compile_in_child(graph, example, cfg.inductor_patches, marker, claim, artifacts)
    with LOCK:
        STATS.child_compiles += int(in_child)
    if job is not None:
        job.publish(artifacts[0] if in_child and artifacts else None)


def _job_key(cfg: Config, graph) -> str:
    import hashlib

    return hashlib.sha256((graph.code + child.fingerprint(cfg, cache_dir=False)).encode()).hexdigest()[:32]


def _compiled_elsewhere(claim: str, marker) -> bool:
    """NOTE [One compile per machine]: True where another process compiled the graph while this
    one waited (a child left by an earlier one adopted meanwhile); False once this process holds
    the claim, to compile it itself."""
    while not claims.take(claim):
        pid = claims.adopt(claim)
        adopted = share.started(pid) if pid is not None else None
        try:
            done = claims.wait_for(claim, marker, tick=adopted.wait_tick if adopted is not None else None)
        finally:
            if adopted is not None:
                adopted.release()
                share.ended(adopted)
        if done:
            with LOCK:
                STATS.shared_compiles += 1
            return True
    return False


def compile_in_background(cfg: Config, key, entry: CompiledBackward, example, what: str, logged: dict, redo_dynamic=None) -> None:
    # `example`: fake tensors only, or a child.Described that makes them in the thread; the thread
    # must not keep the user's tensors alive;
    # `redo_dynamic`: a dynamic graph's sizes and guards, recomputed after the compile (it may add guards)
    is_dynamic = entry.dynamic is not None
    graph = entry.graph

    def work():
        t0 = time.perf_counter()
        me = threading.get_ident()
        _lower_priority()
        try:
            with LOCK:
                _compiling.add(me)  # may be cancelled at exit from here (NOTE [Background compiles at exit])
            try:
                with compile_status(what + " (in the background)", detail=share.status), in_background():
                    with LOCK:
                        marker, slot = _when_compiled.pop(id(entry), WhenCompiled(None, None))
                    if child.applies(cfg.backend, is_dynamic):  # NOTE [Compiling in a child process]
                        _compile_in_child_once(cfg, graph, example, marker)
                    inputs = example() if callable(example) else example
                    fn = backends.compile_graph(
                        cfg.backend, boxed.plain_module(graph), inputs, dynamic=is_dynamic, patches=cfg.inductor_patches
                    )
            finally:
                with LOCK:
                    _compiling.discard(me)
            dynamic = redo_dynamic() if is_dynamic else None
            done = dataclasses.replace(
                entry, fn=fn, dynamic=dynamic, compiled=True, compiling=False, compile_seconds=time.perf_counter() - t0
            )
            CACHE.replace(key, entry, done)
            with LOCK:
                STATS.compile_seconds += time.perf_counter() - t0
            if marker is not None:
                child.write_marker(*marker)
            if not is_dynamic:
                package_later(graph, entry.plan, example, slot, cfg.inductor_patches)
            logged["compile_seconds"] = time.perf_counter() - t0  # its own record: the log may be trimmed
            if dynamic is not None:
                logged["guards"] = dynamic.guard_source
        except CompileCancelled:  # NOTE [Background compiles at exit]
            log.debug("background compile cancelled by the interpreter's exit")
        except Exception as e:  # the traced graph keeps serving this backward
            CACHE.replace(key, entry, dataclasses.replace(entry, compiling=False))
            with LOCK:
                STATS.compile_failures += 1
            if not exiting():
                from . import repro  # NOTE [A graph you can run]

                log.warning(
                    "background compile failed, the traced graph stays in use: %s (a script that reproduces it: %s)",
                    e,
                    repro.write_failed(entry),
                    exc_info=True,
                )
            else:  # torch's executors refuse work, its modules are torn down under the compile
                log.debug("background compile ended by the interpreter's exit: %s", e)
        finally:
            with LOCK:
                STATS.compiles_pending -= 1
                _pending.discard(threading.current_thread())

    def start():
        try:
            torch_patches.install(torch_patches.BACKGROUND)  # NOTE [One compile at a time], and the random state's
        except torch_patches.LayoutDiffers as e:  # NOTE [Torch versions]: the traced graph keeps serving
            CACHE.replace(key, entry, dataclasses.replace(entry, compiling=False))
            with LOCK:
                STATS.compile_failures += 1
            log.warning("background compile not started, the traced graph stays in use: %s", e)
            return
        _wait_at_exit.register()
        # (not a daemon: NOTE [Background compiles at exit])
        # in the context of the thread that started it: torch's configs (inductor's, AOTAutograd's)
        # are context variables, and a thread starts with none of the user's settings (torch 2.13:
        # `torch._inductor.config.max_fusion_size = 7` in the training thread went unseen)
        context = contextvars.copy_context()
        context.run(config.leave_scopes)  # (not in the user's enable() scope, though)
        thread = threading.Thread(target=context.run, args=(work,), name="compiled_autograd compile", daemon=False)
        with LOCK:
            STATS.compiles_pending += 1
            _pending.add(thread)
        thread.start()

    with LOCK:
        _deferred[id(entry)] = start


# NOTE [Background compiles at exit]
# A compile thread that the interpreter abandons at exit (a daemon thread) is
# killed where it next takes the GIL: inside C++ code (a torch op, pybind11's
# GIL release) that unwinds through a noexcept frame, and the process aborts
# ("terminate called without an active exception", exit status 134). So
# compile threads are not daemons (the interpreter joins them), and threading's
# shutdown, before it joins them and before the executors' exit hooks make
# them refuse work, first runs `_wait_at_exit`: it waits for the pending
# compiles up to COMPILED_AUTOGRAD_EXIT_WAIT seconds (default 10; "inf": to the
# end; a finished compile also fills inductor's caches for the next process),
# then cancels the rest: a CompileCancelled raised in each compile thread,
# which Python delivers between bytecodes -- never inside C++ code, which
# finishes the call it is in first -- and repeated until the thread ends.
EXIT_WAIT_DEFAULT = 10.0


class CompileCancelled(BaseException):
    """Raised in a background compile thread to cancel it at exit (a BaseException: code in
    the compiler that catches Exception lets it through)."""


def _exit_wait() -> float | None:
    raw = config.EXIT_WAIT.read()
    try:
        wait = float(raw) if raw.strip() else EXIT_WAIT_DEFAULT
    except ValueError:
        log.warning("COMPILED_AUTOGRAD_EXIT_WAIT=%r is not a number of seconds; waiting %gs", raw, EXIT_WAIT_DEFAULT)
        wait = EXIT_WAIT_DEFAULT
    if wait != wait or wait == float("inf"):
        return None
    return max(0.0, wait)


class _WaitAtExit:
    def __init__(self):
        self.registered = False

    def register(self) -> None:
        if self.registered:
            return
        # (their exit hooks first, so that ours runs before: threading runs them in reverse)
        import concurrent.futures.process  # noqa: F401
        import concurrent.futures.thread  # noqa: F401

        try:
            threading._register_atexit(self)
        except (AttributeError, RuntimeError):  # (no such hook; or the shutdown has begun: joined anyway)
            pass
        self.registered = True

    def __call__(self) -> None:
        _wait_for_compiles()
        _package_now()


def _package_now() -> None:
    """NOTE [Compiled graphs loaded without inductor]: the graphs compiled here packaged by a
    child left to finish after exit; waited for where COMPILED_AUTOGRAD_EXIT_WAIT says so."""
    with LOCK:
        jobs = list(_to_package)
        _to_package.clear()
    if not jobs:
        return
    proc = child.package_after_exit(jobs)
    if proc is not None and config.EXIT_WAIT.read().strip():
        wait = _exit_wait()
        log.info("waiting for the packaging of %d graph(s) before exiting", len(jobs))
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            pass


def _wait_for_compiles() -> None:
    """Wait for the pending compiles up to COMPILED_AUTOGRAD_EXIT_WAIT, then cancel the rest."""
    with LOCK:
        if not _pending:
            return
    shared = share.current()
    wait = _exit_wait()
    if shared is not None:  # (waited for now: it runs free)
        shared.release()
        if child.finish_after_exit() > 0 and not config.EXIT_WAIT.read():
            wait = 0.0  # it finishes after this process instead (NOTE [A compile finished after exit])
    if wait is None or wait > 0:
        log.info("waiting for %d background compile(s) before exiting", len(_pending))
        if synchronize(wait):
            return
    with LOCK:
        threads = [t for t in _pending if t.is_alive()]
    log.info("cancelling %d background compile(s) at exit", len(threads))
    while threads:
        with LOCK:  # (only inside the compile: a thread's own bookkeeping is not interrupted)
            for t in threads:
                if t.ident in _compiling:
                    _cancel(t)
        for t in threads:
            t.join(1.0)  # (again while one is still compiling: its code may have caught it)
        threads = [t for t in threads if t.is_alive()]


_wait_at_exit = _WaitAtExit()


def _cancel(thread: threading.Thread) -> None:
    import ctypes

    if thread.ident is not None and thread.is_alive():
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(CompileCancelled))


def synchronize(timeout: float | None = None) -> bool:
    """Wait for background compiles to finish; True when none is pending."""
    deadline = None if timeout is None else time.perf_counter() + timeout
    while True:
        shared = share.current()
        if shared is not None:  # (waited for: it runs free, NOTE [The compile's share of a busy machine])
            shared.release()
        with LOCK:
            threads = list(_pending)
        if not threads:
            return True
        for t in threads:
            t.join(None if deadline is None else max(0.0, deadline - time.perf_counter()))
        if deadline is not None and time.perf_counter() >= deadline:
            with LOCK:
                return not _pending


def report() -> list:
    """explain()'s lines on the background compile running now and those left to finish after an
    exit (NOTE [The compile's share of a busy machine], NOTE [A compile finished after exit])."""
    out = []
    running = share.current()
    if running is not None:
        out += [f"background compile: {running.summary()}", f"  {share.advice()}"]
    with LOCK:
        packages = len(_to_package)
    if packages:
        out.append(
            f"compiled graphs to package after exit: {packages} (NOTE [Compiled graphs loaded without inductor]: a "
            f"child makes them for the next process, for up to {child.finish_after_exit():.0f} s; "
            "COMPILED_AUTOGRAD_FINISH_AFTER_EXIT=0: not made)"
        )
    if child.left_after_exit:
        out.append(
            f"compiles left to finish after exit: {len(child.left_after_exit)} (for up to "
            f"{child.finish_after_exit():.0f} s; COMPILED_AUTOGRAD_FINISH_AFTER_EXIT=0: stopped at exit)"
        )
    return out


def reset() -> None:
    """Forget the compiles not yet started (their graphs are gone with the cache), and a compile
    worker started ahead (NOTE [A compile worker started ahead])."""
    child.end_worker()
    with LOCK:
        _deferred.clear()
        _when_compiled.clear()
