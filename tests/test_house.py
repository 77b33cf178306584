"""The walls of the house: the package's imports against the drawing in docs/design/house.json.

The drawing names the parts of the package (folders and modules), the arrows between them (who
may import whom: the pipeline from walk/ down to replay/, with the call protocol, the node
families and the values underneath and observe/ beside) and what must never be. An import
between two parts must follow the drawn arrows (straight, or through parts in between); no two
folders import each other; no module imports a private name of another folder (a name another
folder needs is public, and lives where both can see it). Like a line budget (which it keeps
too: modules, functions, C++ classes), this fails the suite where a change breaks a wall, naming
the import.
"""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "compiled_autograd"
SRC = ROOT / "src"
BOARD = ROOT / "docs" / "design" / "house.json"


def _module_of(path: Path) -> str:
    """compiled_autograd.x.y for src/compiled_autograd/x/y.py (a package: its __init__'s name)."""
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def folder(module: str) -> str:
    """The folder (or top-level module) of the package a module belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(module: str, source: str, is_package: bool = False):
    """(line, imported module, name or None) per import of the package in `source`, at any
    depth (an import inside a function is a wall crossed too)."""
    out = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.ImportFrom):
            if n.level:
                base = module.split(".")
                base = base[: len(base) - n.level + (1 if is_package else 0)]
                mod = ".".join(base + ([n.module] if n.module else []))
            else:
                mod = n.module or ""
            if mod != PACKAGE and not mod.startswith(PACKAGE + "."):
                continue
            for a in n.names:
                out.append((n.lineno, mod, a.name))
        elif isinstance(n, ast.Import):
            for a in n.names:
                if a.name.startswith(PACKAGE + "."):
                    out.append((n.lineno, a.name, None))
    return out


def _target(mod: str, name: str | None, modules: set) -> str:
    """The module an import reaches: `from pkg import sub` reaches pkg.sub where that is a module."""
    if name is not None and f"{mod}.{name}" in modules:
        return f"{mod}.{name}"
    return mod


class Board:
    """The drawing: each module's part, the arrows, the nevers."""

    def __init__(self, board: dict):
        self.parts = {name: [p.rstrip("/") for p in part["is"]] for name, part in board["parts"].items()}
        self.arrows: dict = {name: set() for name in self.parts}
        for a, b, *_ in board.get("arrows", ()):
            self.arrows[a].add(b)
        self.never = {(a, b): why for a, b, why in board.get("never", ())}

    def part_of(self, path: str) -> str | None:
        """The part a file is on: the longest path of a part that holds it."""
        best, length = None, -1
        for name, paths in self.parts.items():
            for p in paths:
                if (path == p or path.startswith(p + "/")) and len(p) > length:
                    best, length = name, len(p)
        return best

    def reaches(self, a: str, b: str) -> bool:
        """Whether the drawn arrows lead from part a to part b."""
        seen, todo = {a}, [a]
        while todo:
            for nxt in self.arrows[todo.pop()]:
                if nxt == b:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return False


def violations(sources: dict, board: Board) -> list[str]:
    """What breaks a wall, one line each. `sources`: path from the project's root -> code."""
    modules = {}
    for path in sources:
        p = ROOT / path
        modules[_module_of(p)] = path
    edges: dict = {}
    out = []
    for path, source in sorted(sources.items()):
        me = _module_of(ROOT / path)
        mine = board.part_of(path)
        for line, mod, name in imports(me, source, path.endswith("__init__.py")):
            target = _target(mod, name, set(modules))
            where = f"{path}:{line} imports {target}" + (f".{name}" if target == mod and name else "")
            a, b = folder(me), folder(target)
            if a != b:
                edges.setdefault((a, b), where)
                if name is not None and name.startswith("_") and not name.startswith("__"):
                    out.append(f"private name across folders: {where}")
            theirs = board.part_of(modules[target]) if target in modules else None
            if mine is None or theirs is None or mine == theirs:
                continue
            if (mine, theirs) in board.never:
                out.append(f"never {mine} -> {theirs} ({board.never[(mine, theirs)]}): {where}")
            elif not board.reaches(mine, theirs):
                out.append(f"against the drawn direction ({mine} -> {theirs} is not drawn): {where}")
    for (a, b), where in sorted(edges.items()):
        if (b, a) in edges and a < b:
            out.append(f"folders {a} and {b} import each other: {where}; {edges[(b, a)]}")
    return out


def _package_sources() -> dict:
    out = {}
    for p in sorted((SRC / PACKAGE).rglob("*.py")):
        out[os.path.relpath(p, ROOT)] = p.read_text()
    return out


def _board() -> Board:
    return Board(json.loads(BOARD.read_text()))


def test_every_module_is_on_a_part_of_the_drawing():
    board = _board()
    assert [p for p in _package_sources() if board.part_of(p) is None] == []


