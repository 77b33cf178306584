"""Check one torch release the same way as every other: the whole suite and the conformance sample.

    python -m tools.check_release 2.15.0 [--venv DIR] [--skip-tests] [--skip-conformance] [--no-write]

1. makes (or reuses) the virtualenv `.venv-torch-VERSION` in the repository with that torch from
   the package registry, as pip resolves it (on a CPU machine, the CUDA build runs on the CPU),
   then this package, editable, with its test extras: the library installed beside that torch;
2. runs the whole test suite, `python -m pytest -q -p no:cacheprovider tests`, with
   COMPILED_AUTOGRAD_UNTESTED_TORCH=1 (a release not yet in `releases.WRITTEN_FOR` is checked
   before it is added; on one in it, the variable changes nothing);
3. runs the conformance sample, `python -m tools.conformance` with `SAMPLE_ARGS` (eager backend,
   the first sample of every 4th op and module, float32), written to a temporary directory;
4. writes one row into the matrix of docs/torch-versions.md (a row for the same torch version
   is replaced): date, commit, torch, tests passed/failed/skipped, conformance sample.

Exits 0 when the suite and the sample pass. Pip on some machines is capped below the newest
torch (docs/torch-versions.md says how to get past it).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "torch-versions.md"
MATRIX_START = "<!-- matrix: tools/check_release.py writes the rows below -->"
MATRIX_END = "<!-- end of matrix -->"
HEADER = "| date | commit | torch | tests passed | failed | skipped | conformance sample |\n|---|---|---|---|---|---|---|"
SAMPLE_ARGS = ["--backend", "eager", "--sample", "1", "--every", "4", "--dtypes", "float32", "--quiet"]
TEST_EXTRAS = ["pytest", "expecttest", "numpy", "ninja"]


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], cwd=ROOT, **kw)


def ensure_venv(version: str, venv: Path) -> Path:
    """The venv's python, with torch==version and this package (editable) installed."""
    python = venv / "bin" / "python"
    if not python.exists():
        _run([sys.executable, "-m", "venv", venv], check=True)
    have = subprocess.run(
        [python, "-c", "import torch, compiled_autograd, pytest, expecttest, ninja; print(torch.__version__, compiled_autograd.__file__)"],
        capture_output=True,
        text=True,
        cwd=tempfile.gettempdir(),
    )
    if have.returncode == 0:
        torch_version, package = have.stdout.split()
        if torch_version.split("+")[0] == version and Path(package).is_relative_to(ROOT / "src"):
            return python
    pip = [python, "-m", "pip", "install", "-q"]
    r = _run(pip + [f"torch=={version}"] + TEST_EXTRAS)
    if r.returncode != 0:
        sys.exit(
            f"pip could not install torch=={version} into {venv}; where pip is capped below it "
            "(a constraint such as 'torch<=2.14.1'), see docs/torch-versions.md"
        )
    # the package, editable, beside that torch (its torch range must admit it: pip installs no other)
    _run(pip + ["-e", f"{ROOT}[test]"], check=True)
    got = subprocess.run(
        [python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True, check=True
    ).stdout.strip()
    if got.split("+")[0] != version:
        sys.exit(f"{venv} has torch {got} after installing the package, not {version}")
    return python


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    # (the matrix itself, which each check writes, does not make the commit dirty)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", f":!{DOC.relative_to(ROOT)}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return (head or "unknown") + ("+dirty" if dirty else "")


def run_tests(python: Path, env: dict) -> dict:
    """The suite's counts from pytest's summary line."""
    # build the native helper once, outside pytest's output capture (as scripts/test.sh does)
    _run([python, "-c", "from compiled_autograd import native; native.load()"], env=env)
    r = _run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], env=env, capture_output=True, text=True)
    out = r.stdout + r.stderr
    sys.stdout.write(out[-6000:])
    counts = parse_pytest(out)
    counts["ok"] = r.returncode == 0
    return counts


