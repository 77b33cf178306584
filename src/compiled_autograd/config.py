"""The few options compiled_autograd has, the scope they apply to, and the environment.

Options are set with `ca.enable(...)` (a context manager) and read through
`current()`, a context variable, so they nest and are per thread/task. Every
environment variable the library reads is named here (`ENVIRONMENT`), each read
when it is used: a user (or a test) may set it between backwards.
"""

from __future__ import annotations

import contextvars
import functools
import os
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from .values import BackendLike


class EnvVar(NamedTuple):
    """One environment variable: its name, its value when unset, what it does."""

    name: str
    default: str
    help: str

    def read(self) -> str:
        """Its value now (the default where it is unset)."""
        return os.environ.get(self.name, self.default)

    def on(self) -> bool:
        """A switch: anything but "0" is on."""
        return self.read() != "0"


DISK_CACHE = EnvVar("COMPILED_AUTOGRAD_DISK_CACHE", "1", "0: the disk cache is off unless enable(disk_cache=True)")
GRAPH_DIR = EnvVar("COMPILED_AUTOGRAD_GRAPH_DIR", "", "the disk cache's directory (default: <cache dir>/graphs)")
GRAPH_DIR_MAX_BYTES = EnvVar("COMPILED_AUTOGRAD_GRAPH_DIR_MAX_BYTES", "", "the disk cache's budget in bytes (default 1 GiB)")
CACHE_DIR = EnvVar(
    "COMPILED_AUTOGRAD_CACHE_DIR", "", "where the native helper is built and cached (default: $XDG_CACHE_HOME/compiled_autograd)"
)
XDG_CACHE_HOME = EnvVar("XDG_CACHE_HOME", "", "the user's cache directory (default: ~/.cache)")
LOG = EnvVar("COMPILED_AUTOGRAD_LOG", "", "info or debug: the compiled_autograd logger prints to stderr")
RECORD = EnvVar("COMPILED_AUTOGRAD_RECORD", "1", "0: every capture is traced with make_fx (NOTE [Recording a static trace])")
RECORD_LIVE = EnvVar(
    "COMPILED_AUTOGRAD_RECORD_LIVE", "1", "0: no capture is recorded on the real tensors (NOTE [Recording on the real tensors])"
)
LINT = EnvVar("COMPILED_AUTOGRAD_LINT", "0", "1: every captured graph is linted after its passes (slower; the tests set it)")
UNTESTED_TORCH = EnvVar("COMPILED_AUTOGRAD_UNTESTED_TORCH", "", "1: compile on a torch release the library was not written for")
COMPILE_NICE = EnvVar("COMPILED_AUTOGRAD_COMPILE_NICE", "5", "how much lower a background compile thread's CPU priority is than training's")
EXIT_WAIT = EnvVar("COMPILED_AUTOGRAD_EXIT_WAIT", "", "seconds the exit waits for background compiles (default 10; inf: to the end)")
COMPILE_PROCESS = EnvVar(
    "COMPILED_AUTOGRAD_COMPILE_PROCESS", "1", "0: a background inductor compile runs in a thread only, no child process"
)
CHILD_NICE = EnvVar(
    "COMPILED_AUTOGRAD_CHILD_NICE",
    "idle",
    "the child compile's priority: idle (SCHED_IDLE) or a niceness (the child reads it itself, before it imports anything)",
)
COMPILE_AFTER = EnvVar(
    "COMPILED_AUTOGRAD_COMPILE_AFTER",
    "20",
    "seconds of training after which a starved compile gets COMPILE_SHARE of the time (NOTE [The compile's share of a busy machine])",
)
COMPILE_SHARE = EnvVar(
    "COMPILED_AUTOGRAD_COMPILE_SHARE",
    "0.05",
    "the most of training's time a starved compile gets after COMPILE_AFTER, in any run of steps (at most 0.5)",
)
FINISH_AFTER_EXIT = EnvVar(
    "COMPILED_AUTOGRAD_FINISH_AFTER_EXIT",
    "300",
    "seconds a child compile still running at exit may go on after it (0: stopped at exit; NOTE [A compile finished after exit])",
)
SUBCLASSES = EnvVar(
    "COMPILED_AUTOGRAD_SUBCLASSES",
    "1",
    "0: a backward with a traceable wrapper subclass (DTensor, a user's) "
    "runs in eager autograd, instead of its subclasses flattened and traced through (docs/design/subclasses.md)",
)
REPRO_DIR = EnvVar(
    "COMPILED_AUTOGRAD_REPRO_DIR",
    "",
    "where the script of a graph whose backend failed is written (default: "
    "<temp dir>/compiled_autograd_repro; NOTE [A graph you can run], compile/repro.py)",
)
ENVIRONMENT = (
    DISK_CACHE,
    GRAPH_DIR,
    GRAPH_DIR_MAX_BYTES,
    CACHE_DIR,
    XDG_CACHE_HOME,
    LOG,
    RECORD,
    RECORD_LIVE,
    LINT,
    UNTESTED_TORCH,
    COMPILE_NICE,
    EXIT_WAIT,
    COMPILE_PROCESS,
    CHILD_NICE,
    COMPILE_AFTER,
    COMPILE_SHARE,
    FINISH_AFTER_EXIT,
    SUBCLASSES,
    REPRO_DIR,
)


