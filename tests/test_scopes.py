"""enable()/disable() objects used more than once at a time: nested, recursive, in threads
(each use of a scope object is its own, as with torch.no_grad)."""

import threading

import pytest
import torch

import compiled_autograd as ca
from compiled_autograd import config


def _backend_named(name):
    def backend(gm, example_inputs):
        return gm

    backend.__name__ = name
    return backend


def test_disable_object_entered_twice_nested():
    off = ca.disable()
    with ca.enable("eager") as on:
        with off:
            assert config.current() is None
            with off:
                assert config.current() is None
            assert config.current() is None
        assert config.current() is on.config
    assert config.current() is None


def test_enable_object_entered_twice_nested():
    on, inner = ca.enable("eager"), ca.enable("aot_eager")
    with on:
        with inner:
            with on:
                assert config.current() is on.config
            assert config.current() is inner.config
        assert config.current() is on.config
    assert config.current() is None


def test_recursive_disabled_function():
    seen = []

    @ca.disable()
    def countdown(n):
        seen.append(config.current())
        if n:
            countdown(n - 1)
        seen.append(config.current())

    with ca.enable("eager") as on:
        countdown(3)
        assert config.current() is on.config
    assert seen == [None] * 8


def test_recursive_enabled_function_computes_grads():
    w = torch.randn(4, requires_grad=True)

    @ca.enable("eager")
    def step(n):
        if n:
            step(n - 1)
        assert config.current().backend == "eager"
        (w * n).exp().sum().backward()

    step(2)
    assert config.current() is None
    assert ca.stats().eager_fallbacks == 0


class _Order:
    """Two threads inside one scope at the same time, in the order that a shared token
    list gets wrong: thread 0 enters, then thread 1, then thread 0 leaves first."""

    def __init__(self):
        self.barrier = threading.Barrier(2, timeout=30)
        self.entered0 = threading.Event()
        self.left0 = threading.Event()

    def before_enter(self, i):
        if i == 1:
            assert self.entered0.wait(30)

    def entered(self, i):
        if i == 0:
            self.entered0.set()

    def inside(self, i):
        self.entered(i)
        self.barrier.wait()  # both threads are inside the scope now
        if i == 1:
            assert self.left0.wait(30)  # thread 0 leaves first

    def after_exit(self, i):
        if i == 0:
            self.left0.set()


def _two_threads_at_once(body):
    """Run body(i) in two threads; return their errors."""
    errors = []

    def run(i):
        try:
            body(i)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    return errors


def test_decorated_function_in_two_threads_at_once():
    inner = _backend_named("inner_backend")
    order = _Order()
    inside = []

    @ca.enable(inner)
    def decorated(i):
        order.inside(i)
        inside.append((i, config.current().backend))

    def body(i):
        outer = _backend_named(f"outer{i}")
        with ca.enable(outer) as scope:
            order.before_enter(i)
            try:
                decorated(i)
            finally:
                order.after_exit(i)
            assert config.current() is scope.config, (i, config.current())
        assert config.current() is None

    assert _two_threads_at_once(body) == []
    assert sorted(inside, key=lambda x: x[0]) == [(0, inner), (1, inner)]


def test_with_of_one_shared_enable_object_in_two_threads_at_once():
    shared = ca.enable(_backend_named("shared_backend"))
    off = ca.disable()
    orders = [_Order(), _Order()]
    inside = []

    def body(i):
        with ca.enable(_backend_named(f"outer{i}")) as scope:
            orders[0].before_enter(i)
            try:
                with shared:
                    orders[0].entered(i)
                    inside.append((i, config.current()))
                    orders[1].before_enter(i)
                    try:
                        with off:  # one disable object, too, in both threads at once
                            orders[1].inside(i)
                            assert config.current() is None
                    finally:
                        orders[1].after_exit(i)
                    assert config.current() is shared.config
                    orders[0].inside(i)
            finally:
                orders[0].after_exit(i)
            assert config.current() is scope.config, (i, config.current())
        assert config.current() is None

    assert _two_threads_at_once(body) == []
    assert sorted(inside, key=lambda x: x[0]) == [(0, shared.config), (1, shared.config)]


def test_scope_computes_grads_in_two_threads_at_once():
    shared = ca.enable("eager")
    order = _Order()
    ws = [torch.randn(4, 3, requires_grad=True) for _ in range(2)]
    refs = []
    for w in ws:
        refs.append(torch.autograd.grad((w * 2).tanh().sum(), w)[0])

    def body(i):
        order.before_enter(i)
        try:
            with shared:
                order.inside(i)
                (ws[i] * 2).tanh().sum().backward()
        finally:
            order.after_exit(i)

    assert _two_threads_at_once(body) == []
    for w, ref in zip(ws, refs):
        assert torch.equal(w.grad, ref)
    assert ca.stats().eager_fallbacks == 0


def test_scopes_left_out_of_order():
    a, b = ca.enable("eager"), ca.enable("aot_eager")
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    assert config.current() is b.config  # the innermost scope still entered
    b.__exit__(None, None, None)
    assert config.current() is None  # what `a` found
    with pytest.raises(RuntimeError, match="not entered"):
        b.__exit__(None, None, None)
