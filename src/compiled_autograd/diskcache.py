"""On-disk cache of captured graphs, so a new process skips tracing.

A captured static graph is stored under the hash of its key, which is the
same in every process of one torch build (node types are keyed by a hash of
their C++ type name, everything else by value). A later process that meets the
same key loads the graph and its plan instead of tracing; the compile itself
comes from the backend's own on-disk caches (inductor's FX graph cache).

Only what is safe to reuse across processes is stored: static graphs, with a
string backend, without custom Function nodes (their traced backward is user
code, which may have changed since). Dynamic graphs are re-traced.

NOTE [Private cache]
The directory is the user's (mode 0700) and every file carries an HMAC keyed
by a secret that only this user can read (mode 0600), written on first use.
A file that fails verification, was written by another torch or library
version, or does not unpickle is ignored: the graph is traced as usual. So
what the cache loads, it has written itself.

NOTE [Graphs stored as their nodes]
A GraphModule pickles as its Python code, and unpickles by tracing that code
again with fx's symbolic tracer, which runs every op that has no tensor
argument and keeps its result as a constant: a factory in a backward formula
(`zeros`, `full`, `_efficientzerotensor`) came back as one tensor, shared by
every call of the loaded graph (a ZeroTensor lost what it is, and a graph
returning it handed out that one tensor each time). So a graph is stored as
its nodes (op, name, target, arguments) and the tensors its get_attr nodes
read, ops by their qualified names, and rebuilt node for node: the loaded
graph is the traced one (`tests/test_diskcache.py` compares their code).
"""

from __future__ import annotations

import hashlib
import hmac
import io
import logging
import os
import pickle
import secrets
from pathlib import Path

import torch

from . import native

log = logging.getLogger("compiled_autograd")

FORMAT = 2


def _root() -> Path:
    override = os.environ.get("COMPILED_AUTOGRAD_GRAPH_DIR")
    root = Path(override) if override else native.cache_root() / "graphs"
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        os.chmod(root, 0o700)
    except OSError:  # pragma: no cover
        pass
    return root


