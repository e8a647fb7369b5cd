"""The member-wise Laplace heads on networks whose last layer is not a Linear classifier.

Found by running every family with its defaults on architectures outside the stress matrix
(benchmarks/results/session31.md): on SqueezeNet (a 1×1 convolution, ReLU and pooling give
the logits) eight families trained for 16–44 s and then failed with "laplace_heads needs a
Linear classifier in the model; none found". The heads are on by every family's default, so
a user who asked for nothing lost the whole fit. Now: on by default, they are turned off
(logged) where they cannot sit — at ``bayesify`` when the model has no Linear at all, at
the first batch of ``fit`` when its last Linear does not give the logits (a trunk's
squeeze-excitation Linear before a convolutional classifier); asked for, either is an error
before anything has trained.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bayesify import BayesifyError, bayesify, fit
from bayesify.kit import laplace_heads as heads


class _Excite(nn.Module):
    """Squeeze-excitation with Linear layers: the model's last Linear, but not its classifier."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(channels, channels // 2)
        self.fc2 = nn.Linear(channels // 2, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.fc2(torch.relu(self.fc1(x.mean((2, 3))))))
        return x * gate[:, :, None, None]


def _conv_classifier(excite: bool) -> nn.Module:
    """SqueezeNet's kind of head: a 1×1 convolution to the classes, pooled."""
    torch.manual_seed(0)
    layers = [nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()]
    if excite:
        layers.append(_Excite(8))
    layers += [nn.Conv2d(8, 3, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return nn.Sequential(*layers).eval()


def _loader(n: int = 48, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 6, 6, generator=g)
    y = (x.mean((1, 2, 3)) > 0).long() + (x[:, 0, 0, 0] > 1).long()
    return DataLoader(TensorDataset(x, y), batch_size=16)


class _Steps:
    """A callback that counts optimiser steps."""

    def __init__(self) -> None:
        self.steps = 0

    def on_step_end(self, state, terms) -> None:
        self.steps += 1


@pytest.mark.parametrize("method", ["ibnn", "swag"])
def test_a_model_without_a_linear_gets_its_family_without_heads(method, caplog) -> None:
    """No Linear at all: the default heads are off from ``bayesify`` on (one warning), the
    fit with validation finishes and predicts; asking for them is refused at once, the
    caller's model untouched."""
    model = _conv_classifier(excite=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with caplog.at_level(logging.WARNING, logger="bayesify"):
        bnn = bayesify(model, method)
    assert not bnn.posterior_config.laplace_heads
    assert any("no Linear classifier" in r.getMessage() and "laplace_heads=False"
               in r.getMessage() for r in caplog.records)
    fit(bnn, _loader(), val_loader=_loader(32, 1), epochs=1, progress=False)
    assert not heads.fitted(bnn)
    probs = bnn.predictor()(next(iter(_loader(8, 2)))[0]).probs
    assert torch.isfinite(probs).all() and probs.shape == (8, 3)
    with pytest.raises(BayesifyError, match="laplace_heads=False"):
        bayesify(model, method, laplace_heads=True)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)


@pytest.mark.parametrize("method", ["ibnn", "ensemble"])
def test_a_last_linear_that_is_not_the_classifier_is_found_before_the_first_step(
        method, caplog) -> None:
    """The last Linear is the trunk's squeeze-excitation: the first batch shows that its
    output is not the logits. Default heads: turned off with a warning naming the layer, the
    fit runs; asked for: an error before any optimiser step."""
    with caplog.at_level(logging.WARNING, logger="bayesify"):
        bnn = bayesify(_conv_classifier(excite=True), method)
        assert bnn.posterior_config.laplace_heads  # a Linear exists: not decided yet
        fit(bnn, _loader(), val_loader=_loader(32, 1), epochs=1, progress=False)
    assert not bnn.posterior_config.laplace_heads and not heads.fitted(bnn)
    said = [r.getMessage() for r in caplog.records if "member-wise Laplace heads" in r.getMessage()]
    assert said and "'3.fc2'" in said[0] and "not the model's logits (4, 3)" in said[0]

    asked = bayesify(_conv_classifier(excite=True), method, laplace_heads=True)
    steps = _Steps()
    with pytest.raises(BayesifyError, match=r"last Linear '3\.fc2'.*laplace_heads=False"):
        fit(asked, _loader(), val_loader=_loader(32, 1), epochs=1, progress=False,
            callbacks=[steps])
    assert steps.steps == 0


def test_a_linear_classifier_keeps_its_heads(caplog) -> None:
    """The check does not turn off heads that can sit: a Linear classifier at the end gets
    them fitted, with no warning about them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(4, 3)).eval()
    with caplog.at_level(logging.WARNING, logger="bayesify"):
        bnn = bayesify(model, "ibnn")
        fit(bnn, _loader(), val_loader=_loader(32, 1), epochs=1, progress=False)
    assert bnn.posterior_config.laplace_heads and heads.fitted(bnn)
    assert not any("member-wise Laplace heads" in r.getMessage() for r in caplog.records)


def test_the_refusals_say_what_would_work() -> None:
    """A family that needs a Linear classifier or a normalisation layer says which, and
    which family would take the model."""
    with pytest.raises(BayesifyError, match=r"Linear layer.*'ibnn'"):
        bayesify(_conv_classifier(excite=False), "laplace")
    plain = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    with pytest.raises(BayesifyError, match=r"BatchNorm / LayerNorm / GroupNorm.*another family"):
        bayesify(plain, "abnn")


def test_tune_after_a_custom_loop_turns_the_default_heads_off_before_its_passes(caplog):
    """``tune(train_loader=...)`` after a custom loop (``elbo_loss``) on a model whose last
    Linear is not its classifier: before the thirty-fifth stop the heads (on by default)
    failed after the family's whole search; now they are turned off before any pass, warned
    as ``fit`` does."""
    from bayesify import elbo_loss, tune

    bnn = bayesify(_conv_classifier(excite=True), "ibnn")
    opt = torch.optim.SGD([p for p in bnn.parameters() if p.requires_grad], lr=1e-3)
    for x, y in _loader():
        loss = elbo_loss(bnn, (x, y), n_train=48).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    with caplog.at_level(logging.WARNING, logger="bayesify"):
        record = tune(bnn, _loader(32, 1), train_loader=_loader())
    assert not bnn.posterior_config.laplace_heads and "heads_prior_precision" not in record
    said = [r.getMessage() for r in caplog.records if "Laplace heads" in r.getMessage()]
    assert said and said[0].startswith("tune:") and "'3.fc2'" in said[0]
    with pytest.raises(BayesifyError, match="laplace_heads=True needs a Linear classifier"):
        tune(bayesify(_conv_classifier(excite=True), "ibnn", laplace_heads=True),
             _loader(32, 1), train_loader=_loader())


def test_bayes_trainer_turns_the_default_heads_off_before_training(tmp_path, caplog):
    """The same through the Hugging Face ``Trainer``: decided on the first evaluation batch
    before ``train()`` trains, not after it (where ``tune`` would have failed)."""
    pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    from bayesify.integrations.hf import BayesTrainer

    def rows(loader: DataLoader) -> list[dict]:
        x, y = loader.dataset.tensors
        return [{"input": x[i], "labels": y[i]} for i in range(len(y))]

    bnn = bayesify(_conv_classifier(excite=True), "ibnn")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), num_train_epochs=1,
                                          per_device_train_batch_size=16, report_to=[],
                                          use_cpu=True, save_strategy="no")
    trainer = BayesTrainer(model=bnn, args=args, train_dataset=rows(_loader()),
                           eval_dataset=rows(_loader(32, 1)))
    with caplog.at_level(logging.WARNING, logger="bayesify"):
        trainer.train()
    assert not bnn.posterior_config.laplace_heads
    said = [r.getMessage() for r in caplog.records if "Laplace heads" in r.getMessage()]
    assert said and said[0].startswith("BayesTrainer:")
    assert "ibnn_noise_scale" in trainer.tune_record
