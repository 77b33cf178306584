"""A static graph's inductor compile in a child process at the lowest CPU priority, which fills
inductor's on-disk caches; the training process then loads the compiled graph from them (NOTE
[Compiling in a child process])."""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import threading
import time

import torch

from .. import config
from . import claims, share
from .payload import Described, decode_graph, describe, fakes_of
from .payload import encode_graph as _encode_graph  # (a test makes it fail)

log = logging.getLogger("compiled_autograd")


# NOTE [Compiling in a child process]
# Inductor's compile of a graph is mostly Python (AOTAutograd's trace, lowering, scheduling,
# codegen: 4.3 s of CPU for the D=1024 MLP's backward, cold) plus g++ (5.2 s, in child
# processes). Run in a thread of the training process, the Python part holds the GIL most
# of the time: the forward's many small ops each wait for it (up to the 5 ms switch
# interval) and the transformer's steps while compiling took 2.2x eager's. So a background
# compile of a static inductor graph first runs in a child process (`python -c _BOOT`, which
# runs `main` below) at the lowest CPU priority (COMPILED_AUTOGRAD_CHILD_NICE), given the graph (pickled:
# its code), its inputs' geometry and the config that enters inductor's cache keys; the
# child compiles it as the training process would, which fills inductor's caches
# (AOTAutogradCache, FxGraphCache: the generated code and the .so) in the same cache
# directory. The compile thread waits for the child without the GIL, then compiles the graph
# in-process as before: a hit in both caches (0.3 s for the MLP's graph, plus inductor's
# imports the first time, 1.4 s) where the cold compile took 4.3 s of GIL. A child that
# fails, is killed, or compiled under another key (a config the child could not carry) costs
# nothing but its time: the in-process compile is then a full one, with today's failure
# handling. Only where inductor's caches are on; COMPILED_AUTOGRAD_COMPILE_PROCESS=0 turns it
# off. One child at a time (several graphs: one after the other).
#
# The priority: SCHED_IDLE (Linux; elsewhere niceness 19), so the child only gets CPU that
# training leaves idle. The cost of a compile is CPU, and on a machine whose cores training
# keeps busy (a CPU-only job with one thread per core) any share of it is taken from the
# steps: measured on 2 cores (benchmarks/time_to_train.py, transformer, OpenMP's default
# wait), the steps while compiling took 1.19x eager's with the child at niceness 10 and 0.99x
# at SCHED_IDLE. Where training leaves cores idle (a GPU job: one Python thread feeding the
# device) the idle child compiles at full speed. Where it does not, the compile lands late or
# not at all and training runs in eager autograd meanwhile, at eager's speed:
# COMPILED_AUTOGRAD_CHILD_NICE=10 (or 0) gives it a share of the CPU instead, so the graph
# lands sooner and the steps until then are slower. The priority is set before the child
# imports anything (torch and this package: 3.7 s of CPU idle, 12 s beside training), and
# with OpenMP's PASSIVE wait the training threads sleep at each barrier, so even an idle
# child takes those moments and every step pays the wake-ups (1.55x).
POLL_S = 0.05  # how often the waiting thread looks at the child (a cancel at exit lands between polls)

_child_lock = threading.Lock()


def enabled() -> bool:
    return config.COMPILE_PROCESS.on()


def applies(backend, dynamic: bool) -> bool:
    """Whether a background compile of this graph first runs in a child process."""
    if not enabled() or dynamic or backend != "inductor":
        return False
    try:
        from torch._functorch import config as functorch_config
        from torch._inductor import config as inductor_config
    except ImportError:  # pragma: no cover
        return False
    if inductor_config.force_disable_caches or not inductor_config.fx_graph_cache:
        return False
    return bool(getattr(functorch_config, "enable_autograd_cache", True))


def applies_to(cfg) -> bool:
    """Whether this scope's static graphs compile in the background through a child."""
    return bool(cfg.background_compile) and not cfg.fullgraph and applies(cfg.backend, False)


def fingerprint(cfg, cache_dir: bool = True) -> str:
    """What decides whether a compile cached by another process serves this one (NOTE [A graph
    known compiled], cache/disk.py): the backend's options, the configs that enter inductor's
    and AOTAutograd's keys, the thread count, and (`cache_dir`) the cache directory it is in."""
    import hashlib

    import torch._functorch.config  # noqa: F401  (imported: their values count)
    import torch._inductor.config  # noqa: F401

    configs = repr(sorted((k, repr(v)) for k, v in _configs().items()))
    key = (cfg.backend_key, cfg.inductor_patches, configs, torch.get_num_threads(), _cache_dir() if cache_dir else None)
    return hashlib.sha256(repr(key).encode()).hexdigest()


