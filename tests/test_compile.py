"""``fit(..., compile=...)`` for every family (issue 18, CPU part).

``torch.compile`` captures the training step of each family (dynamo + AOT autograd;
the ``aot_eager`` backend keeps CI free of C++ code generation, which the GPU
benchmark exercises with the default inductor backend). A compiled step draws its
noise from the global RNG, seeded per step from the fit's generator
(:class:`bayesify.train.steps.SeededCompiledForward`): a ``torch.Generator`` inside the
graph broke it at every wrapped layer. So the compiled run must end at the posterior of
the same code traced without compilation (Dynamo's ``eager`` backend), and families
whose training draws nothing at the eager one's.
"""

from __future__ import annotations

import pytest
import torch

from bayesify import bayesify, fit, list_methods
from tests.test_registry_state import loader, model

#: families whose gradient step draws no random numbers
NOISELESS = {"batchensemble", "ensemble", "swag"}


def _run(method, compile_option):
    bnn = bayesify(model(), method)
    kw = ({} if not bnn.method.step().optimizes
          else {"epochs": 1, "n_train": 5000, "seed": 0, "compile": compile_option})
    fit(bnn, loader(n=24), progress=False, **kw)
    return bnn.posterior_tensors()


def _close(a, b):
    for name in a:
        assert torch.allclose(a[name].double(), b[name].double(), atol=1e-5, rtol=1e-4), name


#: compiled in the default run (the default family, a noiseless one, flows, rank-1 factors);
#: the other families under ``-m slow`` (5–29 s each on the CI's two cores)
DEFAULT_RUN = {"ibnn", "ensemble", "mnf", "rank1"}


@pytest.mark.parametrize("method", [
    m if m in DEFAULT_RUN else pytest.param(m, marks=pytest.mark.slow) for m in list_methods()])
def test_compiled_fit_equals_the_traced_one(method):
    torch._dynamo.reset()
    traced, compiled = _run(method, {"backend": "eager"}), _run(method, {"backend": "aot_eager"})
    _close(traced, compiled)
    if method in NOISELESS:
        _close(_run(method, False), compiled)


def test_a_compiled_step_is_one_graph_and_repeats():
    """iBNN on a CNN: the compiled training forward is one graph (it was one per wrapped
    layer, then recompiled per layer) and seeded runs repeat."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    first = _run("ibnn", {"backend": "eager"})
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    assert dict(counters["graph_break"]) == {}, dict(counters["graph_break"])
    again = _run("ibnn", {"backend": "eager"})
    _close(first, again)
    eager = _run("ibnn", False)
    assert any(not torch.equal(first[n], eager[n]) for n in first)  # the noise did differ


def test_the_seeded_compiled_forward_leaves_the_global_rng_alone():
    from bayesify.train.steps import SeededCompiledForward

    def draws(args, kwargs, y):
        return torch.randn(3), torch.randn(())

    forward = SeededCompiledForward(draws, torch.Generator().manual_seed(5), torch.device("cpu"))
    torch.manual_seed(0)
    a = forward((), {}, None)[0]
    after = torch.randn(2)
    torch.manual_seed(0)
    assert torch.equal(after, torch.randn(2))  # the caller's stream did not move
    again = SeededCompiledForward(draws, torch.Generator().manual_seed(5), torch.device("cpu"))
    assert torch.equal(a, again((), {}, None)[0])  # same generator state, same draws
    assert not torch.equal(a, forward((), {}, None)[0])  # the next step draws anew


def test_a_compiled_fit_resumed_mid_epoch_equals_the_uninterrupted_one(digits, tmp_path):
    """The compiled step's seeds come from the fit's generator, whose state the checkpoint
    carries: killed at optimiser step 5 and resumed, the same posterior."""
    from torch.utils.data import DataLoader, TensorDataset

    from tests.test_resume import Kill, KillAt, make_bnn, max_diff, state_of

    x, y = digits.train.tensors
    data = TensorDataset(x[:128], y[:128])
    options = {"epochs": 2, "lr": 0.1, "seed": 3, "progress": False,
               "compile": {"backend": "eager"}}

    def run(**extra):
        bnn = make_bnn()
        fit(bnn, DataLoader(data, batch_size=32, shuffle=True), **options, **extra)
        return bnn

    torch._dynamo.reset()
    full = state_of(run())
    with pytest.raises(Kill):
        run(checkpoint_dir=tmp_path, checkpoint_every_steps=3, callbacks=[KillAt(step=5)])
    resumed = state_of(run(resume=tmp_path))
    assert max_diff(resumed, full) <= 1e-6
