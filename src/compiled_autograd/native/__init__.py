"""Loader for the C++ helper (the `SOURCES` here; module.cpp has its overview).

The helper is built against the installed torch's headers the first time it is
needed (about 20 s with g++ and ninja), then loaded from a per-user cache keyed
by the source and the torch version, so later processes load it in
milliseconds.

NOTE [Torch versions]
The helper reads torch's internals as the releases it was written for lay them
out: how nodes are held (`c10::intrusive_ptr<Node>` since 2.13, `std::shared_ptr`
before), the C++ refcount convention of a tensor's PyObject that judges whether
the graph owns an output, the private hook structs; the patches of
compile/torch_patches.py replace private functions of fx, dynamo and inductor. A
release that lays them out differently may not build the helper, or worse, build
it and misread a value: a silent wrong gradient. So each of them is gated on the
releases it was written for and checked on, one table: `releases.WRITTEN_FOR`
(each release checked by `python -m tools.check_release VERSION`: the whole
suite and the conformance sample; the matrix is in docs/torch-versions.md).

- On a release outside the helper's range, or when the build fails, `load()`
  raises `Unavailable` and every backward runs in eager autograd, counted in
  `stats().fallback_reasons` with the reason (a warning once).
- A patch is installed only on the releases of its row. One that finds torch
  laid out otherwise (a function it replaces is missing or has another shape)
  leaves torch alone and names what differs: an import-time patch makes every
  backward run in eager with that reason (here); a compile-time one fails the
  compile that needed it, which is counted with it; one only for speed is left
  out, logged.
- `COMPILED_AUTOGRAD_UNTESTED_TORCH=1` lifts the release check (not the layout
  checks), to try another release: run `tools/check_release.py` on it first.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path

import torch

from .. import config, releases

log = logging.getLogger("compiled_autograd")

_HERE = Path(__file__).parent
# every file the helper is built from, by stage (module.cpp's overview), all of which name the
# build (and the disk cache's version); helper.cpp, which includes the .cpp files, is compiled
SOURCES = tuple(_HERE / name for name in ("values.h", "capture.h", "collect.cpp", "trace.cpp", "calls.cpp", "module.cpp", "helper.cpp"))
_module = None
_error: str | None = None  # why the helper is unavailable in this process (it is not retried)


class Unavailable(Exception):
    """The helper cannot be used with this torch (NOTE [Torch versions])."""


def version_problem(version: str = torch.__version__) -> str | None:
    """Why the helper must not load on this torch version; None when it may (NOTE [Torch
    versions]: its release range, and an import-time patch that found torch laid out otherwise)."""
    why = releases.problem(releases.HELPER, version)
    if why is None and version == torch.__version__ and releases.LAYOUT_DIFFERS:
        why = next(iter(releases.LAYOUT_DIFFERS.values()))
    return why


def cache_root() -> Path:
    base = config.CACHE_DIR.read()
    if base:
        return Path(base)
    xdg = config.XDG_CACHE_HOME.read() or os.path.join(Path.home(), ".cache")
    return Path(xdg) / "compiled_autograd"


def source_bytes() -> bytes:
    """The helper's sources, each after its name, in `SOURCES`' order."""
    return b"".join(p.name.encode() + b"\0" + p.read_bytes() for p in SOURCES)


def _build_name() -> str:
    h = hashlib.sha256()
    h.update(source_bytes())
    h.update(torch.__version__.encode())
    h.update(sys.version.encode())
    return "compiled_autograd_native_" + h.hexdigest()[:12]


def load():
    """Return the native module, building it on first use; `Unavailable` where it cannot be
    used (NOTE [Torch versions]), then and on every later call."""
    global _module, _error
    if _module is not None:
        return _module
    if _error is None:
        _error = version_problem()
    if _error is None:
        try:
            _module = _load()
        except Exception as e:  # a failed build or import: its first line says why
            first = (str(e).strip().splitlines() or [""])[0]
            _error = (
                f"the native helper could not be built or loaded for torch {torch.__version__}: " + (f"{type(e).__name__}: {first}"[:300])
            )
            log.warning("%s", _error, exc_info=True)
            raise Unavailable(_error) from e
        return _module
    raise Unavailable(_error)


def _load():
    global _module
    from torch.utils import cpp_extension

    name = _build_name()
    build_dir = cache_root() / "native" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    built = any(build_dir.glob(name + "*.so"))
    if built:
        # already built for this source and torch: import it directly (no
        # ninja run, no build lock shared with other processes)
        try:
            _module = cpp_extension._import_module_from_library(name, str(build_dir), True)
            return _module
        except Exception:  # pragma: no cover - fall back to a (re)build
            log.debug("could not import the built helper, rebuilding", exc_info=True)
    else:
        print(
            f"compiled_autograd: building the native helper once (~45 s on 2 cores) in {build_dir}",
            file=sys.stderr,
        )
    _module = cpp_extension.load(
        name=name,
        sources=[str(_HERE / "helper.cpp")],
        build_directory=str(build_dir),
        extra_cflags=["-O2"],
        verbose=False,
    )
    return _module
