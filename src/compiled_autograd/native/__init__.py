"""Loader for the C++ helper (`_C.cpp`).

The helper is built against the installed torch's headers the first time it is
needed (about 20 s with g++ and ninja), then loaded from a per-user cache keyed
by the source and the torch version, so later processes load it in
milliseconds.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path

import torch

log = logging.getLogger("compiled_autograd")

_SOURCE = Path(__file__).with_name("_C.cpp")
_module = None


def cache_root() -> Path:
    base = os.environ.get("COMPILED_AUTOGRAD_CACHE_DIR")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(xdg) / "compiled_autograd"


def _build_name() -> str:
    h = hashlib.sha256()
    h.update(_SOURCE.read_bytes())
    h.update(torch.__version__.encode())
    h.update(sys.version.encode())
    return "compiled_autograd_native_" + h.hexdigest()[:12]


def load():
    """Return the native module, building it on first use."""
    global _module
    if _module is not None:
        return _module
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
            f"compiled_autograd: building the native helper once (~20 s) in {build_dir}",
            file=sys.stderr,
        )
    _module = cpp_extension.load(
        name=name,
        sources=[str(_SOURCE)],
        build_directory=str(build_dir),
        extra_cflags=["-O2"],
        verbose=False,
    )
    return _module
