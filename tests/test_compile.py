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


@pytest.mark.parametrize("method", list_methods())
def test_compiled_fit_equals_the_traced_one(method):
    torch._dynamo.reset()
    traced, compiled = _run(method, {"backend": "eager"}), _run(method, {"backend": "aot_eager"})
    _close(traced, compiled)
    if method in NOISELESS:
        _close(_run(method, False), compiled)


def test_a_compiled_step_is_one_graph_and_keeps_the_global_rng():
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
