"""Names a new user tries (issue 24.4): ``bayesify`` as package, function and API
carrier; one line per family in ``bayesify methods``; the custom-loop helpers
(``posterior_optimizer``, ``tune``) and post-hoc MC dropout tuned without training."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.test_registry_state import loader, model


def test_every_spelling_of_bayesify_works():
    import bayesify
    import bayesify as bz
    from bayesify import BayesianModel
    from bayesify import bayesify as wrap
    from bayesify.persistence import load_posterior
    from bayesify.train.loop import fit

    assert isinstance(bayesify(model()), BayesianModel)          # the package is callable
    assert isinstance(bz.bayesify(model(), "dropout"), BayesianModel)
    assert isinstance(wrap(model(), method="rank1"), BayesianModel)
    # the function carries the package's API: the README style after `from bayesify import bayesify`
    assert wrap.load_posterior is load_posterior and wrap.fit is fit
    assert wrap.elbo_loss is bz.elbo_loss and wrap.tune is bz.tune and wrap.bayesify is wrap
    assert wrap.__version__ == bz.__version__ and wrap.acquisition.select is not None
    assert "method" in str(__import__("inspect").signature(wrap))  # help() shows the factory
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        wrap.nope  # noqa: B018


def test_bayesify_methods_prints_one_described_line_per_family():
    from bayesify import list_methods, method_summary

    out = subprocess.run([sys.executable, "-m", "bayesify.cli", "methods"], check=True,
                         capture_output=True, text=True).stdout.strip().splitlines()
    assert [line.split()[0] for line in out] == list_methods()
    for name, line in zip(list_methods(), out):
        summary = method_summary(name)
        assert 20 < len(summary) < 100 and "Config(" not in summary, name
        assert line.endswith(summary)


def test_custom_loop_helpers_match_fit():
    import bayesify as bz

    bnn = bz.bayesify(model(), "ibnn")
    opt = bz.posterior_optimizer(bnn)
    assert bz.posterior_lr(bnn) == bnn.method.step().defaults["lr"] == opt.param_groups[0]["lr"]
    assert isinstance(opt, torch.optim.SGD) and opt.param_groups[0]["nesterov"]
    ids = {id(p) for g in opt.param_groups for p in g["params"]}
    assert ids == {id(p) for p in bnn.posterior_parameters()}
    assert not any(p.requires_grad for p in bnn.base_parameters())
    groups = bz.param_groups(bnn, base_lr=1e-4)
    assert groups[-1]["name"] == "base" and all(p.requires_grad for p in bnn.base_parameters())


def test_post_hoc_dropout_is_tuned_without_a_training_pass():
    import bayesify as bz

    bnn = bz.bayesify(model(), "dropout", train_weights=False)
    before = {k: v.clone() for k, v in bnn.state_dict().items()}
    with pytest.raises(bz.BayesifyError, match="takes no gradient steps"):
        bz.posterior_optimizer(bnn)
    record = bz.tune(bnn, loader(n=32, seed=1))
    assert record["dropout_rate_scale"] in record["dropout_rate_scale_grid"]
    assert len(record["dropout_rate_scale_val_nll"]) == len(record["dropout_rate_scale_grid"])
    assert bnn.state.value("dropout_rate_scale") == record["dropout_rate_scale"]
    changed = [k for k, v in bnn.state_dict().items() if not torch.equal(v, before[k])]
    # nothing but the knob and the temperature (chosen with it) moved
    assert set(changed) <= {"state.dropout_rate_scale", "state.temperature"}


def test_default_dropout_is_post_hoc_and_fit_only_searches():
    """Post-hoc MC dropout is the default: ``fit`` makes no optimiser step (the weights, the
    base and every buffer stay), with validation it chooses the rate and the temperature as
    ``tune`` does, optimisation options are refused with what to do instead, and
    ``train_weights=True`` still fine-tunes."""
    import bayesify as bz

    # the family alone (its default Laplace heads add their own state: tests/test_laplace_heads.py)
    bnn = bz.bayesify(model(), "dropout", laplace_heads=False)
    assert not bnn.method.step().optimizes and bnn.method.step().trains_nothing
    before = {k: v.clone() for k, v in bnn.state_dict().items()}
    result = bz.fit(bnn, loader(), val_loader=loader(n=32, seed=1), progress=False)
    changed = {k for k, v in bnn.state_dict().items() if not torch.equal(v, before[k])}
    assert changed <= {"state.dropout_rate_scale", "state.temperature"}
    twin = bz.bayesify(model(), "dropout", laplace_heads=False)
    record = bz.tune(twin, loader(n=32, seed=1))
    assert result.last["dropout_rate_scale"] == record["dropout_rate_scale"]
    assert result.last["temperature"] == pytest.approx(record["temperature"])
    with pytest.raises(bz.BayesifyError, match=r"\['lr'\].*train_weights=True"):
        bz.fit(bz.bayesify(model(), "dropout"), loader(), lr=0.1, progress=False)
    with pytest.raises(bz.BayesifyError, match="train_weights=True"):
        bz.posterior_optimizer(bz.bayesify(model(), "dropout"))
    tuned = bz.bayesify(model(), "dropout", train_weights=True)
    start = {k: v.clone() for k, v in tuned.posterior_tensors().items()}
    bz.fit(tuned, loader(), epochs=1, progress=False)
    assert any(not torch.equal(v, start[k]) for k, v in tuned.posterior_tensors().items())


@pytest.mark.parametrize("family", ["swag", "laplace"])
def test_tune_refuses_families_built_inside_fit(family):
    import bayesify as bz

    with pytest.raises(bz.BayesifyError, match="bayesify.fit"):
        bz.tune(bz.bayesify(model(), family), loader(n=16))
