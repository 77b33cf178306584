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
what the cache loads, it has written itself. A directory that is not this
user's, or that group or others can write, is not used at all (one warning);
nor is a secret that is a symlink, not this user's, or readable by others.
Every file is made with O_CREAT|O_EXCL|O_NOFOLLOW (a graph at a temp name with
a random part, then renamed into place), so nothing planted at a name we are
about to write is followed or overwritten.

NOTE [The disk cache never fails a backward]
The cache is an optimization: a directory that cannot be made (a file, or a path
under one), an unusable secret or any OSError on a load or store is logged, the
directory is warned about once per process, and the graph is traced and compiled
as usual -- no eager fallback, no error under fullgraph=True.

NOTE [Disk cache size]
The *.graph files of one directory are bounded by MAX_BYTES_ENV (bytes; the
default DEFAULT_MAX_BYTES, 1 GiB), read after each store by `_evict`: over it, the
least recently used files (oldest mtime; a load touches its file's mtime) are
deleted until the total is within it.

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

import errno
import functools
import hashlib
import hmac
import io
import logging
import os
import pickle
import re
import secrets
import stat
import time
import warnings
from pathlib import Path

import torch

from .. import calls, config, native
from ..values import PackageSlot

log = logging.getLogger("compiled_autograd")

FORMAT = 2


# NOTE [Disk cache size]: the one place the budget is defined
MAX_BYTES_ENV = config.GRAPH_DIR_MAX_BYTES.name
DEFAULT_MAX_BYTES = 1 << 30
STALE_TMP_SECONDS = 3600  # a temp file this old is a crashed store's: removed by `_evict`

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_warned_dirs: set[str] = set()
_GRAPH_NAME = re.compile(r"[0-9a-f]{40}\.graph")  # only what we write is counted and evicted
_TMP_NAME = re.compile(r"[0-9a-f]{40}(-[0-9a-f]{16}\.pt2(\.meta)?)?\.tmp\d+-[0-9a-f]+(\.pt2)?")
_PACKAGE_NAME = re.compile(r"[0-9a-f]{40}-[0-9a-f]{16}\.pt2(\.meta)?")  # NOTE [Compiled graphs loaded without inductor]


def _warn_once(path: Path, why: str) -> None:
    if str(path) not in _warned_dirs:
        _warned_dirs.add(str(path))
        warnings.warn(f"compiled_autograd: not using the disk cache at {path}: {why}; backward graphs are traced as usual", stacklevel=2)


def _root() -> Path | None:
    """The graph directory, or None (warned once) where it cannot be used
    (NOTE [Private cache], NOTE [The disk cache never fails a backward])."""
    override = config.GRAPH_DIR.read()
    root = Path(override) if override else native.cache_root() / "graphs"
    try:
        try:
            root.mkdir(parents=True, mode=0o700)
        except FileExistsError:
            pass  # not ours to chmod: checked below
        else:
            os.chmod(root, 0o700)
        st = os.stat(root)
    except OSError as e:
        _warn_once(root, f"{type(e).__name__}: {e}")
        return None
    if not stat.S_ISDIR(st.st_mode):
        _warn_once(root, "not a directory")
        return None
    if st.st_uid != os.geteuid():
        _warn_once(root, f"owned by uid {st.st_uid}, not by this user")
        return None
    if st.st_mode & 0o022:
        _warn_once(root, f"group or others can write it (mode {stat.S_IMODE(st.st_mode):o})")
        return None
    return root


def _tmp_suffix() -> str:
    return secrets.token_hex(8)


def _write_new(path: Path, data: bytes) -> None:
    """Write path as a whole: a new temp file next to it (never one that exists, never
    through a symlink), then renamed over path."""
    tmp = path.with_name(f"{path.stem}.tmp{os.getpid()}-{_tmp_suffix()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _read_private(path: Path) -> bytes:
    """path's bytes, if it is this user's regular file that no one else can read or
    write (never through a symlink); else PermissionError. FileNotFoundError if none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW | _CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise PermissionError(f"{path} is a symlink") from e
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise PermissionError(f"{path} is not a file that only this user can read")
        return f.read()


def _secret() -> bytes | None:
    """The HMAC key (NOTE [Private cache]), made on first use; None (warned once)
    where it cannot be used."""
    root = native.cache_root()
    path = root / "secret"
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        for _ in range(50):
            try:
                data = _read_private(path)
            except FileNotFoundError:
                data = secrets.token_bytes(32)
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, 0o600)
                except FileExistsError:
                    continue  # another process made it meanwhile: read theirs
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                return data
            if len(data) >= 32:
                return data
            time.sleep(0.01)  # another process is writing it
        # a writer that died before writing it all: a new one, whole
        data = secrets.token_bytes(32)
        _write_new(path, data)
        return data
    except PermissionError as e:
        _warn_once(path, str(e))
        return None


@functools.lru_cache(maxsize=None)
def _version() -> bytes:
    h = hashlib.sha256()
    h.update(torch.__version__.encode())
    h.update(native.source_bytes())
    # the code that writes a graph and its plan, and the code that reads and runs them: all of it
    for f in sorted(Path(__file__).resolve().parents[1].rglob("*.py")):
        h.update(f.read_bytes())
    h.update(str(FORMAT).encode())
    return h.digest()


def portable_key(key, sizes, learned=None) -> bytes | None:
    """A byte string naming a static graph -- its key, its sizes, and what earlier backwards
    taught its trace (`learned`: LEARNED.layouts.of(key), the layouts and types its calls'
    outputs came in) -- across processes, or None if it cannot."""
    if not isinstance(key.backend, str) or key.graph.functions:  # (custom Function nodes: user code)
        return None
    if any(type(e) is tuple and e[:1] in (("W",), ("R",)) for e in key.graph.extra) or any(u.subclass for u in key.graph.in_graph):
        # a tensor subclass (flattened, or held by reference): its type and metadata (DTensor's mesh,
        # its process groups' names) are not yet known to mean the same in another process
        # (docs/design/subclasses.md section 6)
        return None
    graph = key.graph
    h = hashlib.sha256()
    h.update(_version())
    python_parts = [graph.unpacked, graph.in_graph, graph.extra, graph.grad_on_ctx]
    h.update(repr((key.backend, tuple(str(s) for s in key.global_state), key.opaque, key.create_graph, python_parts)).encode())
    h.update(graph.native)
    h.update(repr(tuple(sizes)).encode())
    if learned:
        h.update(repr(sorted(learned.items(), key=repr)).encode())
    return h.digest()


def _path(pkey: bytes) -> Path | None:
    root = _root()
    return None if root is None else root / (pkey.hex()[:40] + ".graph")


def max_bytes() -> int:
    """The disk cache's budget (NOTE [Disk cache size])."""
    value = config.GRAPH_DIR_MAX_BYTES.read()
    if not value:
        return DEFAULT_MAX_BYTES
    try:
        return int(value)
    except ValueError:
        log.warning("ignoring %s=%r: not a number of bytes", MAX_BYTES_ENV, value)
        return DEFAULT_MAX_BYTES


def _evict(root: Path) -> None:
    """Delete the least recently used graphs until the directory is within budget
    (NOTE [Disk cache size]), and temp files a crashed store left."""
    budget = max_bytes()
    files, total, now = [], 0, time.time()
    with os.scandir(root) as it:
        for e in it:
            try:
                if not e.is_file(follow_symlinks=False):
                    continue
                st = e.stat(follow_symlinks=False)
                if _GRAPH_NAME.fullmatch(e.name) or _PACKAGE_NAME.fullmatch(e.name):
                    files.append((st.st_mtime_ns, e.name, st.st_size))
                    total += st.st_size
                elif _TMP_NAME.fullmatch(e.name) and now - st.st_mtime > STALE_TMP_SECONDS:
                    os.unlink(e.path)
            except OSError:  # another process removed it
                continue
    if total <= budget:
        return
    for _, name, size in sorted(files):
        try:
            os.unlink(root / name)
        except FileNotFoundError:
            pass
        total -= size
        if total <= budget:
            break


def store(pkey: bytes, entry) -> None:
    """Write a captured static graph (its FX module, plan and description)."""
    try:
        path = _path(pkey)
        if path is None:
            return
        secret = _secret()
        if secret is None:
            return
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
        mac = hmac.new(secret, data, hashlib.sha256).digest()
        _write_new(path, mac + data)
        _evict(path.parent)
    except Exception:  # NOTE [The disk cache never fails a backward]
        log.debug("could not store a graph on disk", exc_info=True)


# NOTE [A graph known compiled]
# A graph stored here is compiled from the backend's own caches in a later process (inductor's
# FX graph and AOTAutograd caches). Whether that compile is there already decides how a later
# process gets it: a child process that compiles at low priority only to find it cached costs
# its start (importing torch and inductor: 3.7 s of CPU on an idle machine, next to none given
# on a busy one), where loading it from the caches in the compile thread takes about a second.
# So once a background compile of a stored graph finished, a marker beside the graph says so,
# for that fingerprint (the backend's options, the configs that enter inductor's keys, and
# inductor's cache directory, which must still hold its FX graph cache): a later process with
# the same fingerprint loads it at once, in its first backward (capture/entry.py
# entry_from_disk). A marker that lies costs a full compile there. Markers carry the same HMAC
# as graphs.
def _marker(pkey: bytes, fingerprint: str) -> Path | None:
    root = _root()
    if root is None:
        return None
    return root / (pkey.hex()[:40] + "-" + hashlib.sha256(fingerprint.encode()).hexdigest()[:16] + ".compiled")


def package_slot(pkey: bytes, fingerprint: str | None) -> PackageSlot | None:
    """Where the graph `pkey`'s package compiled with `fingerprint` lies (NOTE [Compiled graphs
    loaded without inductor], compile/package.py), and the key of its HMAC; None where there is
    no cache or no package applies (`fingerprint` None)."""
    try:
        root, secret = _root(), _secret()
        if fingerprint is None or root is None or secret is None:
            return None
        name = pkey.hex()[:40] + "-" + hashlib.sha256(fingerprint.encode()).hexdigest()[:16] + ".pt2"
        return PackageSlot(str(root / name), hmac.new(secret, b"package" + pkey + fingerprint.encode(), hashlib.sha256).digest())
    except Exception:  # NOTE [The disk cache never fails a backward]
        log.debug("could not name a package", exc_info=True)
        return None


def compiled_marker(pkey: bytes, fingerprint: str) -> tuple | None:
    """NOTE [A graph known compiled]: (path, bytes) of the marker that says the graph `pkey`'s
    compile with `fingerprint` is cached, for the compile to write once it is (compile/:
    `write_marker`, in this process or in a child left to finish after it); None where there
    is no cache to mark."""
    try:
        path, secret = _marker(pkey, fingerprint), _secret()
        if path is None or secret is None:
            return None
        return str(path), hmac.new(secret, pkey + fingerprint.encode(), hashlib.sha256).digest()
    except Exception:  # NOTE [The disk cache never fails a backward]
        log.debug("could not make a compiled marker", exc_info=True)
        return None


def known_compiled(pkey: bytes, fingerprint: str) -> bool:
    try:
        path, secret = _marker(pkey, fingerprint), _secret()
        if path is None or secret is None:
            return False
        want = hmac.new(secret, pkey + fingerprint.encode(), hashlib.sha256).digest()
        return hmac.compare_digest(_read_private(path), want)
    except FileNotFoundError:
        return False
    except Exception:  # NOTE [The disk cache never fails a backward]
        log.debug("could not read a compiled marker", exc_info=True)
        return False


def load(pkey: bytes) -> dict | None:
    try:
        return _load(pkey)
    except Exception:  # NOTE [The disk cache never fails a backward]
        log.debug("could not load a graph from disk", exc_info=True)
        return None


def _load(pkey: bytes) -> dict | None:
    path = _path(pkey)
    if path is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW | _CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            raw = f.read()
    except OSError:
        return None
    secret = _secret()
    if secret is None:
        return None
    mac, data = raw[:32], raw[32:]
    if not hmac.compare_digest(mac, hmac.new(secret, data, hashlib.sha256).digest()):
        log.warning("ignoring %s: not written by this user's compiled_autograd", path)
        return None
    try:
        calls.install()  # (the graph calls compiled_autograd::call)
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
    try:
        os.utime(path)  # used now: the last to go (NOTE [Disk cache size])
    except OSError:
        pass
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
