"""What ours adds to the first training steps, measured inside one process, where this machine's
drift between processes (up to 15% of a step) cancels (docs/benchmarks.md, time to N steps).

    python -m benchmarks.repro.time_to_train_parts            # D=1024 MLP, 2 threads

1. captures: K backwards of new batch sizes (each a capture, recorded live, eager backend, static)
   alternating with eager's backward of the same shape: the first backward's extra cost.
2. walks and the child: training steps with inductor's background compile pending (its child
   process compiling at SCHED_IDLE), ours and eager alternating every 8 steps and the child
   stopped and resumed (SIGSTOP/SIGCONT) every 16: the walk of a backward whose graph compiles,
   and what the child's compile beside training costs a step.
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import statistics
import sys
import tempfile
import time

os.environ.setdefault("COMPILED_AUTOGRAD_DISK_CACHE", "0")
os.environ.setdefault("COMPILED_AUTOGRAD_EXIT_WAIT", "0")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="ttt-parts-"))

import torch  # noqa: E402

import compiled_autograd as ca  # noqa: E402
from compiled_autograd import native  # noqa: E402

pc = time.perf_counter
D, LAYERS = 1024, 8


def _net():
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(*[m for _ in range(LAYERS) for m in (nn.Linear(D, D), nn.GELU(), nn.LayerNorm(D))])


def captures(k: int = 12) -> None:
    net = _net()
    eager, ours = [], []
    for b in range(64, 64 + k):
        x = torch.randn(b, D)
        for use in (False, True):
            for p in net.parameters():
                p.grad = None
            loss = net(x).pow(2).mean()
            t0 = pc()
            with ca.enable("eager", dynamic=False) if use else contextlib.nullcontext():
                loss.backward()
            (ours if use else eager).append(pc() - t0)
    s = ca.stats()
    e, o = statistics.median(eager[2:]), statistics.median(ours[2:])
    print(
        f"captures: {s.captures} ({s.live_records} live); backward, median of {k - 2}: eager {e * 1e3:.1f} ms, "
        f"a capture {o * 1e3:.1f} ms (+{(o - e) * 1e3:.1f} ms)"
    )


def walks_and_child(blocks: int = 24, block: int = 8) -> None:
    net = _net()
    x = torch.randn(64, D)
    opt = torch.optim.SGD(net.parameters(), lr=1e-4, momentum=0.9)

    def step(use: bool) -> float:
        t0 = pc()
        opt.zero_grad(set_to_none=True)
        loss = net(x).pow(2).mean()
        with ca.enable("inductor") if use else contextlib.nullcontext():
            loss.backward()
        opt.step()
        return pc() - t0

    step(True)  # the capture; its compile starts in the background
    time.sleep(0.5)
    kids = set()
    for f in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        kids |= {int(pid) for pid in open(f).read().split()}
    cells: dict = {}
    try:
        for b in range(blocks):
            running, use = (b // 2) % 2 == 0, b % 2 == 0
            for pid in kids:
                os.kill(pid, signal.SIGCONT if running else signal.SIGSTOP)
            times = [step(use) for _ in range(block)]
            cells.setdefault((running, use), []).extend(times[1:])
    finally:
        for pid in kids:
            os.kill(pid, signal.SIGCONT)
    s = ca.stats()
    print(f"steps while compiling: {s.eager_while_compiling} (hits {s.hits}); child processes {sorted(kids)}")
    for (running, use), times in sorted(cells.items()):
        print(
            f"  child {'running' if running else 'stopped'}, {'ours ' if use else 'eager'}: "
            f"median step {statistics.median(times) * 1e3:.2f} ms ({len(times)} steps)"
        )


def main() -> int:
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    native.load()
    captures()
    ca.reset()
    walks_and_child()
    sys.stdout.flush()
    os._exit(0)  # (the pending compile is not waited for)


if __name__ == "__main__":
    sys.exit(main())