def test_imports_follow_the_drawn_house():
    assert violations(_package_sources(), _board()) == []


def test_the_drawing_has_one_direction():
    """The drawn arrows never lead back to where they started."""
    board = _board()
    assert [a for a in board.parts if board.reaches(a, a)] == []


def test_a_wall_broken_is_caught():
    """The check itself: an import against the drawn direction, a private name across folders,
    two folders importing each other and a never are each reported."""
    board = Board(
        {
            "parts": {
                "Top": {"is": ["src/compiled_autograd/top/"]},
                "Low": {"is": ["src/compiled_autograd/low/"]},
                "Side": {"is": ["src/compiled_autograd/side.py"]},
            },
            "arrows": [["Top", "Low"], ["Top", "Side"]],
            "never": [["Side", "Top", "the side knows no top"]],
        }
    )
    sources = {
        "src/compiled_autograd/top/a.py": "from ..low.b import thing, _secret\n",
        "src/compiled_autograd/low/b.py": "def f():\n    from ..top import a\n",
        "src/compiled_autograd/side.py": "from .top.a import x\n",
    }
    found = violations(sources, board)
    assert any(v.startswith("private name across folders: src/compiled_autograd/top/a.py:1") for v in found), found
    assert any(v.startswith("against the drawn direction (Low -> Top") for v in found), found
    assert any(v.startswith("folders low and top import each other") for v in found), found
    assert any(v.startswith("never Side -> Top") for v in found), found
    assert violations({"src/compiled_autograd/top/a.py": "from ..low.b import thing\n"}, board) == []


MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_CLASS_LINES = 600, 100, 400


def _cpp_classes(source: str):
    """(name, lines) of each C++ class or struct defined at the start of a line."""
    for m in re.finditer(r"^(?:class|struct)\s+(\w+)[^;{]*\{", source, re.M):
        i, depth = m.end(), 1
        while depth and i < len(source):
            depth += {"{": 1, "}": -1}.get(source[i], 0)
            i += 1
        yield m.group(1), source[m.start() : i].count("\n") + 1


_NOT_DEFINITIONS = {"if", "for", "while", "switch", "return", "else", "catch", "do", "sizeof", "case", "new", "delete", "throw"}


def _cpp_functions(source: str):
    """(name, lines) of each C++ function or method defined (a return type, a name, its
    parameters, then its body), at any indentation: inside a class too."""
    for m in re.finditer(r"^[ \t]*((?:[\w:<>,*&~]+[ \t]+)*?)([\w:~]+)[ \t]*\(", source, re.M):
        name = m.group(2)
        if name.split("::")[-1] in _NOT_DEFINITIONS or (not m.group(1).strip() and "::" not in name and name != "PYBIND11_MODULE"):
            continue  # (a statement or a call: no return type)
        i, parens = m.end(), 1
        while i < len(source) and parens:
            parens += {"(": 1, ")": -1}.get(source[i], 0)
            i += 1
        while i < len(source) and source[i] not in "{;=":
            i += 1
        if i >= len(source) or source[i] != "{":
            continue  # (a declaration)
        depth, k = 0, i
        while k < len(source):
            depth += {"{": 1, "}": -1}.get(source[k], 0)
            k += 1
            if depth == 0:
                break
        yield name, source[m.start() : k].count("\n") + 1


def test_rooms_stay_small():
    """The limits the house keeps (a module read in one sitting): modules of at most 600 lines,
    functions of at most 100 (Python and C++), C++ classes of at most 400."""
    big = []
    for path, source in _package_sources().items():
        if source.count("\n") > MAX_MODULE_LINES:
            big.append(f"{path}: {source.count(chr(10))} lines")
        for f in ast.walk(ast.parse(source)):
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES:
                big.append(f"{path}:{f.lineno} {f.name}: {f.end_lineno - f.lineno + 1} lines")
    for p in sorted((SRC / PACKAGE / "native").glob("*.[ch]*")):
        for name, lines in _cpp_classes(p.read_text()):
            if lines > MAX_CLASS_LINES:
                big.append(f"{os.path.relpath(p, ROOT)}: class {name}: {lines} lines")
        for name, lines in _cpp_functions(p.read_text()):
            if lines > MAX_FUNCTION_LINES:
                big.append(f"{os.path.relpath(p, ROOT)}: function {name}: {lines} lines")
    assert big == []


def test_the_cpp_function_budget_sees_a_long_function():
    body = "\n".join(f"  x += {i};" for i in range(120))
    source = (
        f"static int long_one(int x) {{\n{body}\n  return x;\n}}\nstruct S {{\n  void short_one() {{\n    if (a) {{ b(); }}\n  }}\n}};\n"
    )
    found = dict(_cpp_functions(source))
    assert found["long_one"] > MAX_FUNCTION_LINES and found["short_one"] == 3 and "if" not in found
