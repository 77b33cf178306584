"""Step time of DDP, FSDP2 and tensor-parallel training (TP, TP with sequence parallelism, FSDP2 + TP
on a (world/2, 2) mesh): eager, ours and torch's built-in compiled autograd.

    python -m benchmarks.distributed [--worlds 2,4] [--wraps ddp,fsdp2,tp,tp+sp,tp+sp+ckpt,tp+compiled,fsdp2+tp] [--backend inductor]
                                     [--steps 20] [--out docs/bench/distributed]

Each (world, wrap) job runs `world` ranks on loopback (gloo). Every rank builds one copy of a
transformer per mode, wrapped the same way, and runs their steps in turn (the order rotating
each step), so that the modes share the machine's state and their ratios do not move with
it. A step is forward, backward and the optimizer's step, timed on rank 0 between barriers.
The compiled modes warm up (capture, compile, and for ours the background compile waited
for) before the timed steps; their first step's time is reported on its own.

torch's built-in compiled autograd runs DDP with `optimize_ddp="python_reducer"`, the mode
torch documents for it (its graph cannot call the C++ reducer's hooks); a mode that raises is
reported with its error and left out of the later steps on every rank.

Writes OUT/results.json, OUT/results.md and OUT/step_time.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("eager", "ours", "torch-ca")
WRONG_GRADS = 1e-2  # a mode's grads further from eager's than this (relative) are wrong, not rounding


TP_WRAPS = (
    "tp",
    "tp+sp",
    "tp+sp+ckpt",
    "tp+compiled",
    "fsdp2+tp",
)  # (+ckpt: each block activation-checkpointed; +compiled: each block torch.compile'd)


def _model(wrap="ddp"):
    import torch

    from examples.distributed import Model, TPModel  # (the torchrun example's models, larger)

    torch.manual_seed(0)
    if wrap in TP_WRAPS:
        return TPModel(d=128, heads=4, layers=4, ff=256, vocab=64)
    return Model(d=128, heads=4, layers=4, ff=256)


def _tp_mesh(wrap):
    """(the mesh FSDP2 shards, or None; the TP mesh): every rank on TP, or (world/2, 2) for fsdp2+tp."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if wrap == "fsdp2+tp":
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        return mesh["dp"], mesh["tp"]
    return None, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))


def _wrap(model, wrap, mode):
    import torch

    if wrap in TP_WRAPS:
        from examples.distributed import parallelize

        dp, tp = _tp_mesh(wrap)
        parallelize(model, tp, sequence_parallel=wrap.startswith("tp+sp"))
        if wrap.endswith("+ckpt"):
            import functools

            from torch.utils.checkpoint import checkpoint

            for block in model.blocks:
                block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
        if wrap.endswith("+compiled"):  # (the forward compiled by inductor in every mode: only the backward differs)
            for block in model.blocks:
                block.compile()
        if dp is not None:
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:
                fully_shard(block, mesh=dp)
            fully_shard(model, mesh=dp)
        return model
    if wrap == "ddp":
        import torch._dynamo
        from torch.nn.parallel import DistributedDataParallel as DDP

        # (read when DDP is built: only torch's compiled autograd needs the Python reducer)
        torch._dynamo.config.optimize_ddp = "python_reducer" if mode == "torch-ca" else "ddp_optimizer"
        return DDP(model, bucket_cap_mb=1)
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def _contexts(backend):
    import torch

    import contextlib

    import compiled_autograd as ca
    from torch._dynamo import compiled_autograd as tca

    compiler = torch.compile(backend=backend)
    return {"eager": contextlib.nullcontext, "ours": lambda: ca.enable(backend), "torch-ca": lambda: tca._enable(compiler)}


