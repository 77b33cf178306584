"""AccumulateGrad with eager semantics."""

import pytest
import torch

import compiled_autograd as ca
from helpers import assert_grads_equal, copies_in, parity


def test_grad_none_is_assigned_then_accumulated_in_place():
    w = torch.randn(3, 4, requires_grad=True)
    x1, x2 = torch.randn(2, 3), torch.randn(2, 3)
    with ca.enable("eager", fullgraph=True):
        (x1 @ w).pow(2).sum().backward()
        g = w.grad
        first = g.clone()
        (x2 @ w).pow(2).sum().backward()
    assert w.grad is g, "accumulation must be in place, like eager"
    ref = torch.autograd.grad((x1 @ w).pow(2).sum(), w)[0] + torch.autograd.grad((x2 @ w).pow(2).sum(), w)[0]
    assert_grads_equal([w.grad, first], [ref, torch.autograd.grad((x1 @ w).pow(2).sum(), w)[0]], exact=True)
    assert ca.stats().captures == 1 and ca.stats().hits == 1


def test_zero_grad_set_to_none_false_then_backward():
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 4)
    model(x).sum().backward()
    opt.zero_grad(set_to_none=False)
    grads = [p.grad for p in model.parameters()]
    with ca.enable("eager", fullgraph=True):
        model(x).pow(2).sum().backward()
    for p, g in zip(model.parameters(), grads):
        assert p.grad is g
    ref = torch.autograd.grad(model(x).pow(2).sum(), list(model.parameters()))
    assert_grads_equal([p.grad for p in model.parameters()], list(ref), exact=True)


def test_leaf_that_does_not_require_grad_gets_nothing():
    a = torch.randn(3, requires_grad=True)
    b = torch.randn(3)
    with ca.enable("eager", fullgraph=True):
        (a * b).sum().backward()
    assert b.grad is None and a.grad is not None


def test_requires_grad_turned_off_after_forward():
    a = torch.randn(3, requires_grad=True)
    c = torch.randn(3, requires_grad=True)
    loss = (a * c).sum()
    c.requires_grad_(False)
    with ca.enable("eager", fullgraph=True):
        loss.backward()
    assert c.grad is None  # AccumulateGrad skips a leaf that no longer requires grad
    torch.testing.assert_close(a.grad, c)


def test_layout_contract_channels_last_and_transposed_params():
    def leaves():
        torch.manual_seed(0)
        w = torch.randn(8, 3, 3, 3).to(memory_format=torch.channels_last).requires_grad_()
        v = torch.randn(6, 5).t().requires_grad_()  # a transposed leaf
        return [w, v]

    def fn(ls):
        w, v = ls
        x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
        return torch.nn.functional.conv2d(x, w).pow(2).mean() + (torch.ones(4, 5) @ v).pow(2).sum()

    ls = leaves()
    parity(lambda: fn(ls), ls, lambda step: (), steps=1)  # (grads bitwise, and their strides)


def test_leaf_used_as_root():
    x = torch.randn(3, requires_grad=True)
    g = torch.randn(3)
    with ca.enable("eager", fullgraph=True):
        x.backward(g)
    torch.testing.assert_close(x.grad, g)
    assert x.grad is not g  # the user still holds g: eager clones it


def test_mixed_precision_leaf():
    # float16 / bfloat16 leaves: grads arrive in the leaf's dtype
    def leaves():
        torch.manual_seed(0)
        return [torch.randn(4, 4, dtype=torch.bfloat16, requires_grad=True), torch.randn(4, dtype=torch.float16, requires_grad=True)]

    def fn(ls):
        a, b = ls
        return (a.float() @ torch.ones(4, 4)).sum() + (b.float() * 3).pow(2).sum()

    ls = leaves()
    parity(lambda: fn(ls), ls, lambda step: (), steps=1)  # (dtypes too)


def test_in_graph_accumulate_steals_a_fresh_grad_as_eager_and_copies_a_users_tensor():
    # a post-accumulate hook puts AccumulateGrad inside the graph (NOTE [Stealing a fresh
    # grad]): W's grad is the graph's own mm result, stolen as eager steals it; x's grad is
    # a view of the user's root grad g, which must stay the user's (AccumulateGrad copies it)
    for backend in ("eager", "aot_eager"):
        for step in range(2):
            runs = []
            for compiled in (False, True):
                torch.manual_seed(step)
                w = torch.randn(16, 16, requires_grad=True)
                x = torch.randn(16, requires_grad=True)
                seen = []
                w.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
                x.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
                g = torch.randn(4, 16)
                out = torch.cat([(x.view(1, 16) @ w), x.view(1, 16)]).tanh().repeat(2, 1) + x.view(1, 16).expand(4, 16)

                def backward():
                    if compiled:
                        with ca.enable(backend, fullgraph=True):
                            out.backward(g)
                    else:
                        out.backward(g)

                copies = copies_in(backward)
                g.add_(1.0)  # the user's tensor changes afterwards: no grad may alias it
                runs.append((copies, [w.grad.clone(), x.grad.clone()], seen))
            (eager_copies, want, want_seen), (copies, got, got_seen) = runs
            assert_grads_equal(got + got_seen, want + want_seen, what=f"{backend} step {step}", exact=True)
            if step == 1:  # a hit: no copy beyond eager's (the hook's clones are in both)
                assert copies <= eager_copies, (backend, copies, eager_copies)
        s = ca.stats()
        assert (s.captures, s.hits, s.eager_fallbacks) == (1, 1, 0), (backend, s)
        ca.reset()


