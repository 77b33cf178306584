"""Time to N steps of a DDP job, compiles included (issue 47): eager against ours, same job.

    python -m benchmarks.ddp_time_to_train --world 2 --steps 3000            # shared cache directories
    python -m benchmarks.ddp_time_to_train --world 2 --steps 3000 --separate # one set of caches per rank
    python -m benchmarks.ddp_time_to_train --world 4 --steps 1500
    python -m benchmarks.ddp_time_to_train --world 2 --steps 3000 --repeat 3 # rounds in turn: the ratio's median

Each job runs `world` ranks on loopback (gloo), one thread each, an MLP of 4 blocks (Linear(512,
512) + GELU) and a head, batch 64, SGD; fresh inductor and disk caches per job (shared by the
ranks, as on one machine; `--separate`: each rank its own, standing for ranks on different
machines). A job's time is rank 0's wall time from its first step to its last (a barrier at each
end). Ours is `compiled_autograd.enable("inductor")` around the backward, its defaults: the compile
in a background child, the steps meanwhile in eager autograd. Per rank it reports its compiles
(its child's), the compiles it waited for instead (shared), and the step at which its compiled
graph took over. Prints one JSON line per job and mode, and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_RANK = r"""
import json, os, sys, time
import torch, torch.distributed as dist
torch.set_num_threads(1)
rank, world, steps, mode = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", rank=rank, world_size=world)
import compiled_autograd as ca
from compiled_autograd import native
native.load()
torch.manual_seed(0)
d = 512
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.GELU()) for _ in range(4)], torch.nn.Linear(d, 1))
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
g = torch.Generator().manual_seed(rank)
xs = [torch.randn(64, d, generator=g) for _ in range(16)]
times, compiled_at = [], None
dist.barrier()
t0 = time.perf_counter()
for step in range(steps):
    t = time.perf_counter()
    loss = ddp(xs[step % 16]).square().mean()
    if mode == "ours":
        with ca.enable("inductor"):
            loss.backward()
        if compiled_at is None and ca.stats().hits:
            compiled_at = step
    else:
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - t)
dist.barrier()
total = time.perf_counter() - t0
s = ca.stats()
print(json.dumps({"rank": rank, "mode": mode, "total": total, "steps": steps, "times": times, "compiled_at": compiled_at,
                  "child_compiles": s.child_compiles, "shared_compiles": s.shared_compiles, "compile_failures": s.compile_failures,
                  "eager_while_compiling": s.eager_while_compiling, "hits": s.hits, "fallbacks": s.eager_fallbacks,
                  "eager_turns": s.eager_turns, "set_aside": s.fallback_reasons.get("slower than eager", 0)}))
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(world: int, steps: int, mode: str, separate: bool, timeout: float) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        port = _free_port()
        procs = []
        for rank in range(world):
            where = Path(tmp) / (f"rank{rank}" if separate else "shared")
            env = dict(
                os.environ,
                RANK=str(rank),
                WORLD_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
                TORCHINDUCTOR_CACHE_DIR=str(where / "inductor"),
                COMPILED_AUTOGRAD_GRAPH_DIR=str(where / "graphs"),
                PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _RANK, str(steps), mode],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    cwd=str(ROOT),
                )
            )
        out = []
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            if p.returncode != 0:
                raise RuntimeError(stderr[-3000:])
            out.append(json.loads(stdout.strip().splitlines()[-1]))
        return out


def _windows(times, n=10):
    return [sum(times[i : i + n]) for i in range(0, len(times) - n + 1, n)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--separate", action="store_true", help="each rank its own caches (ranks on different machines)")
    p.add_argument("--modes", default="eager,ours")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--repeat", type=int, default=1, help="rounds of the modes in turn (the machine drifts between jobs)")
    a = p.parse_args(argv)
    totals: dict = {}
    for _ in range(a.repeat):
        rows = {}
        for mode in a.modes.split(","):
            ranks = run_job(a.world, a.steps, mode, a.separate, a.timeout)
            r0 = next(r for r in ranks if r["rank"] == 0)
            rows[mode] = r0
            totals.setdefault(mode, []).append(r0["total"])
            print(json.dumps(_summary(a, mode, ranks)), flush=True)
        if "eager" in rows and "ours" in rows:
            _compare(rows["eager"], rows["ours"])
    if a.repeat > 1 and "eager" in totals and "ours" in totals:
        import statistics

        rounds = [o / e for o, e in zip(totals["ours"], totals["eager"])]
        print(
            f"{a.repeat} rounds, ours / eager per round: {', '.join(f'{r:.3f}x' for r in rounds)}; median of the rounds "
            f"{statistics.median(rounds):.3f}x; medians of the totals: ours {statistics.median(totals['ours']):.1f} s, "
            f"eager {statistics.median(totals['eager']):.1f} s"
        )
    return 0


def _summary(a, mode: str, ranks: list) -> dict:
    return {
        "world": a.world,
        "steps": a.steps,
        "separate": a.separate,
        "mode": mode,
        "total_s": round(next(r for r in ranks if r["rank"] == 0)["total"], 2),
        "compiled_at": [r["compiled_at"] for r in ranks],
        "child_compiles": [r["child_compiles"] for r in ranks],
        "shared_compiles": [r["shared_compiles"] for r in ranks],
        "failures": [r["compile_failures"] for r in ranks],
        "eager_while_compiling": [r["eager_while_compiling"] for r in ranks],
        # a landed graph judged in turns with eager (NOTE [A compiled graph slower than eager]): the backwards run in
        # eager for it, and those run in eager after it was set aside as slower
        "eager_turns": [r.get("eager_turns", 0) for r in ranks],
        "set_aside": [r.get("set_aside", 0) for r in ranks],
    }


def _compare(eager: dict, ours: dict) -> None:
    """Rank 0's job time, its 10-step windows, and its steps before and after the landing, against eager's."""
    import statistics

    median = statistics.median(eager["times"])
    ours_w, eager_w = [w / (10 * median) for w in _windows(ours["times"])], [w / (10 * median) for w in _windows(eager["times"])]
    later = max(range(1, len(ours_w)), key=ours_w.__getitem__, default=0)
    print(
        f"ours / eager total: {ours['total'] / eager['total']:.3f}x ({ours['total']:.1f} s vs {eager['total']:.1f} s); "
        f"10-step windows against eager's median step ({1e3 * median:.1f} ms): ours' first {ours_w[0]:.2f}x (the capture), "
        f"worst after it {ours_w[later]:.2f}x (steps {10 * later}-{10 * later + 9}); eager's own worst {max(eager_w):.2f}x"
    )
    at = ours["compiled_at"]
    if at is not None:  # the steps' medians before and after the compiled graph took over, against eager's at the same steps

        def med(t, a, b):
            return 1e3 * statistics.median(t[a:b]) if b > a else float("nan")

        print(
            f"rank 0's median step before step {at}: ours {med(ours['times'], 20, at - 10):.1f} ms, eager "
            f"{med(eager['times'], 20, at - 10):.1f} ms; after it: ours {med(ours['times'], at + 20, len(ours['times'])):.1f} ms, "
            f"eager {med(eager['times'], at + 20, len(eager['times'])):.1f} ms; the 20 steps from it: ours "
            f"{1e3 * sum(ours['times'][at : at + 20]):.0f} ms, eager {1e3 * sum(eager['times'][at : at + 20]):.0f} ms"
        )


if __name__ == "__main__":
    sys.exit(main())
