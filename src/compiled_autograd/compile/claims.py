"""One compile of a graph per machine: the claim beside its marker (NOTE [One compile per machine]).

NOTE [One compile per machine]
Processes that share the disk cache and inductor's cache directory -- the ranks of a job on one
machine, a run and the next, a run and the child its predecessor left to finish (NOTE [A compile
finished after exit], compile/child.py) -- capture the same static graph under the same key and
would each compile it: a 2-rank DDP job spent 2 x 97 s of CPU on one graph. So the background
compile of a stored graph first claims it: a file beside the graph's compiled marker (NOTE [A
graph known compiled], cache/disk.py), made with O_EXCL, naming the host and the process that
compiles it (the child, once started). The process that made it compiles; any other waits -- its
backwards of that graph run in eager autograd meanwhile, as while its own compile would run --
until the marker says the graph is compiled, then loads it from inductor's caches (about a
second). A claim whose process is gone (killed, or ended without compiling) is taken over. A
child left to finish after its process exited keeps its claim: the next process waits for it
rather than start again, and adopts it (its share of the CPU: NOTE [The compile's share of a busy
machine]; the child's own watchdog then leaves it alive). `stats().shared_compiles` counts the
compiles this process waited for instead of making.
"""

from __future__ import annotations

import logging
import os
import socket
import time

log = logging.getLogger("compiled_autograd")

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
POLL_S = 0.25


def path_of(marker) -> str | None:
    """The claim beside a marker (cache/disk.py compiled_marker: (path, bytes)), or None."""
    return None if marker is None else marker[0] + ".claim"


def _write(path: str, text: str, exclusive: bool) -> bool:
    flags = os.O_WRONLY | os.O_CREAT | _NOFOLLOW | (os.O_EXCL if exclusive else os.O_TRUNC)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return True


def take(path: str, pid: int | None = None) -> bool:
    """Claim the compile (True), or find it claimed by a live process (False). A stale claim is
    taken over."""
    text = f"{socket.gethostname()} {pid or os.getpid()} 0\n"
    for _ in range(2):
        try:
            if _write(path, text, exclusive=True):
                return True
        except OSError:  # (no cache directory to claim in: every process compiles, as before)
            log.debug("could not claim a compile", exc_info=True)
            return True
        if holder_alive(path):
            return False
        try:
            os.unlink(path)  # (stale: its process is gone)
        except OSError:
            pass
    return True


def hand_to(path: str | None, pid: int) -> None:
    """The claim now names the child that compiles (it outlives this process at exit)."""
    if path is not None:
        try:
            _write(path, f"{socket.gethostname()} {pid} 0\n", exclusive=False)
        except OSError:
            log.debug("could not hand a claim to the child", exc_info=True)


def adopt(path: str) -> int | None:
    """The pid of the claim's compiling process, now adopted by this one (its watchdog leaves it
    alive while this process is); None where it is not on this host or not alive."""
    holder = _read(path)
    if holder is None or holder[0] != socket.gethostname() or not _alive(holder[1]):
        return None
    try:
        _write(path, f"{holder[0]} {holder[1]} {os.getpid()}\n", exclusive=False)
    except OSError:
        return None
    return holder[1]


def adopted(path: str) -> bool:
    """In the child: whether a live process adopted it."""
    holder = _read(path)
    return holder is not None and holder[2] > 0 and _alive(holder[2])


def release(path: str | None) -> None:
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass


def _read(path: str):
    try:
        with open(path) as f:
            host, pid, adopter = f.read().split()
        return host, int(pid), int(adopter)
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def holder_alive(path: str) -> bool:
    """Whether the claim's process is alive (one on another host, sharing the directory: taken as
    alive while the claim is younger than an hour)."""
    holder = _read(path)
    if holder is None:
        return os.path.exists(path)  # (being written)
    if holder[0] != socket.gethostname():
        try:
            return time.time() - os.path.getmtime(path) < 3600
        except OSError:
            return False
    return _alive(holder[1])


def wait_for(path: str, marker, tick=None) -> bool:
    """Wait while another process compiles: True once the marker says the graph is compiled,
    False where the claim went stale first (the caller claims it then). `tick`: called each
    poll (an adopted child's share). A cancel at exit lands between polls."""
    while True:
        if _marked(marker):
            return True
        if not holder_alive(path):
            return _marked(marker)
        if tick is not None:
            tick()
        time.sleep(POLL_S)


def _marked(marker) -> bool:
    try:
        with open(marker[0], "rb") as f:
            return f.read() == marker[1]
    except OSError:
        return False


# NOTE [One compile per job]
# Ranks on different machines share no cache directory (nor do ranks given one each): each would
# compile the same graph. Where a process group is up, the compile of a graph is claimed through
# its store instead (the default store of torch.distributed: a key-value service every rank
# reaches, used outside the collectives, so no rank waits for another at a step): the first rank
# to add to the graph's claim key compiles it, in its child, which also saves what it compiled as
# inductor's portable cache artifacts (torch.compiler.save_cache_artifacts); that rank publishes
# them in the store. Every other rank waits for them -- its backwards of that graph in eager
# meanwhile -- loads them into its own caches (torch.compiler.load_cache_artifacts) and loads the
# graph from there. A rank whose compile failed publishes nothing, and the others compile it
# themselves.
class JobClaim:
    """The compile of one graph, claimed through the process group's store (NOTE above)."""

    PREFIX = "compiled_autograd/compile/"

    def __init__(self, store, key: str):
        self.store, self.key = store, key

    def take(self) -> bool:
        return self.store.add(self.PREFIX + "claim/" + self.key, 1) == 1

    def publish(self, artifacts: bytes | None) -> None:
        self.store.set(self.PREFIX + "artifacts/" + self.key, artifacts or b"")
        self.store.set(self.PREFIX + "done/" + self.key, b"1")

    def wait(self, tick=None) -> bytes | None:
        """The artifacts the claiming rank published (None where it failed), once it has."""
        done = self.PREFIX + "done/" + self.key
        while not self.store.check([done]):
            if tick is not None:
                tick()
            time.sleep(POLL_S)
        got = self.store.get(self.PREFIX + "artifacts/" + self.key)
        return bytes(got) or None


def job_claim(key: str) -> JobClaim | None:
    """The job's claim of a graph's compile, where a process group of more than one rank is up."""
    import sys

    dist = sys.modules.get("torch.distributed")  # (never imported here: only where the user did)
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
            return None
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # (no store to reach: each rank compiles, or shares the machine's claim)
        log.debug("no process group store for the compile's claim", exc_info=True)
        return None
    return JobClaim(store, key)


def load_artifacts(artifacts: bytes) -> bool:
    """Another rank's compile, loaded into this process's caches (NOTE [One compile per job])."""
    try:
        import torch

        torch.compiler.load_cache_artifacts(artifacts)
        return True
    except Exception:
        log.debug("could not load another rank's compile", exc_info=True)
        return False