@pytest.mark.inductor
def test_inductor_in_graph_accumulate_with_reused_buffers_and_no_op_inputs():
    # NOTE [Stealing a fresh grad] with inductor: two same-shape weights accumulated in the
    # graph (hooks), whose dead grad buffers inductor may reuse for one another, and a zero
    # pad, whose backward (a pad by zero) inductor may turn into the user's root grad itself,
    # which must not become x.grad (the user changes it afterwards)
    def run(compiled, step):
        torch.manual_seed(step)
        w1, w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
        x = torch.randn(4, 8, requires_grad=True)
        for p in (w1, w2, x):
            p.register_post_accumulate_grad_hook(lambda p: None)
        a = torch.randn(4, 8)
        g = torch.randn(4, 8)
        out = torch.tanh(torch.tanh(a @ w1) @ w2) + torch.nn.functional.pad(x, (0, 0))
        if compiled:
            with ca.enable("inductor", fullgraph=True, background=False):
                out.backward(g)
        else:
            out.backward(g)
        g.add_(1.0)
        return [w1.grad, w2.grad, x.grad]

    for step in range(2):
        for got, want in zip(run(True, step), run(False, step)):
            torch.testing.assert_close(got, want)
    s = ca.stats()
    assert (s.captures, s.hits, s.eager_fallbacks) == (1, 1, 0), s


@pytest.mark.inductor
def test_inductor_does_not_reuse_a_grad_buffer_handed_to_accumulate_grad():
    # w's grad (an mm result) becomes w.grad inside the graph; inductor would then write
    # the next same-sized result (h's grad) into that dead buffer (`buf3 = buf1  # reuse`):
    # our lowering keeps it from reuse (NOTE [Stealing a fresh grad])
    def run(compiled, step):
        torch.manual_seed(step)
        w = torch.randn(8, 8, requires_grad=True)
        v = torch.randn(8, 8, requires_grad=True)
        for p in (w, v):
            p.register_post_accumulate_grad_hook(lambda p: None)
        g = torch.randn(8, 8)
        out = torch.tanh(torch.tanh(v * 3) @ w)
        if compiled:
            with ca.enable("inductor", fullgraph=True, background=False):
                out.backward(g)
        else:
            out.backward(g)
        return [w.grad, v.grad]

    for step in range(2):
        for got, want in zip(run(True, step), run(False, step)):
            torch.testing.assert_close(got, want)
    s = ca.stats()
    assert (s.captures, s.hits, s.eager_fallbacks) == (1, 1, 0), s


def test_a_grad_the_graph_still_reads_is_not_handed_to_accumulate_grad():
    # (p + x * w): AddBackward gives p's AccumulateGrad and MulBackward the same tensor.
    # Eager's AccumulateGrad copies it (its input buffer for MulBackward still holds it),
    # and p's hook scales p.grad in place; a stolen grad would be the buffer the graph
    # then reads for w's grad (w.grad was off by 100x under eager and aot_eager)
    def run(backend, step):
        torch.manual_seed(step)
        p = torch.randn(4, requires_grad=True)
        w = torch.randn(4, requires_grad=True)
        x = torch.randn(4)

        def scale(t):
            t.grad.mul_(100)

        p.register_post_accumulate_grad_hook(scale)
        out = ((p + x * w) ** 2).sum()
        if backend is None:
            out.backward()
        else:
            with ca.enable(backend, fullgraph=True, background=False):
                out.backward()
        return [p.grad, w.grad]

    for backend in ("eager", "aot_eager"):
        for step in range(2):
            assert_grads_equal(run(backend, step), run(None, step), what=f"{backend} step {step}", exact=True)
        s = ca.stats()
        assert (s.captures, s.hits, s.eager_fallbacks) == (1, 1, 0), (backend, s)
        ca.reset()