def caches_present() -> bool:
    """Whether inductor's FX graph cache is there (a marker of a graph compiled into a cache
    that was deleted since says nothing)."""
    cache = _cache_dir()
    return bool(cache) and os.path.isdir(os.path.join(cache, "fxgraph"))


def _configs() -> dict:
    """The configs whose values enter inductor's and AOTAutograd's cache keys, as the training
    process has them (the user's settings, our tests' settings)."""
    out = {}
    for name in ("torch._inductor.config", "torch._functorch.config"):
        module = sys.modules.get(name)
        save = getattr(module, "save_config_portable", None)
        if save is not None:
            try:
                out[name] = save()
            except Exception:  # pragma: no cover - a config that cannot be carried: the key may differ
                pass
    return out


def _cache_dir() -> str | None:
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        return cache_dir()
    except Exception:  # pragma: no cover
        return None


def _isa_patches() -> dict | None:
    from .inductor import decided_isa_patches

    return decided_isa_patches()


def compile_in_child(gm: torch.fx.GraphModule, example_inputs, patches: dict | None, marker=None, claim=None, artifacts=None) -> bool:
    """Compile the graph in a child process (NOTE [Compiling in a child process]); True when the
    child finished. Whatever happens, the caller compiles in-process next. `marker`: (disk key,
    fingerprint) the child marks compiled when it is done (NOTE [A graph known compiled]);
    `claim`: this process's claim of the compile, handed to the child (NOTE [One compile per
    machine]), released when it ends here (the child releases it where it outlives us);
    `artifacts`: a list the child's portable cache artifacts are appended to (NOTE [One compile
    per job], compile/claims.py)."""
    try:
        payload = pickle.dumps(
            {
                "graph": _encode_graph(gm),
                "inputs": example_inputs.described if isinstance(example_inputs, Described) else describe(example_inputs),
                "patches": patches or {},
                "configs": _configs(),
                "threads": torch.get_num_threads(),  # (inductor's key has the thread count)
                "marker": marker,
                "claim": claim,
                "artifacts": artifacts is not None,
                "isa": _isa_patches(),  # (the parent's decision, or None: NOTE [The machine's vector ISAs, probed once])
                "parent": os.getpid(),
            }
        )
    except Exception as e:  # a graph whose code cannot be pickled: compiled in-process only
        log.debug("graph not compiled in a child process: %s", e)
        return False
    with _child_lock:
        fd, path = tempfile.mkstemp(prefix="compiled_autograd_graph_", suffix=".pkl")
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        done = _run_child(path, claim)  # (the child removes the file once it has read it)
        _take_isa_decision(path + ".isa")
        if artifacts is not None:  # (what the child saved of its compile: path + ".artifacts")
            try:
                with open(path + ".artifacts", "rb") as f:
                    artifacts.append(f.read())
                os.unlink(path + ".artifacts")
            except OSError:
                pass
        return done


def _take_isa_decision(path: str) -> None:
    """The child's decision on the vector ISAs, where this process had taken none (NOTE [The
    machine's vector ISAs, probed once])."""
    try:
        with open(path) as f:
            patches = json.load(f)
        os.unlink(path)
    except (OSError, ValueError):
        return
    from .inductor import decided_isa_patches, set_isa_patches

    if decided_isa_patches() is None:
        set_isa_patches(patches)


# The child lowers its priority first, before it imports torch and this package (3.7 s of CPU
# on an idle machine, 12 s beside training): run by `-c` before any import, so
# that nothing of the child runs at the priority it inherits (the compile thread's, niceness 5).
_BOOT = (
    "import os, sys\n"
    "p = os.environ.get('COMPILED_AUTOGRAD_CHILD_NICE', 'idle')\n"
    "try:\n"
    "    if p == 'idle': os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
    "except (AttributeError, OSError): p = '19'\n"
    "try:\n"
    "    if p != 'idle': os.setpriority(os.PRIO_PROCESS, 0, max(int(p), os.getpriority(os.PRIO_PROCESS, 0)))\n"
    "except (AttributeError, OSError, ValueError): pass\n"
    "from compiled_autograd.compile.child import main\n"
    "sys.exit(main())\n"
)