@dataclass(frozen=True)
class Backend:
    """A named backend: how it compiles a captured graph, and what the rest of the library
    may assume about the code it makes."""

    name: str
    compile: Callable  # (gm, example_inputs, dynamic, patches) -> a callable taking the graph inputs
    # its code leaves a grad handed to AccumulateGrad alone: AccumulateGrad may take the graph's
    # buffer as `.grad` (NOTE [Stealing a fresh grad] in nodes/accumulate.py)
    steals: bool
    background: bool  # compiled in a background thread unless enable(background=...) says otherwise
    eager_kernels: bool  # runs eager's kernels in eager's order: results bitwise eager's


# the backend registry, name -> Backend: the one list of names an option may give (the
# built-in ones are registered by compile/backends.py, which the package imports)
BACKENDS: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    BACKENDS[backend.name] = backend
    return backend


@dataclass(frozen=True)
class Config:
    """Options of one `enable()` scope.

    backend:   "eager" (run the captured FX graph as Python), "aot_eager",
               "inductor", or a callable ``(gm, example_inputs) -> callable``.
    fullgraph: raise instead of falling back to eager autograd when a backward
               cannot be captured or compiled.
    cache_size_limit: captured graphs kept per process (least recently used
               entries are dropped).
    opaque:    node names (e.g. "MulBackward0") to run eagerly inside the
               compiled graph instead of tracing them.
    dynamic:   None (default): the first graph of a structure is static; when
               the same structure comes back with other sizes, the sizes that
               changed become symbolic in one more capture. True: symbolic
               from the first capture. False: always static.
    background: compile in a background thread and replay the traced graph
               as is meanwhile (None: only for inductor; off under fullgraph).
    disk_cache: store captured static graphs on disk and load them in later
               processes instead of tracing (default on; the environment
               variable COMPILED_AUTOGRAD_DISK_CACHE=0 turns it off).
    mode, options: inductor's, as in `torch.compile(mode=..., options=...)`
               (e.g. mode="max-autotune-no-cudagraphs", options={"max_autotune":
               True}); one or the other, only with backend="inductor". Applied
               as inductor config patches while our graphs compile, and part of
               the cache key.
    """

    backend: BackendLike = "inductor"
    fullgraph: bool = False
    cache_size_limit: int = 256
    opaque: tuple = ()
    dynamic: bool | None = None
    background: bool | None = None
    disk_cache: bool = field(default_factory=DISK_CACHE.on)
    mode: str | None = None
    options: tuple = ()  # sorted (name, value) pairs; a dict is accepted

    def __post_init__(self):
        if isinstance(self.backend, str) and self.backend not in BACKENDS:
            raise ValueError(
                f"compiled_autograd: unknown backend {self.backend!r}; "
                f"expected one of {', '.join(BACKENDS)} or a callable (gm, example_inputs) -> callable"
            )
        if not isinstance(self.backend, str) and not callable(self.backend):
            raise TypeError(f"compiled_autograd: backend must be a str or callable, got {type(self.backend)}")
        object.__setattr__(self, "opaque", tuple(sorted(set(self.opaque))))
        self._check_inductor_options()
        if self.cache_size_limit < 1:
            raise ValueError("compiled_autograd: cache_size_limit must be >= 1")

    def _check_inductor_options(self) -> None:
        options = self.options
        if isinstance(options, dict):
            options = tuple(sorted(options.items()))
            object.__setattr__(self, "options", options)
        if self.mode is None and not options:
            return
        if self.backend != "inductor":
            raise ValueError("compiled_autograd: mode and options are inductor's: they need backend='inductor'")
        if self.mode is not None and options:
            raise ValueError("compiled_autograd: either mode or options can be specified, but both can't be specified at the same time")
        from torch._inductor import config as inductor_config

        if self.mode is not None:
            from torch._inductor import list_mode_options

            if self.mode not in ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"):
                raise ValueError(f"compiled_autograd: unknown mode {self.mode!r}")
            options = tuple(sorted(list_mode_options(self.mode).items()))
            object.__setattr__(self, "options", options)
        known = inductor_config.get_config_copy()
        for name, _ in options:
            if name.replace("-", "_") not in known:
                raise RuntimeError(f"compiled_autograd: unexpected inductor option {name!r}")

    @property
    def backend_label(self) -> str:
        return self.backend_name + (f" (options {dict(self.options)})" if self.options else "")

    @functools.cached_property
    def backend_key(self):
        """The backend as the cache key sees it: with its options, which change the compiled code
        (computed once: it is read on every backward)."""
        if not self.options:
            return self.backend
        return f"{self.backend} {self.options!r}"

    @property
    def inductor_patches(self) -> dict:
        return {name.replace("-", "_"): value for name, value in self.options}

    @property
    def background_compile(self) -> bool:
        if self.background is None:
            return isinstance(self.backend, str) and BACKENDS[self.backend].background
        return bool(self.background) and self.backend != "eager"

    @property
    def backend_name(self) -> str:
        if isinstance(self.backend, str):
            return self.backend
        return getattr(self.backend, "__name__", type(self.backend).__name__)


_active: contextvars.ContextVar[Config | None] = contextvars.ContextVar("compiled_autograd_config", default=None)


def current() -> Config | None:
    """The config of the innermost active `enable()` scope, or None."""
    return _active.get()


def leave_scopes() -> None:
    """No `enable()` scope from here on, in this context (a copy of the user's, in which a
    background compile runs: compile/background.py)."""
    _active.set(None)
