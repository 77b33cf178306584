"""A compiled graph a later process loads without inductor: an AOTInductor package (NOTE
[Compiled graphs loaded without inductor])."""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import operator
import os
import pickle
import platform
import sys
from typing import NamedTuple

import torch

from ..values import BOXED, PackageSlot

log = logging.getLogger("compiled_autograd")


# NOTE [Compiled graphs loaded without inductor]
# A later process that finds a graph compiled before (NOTE [A graph known compiled] in
# cache/disk.py) loaded it from inductor's caches: 1.2 s on its first backward, of which 1.1 s
# is importing inductor (torch 2.13's `torch._inductor` imports dynamo; its config alone costs
# that) and the rest AOTAutograd's cache. On the D=1024 MLP (60 steps of ~50 ms) that second is
# a third of eager's whole run. So a static graph of plain aten ops (no call of ours, nothing
# mutated, tensors out) is also compiled into an AOTInductor package -- the same inductor
# kernels, and a C++ wrapper instead of Python -- which `torch._C._aoti` loads in ~3 ms with no
# inductor import: the later process runs compiled from its first backward. Measured here on
# the MLP's graph: the package's outputs equal the Python-wrapper compile's bitwise, at the same
# step time (26.0 against 26.2 ms).
#
# The package is made by a child process after training exits (the compile's work is kept for
# the next process; `COMPILED_AUTOGRAD_FINISH_AFTER_EXIT=0` turns it off, with what is left to
# finish after exit, and bounds it: compile/child.py), so it never takes CPU from training's
# steps. Its key holds what the compile bakes in and a process can know without importing
# inductor: the graph (the disk cache's key), the backend's options, the thread count, torch's
# version, the CPU's flags, inductor's environment variables; and inductor's and AOTAutograd's
# configs must be at their defaults (nobody set one), in the process that compiled it and in
# the one that loads it: else no package is made or used. Its file carries an HMAC, as our
# graphs do (cache/disk.py), and the outputs' geometry as the traced graph gives it: the first
# run is checked against it (run again as the FX graph, and the package dropped, if it
# differs: a graph of plain ops may run twice).
ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCH_COMPILE_", "TORCHDYNAMO_", "TORCH_LOGS")


class Job(NamedTuple):
    """A compiled graph to package after exit (compile/background.py package_later)."""

    graph: torch.fx.GraphModule
    described: list  # its inputs' geometry (compile/child.py describe)
    slot: PackageSlot
    patches: dict  # inductor's options (enable(mode=..., options=...))


def fingerprint(cfg) -> str | None:
    """What a package's compile bakes in beside the graph, read without importing inductor;
    None where no package applies (not inductor, or a config somebody set)."""
    if cfg.backend_name != "inductor" or not _configs_at_defaults():
        return None
    # (not inductor's cache directory: a package does not depend on it, and importing inductor sets it)
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(ENV_PREFIXES) and k != "TORCHINDUCTOR_CACHE_DIR")
    # (and the process state inductor's own cache keys read: matmul precision, mkldnn, determinism)
    key = (
        cfg.backend_key,
        cfg.inductor_patches,
        torch.__version__,
        torch.get_num_threads(),
        platform.machine(),
        _cpu_flags(),
        torch.backends.cpu.get_cpu_capability(),
        env,
        torch.get_float32_matmul_precision(),
        torch.backends.mkldnn.enabled,
        torch.are_deterministic_algorithms_enabled(),
    )
    return hashlib.sha256(repr(key).encode()).hexdigest()


def _configs_at_defaults() -> bool:
    from torch.utils import _config_module

    unset = getattr(_config_module, "_UNSET_SENTINEL", None)
    for name in ("torch._inductor.config", "torch._functorch.config"):
        module = sys.modules.get(name)
        if module is None:  # (not imported: nobody set one)
            continue
        entries = getattr(module, "_config", None)
        if unset is None or not isinstance(entries, dict):
            return False  # (another torch: not known)
        for entry in entries.values():
            override = getattr(entry, "user_override", None)
            if override is None:
                return False
            value = override.get()
            if value is unset:
                continue
            # (a `config.patch` leaves the value it restored set: the default is still the default)
            default = next(
                (v for v in (getattr(entry, "env_value_force", unset), getattr(entry, "env_value_default", unset)) if v is not unset),
                getattr(entry, "default", unset),
            )
            try:
                if not (type(value) is type(default) and value == default):
                    return False
            except Exception:
                return False
    return True


@functools.lru_cache(maxsize=None)
def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return hashlib.sha256(line.encode()).hexdigest()[:16]
    except OSError:
        pass
    return platform.processor()


