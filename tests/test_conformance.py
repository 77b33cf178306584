"""Conformance with eager autograd over torch's OpInfo / ModuleInfo tables (CI-sized).

The full run is `python -m tools.conformance` (docs/conformance/). Here: every
autograd op and every module of the tables, float32, the first two sample inputs, with the
`eager` backend; a deterministic sample of ~20 ops with `aot_eager`; every 3rd op and module
through `create_graph=True` and a backward through it; and every 4th op through
the on-disk graph cache (about 1.5 min in all on 2 idle cores, 2.5 min on busy ones). Any
`wrong` (gradient differs from eager) or `error` (compiled_autograd raised where eager did
not) case fails the test, listing them; fallbacks, opaque nodes and recaptures are allowed
(they are reported in docs/conformance/, not bugs). Select these with `-k conformance`.
"""

import logging
import warnings

import pytest
import torch

from tools import conformance as conf

# first N sample inputs per op/module and dtype (the cheapest way to touch every entry)
SAMPLES = 2


@pytest.fixture(autouse=True)
def _bitwise(monkeypatch):
    # every case here runs the eager or aot_eager backend, which run eager's kernels in eager's
    # order: the grads must be bitwise eager's (rtol = atol = 0; NaN where eager has NaN)
    for dtype in (torch.float32, torch.float64):
        monkeypatch.setitem(conf.DEFAULT_TOL, dtype, (0.0, 0.0))


def _check(report, min_cases=1):
    """Every case compiled, opaque or fallen back, never wrong or an error: first-order grads
    bitwise eager's (the fixture above), second-order ones within their contract (NOTE [The
    contract of a second-order gradient], tools/conformance/tensors.py)."""
    bugs = report.bugs()
    if bugs:
        lines = [f"{c.status.upper()}: {c.case_id}: {c.reason}" for c in bugs]
        pytest.fail(f"{len(bugs)} conformance bug(s) ({report.backend}):\n" + "\n".join(lines), pytrace=False)
    ran = [c for c in report.cases if not c.status.startswith("skipped")]
    assert len(ran) >= min_cases, f"only {len(ran)} cases ran"
    compiled = [c for c in ran if c.status in ("compiled", "opaque")]
    assert compiled, "no case was compiled"


def _run(**kw):
    # torch's structured-trace logger logs every fake tensor at DEBUG; under pytest its records
    # reach the log capture and bury a failure's report in thousands of lines
    trace_log = logging.getLogger("torch.__trace")
    level = trace_log.level
    trace_log.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return conf.run(dtypes=("float32",), sample=SAMPLES, **kw)
    finally:
        trace_log.setLevel(level)


@pytest.mark.slow
def test_conformance_ops_eager():
    _check(_run(backend="eager", ops=True, modules=False), min_cases=500)


@pytest.mark.slow
def test_conformance_modules_eager():
    _check(_run(backend="eager", ops=False, modules=True), min_cases=100)


@pytest.mark.slow
def test_conformance_ops_aot_eager_sample():
    # ~20 ops spread over the table, deterministic
    n = len(conf.select_ops())
    _check(_run(backend="aot_eager", ops=True, modules=False, every=max(1, n // 20)), min_cases=20)


@pytest.mark.slow
def test_conformance_disk_cache_sample():
    # every 4th op, two samples each (samples of one op differ in sizes and constants): each
    # case also runs from a graph loaded from the on-disk cache (in a temporary directory),
    # which must give eager's grads
    _check(_run(backend="eager", ops=True, modules=False, every=4, modes=("backward",), disk_cache=True), min_cases=100)


@pytest.mark.slow
def test_conformance_empty_samples():
    # every sample of every op that holds a tensor with no elements (~300 in op_db), through a
    # backward and grad(create_graph=True): an empty grad is a tensor, never None (issue 36)
    _check(_run(backend="eager", ops=True, modules=False, empty=True, modes=("backward", "create_graph")), min_cases=200)


@pytest.mark.slow
def test_conformance_create_graph_sample():
    # every 3rd op and module (~half a minute): grad(create_graph=True) compiled, then a
    # backward through it, compiled too; first- and second-order grads and which first-order
    # grads require grad must be eager's
    _check(_run(backend="eager", ops=True, modules=True, every=3, modes=("create_graph",)), min_cases=150)


def test_conformance_report_renders():
    report = _run(backend="eager", ops=True, modules=True, op_names=["add", "cat"], module_names=["nn.Linear"])
    md = conf.to_markdown(report)
    js = conf.to_json(report)
    assert "## Totals" in md and js["totals"]["ops"]["cases"] > 0 and js["totals"]["modules"]["cases"] > 0
    statuses = {c["status"] for c in js["cases"]}
    assert statuses <= set(conf.STATUSES), statuses


def test_conformance_report_round_trips(tmp_path):
    # write() stores gzipped JSON; --render rebuilds the same Markdown from it
    report = _run(backend="eager", ops=True, modules=False, op_names=["mul"])
    jpath, mpath = conf.write(report, str(tmp_path), "r")
    assert jpath.endswith(".json.gz")
    assert conf.main(["--render", jpath, "--out", str(tmp_path / "again"), "--stem", "r"]) == 0
    assert (tmp_path / "again" / "r.md").read_text() == open(mpath).read()