def _child_env() -> dict:
    env = dict(os.environ)
    cache = _cache_dir()
    if cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache
    env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"  # (g++ as its own child, at its priority; more where cores are idle: _compile_threads)
    env["COMPILED_AUTOGRAD_CHILD_NICE"] = config.CHILD_NICE.read()
    # (the package as this process imported it, wherever that is)
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([package_root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def _child_command(arg: str) -> list:
    """The child's command line: its graph's payload path, or --worker (a test replaces it)."""
    return [sys.executable, "-c", _BOOT, arg]


def _spawn(arg: str, err, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL):
    # its own process group (NOTE [The compile's share of a busy machine]: stopped and continued
    # with its g++), in this session: with the scheduler's autogroups (Linux), a new session is
    # a new group that gets a fair share of the CPU against training's whatever its own
    # priority: SCHED_IDLE then took half the CPU, and training's steps took 1 s for 40 ms
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    return subprocess.Popen(_child_command(arg), env=_child_env(), stdin=stdin, stdout=stdout, stderr=err, **group)


# NOTE [A compile worker started ahead]
# A compile child spends its first seconds importing torch, this package and inductor (4.7 s of
# CPU on 2 cores), and, the first time on a machine, probing its vector ISAs (NOTE [The machine's
# vector ISAs, probed once]). So the first miss that will compile in a child (capture/miss.py: no
# package, nothing compiled in the caches) starts one at once, at its low priority: it imports all
# that while the training process captures the graph and runs its first backward, then waits for
# the graph (a path on its stdin). Its kernels are compiled by as many workers as the machine has
# idle cores while training runs, measured as the graph arrives (inductor's compile_threads; one
# where training keeps the cores busy: more workers would be more imports for the same CPU). The
# training process imports inductor only once the child is done: importing it meanwhile held the
# GIL against the steps (the D=1024 MLP's 60 steps took 1.4x eager's). Its imports done, it says
# so (a line on stdout) and is given no time until a graph comes (a rank whose graph another
# compiled gave its idle worker 15% of its steps until exit). A worker no graph came to is ended at exit.
_worker = None
_worker_tried = False


def prestart(cfg) -> None:
    """Start a compile worker ahead of the first graph, once per process (NOTE above)."""
    global _worker, _worker_tried
    if _worker_tried:
        return
    _worker_tried = True
    if not applies_to(cfg):  # (inductor's config imported: this process compiles with it anyway)
        return
    try:
        err = tempfile.TemporaryFile()
        proc = _spawn("--worker", err, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    except OSError as e:
        log.debug("no compile worker started ahead: %s", e)
        return
    # (its share of a busy machine from its start: its imports must not cost the steps either;
    # none once it waits for a graph)
    _worker = (proc, err, share.started(proc.pid, waiting=share.ReadyLine(proc.stdout)))
    import atexit

    atexit.register(end_worker)


def end_worker() -> None:
    """End a worker no graph came to (at exit; ca.reset(): the next scope starts one anew)."""
    global _worker, _worker_tried
    _worker_tried = False
    if _worker is not None:
        proc, _, shared = _worker
        _worker = None
        shared.release()
        share.ended(shared)
        try:
            proc.stdin.close()  # (it reads no graph and exits)
        except OSError:
            pass


def _take_worker():
    """The worker started ahead, its stderr's file and its share, if it is still there to take a
    graph."""
    global _worker
    worker, _worker = _worker, None
    if worker is not None and worker[0].poll() is not None:
        share.ended(worker[2])
        worker = None
    return worker


def _cpu_times():
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return fields[3] + fields[4], sum(fields)  # (idle + iowait, all)


def _compile_threads(window: float = 0.3) -> int:
    """In the child, as its graph arrives (training runs then): inductor's kernel compile
    workers, one per core idle over the next `window` seconds, at most 8 (NOTE above)."""
    try:
        cores = len(os.sched_getaffinity(0))
        idle0, all0 = _cpu_times()
        time.sleep(window)
        idle1, all1 = _cpu_times()
    except (AttributeError, OSError, ValueError, IndexError):
        return 1
    idle = cores * (idle1 - idle0) / max(all1 - all0, 1)
    return max(1, min(8, int(idle + 0.5)))


def _run_child(path: str, claim=None) -> bool:
    t0 = time.perf_counter()
    err = tempfile.TemporaryFile()  # (a file, not a pipe: a child left to finish after exit writes to no one)
    worker = _take_worker()
    shared = None
    try:
        if worker is not None:  # (the worker started ahead: NOTE [A compile worker started ahead])
            proc, err, shared = worker
            proc.stdin.write((path + "\n").encode())  # (read once it runs: stopped, where its share says so)
            proc.stdin.close()
        else:
            proc = _spawn(path, err)
    except OSError as e:  # (no interpreter to start: an embedded Python)
        log.debug("no child compile: %s", e)
        _unlink(path)
        return False
    claims.hand_to(claim, proc.pid)
    shared = share.restarted(shared) if shared is not None else share.started(proc.pid)
    left = False
    try:
        # (a loop of short waits: a cancel at exit, raised between bytecodes, gets here)
        while True:
            try:
                proc.wait(timeout=POLL_S)
                break
            except subprocess.TimeoutExpired:
                shared.wait_tick()
    except BaseException:
        shared.release()
        left = _left_to_finish(proc)
        if not left:
            _kill(proc)
            _unlink(path)
        raise
    finally:
        share.ended(shared)
        if not left:
            claims.release(claim)
    if proc.returncode != 0:
        err.seek(0)
        tail = err.read().decode(errors="replace").strip().splitlines()[-3:]
        log.debug("the child compile failed (exit status %s): %s", proc.returncode, " | ".join(tail))
        _unlink(path)
        return False
    log.debug("child compile done in %.1fs", time.perf_counter() - t0)
    return True


def _kill(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # (its g++ too)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# NOTE [A compile finished after exit]
# A compile still running when training exits was cancelled there, after
# COMPILED_AUTOGRAD_EXIT_WAIT seconds: its work was lost, and a second process with the same
# model was just as cold (the MLP's three runs in a row on a busy machine: none compiled). The
# child fills inductor's on-disk caches, which is all a later process needs (our disk cache has
# the graph; inductor's has its compile). So at exit a child still compiling is left to finish
# in its own process group, free at SCHED_IDLE, for at most FINISH_AFTER_EXIT seconds after this
# process is gone, and while the machine has room for it (its own watchdog, `_watch_parent`: a
# child that gets less than half a CPU, beside a job that keeps every core busy, ends rather than
# cost that job's steps); COMPILED_AUTOGRAD_FINISH_AFTER_EXIT=0 kills it at exit instead. The log
# and explain() say so.
def finish_after_exit() -> float:
    """COMPILED_AUTOGRAD_FINISH_AFTER_EXIT, read when used."""
    return float(config.FINISH_AFTER_EXIT.read())


left_after_exit: list = []  # pids of the children left to finish (explain())


def exiting() -> bool:
    """Whether the interpreter is exiting: threading's shutdown has begun (it first runs the
    executors' exit hooks, after which they refuse new work), or the main thread has ended."""
    return getattr(threading, "_SHUTTING_DOWN", False) or not threading.main_thread().is_alive()


def _left_to_finish(proc) -> bool:
    """At exit (a CompileCancelled): whether the child goes on after this process."""
    if finish_after_exit() <= 0 or not exiting() or proc.poll() is not None:
        return False
    left_after_exit.append(proc.pid)
    log.info(
        "a background compile goes on in process %d for up to %.0f s after this one exits, so that the next "
        "process finds it in inductor's caches (COMPILED_AUTOGRAD_FINISH_AFTER_EXIT=0: stop it at exit)",
        proc.pid,
        finish_after_exit(),
    )
    return True


def _watch_parent(limit: float, claim=None) -> None:
    """In the child: once the training process is gone, finish within `limit` seconds, and only
    while the machine has room for it (at least FREE_RATE of a CPU over each window: another
    job that keeps the cores busy would pay for a child it does not know of, NOTE [The
    compile's share of a busy machine]); else end, with its g++ (the whole process group)."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        deadline = time.perf_counter() + limit
        before = share._cpu_seconds(os.getpgrp())
        while True:
            time.sleep(share.FREE_WINDOW * 2)
            now = share._cpu_seconds(os.getpgrp())
            if claim and claims.adopted(claim):  # (a process that adopted it gives it its share: NOTE [One compile per machine])
                before = now
                continue
            if time.perf_counter() > deadline or now - before < share.FREE_RATE * share.FREE_WINDOW * 2:
                break
            before = now
        claims.release(claim)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()


def package_after_exit(jobs: list):
    """NOTE [Compiled graphs loaded without inductor]: a child that packages these graphs
    (package.Job), in its own process group, left to finish after this process; the child's
    Popen, or None."""
    try:
        payload = pickle.dumps(
            {
                "packages": [job._replace(graph=_encode_graph(job.graph)) for job in jobs],
                "configs": _configs(),
                "threads": torch.get_num_threads(),
            }
        )
        fd, path = tempfile.mkstemp(prefix="compiled_autograd_graph_", suffix=".pkl")
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
        proc = subprocess.Popen(
            _child_command(path), env=_child_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **group
        )
    except Exception as e:  # (nothing is lost but the next process's speed)
        log.debug("no package made after exit: %s", e)
        return None
    left_after_exit.append(proc.pid)
    log.info(
        "%d compiled graph(s) packaged in process %d after this one exits, for up to %.0f s, so that the next "
        "process loads them without inductor (COMPILED_AUTOGRAD_FINISH_AFTER_EXIT=0: not made)",
        len(jobs),
        proc.pid,
        finish_after_exit(),
    )
    return proc


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from .. import calls

    calls.install()  # (the graphs call compiled_autograd::call: importing the package registers nothing)
    if argv and argv[0] == "--worker":  # NOTE [A compile worker started ahead]
        _warm_up()
        _say_ready()
        line = sys.stdin.readline().strip()
        if not line:
            return 0
        argv = [line]
    with open(argv[0], "rb") as f:
        payload = pickle.load(f)
    _unlink(argv[0])
    _watch_parent(finish_after_exit(), payload.get("claim"))
    torch.set_num_threads(payload["threads"])
    for name, saved in payload["configs"].items():
        import importlib

        try:
            importlib.import_module(name).load_config(saved)
        except Exception:  # pragma: no cover - then the keys may differ: the parent compiles in full
            pass
    if "packages" in payload:
        from . import package

        failed = 0
        for job in payload["packages"]:
            try:
                with torch.no_grad():
                    package.build(decode_graph(job.graph), fakes_of(job.described), job.slot, job.patches)
            except Exception:  # (the next one may still be made)
                log.debug("could not package a graph", exc_info=True)
                failed += 1
        return int(bool(failed))
    from .inductor import compile_inductor, isa_patches, set_isa_patches
    from .torch_patches import compile_lock

    if payload.get("isa") is not None:
        set_isa_patches(payload["isa"])
    elif os.getppid() == payload.get("parent"):  # (it takes this child's decision: NOTE [The machine's vector ISAs, probed once])
        # (beside the graph's file only while the parent is there to read it, as the artifacts:
        # a child left to finish after exit writes neither)
        with open(argv[0] + ".isa", "w") as f:
            json.dump(isa_patches(), f)
    threads = _compile_threads()
    if threads > 1:  # (not in inductor's cache keys: a compile's result is the same)
        import torch._inductor.config as inductor_config

        inductor_config.compile_threads = threads
    gm = decode_graph(payload["graph"])
    fakes = fakes_of(payload["inputs"])
    with compile_lock, torch.no_grad():
        compile_inductor(gm, fakes, False, payload["patches"])
    if payload.get("artifacts") and os.getppid() == payload.get("parent"):  # NOTE [One compile per job] (compile/claims.py)
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            with open(argv[0] + ".artifacts", "wb") as f:
                f.write(saved[0])
    if payload.get("marker") is not None:  # (a child left to finish after exit: nobody else will)
        write_marker(*payload["marker"])
    claims.release(payload.get("claim"))
    return 0


def _say_ready() -> None:
    """In a worker started ahead: it waits for its graph (a line on stdout, then /dev/null there: nobody reads it)."""
    try:
        os.write(1, b"ready\n")
    except OSError:
        pass
    fd = os.open(os.devnull, os.O_WRONLY)
    os.dup2(fd, 1)
    os.close(fd)


def _warm_up() -> None:
    """In a worker started ahead: what its compile will need, imported (and the machine's vector
    ISAs probed where no verdict says them fine) while it waits for its graph."""
    try:
        import torch._inductor.compile_fx  # noqa: F401

        from .inductor import _isa_verdict, _register_inductor_lowering

        _register_inductor_lowering()
        if not _isa_verdict():
            from torch._inductor.cpu_vec_isa import valid_vec_isa_list

            valid_vec_isa_list()
    except Exception:  # (the compile imports them again and reports what fails)
        pass


def write_marker(path: str, data: bytes) -> None:
    """Write the disk cache's marker of a graph compiled (NOTE [A graph known compiled],
    cache/disk.py, which made `data`): at a new temp name, never through a symlink, then renamed
    into place, as the disk cache writes its files (NOTE [Private cache])."""
    tmp = f"{path}.tmp{os.getpid()}-{os.urandom(8).hex()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:  # (the disk cache never fails a backward: the next process compiles it again)
        log.debug("could not write a compiled marker", exc_info=True)
        try:
            os.unlink(tmp)
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(main())
