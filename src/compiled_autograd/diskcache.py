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

FORMAT = 1


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
            graph=entry.graph,
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
    return record
