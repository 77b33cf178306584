"""Seeing what happened: why each capture exists and what fell back (api.py hands in the cached
entries: `ca.explain()`, `ca.dump(path)`)."""

from __future__ import annotations

import os
import re
import sys
from collections import Counter

from ..nodes import FAMILIES
from .captures import capture_log
from .stats import LOCK, STATS


class Report(str):
    """explain()'s text; echoed at a prompt as one line (explain() has printed it)."""

    def __repr__(self) -> str:
        return f"<compiled_autograd report: {self.count(chr(10)) + 1} lines, printed>"


def explain(entries: list, file=sys.stdout, compiles=(), judged=()) -> Report:
    """Print a readable report -- counters, one line per capture with its reason, why
    backwards ran in eager and nodes ran opaquely, the background compiles (`compiles`: lines
    compile/background.py's report() wrote), what timing landed graphs against eager found
    (`judged`), the cached graphs (`entries`) -- to `file` (None: print nothing), and return its text."""
    text = Report(_report(entries, compiles, judged))
    if file is not None:
        print(text, file=file)
    return text


# NOTE [explain() stays readable]
# Every list explain() prints is bounded, and so is every line: a dynamic graph of a two-layer
# GPT carries about 380 guards, once printed on one line of 17,196 characters. Long lists are
# summarised (a count, the first few) and point to dump(), which writes everything.
MAX_ITEMS = 10  # entries of one list shown (opaque nodes of a capture, details of a reason)
MAX_CAPTURES = 32  # capture lines shown: the newest; the rest are counted by reason
MAX_LINE = 240  # characters of one line
MAX_GUARDS = 2  # guards quoted of a dynamic graph's


def _report(entries: list, compiles=(), judged=()) -> str:
    with LOCK:
        s = STATS.snapshot()
    lines = [f"compiled_autograd: {s}"]
    log = capture_log()
    if len(log) > MAX_CAPTURES:
        older = Counter(c["reason"].split(":")[0] for c in log[: len(log) - MAX_CAPTURES])
        why = ", ".join(f"{r} x{n}" for r, n in older.most_common(MAX_ITEMS))
        lines.append(f"  {len(log) - MAX_CAPTURES} earlier captures not shown ({why})")
    first = max(0, len(log) - MAX_CAPTURES)
    for i, c in enumerate(log[first:], start=first):
        lines.append(
            f"  capture {i}: {c['nodes']} nodes, {c['inputs']} inputs, backend {c['backend']}: {c['reason']} "
            f"(trace {c['trace_seconds']:.2f}s, compile {c['compile_seconds']:.2f}s)"
        )
        if c.get("traced"):
            lines.append(f"    traced: {c['traced']}")
        opaque = list(c.get("opaque", ()))
        for name, why in opaque[:MAX_ITEMS]:
            lines.append(f"    opaque: {name}: {why}")
        if len(opaque) > MAX_ITEMS:
            lines.append(f"    opaque: ... {len(opaque) - MAX_ITEMS} more nodes (all of them: ca.dump(path))")
        if c.get("in_graph"):
            lines.append(f"    saved-tensor hooks: {c['in_graph']} tensors unpacked in the graph, each when its node runs (as in eager)")
        if c.get("unpacked"):
            lines.append(
                f"    saved-tensor hooks: {c['unpacked']} tensors ({c['unpacked_mb']:.1f} MB) unpacked when the backward "
                "started (eager unpacks each when its node runs; these hooks returned something other than a "
                "plain strided tensor, or other metadata than before, so these are alive together)"
            )
        if c.get("create_graph"):
            lines.append(f"    create_graph: {c['create_graph']}")
        if c.get("dynamic"):
            dyn = c["dynamic"]
            shown = ", ".join(dyn[:4]) + (f" ... ({len(dyn)} in all)" if len(dyn) > 4 else "")
            lines.append(f"    symbolic sizes: {shown}")
            lines.append(f"    guards: {summarise_guards(c.get('guards'))}")
    for kind, n in s.fallback_reasons.most_common():
        lines.append(f"  eager fallback x{n}: {kind}")
    for detail, n in s.fallback_details.most_common(MAX_ITEMS):
        lines.append(f"    x{n}: {detail}")
    for kind, n in s.opaque_reasons.most_common():
        lines.append(f"  opaque node runs x{n}: {kind}")
    for detail, n in s.opaque_details.most_common(MAX_ITEMS):
        lines.append(f"    x{n}: {detail}")
    lines.extend(f"  {line}" for line in compiles)
    if not compiles and s.compiles_pending:
        lines.append(f"  background compiles pending: {s.compiles_pending}")
    lines.extend(f"  {line}" for line in judged)
    lines.append(f"  cached graphs: {len(entries)}")
    return "\n".join(_clip(line) for line in lines)


def _clip(line: str) -> str:
    return line if len(line) <= MAX_LINE else line[: MAX_LINE - 24] + f" ... (+{len(line) - MAX_LINE + 24} chars)"


_SIZE_TERM = re.compile(r"L\['t\d+'\]\.(?:size\(\)\[\d+\]|stride\(\)\[\d+\]|storage_offset\(\))")


