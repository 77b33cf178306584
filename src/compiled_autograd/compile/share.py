"""The compile's share of a machine that training keeps busy (NOTE [The compile's share of a
busy machine]): when the child compiling a graph runs, and for how long training waits for it."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from .. import config

log = logging.getLogger("compiled_autograd")

# NOTE [The compile's share of a busy machine]
# The child compiles at SCHED_IDLE (NOTE [Compiling in a child process], compile/child.py): it
# takes only CPU that training leaves idle. Where training keeps every core busy (a CPU job
# with a thread per core) that is next to nothing -- 4-5% of a CPU on 2 cores, so a compile
# of ~13 s of CPU would land after minutes, or never -- and yet it costs the steps: each time
# an OpenMP thread of training waits at a barrier the child takes the core, and the thread
# wakes to a core whose caches the compiler's Python and g++ have filled (steps while
# compiling +19-33% on an Intel 2-core machine). So the child's time is handed out by the
# training process, between its steps:
#   * free: the child runs at SCHED_IDLE as before, where that gets it most of a core (a GPU
#     job, idle cores): no step pays anything;
#   * sliced: where it gets less than FREE_RATE of a CPU over a FREE_WINDOW, or training's own
#     threads keep every core busy (training takes more than cores - 0.75 CPUs: the child at
#     SCHED_IDLE still took half a core from the D=1024 MLP's barriers, its steps 1.4x), the child (its
#     whole process group: g++ too) is stopped (SIGSTOP), so it costs the steps nothing, and
#     each backward gives it a slice of its own: the training thread sleeps while the child runs
#     (SIGCONT ... SIGSTOP), alone on the machine, for what the budget owes it.
# The budget: a compile costs a fixed amount of CPU and pays back only over the steps after
# it, and how long the run will last is unknown, so it is never let to make training slower
# than a bounded share. Until training has run `after()` seconds since the compile started, the
# child is owed nothing (a short run pays no more than noise); from then on each step earns it
# share()/(1 - share()) of that step's own time, so that in any run of steps the child has at
# most share() of the time: 5% by default, every window of 10 steps within 1.05x eager's plus
# one slice carried in (issue 47: never above 1.2x while compiling). Owed time is given as soon
# as it is worth a slice (MIN_SLICE), and never more than MAX_SLICE at once. A backward that is
# not a step of this training (no backward for IDLE_S: the process does something else) lets the
# child run free again. `stats()`/`explain()` say how much of a CPU the compile got while pending.
FREE_RATE = 0.5  # CPU seconds per second below which the free child counts as starved
FREE_WINDOW = 0.25  # seconds of a free child's run measured before it is judged
MIN_SLICE = 0.005  # seconds: a slice shorter than this is not worth the stop and the wake-up
MAX_SLICE = 5.0  # (a safety: what a step earns is its own share, so slices stay short where steps are)
IDLE_S = 10.0  # seconds without a backward after which the process is taken to do something else


def after() -> float:
    """Seconds of training before a starved compile is owed any time (read when used)."""
    return float(config.COMPILE_AFTER.read())


def share() -> float:
    """The most of training's time a starved compile gets, from after() on (read when used)."""
    return min(max(float(config.COMPILE_SHARE.read()), 0.0), 0.5)


