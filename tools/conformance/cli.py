"""Files and the command line: `write` (STEM.json.gz and STEM.md) and `main`
(`python -m tools.conformance`)."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import warnings
from typing import Sequence

import torch

from .driver import run
from .markdown import to_markdown
from .report import Report, from_json, to_json, totals


def write(report: Report, out_dir: str, stem: str | None = None) -> tuple[str, str]:
    stem = stem or ("conformance" if report.backend == "eager" else f"conformance_{report.backend}")
    os.makedirs(out_dir, exist_ok=True)
    jpath = os.path.join(out_dir, stem + ".json.gz")  # a full run is ~10 MB of JSON, 0.2 MB gzipped
    mpath = os.path.join(out_dir, stem + ".md")
    d = to_json(report)
    cases = d.pop("cases")
    with gzip.open(jpath, "wt") as f:  # one case per line: zgrep-able
        head = json.dumps(d, indent=1, default=str)
        f.write(head[:-2] + ',\n "cases": [\n')
        f.write(",\n".join(json.dumps(c, default=str, separators=(",", ":")) for c in cases))
        f.write("\n ]\n}\n")
    with open(mpath, "w") as f:  # from what the JSON holds (its rounded times): --render gives the same
        f.write(to_markdown(from_json(dict(d, cases=cases))))
    return jpath, mpath


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.conformance", description=sys.modules[__package__].__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="eager", choices=("eager", "aot_eager", "inductor"))
    g = p.add_mutually_exclusive_group()
    g.add_argument("--ops-only", action="store_true")
    g.add_argument("--modules-only", action="store_true")
    p.add_argument("--filter", default=None, help="only ops/modules whose name contains SUBSTR")
    p.add_argument("--sample", type=int, default=None, metavar="N", help="at most N sample inputs per op/module and dtype")
    p.add_argument("--every", type=int, default=1, metavar="K", help="only every K-th op/module (deterministic subset)")
    p.add_argument("--dtypes", default="float32,float64", help="comma-separated, of float32,float64")
    p.add_argument("--module-dtypes", default=None, help="dtypes for modules (default: --dtypes)")
    p.add_argument("--modes", default="backward,grad_subset")
    p.add_argument("--out", default="docs/conformance", help="directory for STEM.json.gz / STEM.md")
    p.add_argument("--stem", default=None, help="file name stem (default conformance[_BACKEND])")
    p.add_argument(
        "--disk-cache",
        action="store_true",
        help="also round-trip every case through the on-disk graph cache (in a temporary "
        "directory unless COMPILED_AUTOGRAD_GRAPH_DIR is set)",
    )
    p.add_argument(
        "--empty-samples",
        action="store_true",
        help="run every op sample that holds a tensor with no elements instead of the first N (ops only)",
    )
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--render", default=None, metavar="JSON", help="only re-render JSON (a stored run) into --out, without running anything")
    a = p.parse_args(argv)
    if a.render:
        with (gzip.open if a.render.endswith(".gz") else open)(a.render, "rt") as f:
            report = from_json(json.load(f))
        print("wrote %s and %s" % write(report, a.out, a.stem))
        return 0
    if a.threads:
        torch.set_num_threads(a.threads)
    args = list(sys.argv[1:] if argv is None else argv)
    command = "python -m tools.conformance" + "".join(f" {x}" for x in args)
    warnings.simplefilter("ignore")
    import logging

    logging.getLogger("compiled_autograd").setLevel(logging.ERROR)
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if not a.quiet else None
    report = run(
        a.backend,
        ops=not a.modules_only,
        modules=not a.ops_only,
        filter=a.filter,
        sample=a.sample,
        every=a.every,
        dtypes=[d for d in a.dtypes.split(",") if d],
        module_dtypes=[d for d in a.module_dtypes.split(",") if d] if a.module_dtypes else None,
        modes=[m for m in a.modes.split(",") if m],
        disk_cache=a.disk_cache,
        empty=a.empty_samples,
        progress=log,
        command=command,
    )
    jpath, mpath = write(report, a.out, a.stem)
    for kind in ("op", "module"):
        cs = report.of(kind)
        if cs:
            print(f"{kind}s: {json.dumps(totals(cs))}")
    for c in report.bugs():
        print(f"{c.status.upper()}: {c.case_id}: {c.reason}")
    print(f"wrote {jpath} and {mpath} in {report.seconds:.0f} s")
    return 0