def _rank(rank, world, port, job, out_dir):
    import torch

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), COMPILED_AUTOGRAD_DISK_CACHE="0")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(out_dir, f"inductor{rank}"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    import compiled_autograd as ca
    from compiled_autograd import native

    native.load()
    contexts = _contexts(job["backend"])
    models = {m: _wrap(_model(job["wrap"]), job["wrap"], m) for m in job["modes"]}
    tp_size = 2 if job["wrap"] == "fsdp2+tp" else world
    opts = {m: torch.optim.AdamW(models[m].parameters(), lr=1e-3) for m in models}
    times = {m: [] for m in models}
    errors = {}
    grad_diff = {m: 0.0 for m in models}  # the largest difference from eager's grads, relative to their largest
    grads: dict = {}

    def full(g):
        # (a collective for a DTensor: every rank runs the modes in the same order)
        return None if g is None else (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().float().clone()

    def batch(i):
        if job["wrap"] not in TP_WRAPS:
            torch.manual_seed(1000 * i + rank)
            return torch.randn(16, 32, 128), torch.randint(0, 8, (16,))
        torch.manual_seed(1000 * i + rank // tp_size)  # (one batch per TP group)
        x, y = torch.randn(16, 32, 128), torch.randint(0, 64, (16, 32))
        if job["wrap"].startswith("tp+sp"):  # (this rank's slice of the sequence)
            x = x.chunk(tp_size, dim=1)[rank % tp_size]
        return x, y

    def step(mode, i):
        x, y = batch(i)
        dist.barrier()
        t0 = time.perf_counter()
        out = models[mode](x)
        loss = torch.nn.functional.cross_entropy(out.flatten(0, 1) if out.dim() == 3 else out, y.flatten() if y.dim() == 2 else y)
        with contexts[mode]():
            loss.backward()
        opts[mode].step()
        t = time.perf_counter() - t0
        grads[mode] = [full(p.grad) for p in models[mode].parameters()]  # (the optimizer leaves them)
        opts[mode].zero_grad()
        return t

    def compare_grads():
        # each mode's grads against eager's of the same step: a mode whose gradients are wrong
        # is reported as such, not as a speed-up
        want = grads.pop("eager", None)
        for mode, got in grads.items():
            if want is None:
                continue
            scale = max((float(a.abs().max()) for a in want if a is not None), default=0.0) or 1.0
            for a, b in zip(want, got):
                if (a is None) != (b is None) or (a is not None and a.shape != b.shape):
                    grad_diff[mode] = float("inf")
                elif a is not None:
                    grad_diff[mode] = max(grad_diff[mode], float((a - b).abs().max()) / scale)
        grads.clear()

    try:
        order = list(models)
        for i in range(job["warmup"] + job["steps"]):
            for mode in order[i % len(order) :] + order[: i % len(order)]:
                if mode in errors:
                    continue
                try:
                    times[mode].append(step(mode, i))
                except Exception as e:  # noqa: BLE001 - reported, and the mode left out
                    errors[mode] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                    if rank == 0:
                        traceback.print_exc()
                if mode == "ours" and i == job["warmup"] - 1:
                    ca.synchronize()
            compare_grads()
        s = ca.stats()
        stats = dict(
            captures=s.captures,
            hits=s.hits,
            eager_fallbacks=s.eager_fallbacks,
            learning=s.learning_backwards,
            eager_while_compiling=getattr(s, "eager_while_compiling", 0),
            opaque=dict(s.opaque_reasons),
        )
        torch.save(dict(times=times, errors=errors, stats=stats, grad_diff=grad_diff), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        import gc

        models = opts = None  # (the process group freed while Python is whole: tests/test_distributed.py)
        ca.reset()
        gc.collect()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(job, world, timeout=1800):
    import torch

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_rank, args=(world, _free_port(), job, out_dir), nprocs=world, join=False, start_method="spawn")
        t0 = time.monotonic()
        try:
            while not ctx.join(timeout=5):
                if time.monotonic() - t0 > timeout:
                    raise TimeoutError(f"{job} on {world} ranks did not finish in {timeout} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        return torch.load(os.path.join(out_dir, "rank0.pt"), weights_only=False)


def summarize(result, job):
    rows = {}
    warm = job["warmup"]
    for mode in job["modes"]:
        t = result["times"].get(mode, [])
        if mode in result["errors"] or len(t) <= warm:
            rows[mode] = dict(error=result["errors"].get(mode, "no timed steps"))
            continue
        rows[mode] = dict(first_s=t[0], median_s=statistics.median(t[warm:]), min_s=min(t[warm:]), steps=len(t) - warm)
        rows[mode]["grad_diff"] = result.get("grad_diff", {}).get(mode)
    base = rows["eager"].get("median_s")
    for mode, r in rows.items():
        if base and "median_s" in r:
            r["vs_eager"] = r["median_s"] / base
    if (
        "median_s" in rows.get("ours", {})
        and "median_s" in rows.get("torch-ca", {})
        and (rows["torch-ca"].get("grad_diff") or 0.0) <= WRONG_GRADS
    ):  # (no ratio to a wrong result)
        rows["ours"]["vs_torch_ca"] = rows["ours"]["median_s"] / rows["torch-ca"]["median_s"]
    return rows


def _diff(rows, mode) -> str:
    d = rows.get(mode, {}).get("grad_diff")
    return "-" if d is None else ("equal" if d == 0 else f"{d:.1g}")


def write_report(out: Path, results: dict, meta: dict):
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    lines = [
        "# Distributed step time",
        "",
        f"{meta['date']}, commit {meta['commit']}, torch {meta['torch']}, {meta['cpus']} CPUs ({meta['cpu']}), gloo on "
        f"loopback, backend {meta['backend']}. Command: `{meta['command']}`.",
        "",
        "DDP, FSDP2: a transformer (4 encoder layers, d=128, batch 16x32) per rank; TP, TP with sequence",
        "parallelism (tp+sp), FSDP2 + TP on a (world/2, 2) mesh: examples/distributed.py's TPModel (4",
        "pre-norm blocks, d=128, a 64-word head), one batch per TP group. A step is forward, backward and",
        "AdamW's step, timed on rank 0 between barriers; the modes' steps alternate in one set of",
        f"processes. Median of {meta['steps']} steps after {meta['warmup']} warm-up steps (capture and compile).",
        "Every step, each mode's gradients (gathered in full) are compared with eager's of the same",
        f"step; a mode whose grads are off by more than {WRONG_GRADS:g} of their largest is marked as wrong.",
        "",
        "| job | ranks | eager step | ours | ours / eager | torch built-in | built-in / eager | ours / built-in | ours' first step "
        "| ours: captures, hits, fallbacks, opaque | grads vs eager: ours; built-in |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, r in results.items():
        wrap, world = key.split("@")
        rows, st = r["rows"], r["stats"]

        def cell(mode, field="median_s", scale=1e3, fmt="{:.1f} ms"):
            m = rows.get(mode, {})
            if "error" in m:
                return "fails: " + m["error"].replace("|", "/")[:80]
            text = fmt.format(m[field] * scale) if field in m else "-"
            diff = m.get("grad_diff")
            if field == "median_s" and diff is not None and diff > WRONG_GRADS:
                text += f" (**wrong grads**: {diff:.2g} of their largest off)"
            return text

        lines.append(
            f"| {wrap} | {world} | {cell('eager')} | {cell('ours')} | {cell('ours', 'vs_eager', 1, '{:.2f}x')} | "
            f"{cell('torch-ca')} | {cell('torch-ca', 'vs_eager', 1, '{:.2f}x')} | {cell('ours', 'vs_torch_ca', 1, '{:.2f}x')} | "
            f"{cell('ours', 'first_s', 1, '{:.1f} s')} | {st['captures']}, {st['hits']}, {st['eager_fallbacks']}, "
            f"{sum(st['opaque'].values())} | {_diff(rows, 'ours')}; {_diff(rows, 'torch-ca')} |"
        )
    (out / "results.md").write_text("\n".join(lines) + "\n")
    _plot(out / "step_time.png", results)


def _plot(path: Path, results: dict):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    keys = list(results)
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(keys), 3.6))
    width = 0.8 / len(MODES)
    for j, mode in enumerate(MODES):
        rows = [results[k]["rows"].get(mode, {}) for k in keys]
        xs = [i + j * width for i in range(len(keys))]
        bars = ax.bar(xs, [r.get("vs_eager", 0) for r in rows], width, label=mode)
        for bar, r in zip(bars, rows):
            if (r.get("grad_diff") or 0.0) > WRONG_GRADS:  # (a wrong result is no speed)
                bar.set_hatch("//")
                bar.set_alpha(0.5)
                ax.annotate(
                    "wrong\ngrads", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=7, color="red"
                )
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks([i + width for i in range(len(keys))], [k.replace("@", "\n") + " ranks" for k in keys])
    ax.set_ylabel("step time / eager (lower is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--wraps", default="ddp,fsdp2")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "docs" / "bench" / "distributed"))
    p.add_argument("--append", action="store_true", help="keep the jobs of OUT/results.json this run does not redo")
    p.add_argument("--report-only", action="store_true", help="re-render OUT/results.md and the plot from OUT/results.json")
    args = p.parse_args(argv)
    if args.report_only:  # (needs no torch: a Python with matplotlib will do)
        stored = json.loads((Path(args.out) / "results.json").read_text())
        write_report(Path(args.out), stored["results"], stored["meta"])
        return
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    cpu = next(
        (line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
        platform.processor(),
    )
    meta = dict(
        date=datetime.date.today().isoformat(),
        commit=commit,
        torch=torch.__version__,
        cpus=os.cpu_count(),
        cpu=cpu,
        backend=args.backend,
        steps=args.steps,
        warmup=args.warmup,
        command="python -m benchmarks.distributed " + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
    )
    results = {}
    if args.append and (Path(args.out) / "results.json").exists():
        results = json.loads((Path(args.out) / "results.json").read_text())["results"]
    for world in (int(w) for w in args.worlds.split(",")):
        for wrap in args.wraps.split(","):
            job = dict(wrap=wrap, backend=args.backend, modes=args.modes.split(","), steps=args.steps, warmup=args.warmup)
            t0 = time.monotonic()
            r = run_job(job, world)
            results[f"{wrap}@{world}"] = dict(rows=summarize(r, job), stats=r["stats"])
            print(f"{wrap} on {world} ranks ({time.monotonic() - t0:.0f} s):", json.dumps(results[f"{wrap}@{world}"]), flush=True)
            write_report(Path(args.out), results, meta)


if __name__ == "__main__":
    main()
