"""Saved-tensor hooks: each hooked tensor unpacked in the graph when its node runs, with what
the hook returns learned from an eager backward (NOTE [Unpack metadata learned from the last
backward]); popping (offloading-style) hooks run once, unliftable results fall back, and a
hook whose result changes raises once."""

import contextlib

import pytest
import torch
import torch.utils.checkpoint as checkpoint

import compiled_autograd as ca
from helpers import assert_grads_equal, leaf, observe


def test_saved_tensors_hooks():
    def build(log, step):
        def pack(t):
            log.append(("pack", tuple(t.shape)))
            return t * 1

        def unpack(t):
            log.append(("unpack", tuple(t.shape)))
            return t

        x = leaf(3, 4)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            y = (x.exp() * x).sum()
        return y, [x]

    observe(build, steps=3, learning=1)
    # what a user's hook returns is not known before it runs: the first backward runs in eager
    # and learns it (NOTE [Unpack metadata learned from the last backward]); the capture and
    # the hit unpack each when its node runs
    explained = ca.explain()
    assert "saved-tensor hooks: 3 tensors unpacked in the graph, each when its node runs (as in eager)" in explained
    assert "learning_backwards=1" in explained and "unpacked when the backward started" not in explained


def test_each_hooked_tensor_is_unpacked_by_position():
    # a user's unpack hook returning shared tensors: [T1, T1, T2, T3] then [T1, T2, T2, T3].
    # Each is unpacked by its own call in the graph (not lifted and wired by identity), so
    # the second backward hits the first's graph and reads what its hooks return
    table = [torch.randn(3) for _ in range(3)]
    order = [[0, 0, 1, 2], [0, 1, 1, 2], [2, 1, 0, 0]]  # (the first backward learns, in eager)

    def build(log, step):
        a, b, c = leaf(3), leaf(3), leaf(3)
        positions = iter(range(4))
        with torch.autograd.graph.saved_tensors_hooks(lambda t: next(positions), lambda i: table[order[step][i]]):
            y = (a * b) * c  # saves a, b, then a * b, c
        return y.sum(), [a, b, c]

    observe(build, steps=3, learning=1)


def test_an_unpack_hook_returning_a_sparse_tensor_falls_back():
    # a tensor we cannot lift: the backward runs in eager, counted (the internal error escaped)
    def run(step, compiled):
        torch.manual_seed(step)
        x, w = leaf(4, 3), leaf(3, 3)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach().to_sparse() if t.shape == (3, 3) else t, lambda t: t):
            loss = (x @ w).tanh().sum()
        with ca.enable("aot_eager") if compiled else contextlib.nullcontext():
            loss.backward()
        return [x.grad, w.grad]

    for step in range(3):
        assert_grads_equal(run(step, True), run(step, False), what=f"step {step}", exact=True)
    s = ca.stats()
    # the first backward learns (in eager) that the hook returns what cannot be predicted; the
    # next ones unpack it up front, and cannot lift it
    assert (s.captures, s.learning_backwards, s.eager_fallbacks) == (0, 1, 2), s
    assert s.fallback_details["saved-tensor hook returned a non-strided lifted tensor"] == 2
    assert s.fallback_reasons["unliftable tensor"] == 2


def test_a_packed_tensor_of_another_shape_is_not_predicted_from_the_last():
    # index_fill saves its index; its length changes where nothing else in the graph does.
    # A hook that packs a tensor shows its shape, which keys what was learned (NOTE [Unpack
    # metadata learned from the last backward]): each length gets its own prediction
    def build(log, step):
        x = leaf(5, 3)
        idx = torch.arange([2, 3, 3, 2, 2, 3][step])
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):
            y = ((x * 2).index_fill(0, idx, 1.0) ** 2).sum()
        return y, [x]

    observe(build, steps=6, captures=2, learning=2)


def test_save_on_cpu():
    def build(log, step):
        x, w = leaf(3, 4), leaf(4, 5)
        with torch.autograd.graph.save_on_cpu():
            y = (x @ w).tanh().sum()
        return y, [x, w]

    observe(build)
    # x and w (for x @ w), the tanh's output
    assert "saved-tensor hooks: 3 tensors unpacked in the graph" in ca.explain()