def summarise_guards(source: str | None) -> str:
    """A dynamic graph's guards in one short line: how many, over how many sizes, the first few;
    dump() writes them all (graph_<i>.txt)."""
    if not source:
        return "none"
    guards = [g.strip() for g in source.split(" and ") if g.strip()]
    sizes = list(dict.fromkeys(_SIZE_TERM.findall(source)))
    if len(guards) <= MAX_GUARDS and len(source) <= MAX_LINE - 20:
        return source
    quoted = "; ".join(g if len(g) <= 60 else g[:57] + "..." for g in guards[:MAX_GUARDS])
    return f"{len(guards)} over {len(sizes)} input sizes, first: {quoted}; all of them: ca.dump(path), graph_<i>.txt"


# -- dump ----------------------------------------------------------------------------


def dump(entries: list, path, script) -> list[str]:
    """Write every cached graph (`entries`) to `path`: a script that runs it (graph_<i>.py,
    `script(entry, file)`: NOTE [A graph you can run], compile/repro.py), how it was captured,
    with the graph's code and shapes (graph_<i>.txt), and a picture of the backward graph
    (graph_<i>.svg, plus .dot) with node kinds, opaque nodes and hooks marked. Returns the
    files written."""
    os.makedirs(path, exist_ok=True)
    written = []
    for i, e in enumerate(entries):
        base = os.path.join(path, f"graph_{i}")
        script(e, base + ".py")
        with open(base + ".txt", "w") as f:
            f.write(_describe_entry(e))
            f.write("\n" + e.graph.print_readable(print_output=False))
            if e.vjp is not None:
                f.write("\n# its vjp graph (create_graph=True: the backward of this graph's results)\n")
                f.write(e.vjp.graph.print_readable(print_output=False))
        dot = _dot(e)
        with open(base + ".dot", "w") as f:
            f.write(dot)
        with open(base + ".svg", "w") as f:
            f.write(_svg(e))
        written += [base + ext for ext in (".py", ".txt", ".dot", ".svg")]
    return written


def _describe_entry(e) -> str:
    lines = [
        f"reason: {e.reason}",
        f"backend: {e.backend}",
        f"inputs: {e.num_inputs}",
        f"trace {e.trace_seconds:.2f}s, compile {e.compile_seconds:.2f}s",
    ]
    if e.dynamic is not None:
        lines.append(f"symbolic size positions: {list(e.dynamic.symbolic)}")
        lines.append(f"guards: {e.dynamic.guard_source}")
    for kind, node, *_ in e.plan.slots:
        if kind == "unpack":
            lines.append(f"opaque call: unpack hook of hooked saved tensor #{node}")
        else:
            lines.append(f"opaque call: {kind} of node #{node} {e.node_names[node]}")
    return "\n".join(lines) + "\n"


def _label(n, i):
    """`n`: a NodeSummary."""
    marks = []
    if n.opaque_reason:
        marks.append(f"opaque: {n.opaque_reason[:40]}")
    names = ("tensor hooks", "retain_grad", "pre hooks", "post hooks", "post-acc hooks")
    marks += [m for m, c in zip(names, n.hooks) if c]
    return f"#{i} {n.name}" + (f" [{'; '.join(marks)}]" if marks else "")


def _color(n):
    if n.opaque_reason:
        return "#f4b183"
    if any(n.hooks):
        return "#ffe699"
    return FAMILIES[n.kind].color


def _dot(e) -> str:
    out = ["digraph backward {", "  rankdir=TB; node [shape=box, style=filled, fontname=monospace];"]
    for i, n in enumerate(e.nodes):
        out.append(f'  n{i} [label="{_label(n, i)}", fillcolor="{_color(n)}"];')
        for to, nr in n.edges:
            if to >= 0:
                out.append(f"  n{i} -> n{to} [label={nr}];")
    out.append("}")
    return "\n".join(out) + "\n"


def _svg(e) -> str:
    """A self-contained picture: nodes top to bottom in execution order, edges
    as curves on the side (no graphviz needed)."""
    from xml.sax.saxutils import escape

    h, w, gap = 22, 520, 8
    rows = len(e.nodes)
    height = rows * (h + gap) + 40
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w + 260}" height="{height}" font-family="monospace" font-size="11">',
        f'<text x="10" y="16">{escape(e.reason)} ({e.backend}, {rows} nodes)</text>',
    ]
    y = lambda i: 30 + i * (h + gap)
    for i, n in enumerate(e.nodes):
        out.append(f'<rect x="10" y="{y(i)}" width="{w}" height="{h}" fill="{_color(n)}" stroke="#555"/>')
        out.append(f'<text x="16" y="{y(i) + 15}">{escape(_label(n, i))}</text>')
        for to, nr in n.edges:
            if to > i:
                x0 = w + 10
                bend = x0 + 12 + min(220, 6 * (to - i))
                out.append(
                    f'<path d="M{x0},{y(i) + h / 2} C{bend},{y(i) + h / 2} {bend},{y(to) + h / 2} {x0},{y(to) + h / 2}" '
                    f'fill="none" stroke="#888"/>'
                )
    legend = [("#c5e0b4", "AccumulateGrad"), ("#bdd7ee", "custom Function"), ("#ffe699", "hooks"), ("#f4b183", "opaque")]
    for k, (c, t) in enumerate(legend):
        out.append(f'<rect x="{w + 40}" y="{30 + k * 18}" width="12" height="12" fill="{c}" stroke="#555"/>')
        out.append(f'<text x="{w + 58}" y="{40 + k * 18}">{t}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
