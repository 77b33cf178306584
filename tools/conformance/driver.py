"""A whole run: `run(...)` selects the ops and modules, runs their cases and returns the
`Report`."""

from __future__ import annotations

import contextlib
import gc
import os
import time
import warnings
from collections import Counter
from typing import Callable, Sequence

import torch

from .report import BUG_STATUSES, Report
from .tables import op_full_name, run_module, run_op, select_modules, select_ops

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def run(
    backend: str = "eager",
    *,
    ops: bool = True,
    modules: bool = True,
    filter: str | None = None,
    sample: int | None = None,
    every: int = 1,
    dtypes: Sequence[str] = ("float32", "float64"),
    module_dtypes: Sequence[str] | None = None,
    op_names: Sequence[str] | None = None,
    module_names: Sequence[str] | None = None,
    modes: Sequence[str] = ("backward", "grad_subset"),
    disk_cache: bool = False,
    empty: bool = False,
    progress: Callable[[str], None] | None = None,
    command: str = "",
) -> Report:
    """Run the conformance cases and return the report (see the module docstring)."""
    t0 = time.perf_counter()
    from compiled_autograd import native

    native.load()  # fail fast (not once per case) when the helper cannot be built
    report = Report(
        backend=backend,
        command=command,
        options=dict(
            ops=ops,
            modules=modules,
            filter=filter,
            sample=sample,
            every=every,
            dtypes=list(dtypes),
            module_dtypes=list(module_dtypes or dtypes),
            modes=list(modes),
            disk_cache=disk_cache,
            empty=empty,
            native_build=native._build_name(),
            core=_core_version(),
        ),
    )
    with _scratch_graph_dir(disk_cache):
        op_dt = [DTYPES[d] for d in dtypes]
        mod_dt = [DTYPES[d] for d in (module_dtypes or dtypes)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if ops:
                sel = select_ops(filter, every, op_names)
                for k, op in enumerate(sel):
                    t = time.perf_counter()
                    rs = run_op(op, backend=backend, dtypes=op_dt, sample_limit=sample, modes=modes, disk_cache=disk_cache, empty=empty)
                    report.cases.extend(rs)
                    if progress:
                        progress(_progress_line("op", k, len(sel), op_full_name(op), rs, time.perf_counter() - t))
                    if k % 50 == 49:  # a full collection costs ~0.2 s with op_db loaded
                        gc.collect()
            if modules and not empty:  # (ModuleInfo has no such samples to pick)
                sel = select_modules(filter, every, module_names)
                for k, info in enumerate(sel):
                    t = time.perf_counter()
                    rs = run_module(info, backend=backend, dtypes=mod_dt, sample_limit=sample, modes=modes, disk_cache=disk_cache)
                    report.cases.extend(rs)
                    if progress:
                        progress(_progress_line("module", k, len(sel), info.name, rs, time.perf_counter() - t))
                    if k % 10 == 9:
                        gc.collect()
    report.seconds = time.perf_counter() - t0
    return report


@contextlib.contextmanager
def _scratch_graph_dir(disk_cache: bool):
    """With the disk cache on and no graph directory set, a temporary one, removed after."""
    if not disk_cache or os.environ.get("COMPILED_AUTOGRAD_GRAPH_DIR"):
        yield
        return
    import shutil
    import tempfile

    tmp = tempfile.mkdtemp(prefix="ca_conformance_graphs_")
    os.environ["COMPILED_AUTOGRAD_GRAPH_DIR"] = tmp
    try:
        yield
    finally:
        os.environ.pop("COMPILED_AUTOGRAD_GRAPH_DIR", None)
        shutil.rmtree(tmp, ignore_errors=True)


def _core_version() -> str:
    """The commit of the compiled_autograd checkout under test (`+dirty` with local changes)."""
    env = os.environ.get("COMPILED_AUTOGRAD_COMMIT")
    if env:
        return env
    import subprocess

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tools/, as before the package
    try:
        commit = subprocess.run(
            ["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "--untracked-files=no", "--", "."], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        return commit + ("+dirty" if dirty else "")
    except Exception:
        return "unknown"


def _progress_line(kind, k, n, name, rs, secs) -> str:
    c = Counter(r.counted_status for r in rs)
    bugs = [r for r in rs if r.status in BUG_STATUSES]
    s = f"[{kind} {k + 1}/{n}] {name}: " + " ".join(f"{st}={c[st]}" for st in sorted(c)) + f" ({secs:.1f}s)"
    for b in bugs[:3]:
        s += f"\n    {b.status.upper()}: {b.case_id}: {b.reason[:200]}"
    return s