def _secret() -> bytes:
    path = native.cache_root() / "secret"
    try:
        data = path.read_bytes()
        if len(data) >= 32:
            return data
    except FileNotFoundError:
        pass
    data = secrets.token_bytes(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return data


def _version() -> bytes:
    h = hashlib.sha256()
    h.update(torch.__version__.encode())
    h.update(native._SOURCE.read_bytes())
    # the code that writes a graph and its plan, and the code that reads and runs them
    for name in ("trace.py", "collect.py", "ops.py", "runtime.py", "backends.py"):
        h.update((Path(__file__).parent / name).read_bytes())
    h.update(str(FORMAT).encode())
    return h.digest()


def portable_key(key, sizes) -> bytes | None:
    """A byte string naming a static graph -- its key and its sizes -- across
    processes, or None if it cannot."""
    backend, global_state, opaque, create_graph, collected_key = key
    if not isinstance(backend, str):
        return None
    native_key, *python_parts = collected_key
    if python_parts and python_parts[0]:  # custom Function nodes
        return None
    h = hashlib.sha256()
    h.update(_version())
    h.update(repr((backend, tuple(str(s) for s in global_state), opaque, create_graph, python_parts)).encode())
    h.update(native_key)
    h.update(repr(tuple(sizes)).encode())
    return h.digest()


def _path(pkey: bytes) -> Path:
    return _root() / (pkey.hex()[:40] + ".graph")


def store(pkey: bytes, entry) -> None:
    """Write a captured static graph (its FX module, plan and description)."""
    try:
        payload = io.BytesIO()
        record = dict(
            key=pkey,
            graph=_GraphNodes.of(entry.graph),
            plan=entry.plan,
            node_names=entry.node_names,
            nodes=entry.nodes,
            node_keys=entry.node_keys,
            num_inputs=entry.num_inputs,
        )
        pickle.dump(record, payload, protocol=pickle.HIGHEST_PROTOCOL)
        data = payload.getvalue()
        mac = hmac.new(_secret(), data, hashlib.sha256).digest()
        path = _path(pkey)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(mac + data)
        os.replace(tmp, path)
    except Exception:  # the cache is an optimization: never fail a backward for it
        log.debug("could not store a graph on disk", exc_info=True)


def load(pkey: bytes) -> dict | None:
    path = _path(pkey)
    try:
        raw = path.read_bytes()
    except OSError:
        return None
    mac, data = raw[:32], raw[32:]
    if not hmac.compare_digest(mac, hmac.new(_secret(), data, hashlib.sha256).digest()):
        log.warning("ignoring %s: not written by this user's compiled_autograd", path)
        return None
    try:
        from . import ops  # noqa: F401  (the graph calls compiled_autograd::call)

        record = pickle.loads(data)
    except Exception:
        log.debug("could not load %s", path, exc_info=True)
        return None
    if record.get("key") != pkey:
        return None
    try:
        record["graph"] = record["graph"].build()
    except Exception:
        log.debug("could not rebuild the graph of %s", path, exc_info=True)
        return None
    return record


class _Ref:
    """A node, by name, in the stored arguments of another."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __reduce__(self):
        return (_Ref, (self.name,))


def _op_name(target):
    """A target by name: an operator overload or higher-order operator (not picklable), or
    anything else pickle stores by reference (operator.getitem)."""
    if isinstance(target, torch._ops.OpOverload):
        ns, name = target._schema.name.split("::")
        return ("op", ns, name, target._overloadname)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return ("hop", target.name())
    return ("py", target)


def _resolve(ref):
    if ref[0] == "op":
        return getattr(getattr(getattr(torch.ops, ref[1]), ref[2]), ref[3])
    if ref[0] == "hop":
        return getattr(torch.ops.higher_order, ref[1])
    return ref[1]


def _map(a, fn):
    """a with every node (or _Ref) replaced by fn of it, through tuples, lists, dicts and slices."""
    if isinstance(a, (torch.fx.Node, _Ref)):
        return fn(a)
    if isinstance(a, tuple):
        return tuple(_map(x, fn) for x in a)
    if isinstance(a, list):
        return [_map(x, fn) for x in a]
    if isinstance(a, dict):
        return {k: _map(v, fn) for k, v in a.items()}
    if isinstance(a, slice):
        return slice(_map(a.start, fn), _map(a.stop, fn), _map(a.step, fn))
    return a


class _GraphNodes:
    """A GraphModule as its nodes (NOTE [Graphs stored as their nodes])."""

    def __init__(self, nodes: list, attrs: dict):
        self.nodes = nodes
        self.attrs = attrs

    @classmethod
    def of(cls, gm: torch.fx.GraphModule) -> "_GraphNodes":
        if type(gm.graph._codegen) is not torch.fx.graph.CodeGen:
            raise TypeError(f"a graph with {type(gm.graph._codegen).__name__}")
        nodes, attrs = [], {}
        for n in gm.graph.nodes:
            if n.op == "call_module":
                raise TypeError("a graph calling a submodule")
            if n.op == "get_attr":
                attrs[n.target] = torch.fx.graph_module._get_attr(gm, n.target)
            target = _op_name(n.target) if n.op == "call_function" else ("py", n.target)
            args, kwargs = (_map(x, lambda r: _Ref(r.name)) for x in (n.args, n.kwargs))
            nodes.append((n.op, n.name, target, args, kwargs))
        return cls(nodes, attrs)

    def build(self) -> torch.fx.GraphModule:
        g = torch.fx.Graph()
        env: dict = {}
        for op, name, target, args, kwargs in self.nodes:
            args, kwargs = (_map(x, lambda r: env[r.name]) for x in (args, kwargs))
            env[name] = node = g.create_node(op, _resolve(target), args, kwargs, name=name)
            if node.name != name:  # (the code the backend sees names what the trace named)
                raise ValueError(f"node {name} came back as {node.name}")
        return torch.fx.GraphModule(self.attrs, g)