def _stash_hooks():
    """An offloading-style pair: the packed value is a key into the hook's own stash."""
    stash = {}

    def pack(t):
        stash[len(stash)] = t.detach().clone()
        return len(stash) - 1

    return stash, pack, stash.pop


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_hook_that_changes_a_stashed_tensor_before_its_node_is_seen(backend):
    # NOTE [Unpack metadata learned from the last backward]: the stashed tensor is unpacked
    # when its node runs, after the tensor hook of the node before it changed it:
    # ExpBackward0's grad uses the doubled result, as in eager (the first backward learns in
    # eager, the second is a capture, the third a hit)
    def build(log, step):
        stash, pack, unpack = _stash_hooks()
        x = leaf(3, 4)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            a = x.exp()  # ExpBackward0 saves its result: stash[0]
        b = a * 2.0
        b.register_hook(lambda g: stash[0].mul_(2.0).sum() and None)
        log.append(len(stash))
        return b.sum(), [x]

    observe(build, backend, steps=3, learning=1)


def test_an_unpack_hook_returning_other_metadata_than_it_learned_goes_on_in_eagers_order():
    # the hit's graph was traced with what the hook returned the first time (float32); a hook
    # that then returns float64 stops the graph at its unpack, and the backward goes on from
    # there in eager's order (NOTE [A call output not as traced]): eager's grads (was: an error);
    # from the next backward on that tensor is unpacked up front again (a new capture)
    def run(compiled, dtype):
        torch.manual_seed(0)
        stash, pack, unpack = _stash_hooks()
        x = leaf(3, 4)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda k: unpack(k).to(dtype)):
            y = x.exp().sum()
        if compiled:
            with ca.enable("eager"):
                y.backward()
        else:
            y.backward()
        return x.grad

    for _ in range(2):  # the first learns, in eager; the second is the capture
        assert_grads_equal([run(True, torch.float32)], [run(False, torch.float32)], exact=True)
    want = run(False, torch.float64)  # eager: a float64 grad, cast back to x's dtype
    for _ in range(3):  # (stopped and resumed; captured again; a hit)
        assert_grads_equal([run(True, torch.float64)], [want], exact=True)
    s = ca.stats()
    assert (s.captures, s.hits, s.eager_fallbacks, s.learning_backwards, s.type_resumes) == (2, 2, 0, 1, 1), s


def _sparse_w_stash():
    """A popping stash whose (3, 3) tensor comes back sparse: unpredictable, so unpacked when
    the backward starts (after the first backward learned that), and a lifted sparse tensor
    falls back to eager."""
    stash, calls = {}, []

    def pack(t):
        stash[len(stash)] = t.detach().to_sparse() if t.shape == (3, 3) else t.detach().clone()
        return len(stash) - 1

    def unpack(k):
        calls.append(k)
        return stash.pop(k)

    return stash, calls, pack, unpack


def _popped_once(seed, compiled, make_hooks, **options):
    """x @ w, tanh, under popping hooks (`make_hooks()`: stash, calls, pack, unpack): each of the
    3 saved tensors unpacked once, as in eager; the grads."""
    torch.manual_seed(seed)
    x, w = leaf(4, 3), leaf(3, 3)
    stash, calls, pack, unpack = make_hooks()
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss = (x @ w).tanh().sum()
    with ca.enable("aot_eager", **options) if compiled else contextlib.nullcontext():
        loss.backward()
    assert sorted(calls) == [0, 1, 2] and not stash
    return [x.grad, w.grad]


def test_a_fallback_after_unpacking_up_front_does_not_unpack_again():
    # NOTE [Handing unpacked tensors to their saved variables]: the sparse tensor is unpacked
    # when the backward starts, and the fallback's engine would run its popping hook a second
    # time (KeyError); it gets the tensor already unpacked, the other hooks run once as in eager
    for seed in range(3):
        assert_grads_equal(
            _popped_once(seed, True, _sparse_w_stash), _popped_once(seed, False, _sparse_w_stash), what=f"seed {seed}", exact=True
        )
    s = ca.stats()
    assert (s.learning_backwards, s.eager_fallbacks) == (1, 2), s


def test_an_opaque_node_with_a_popping_hook_runs_it_once():
    # the first backward learns in eager (each hook once, at its node), the second the opaque
    # node's output layouts (NOTE [Layouts of call outputs]); then the opaque TanhBackward0
    # runs its own apply, which unpacks its saved result itself
    def hooks():
        stash, pack, pop = _stash_hooks()
        calls = []
        return stash, calls, pack, lambda k: calls.append(k) or pop(k)

    for seed in range(4):
        got = _popped_once(seed, True, hooks, opaque=("TanhBackward0",))
        assert_grads_equal(got, _popped_once(seed, False, hooks), what=f"seed {seed}", exact=True)
    s = ca.stats()
    assert (s.learning_backwards, s.captures, s.hits, s.eager_fallbacks, s.opaque_nodes) == (2, 1, 1, 0, 2), s