def _own_cpu() -> float:
    """This process's CPU seconds (every thread: training's)."""
    t = os.times()
    return t.user + t.system


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cpu_seconds(pgid: int) -> float:
    """CPU seconds used so far by the processes of group `pgid` (the child and its g++), from
    /proc; those that ended are counted in their parent's children's time."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        # (state, ppid, pgrp, ... utime (11), stime (12), cutime (13), cstime (14))
        if len(fields) > 14 and int(fields[2]) == pgid:
            total += sum(int(x) for x in fields[11:15])
    return total / tick


class ReadyLine:
    """Whether a worker started ahead waits for its graph: the line it writes once its imports are
    done (NOTE [A compile worker started ahead], compile/child.py), read without blocking."""

    def __init__(self, pipe):
        self.pipe, self.ready = pipe, False

    def __call__(self) -> bool:
        if not self.ready and self.pipe is not None:
            import select

            try:
                if select.select([self.pipe], [], [], 0)[0]:
                    self.ready = True  # (its line, or the end of the pipe: either way it wants no time)
                    self.pipe.close()
                    self.pipe = None
            except (OSError, ValueError):
                self.ready, self.pipe = True, None
        return self.ready


class Share:
    """The CPU share of one running child (NOTE [The compile's share of a busy machine])."""

    def __init__(self, pid: int, waiting=None):
        self.pgid = pid  # (the child leads its own process group)
        self.waiting = waiting  # a callable: True while the child waits for work (it is owed nothing then)
        self.started = self.seen = time.perf_counter()
        self.lock = threading.Lock()
        self.sliced = False
        self.stopped = False
        self.paid = 0.0  # seconds the training thread waited for the child
        self.earned = 0.0  # seconds the steps since after() earned it (step's time * share / (1 - share))
        self.window = (self.started, 0.0)  # (wall, cpu) where the current measure began
        self.own = _own_cpu()  # this process's CPU seconds there (training's)
        self.cpu = 0.0
        self.after, self.share = after(), share()

    # -- the child's state ---------------------------------------------------------------------
    def _signal(self, sig) -> None:
        try:
            os.killpg(self.pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _stop(self) -> None:
        if not self.stopped:
            self._signal(signal.SIGSTOP)
            self.stopped = True

    def _go(self) -> None:
        if self.stopped:
            self._signal(signal.SIGCONT)
            self.stopped = False

    def release(self) -> None:
        """Let the child run (free) from now on: it is being waited for, or left to finish."""
        with self.lock:
            self.sliced = False
            self._go()

    # -- called by the training thread at each backward -------------------------------------------
    def step(self) -> None:
        with self.lock:
            now = time.perf_counter()
            idle = now - self.seen > IDLE_S
            if self.sliced and not idle and now - self.started >= self.after:  # (a step's time earns the child its share)
                self.earned += (now - max(self.seen, self.started + self.after)) * self.share / (1.0 - self.share)
            self.seen = now
            if not self.sliced:
                self._judge(now)
                return
            if idle:  # (the waiting thread let it run while no step came: that time was free)
                self.window = (now, self._cpu())
            if self.waiting is not None and self.waiting():  # (a worker with no graph: nothing to give it)
                self.earned = self.paid  # (what its wait earned it is not owed)
                return
            owed = self.owed(now)
            if owed < MIN_SLICE:
                self._stop()
                return
            slice_s = min(owed, MAX_SLICE)
            self._go()
        time.sleep(slice_s)  # training waits: the child runs alone
        with self.lock:
            if self.sliced:
                self._stop()
            self.paid += slice_s
            self.seen = time.perf_counter()  # (the slice is not training's time: it earns nothing)

    def _judge(self, now) -> None:
        """A free child's last window: starved, or beside training that leaves no core idle, it is
        sliced from now on."""
        wall0, cpu0 = self.window
        if now - wall0 < FREE_WINDOW:
            return
        cpu, mine = self._cpu(), _own_cpu()
        rate = (cpu - cpu0) / (now - wall0)
        training = (mine - self.own) / (now - wall0)
        self.window, self.own = (now, cpu), mine
        busy = training > _cores() - 0.75  # (training's own threads take every core: none is idle for the child)
        if rate < FREE_RATE or busy:
            log.info(
                "background compile beside busy training (%.0f%% of a CPU at SCHED_IDLE, training %.1f CPUs): its time "
                "is now given between steps",
                100 * rate,
                training,
            )
            self.sliced = True
            self._stop()

    def owed(self, now) -> float:
        """What the budget owes the child now (above): what the steps earned it, less what it had."""
        return self.earned - self.paid

    def wait_tick(self) -> None:
        """Called by the thread that waits for the child: no step for IDLE_S lets it run free."""
        with self.lock:
            if self.sliced and self.stopped and time.perf_counter() - self.seen > IDLE_S:
                self._go()

    def _cpu(self) -> float:
        try:
            self.cpu = _cpu_seconds(self.pgid)
        except OSError:
            pass
        return self.cpu

    def summary(self) -> str:
        """How the pending compile is getting on: for explain() and the log."""
        now = time.perf_counter()
        pending = now - self.started
        cpu = self._cpu()
        how = "given time between steps" if self.sliced else "at SCHED_IDLE (CPU training leaves idle)"
        if self.waiting is not None and self.waiting():
            how = "imported, waiting for a graph (given no time)"
        return f"pending {pending:.0f} s, {100 * cpu / max(pending, 1e-9):.0f}% of a CPU, {how}; training waited {self.paid:.1f} s"


_current: Share | None = None
_current_lock = threading.Lock()


def started(pid: int, waiting=None) -> Share:
    global _current
    with _current_lock:
        _current = Share(pid, waiting)
        return _current


def restarted(share: Share) -> Share:
    """The share of a worker started ahead, now compiling its graph: judged afresh, its budget
    counted from now (NOTE [A compile worker started ahead], compile/child.py)."""
    global _current
    with _current_lock:
        fresh = Share(share.pgid)
        if share.sliced:  # (judged beside busy training already: stopped from the start)
            fresh.sliced = True
            fresh._stop()
        _current = fresh
        return fresh


def ended(share: Share) -> None:
    global _current
    with _current_lock:
        if _current is share:
            _current = None


def current() -> Share | None:
    return _current


def advice() -> str:
    """What a user can do about a compile that lands late."""
    return (
        f"sooner: COMPILED_AUTOGRAD_COMPILE_SHARE={share():g} of the time after COMPILED_AUTOGRAD_COMPILE_AFTER="
        f"{after():g} s of training (raise it, or lower the wait); ca.synchronize() waits; an idle core compiles it free"
    )


def status() -> str:
    """The running child's state and what the user can do, or '' (the log)."""
    shared = _current
    if shared is None:
        return ""
    return f"{shared.summary()} ({advice()})"


def step() -> None:
    """Each backward, while a child compiles: its slice, if it is owed one."""
    share = _current
    if share is not None:
        share.step()