def eligible(gm: torch.fx.GraphModule, described, plan) -> bool:
    """A graph a package can hold as it is: plain aten ops, none mutating (so inputs that share
    a storage are only read), plain tensors in and out: no tensor subclass stood in for, no
    value held by reference (its plan's)."""
    if plan.stand_ins or plan.held or plan.by_reference or plan.wrapped or plan.differentiable is not None:
        return False
    if any(d[0] != "tensor" for d in described):
        return False
    for node in gm.graph.nodes:
        if node.op == "call_function":
            target = node.target
            if target is operator.getitem:  # (an output of a multi-output op)
                continue
            if not isinstance(target, torch._ops.OpOverload) or target.namespace not in ("aten", "prims"):
                return False
            if target._schema.is_mutable:
                return False
        elif node.op == "output":
            outs = node.args[0]
            if not isinstance(outs, (list, tuple)) or not all(isinstance(o, torch.fx.Node) for o in outs):
                return False
        elif node.op not in ("placeholder", "get_attr"):
            return False
    return True


class _Positional(torch.nn.Module):
    def __init__(self, gm):
        super().__init__()
        self.gm = gm

    def forward(self, *args):
        return tuple(self.gm(*args))


def build(gm: torch.fx.GraphModule, fakes: list, slot: PackageSlot, patches: dict | None) -> None:
    """In the child: export the graph on its inputs' fakes, compile it into a package at
    `slot`, with the outputs' geometry and an HMAC beside it."""
    import torch._inductor

    ep = torch.export.export(_Positional(gm), tuple(fakes), strict=False)
    out_node = next(n for n in ep.graph.nodes if n.op == "output")
    geometry = [_geometry(n.meta["val"]) for n in out_node.args[0]]
    tmp = f"{slot.path}.tmp{os.getpid()}-{os.urandom(8).hex()}.pt2"  # (aoti wants the suffix)
    try:
        torch._inductor.aoti_compile_and_package(ep, package_path=tmp, inductor_configs=dict(patches or {}))
        meta = pickle.dumps(geometry)
        with open(tmp, "rb") as f:
            digest = hashlib.sha256(f.read()).digest()
        _write(slot.path + ".meta", hmac.new(slot.key, digest + meta, hashlib.sha256).digest() + meta)
        os.chmod(tmp, 0o600)  # (as the disk cache's files: NOTE [Private cache])
        os.replace(tmp, slot.path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _geometry(t) -> tuple:
    return tuple(int(s) for s in t.shape), tuple(int(s) for s in t.stride()), t.dtype


def _write(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp{os.getpid()}-{os.urandom(8).hex()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def load(slot: PackageSlot, gm: torch.fx.GraphModule):
    """The package at `slot` as a boxed callable, or None (none there, not this user's, or
    not loadable here)."""
    try:
        with open(slot.path + ".meta", "rb") as f:
            raw = f.read()
        with open(slot.path, "rb") as f:
            digest = hashlib.sha256(f.read()).digest()
    except OSError:
        return None
    mac, meta = raw[:32], raw[32:]
    if not hmac.compare_digest(mac, hmac.new(slot.key, digest + meta, hashlib.sha256).digest()):
        log.warning("ignoring %s: not written by this user's compiled_autograd", slot.path)
        return None
    try:
        geometry = pickle.loads(meta)
        loader = torch._C._aoti.AOTIModelPackageLoader(slot.path, "model", False, 1, -1)
    except Exception:
        log.debug("could not load the package %s", slot.path, exc_info=True)
        return None
    return Packaged(loader, geometry, gm, slot.path)


class Packaged:
    """A graph's package, run boxed (NOTE [Boxed graphs free their inputs]); its first run
    checked against the traced graph's outputs (NOTE [Compiled graphs loaded without inductor])."""

    def __init__(self, loader, geometry: list, gm: torch.fx.GraphModule, path: str):
        self.loader, self.geometry, self.gm, self.path = loader, geometry, gm, path
        self.checked = False
        self.instead = None  # the FX graph, where the package's outputs differed
        setattr(self, BOXED, True)

    def __call__(self, args: list):
        if self.checked:
            return self.loader.boxed_run(args)
        if self.instead is not None:
            return self.instead(args)
        outs = self.loader.run(args)
        if len(outs) == len(self.geometry) and all(_geometry(o) == g for o, g in zip(outs, self.geometry)):
            self.checked = True
            args.clear()
            return outs
        log.warning(
            "the compiled package %s returned outputs other than its graph's: it is dropped, and the graph runs as traced", self.path
        )
        for p in (self.path, self.path + ".meta"):
            try:
                os.unlink(p)
            except OSError:
                pass
        from .boxed import _boxed_graph_module

        self.instead = _boxed_graph_module(self.gm)
        return self.instead(args)