def test_retain_graph_runs_the_unpack_hooks_again_on_the_next_backward():
    # what collect unpacked (or learned through) serves its backward only: with retain_graph
    # the user's hooks are back for the next one (eager runs them once per backward); without,
    # the graph is freed. Seed 0's first backward learns in eager; seed 1's unpacks the sparse
    # tensor up front and falls back
    for seed in range(2):
        torch.manual_seed(seed)
        x, w = leaf(4, 3), leaf(3, 3)
        stash, calls, pack, _ = _sparse_w_stash()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda k: calls.append(k) or stash[k]):
            loss = (x @ w).tanh().sum()
        with ca.enable("aot_eager"):
            loss.backward(retain_graph=True)
        assert sorted(calls) == [0, 1, 2]
        loss.backward(retain_graph=True)  # eager
        assert len(calls) == 6
        with ca.enable("aot_eager"):
            loss.backward()
        assert len(calls) == 9
        want = torch.autograd.grad((x @ w).tanh().sum(), [x, w])  # (no hooks)
        torch.testing.assert_close(x.grad, 3 * want[0])
        torch.testing.assert_close(w.grad, 3 * want[1])
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            loss.backward()
    s = ca.stats()
    assert (s.learning_backwards, s.eager_fallbacks) == (1, 3), s


@pytest.mark.parametrize("retain", [True, False])
def test_an_error_in_the_learning_backward_is_the_users_and_runs_nothing_twice(retain):
    # the first backward with a user unpack hook runs in eager (it learns); a hook raising in it
    # must raise as in eager: the backward was run a second time from the start (w2's grad
    # doubled, every unpack hook run again)
    def run(compiled):
        torch.manual_seed(0)
        w1, w2, x = leaf(4, 4), leaf(4, 4), torch.randn(3, 4)
        unpacks, fail = [], [True]
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach().clone(), lambda t: unpacks.append(1) or t):
            h = (x @ w1).tanh()
            loss = (h @ w2).sin().sum()

        def flaky(g):  # runs after w2's grad was accumulated
            if fail.pop():
                raise RuntimeError("transient failure")

        h.register_hook(flaky)
        with pytest.raises(RuntimeError, match="transient failure"):
            with ca.enable("aot_eager") if compiled else contextlib.nullcontext():
                loss.backward(retain_graph=retain)
        return len(unpacks), w2.grad.clone()

    (n_eager, g_eager), (n_ours, g_ours) = run(False), run(True)
    assert n_ours == n_eager
    assert_grads_equal([g_ours], [g_eager], exact=True)
    s = ca.stats()
    assert (s.captures, s.hits, s.eager_fallbacks) == (0, 0, 0), s


@pytest.mark.slow
def test_a_learning_backward_through_nodes_that_free_their_saved_variables():
    # a Foreach node's release destroys its saved variables themselves (it clears their vector):
    # putting back hooks there read freed memory (a segfault once the vector was large)
    def run(compiled, seed, n=40):
        torch.manual_seed(seed)
        xs, ys = [leaf(2) for _ in range(n)], [leaf(2) for _ in range(n)]
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t * 1, lambda t: t + 0):
            loss = torch.stack(torch._foreach_mul(xs, ys)).sum()
        with ca.enable("aot_eager") if compiled else contextlib.nullcontext():
            loss.backward()
        return [torch.stack([x.grad for x in xs])]

    # 3000: a vector large enough to be unmapped when freed (the learning backward only: a
    # capture of 6000 unpack calls takes minutes)
    assert_grads_equal(run(True, 0, n=3000), run(False, 0, n=3000), exact=True)
    for seed in range(3):  # a smaller graph: learns in eager, then a capture, then a hit
        assert_grads_equal(run(True, seed), run(False, seed), what=f"seed {seed}", exact=True)
    s = ca.stats()
    assert (s.learning_backwards, s.captures, s.hits, s.eager_fallbacks) == (2, 1, 1, 0), s


