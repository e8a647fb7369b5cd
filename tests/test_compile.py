"""``fit(..., compile=...)`` for every family (issue 18, CPU part).

``torch.compile`` captures the training step of each family (dynamo + AOT autograd;
the ``aot_eager`` backend keeps CI free of C++ code generation, which the GPU
benchmark exercises with the default inductor backend). The compiled run must end
at the same posterior as the eager one.
"""

from __future__ import annotations

import pytest
import torch

from bayesify import bayesify, fit, list_methods
from tests.test_registry_state import loader, model


@pytest.mark.parametrize("method", list_methods())
def test_compiled_fit_equals_eager(method):
    def run(compile_option):
        bnn = bayesify(model(), method)
        kw = ({} if not bnn.method.step().optimizes
              else {"epochs": 1, "n_train": 5000, "seed": 0, "compile": compile_option})
        fit(bnn, loader(n=24), progress=False, **kw)
        return bnn.posterior_tensors()

    torch._dynamo.reset()
    eager, compiled = run(False), run({"backend": "aot_eager"})
    for name in eager:
        assert torch.allclose(eager[name].double(), compiled[name].double(),
                              atol=1e-5, rtol=1e-4), name