def test_a_grad_from_a_multi_output_op_is_still_stolen():
    # convolution_backward's weight grad is one result of a multi-output op: read by
    # AccumulateGrad alone, it is the graph's own memory and eager steals it
    for backend in ("eager", "aot_eager"):
        for step in range(2):
            runs = []
            for compiled in (False, True):
                torch.manual_seed(step)
                conv = torch.nn.Conv2d(3, 4, 3)
                for q in conv.parameters():
                    q.register_post_accumulate_grad_hook(lambda t: None)
                x = torch.randn(2, 3, 8, 8, requires_grad=True)
                out = conv(x).tanh().sum()

                def backward():
                    if compiled:
                        with ca.enable(backend, fullgraph=True):
                            out.backward()
                    else:
                        out.backward()

                copies = copies_in(backward)
                runs.append((copies, [x.grad, conv.weight.grad, conv.bias.grad]))
            (eager_copies, want), (copies, got) = runs
            assert_grads_equal(got, want, what=f"{backend} step {step}", exact=True)
            if step == 1:
                assert copies <= eager_copies, (backend, copies, eager_copies)
        s = ca.stats()
        assert (s.captures, s.hits, s.eager_fallbacks) == (1, 1, 0), (backend, s)
        ca.reset()


def test_input_storages_are_compared_by_identity_and_not_kept_alive():
    # a boxed graph frees its inputs as it goes, and a grad allocated later may get a freed
    # input's memory: by data address it read as that input, so AccumulateGrad was given a
    # copy instead of the grad (a flaky extra copy in CI). Storages are compared by
    # identity, pinned by weak references, which do not keep the memory alive
    from torch.multiprocessing.reductions import StorageWeakRef

    from compiled_autograd.calls import kernel as ops

    kept = torch.randn(3)
    assert kept[1:] in ops.input_storages([kept])
    args = [torch.randn(1000)]
    ref = StorageWeakRef(args[0].untyped_storage())
    storages = ops.input_storages(args)
    args.clear()  # the graph frees it
    assert ref.expired(), "input_storages kept the input alive"
    assert not any(torch.empty(1000) in storages for _ in range(8))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_grad_a_leaf_hook_keeps_is_not_handed_to_dotgrad(backend):
    # a logging hook on a leaf stores the grad it is given; eager's AccumulateGrad sees that
    # reference and copies, so accumulating the next micro-batch into .grad leaves the stored
    # tensor alone. Ours handed .grad the same memory (NOTE [Stealing a fresh grad])
    def run(compiled):
        torch.manual_seed(0)
        w = torch.randn(3, 3, requires_grad=True)
        seen = []
        w.register_hook(lambda g: seen.append(g))
        for _ in range(3):
            loss = (torch.randn(4, 3) @ w).tanh().sum()
            if compiled:
                with ca.enable(backend, background=False, fullgraph=True):
                    loss.backward()
            else:
                loss.backward()
        return [t.clone() for t in seen] + [w.grad], any(t.data_ptr() == w.grad.data_ptr() for t in seen)

    want, want_shared = run(False)
    got, shared = run(True)
    assert not want_shared and not shared
    assert_grads_equal(got, want, exact=True)
    s = ca.stats()
    assert (s.captures, s.hits, s.eager_fallbacks) == (1, 2, 0), s


def test_a_grad_an_accumulate_grad_post_hook_reads_is_stolen_as_eager_steals_it():
    # DDP's reducer hooks each parameter's AccumulateGrad node (a post hook). Eager's engine
    # hands that hook the grad AccumulateGrad stole as `.grad` (one tensor: no copy); the
    # graph passed the same grad to the hook's call, and AccumulateGrad copied it for every
    # parameter (DDP's compiled step 1.05-1.13x eager's)
    def run(backend, step):
        torch.manual_seed(step)
        lin = torch.nn.Linear(64, 64)
        seen, accs = [], []
        for p in lin.parameters():
            acc = p.view_as(p).grad_fn.next_functions[0][0]
            accs.append(acc)  # (held, as DDP's reducer holds them)

            def hook(grad_inputs, grad_outputs, p=p):
                seen.append((grad_outputs[0].data_ptr() == p.grad.data_ptr(), grad_outputs[0].clone()))

            acc.register_hook(hook)
        out = lin(torch.randn(8, 64)).tanh().sum()

        def backward():
            if backend is None:
                out.backward()
            else:
                with ca.enable(backend, fullgraph=True, background=False):
                    out.backward()

        copies = copies_in(backward)
        return copies, [p.grad for p in lin.parameters()], seen

    for backend in ("eager", "aot_eager"):
        for step in range(2):
            want_copies, want, want_seen = run(None, step)
            copies, got, got_seen = run(backend, step)
            assert [same for same, _ in want_seen] == [True, True]  # (eager: the hook's grad is `.grad`)
            assert [same for same, _ in got_seen] == [True, True], (backend, step)
            assert_grads_equal(got + [g for _, g in got_seen], want + [g for _, g in want_seen], what=f"{backend} {step}", exact=True)
            if step == 1:
                assert copies <= want_copies, (backend, copies, want_copies)
        s = ca.stats()
        assert (s.captures, s.hits, s.eager_fallbacks) == (1, 1, 0), (backend, s)
        ca.reset()
