"""The torch releases each piece of code that reads torch's internals was written for: the
native helper and every patch of `compile/torch_patches.py`, in one table (`WRITTEN_FOR`),
and what is in force on the running torch (NOTE [Torch versions] in native/__init__.py).
Imports nothing of ours, so the helper's loader and the patches both read it."""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from .config import UNTESTED_TORCH

Release = Tuple[int, int]  # (major, minor)
# (first, last) releases, both included; None: open on that side
Range = Tuple[Optional[Release], Optional[Release]]

UNTESTED_ENV = UNTESTED_TORCH.name

# NOTE [Torch versions] (native/__init__.py): each piece of code that reads torch's internals,
# and the releases it was written for and checked on (tools/check_release.py runs the suite
# and the conformance sample on each; docs/torch-versions.md has the matrix). The helper's
# range is the releases compiled backwards run on by default; a patch outside its range is
# not installed (`torch_patches.install`). Widen a range only after a check of that release.
WRITTEN_FOR: dict[str, Range] = {
    # the C++ helper: node ownership, a tensor's PyObject refcount convention, hook structs
    "native helper": ((2, 13), (2, 15)),
    # NOTE [One fx trace at a time] (the flag became thread-local in 2.14; the lock stays)
    "fx traces": ((2, 13), (2, 15)),
    # NOTE [Engine queries from hooks] (calls/kernel.py)
    "engine queries": ((2, 13), (2, 15)),
    # NOTE [One compile at a time]
    "dynamo compiles": ((2, 13), (2, 15)),
    # NOTE [A background compile leaves the random state alone]
    "random state": ((2, 13), (2, 15)),
    # NOTE [Freed, never reused]
    "freed buffers": ((2, 13), (2, 15)),
    # NOTE [Mutation renames after a loop recompute]: torch 2.14 fixed it; needed up to 2.13
    "mutation renames": ((2, 11), (2, 13)),
    # NOTE [Remembered vector-ISA probes]
    "vector-ISA probes": ((2, 13), (2, 15)),
    # NOTE [One dynamic graph per size range]
    "reduction helper": ((2, 13), (2, 15)),
    # NOTE [Indexing of dynamic reshapes]
    "reshape indexing": ((2, 13), (2, 15)),
}

HELPER = "native helper"


def parse(version: str) -> Release | None:
    """(major, minor) of a torch version string ("2.15.0+cu130" -> (2, 15)); None if unreadable."""
    try:
        major, minor = (int(x) for x in version.split("+")[0].split(".")[:2])
    except ValueError:
        return None
    return major, minor


def name(release: Release) -> str:
    return f"{release[0]}.{release[1]}"


def contains(span: Range, release: Release | None) -> bool:
    first, last = span
    if release is None:
        return False
    return (first is None or release >= first) and (last is None or release <= last)


def describe(span: Range) -> str:
    """'2.13', '2.13-2.15', '2.13 and later', 'up to 2.13', 'any'."""
    first, last = span
    if first is not None and last is not None:
        return name(first) if first == last else f"{name(first)}-{name(last)}"
    if first is not None:
        return f"{name(first)} and later"
    if last is not None:
        return f"up to {name(last)}"
    return "any"


def untested_allowed() -> bool:
    return UNTESTED_TORCH.read() == "1"


def written_for(what: str, version: str = torch.__version__) -> bool:
    """Whether `what` (a key of `WRITTEN_FOR`) was written for this torch version."""
    return contains(WRITTEN_FOR[what], parse(version))


def problem(what: str = HELPER, version: str = torch.__version__) -> str | None:
    """Why `what` must not be used on this torch version; None when it may (a release it was
    written for, or any release under COMPILED_AUTOGRAD_UNTESTED_TORCH=1)."""
    if parse(version) is None:
        return f"torch {version}: not a version compiled_autograd can parse"
    if written_for(what, version) or untested_allowed():
        return None
    return f"torch {version} is not a release the {what} was written for ({describe(WRITTEN_FOR[what])}); set {UNTESTED_ENV}=1 to try it"


def in_force(what: str, version: str = torch.__version__) -> bool:
    """Whether the patch `what` is installed on this torch version: on a release it was written
    for; under COMPILED_AUTOGRAD_UNTESTED_TORCH=1 on a release beyond the helper's range, also
    when its range reaches that side of the helper's (so a patch that an earlier release needed
    and a later one fixed stays off on later releases)."""
    release = parse(version)
    span = WRITTEN_FOR[what]
    if contains(span, release):
        return True
    if release is None or not untested_allowed():
        return False
    (first, last), (helper_first, helper_last) = span, WRITTEN_FOR[HELPER]
    if helper_last is not None and release > helper_last:
        return last == helper_last
    if helper_first is not None and release < helper_first:
        return first == helper_first
    return False


# what differs in the running torch from what an import-time patch expects (set by
# compile/torch_patches.py: NOTE [Torch versions]); every backward then runs in eager
LAYOUT_DIFFERS: dict[str, str] = {}