def parse_pytest(out: str) -> dict:
    """passed/failed/skipped/errors from pytest's last summary line, and the failed tests' ids."""
    summary = next((line for line in reversed(out.splitlines()) if re.search(r"\d+ (passed|failed|error)", line)), "")
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", summary)}
    counts["errors"] = counts.pop("error", 0) + counts.pop("errors", 0)
    counts["failed_names"] = re.findall(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    return counts


def run_conformance(python: Path, env: dict) -> tuple[str, bool]:
    with tempfile.TemporaryDirectory() as out:
        r = _run(
            [python, "-m", "tools.conformance", *SAMPLE_ARGS, "--out", out, "--stem", "sample"], env=env, capture_output=True, text=True
        )
        sys.stdout.write((r.stdout + r.stderr)[-3000:])
        if r.returncode != 0:
            return f"did not finish (exit {r.returncode})", False
        totals = {}
        for line in r.stdout.splitlines():
            m = re.match(r"(op|module)s: (\{.*\})$", line)
            if m:
                totals[m.group(1)] = json.loads(m.group(2))
    bugs = sum(t["wrong"] + t["error"] for t in totals.values())
    parts = [f"{t['run']} {kind}s: {t['compiled_pct']}% compiled, {t['wrong']} wrong, {t['error']} error" for kind, t in totals.items()]
    return "; ".join(parts) or "no cases", bool(totals) and bugs == 0


def write_row(row: str, version: str, doc: Path = DOC) -> None:
    """Put `row` into the matrix of `doc`, in place of a row of the same torch version; the
    rows sorted newest release first."""
    text = doc.read_text()
    if MATRIX_START not in text:
        raise SystemExit(f"{doc} has no matrix ({MATRIX_START!r})")
    head, rest = text.split(MATRIX_START, 1)
    body, tail = rest.split(MATRIX_END, 1)
    rows = [line for line in body.strip().splitlines()[2:] if line.startswith("|")]
    rows = [r for r in rows if r.split("|")[3].strip() != version]
    rows.append(row)
    rows.sort(key=lambda r: [int(x) for x in re.findall(r"\d+", r.split("|")[3])], reverse=True)
    doc.write_text(head + MATRIX_START + "\n" + HEADER + "\n" + "\n".join(rows) + "\n" + MATRIX_END + tail)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.check_release", description=__doc__.split("\n\n")[0])
    p.add_argument("version", help="a torch release on the package registry, e.g. 2.15.0")
    p.add_argument("--venv", default=None, help="the virtualenv to make or reuse (default .venv-torch-VERSION)")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--skip-conformance", action="store_true")
    p.add_argument("--no-write", action="store_true", help="print the row, leave docs/torch-versions.md alone")
    a = p.parse_args(argv)
    if not re.fullmatch(r"\d+\.\d+\.\d+", a.version):
        p.error("VERSION is a full release, e.g. 2.15.0")

    venv = Path(a.venv) if a.venv else ROOT / f".venv-torch-{a.version}"
    python = ensure_venv(a.version, venv.absolute())
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["COMPILED_AUTOGRAD_UNTESTED_TORCH"] = "1"
    at = commit()  # before the run: what was checked

    ok = True
    passed = failed = skipped = "-"
    if not a.skip_tests:
        t = run_tests(python, env)
        passed, skipped = t.get("passed", 0), t.get("skipped", 0)
        failed = t.get("failed", 0) + t["errors"]
        ok = ok and t["ok"]
        for name in t["failed_names"]:
            print("failed:", name)
    sample = "-"
    if not a.skip_conformance:
        sample, sample_ok = run_conformance(python, env)
        ok = ok and sample_ok
    row = f"| {datetime.date.today().isoformat()} | {at} | {a.version} | {passed} | {failed} | {skipped} | {sample} |"
    print(row)
    if not a.no_write:
        write_row(row, a.version)
        print(f"wrote the row into {DOC.relative_to(ROOT)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
