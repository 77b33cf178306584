"""The report model: one `CaseResult` per case, the `Report` of a run, the totals, and the
report as JSON (`to_json`, and `from_json` to re-render a stored run)."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Sequence

import torch

STATUSES = ("compiled", "opaque", "fallback", "wrong", "error", "skipped_eager_error", "skipped_no_grad")
BUG_STATUSES = ("wrong", "error")


@dataclass
class CaseResult:
    kind: str  # "op" or "module"
    name: str  # op full name (name.variant) or module name
    variant: str  # OpInfo variant_test_name / ModuleInput desc
    mode: str  # "backward" or "grad_subset"
    dtype: str
    sample: int
    status: str
    recaptured: bool = False
    reason: str = ""
    recapture_reason: str = ""
    stride_mismatch: str = ""
    second_values: str = ""  # how the second value set went ("ok", "skipped: ...")
    disk: str = ""  # --disk-cache: how the round trip through the on-disk cache went
    nodes: list[str] = field(default_factory=list)
    captures: int = 0
    hits: int = 0
    seconds: float = 0.0
    drift: float = 0.0  # create_graph: the largest second-order drift, in eps (NOTE [The contract of a second-order gradient])

    @property
    def counted_status(self) -> str:
        """The status the totals use: a recaptured `compiled` case is not compiled."""
        if self.status == "compiled" and self.recaptured:
            return "compiled_recaptured"
        return self.status

    @property
    def case_id(self) -> str:
        v = f"[{self.variant}]" if self.variant else ""
        return f"{self.kind}:{self.name}{v} {self.dtype} sample {self.sample} {self.mode}"


@dataclass
class Report:
    backend: str
    command: str
    cases: list[CaseResult] = field(default_factory=list)
    seconds: float = 0.0
    torch_version: str = torch.__version__
    options: dict = field(default_factory=dict)

    def of(self, kind: str) -> list[CaseResult]:
        return [c for c in self.cases if c.kind == kind]

    def bugs(self) -> list[CaseResult]:
        return [c for c in self.cases if c.status in BUG_STATUSES]


TOTAL_COLUMNS = ("compiled", "compiled_recaptured", "opaque", "fallback", "wrong", "error", "skipped_eager_error", "skipped_no_grad")


def totals(cases: Sequence[CaseResult]) -> dict:
    c = Counter(r.counted_status for r in cases)
    t = {k: c.get(k, 0) for k in TOTAL_COLUMNS}
    t["cases"] = len(cases)
    t["run"] = sum(v for k, v in t.items() if k in TOTAL_COLUMNS and not k.startswith("skipped"))
    t["compiled_pct"] = round(100.0 * t["compiled"] / t["run"], 2) if t["run"] else 0.0
    return t


_OPTIONAL_FIELDS = ("recapture_reason", "stride_mismatch", "captures", "hits", "disk", "drift")


def to_json(report: Report) -> dict:
    """The report as JSON. Each case's `nodes` are indices into the top-level `node_types`
    (the node types of the graphs that case captured); `recapture_reason`, `stride_mismatch`,
    `captures` and `hits` are left out when empty/0; `counted_status` (the status the totals
    use) is only there when it differs from `status`."""
    node_types = sorted({n for c in report.cases for n in c.nodes})
    index = {n: i for i, n in enumerate(node_types)}
    cases = []
    for c in report.cases:
        d = asdict(c)
        d["nodes"] = [index[n] for n in c.nodes]
        for k in _OPTIONAL_FIELDS:  # omitted when empty, to keep the file small
            if not d[k]:
                del d[k]
        if c.counted_status != c.status:
            d["counted_status"] = c.counted_status
        cases.append(d)
    return dict(
        backend=report.backend,
        command=report.command,
        torch_version=report.torch_version,
        seconds=round(report.seconds, 1),
        options=report.options,
        totals=dict(ops=totals(report.of("op")), modules=totals(report.of("module"))),
        node_types=node_types,
        cases=cases,
    )


def from_json(d: dict) -> Report:
    """The inverse of `to_json` (to re-render the Markdown of a stored run)."""
    names = d.get("node_types")
    fields = set(CaseResult.__dataclass_fields__)
    cases = []
    for c in d["cases"]:
        c = {k: v for k, v in c.items() if k in fields}
        if names is not None:
            c["nodes"] = [names[i] if isinstance(i, int) else i for i in c.get("nodes", [])]
        cases.append(CaseResult(**c))
    return Report(
        backend=d["backend"],
        command=d["command"],
        cases=cases,
        seconds=d.get("seconds", 0.0),
        torch_version=d.get("torch_version", ""),
        options=d.get("options", {}),
    )