def test_an_opaque_custom_function_with_a_popping_hook_unpacks_once():
    # collecting a custom Function reads its saved_tensors (runs the user's unpack hooks); an
    # opaque one (reentrant checkpoint) then runs its own backward, which read them again
    # (KeyError). What the hooks returned is handed to its saved variables instead
    def run(compiled):
        stash, n = {}, [0]

        def pack(t):
            stash[len(stash) + n[0]] = t.detach().clone()
            return len(stash) + n[0] - 1

        def unpack(k):
            n[0] += 1
            return stash.pop(k)

        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
        out = []
        for step in range(3):
            x = torch.randn(4, 6, requires_grad=True)
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                h = checkpoint.checkpoint(lambda a: m[1](m[0](a)), x, use_reentrant=True)
                loss = m[2](h).pow(2).sum()
            m.zero_grad()
            with ca.enable("aot_eager") if compiled else contextlib.nullcontext():
                loss.backward()
            out += [n[0], m[0].weight.grad.clone(), x.grad.clone()]
        return out

    want, got = run(False), run(True)
    for i, (g, w) in enumerate(zip(got, want)):
        if isinstance(w, int):
            assert g == w, (i, g, w)
        else:
            assert_grads_equal([g], [w], what=f"output {i}", exact=True)
    s = ca.stats()  # (the checkpoint's inner backward is compiled too: one more graph)
    assert s.eager_fallbacks == 0 and s.learning_backwards >= 1 and s.hits >= 1, s


def test_a_hook_whose_result_changes_stops_its_graph_once():
    # NOTE [Unpack metadata learned from the last backward]: the unpack hook switches to float64
    # after two steps; the graph traced with float32 stops at the first unpack and goes on in
    # eager's order (was: raised), and the next backward learns again every tensor of that graph
    # (not one stop per hooked tensor)
    double = [False]

    def run(compiled):
        torch.manual_seed(0)
        w = leaf(4, 3)
        outcome = []
        for step in range(6):
            double[0] = step >= 2
            x = torch.randn(4, 3)
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach().clone(), lambda t: t.double() if double[0] else t):
                loss = (x * w).exp().sin().sum()  # 3 hooked saved tensors
            w.grad = None
            try:
                with ca.enable("aot_eager") if compiled else contextlib.nullcontext():
                    loss.backward()
                outcome.append(w.grad.clone())
            except RuntimeError as e:
                assert "the previous backward of this graph got" in str(e)
                outcome.append("raised")
        return outcome

    want, got = run(False), run(True)
    assert "raised" not in got, got
    s = ca.stats()  # learn, capture, stop (a hit); learn again, capture, hit
    assert (s.learning_backwards, s.captures, s.hits, s.eager_fallbacks, s.type_resumes) == (2, 2, 2, 0, 1), s
    for step, (g, w) in enumerate(zip(got, want)):
        assert_grads_equal([g], [w], what=f"step {step}", exact=True)


def _bf16_offload():
    return torch.autograd.graph.saved_tensors_hooks(
        lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t,
        lambda t: t.float() if t.dtype == torch.bfloat16 else t,
    )


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_offloading_hooks_on_a_stream_of_sizes_learn_at_two_sizes_only(backend):
    # NOTE [Unpack metadata learned from the last backward]: an offloading hook pair returns a
    # tensor of the packed one's shape; seen to hold at two batch sizes, that rule predicts
    # every other size: no eager learning backward per new size, a dynamic graph from the fourth
    sizes = [3, 5, 7, 4, 9, 6]

    def build(log, step):
        torch.manual_seed(0)
        w = leaf(6, 8)
        b = leaf(8)
        torch.manual_seed(step)
        x = torch.randn(sizes[step], 6)
        with _bf16_offload():
            loss = torch.tanh(x @ w + b).pow(2).sum()
        return loss, [w, b]

    observe(build, backend, steps=len(sizes), captures=2, learning=2)
    assert ca.stats().dynamic_captures == 1


def test_a_hook_whose_packed_value_hides_the_shape_learns_at_every_size():
    # the rule needs the one packed tensor of the unpacked one's shape: a hook that packs a
    # flattened tensor (and the shape beside it) gives none, so each new size learns again
    sizes = [3, 5, 7]

    def build(log, step):
        torch.manual_seed(0)
        w = leaf(6, 8)
        torch.manual_seed(step)
        x = torch.randn(sizes[step], 6)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: (t.flatten(), t.shape), lambda p: p[0].view(p[1])):
            loss = torch.tanh(x @ w).pow(2).sum()
        return loss, [w]

    observe(build, steps=len(sizes), captures=0, learning=3)
