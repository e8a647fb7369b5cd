"""SWAG: moments vs a naive reference from stored snapshots, sampling, BatchNorm, prediction."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import update_bn
from torch.utils.data import DataLoader, TensorDataset

from bayesify import BayesifyError, bayesify, fit, load_posterior
from bayesify.methods.swag import posterior as swag_posterior
from bayesify.methods.swag import state as swag_state
from tests.pretrained_nets import fit_full_batch


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def convnet() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))


def data(shape: tuple[int, ...], n: int = 40, dtype=torch.float64, batch: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn((n, *shape), generator=g, dtype=dtype)
    y = torch.randint(0, 3, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch)


def learnable_data(n: int = 40, batch: int = 8) -> DataLoader:
    """4 features, 3 classes: the argmax of the first three features plus noise."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn((n, 4), generator=g, dtype=torch.float64)
    y = (x[:, :3] + 0.5 * torch.randn((n, 3), generator=g, dtype=torch.float64)).argmax(1)
    return DataLoader(TensorDataset(x, y), batch_size=batch)


def test_moments_match_naive_reference_from_snapshots():
    loader = data((4,))
    base = mlp()
    original = [p.detach().clone() for p in base.parameters()]
    bnn = bayesify(base, "swag", max_rank=4, snapshot_every_steps=2, lr=0.05)
    snaps: list[torch.Tensor] = []

    class Snapshots:  # the loop's own callbacks see every iterate the family collects
        def on_step_end(self, state, terms):
            if state.global_step % 2 == 0:
                params = dict(state.bnn.named_posterior_parameters())
                keys = swag_posterior.parameter_keys(swag_state.layers(state.bnn))
                snaps.append(torch.cat([params[name].detach().reshape(-1).clone()
                                        for name, _, _ in keys]))

    fit(bnn, loader, epochs=3, progress=False, callbacks=[Snapshots()])
    layers = swag_state.layers(bnn)
    theta = torch.stack(snaps)  # [T, P]
    t = theta.shape[0]
    assert t == 7 and swag_posterior.snapshots(layers) == t  # 15 steps, one snapshot every 2
    mean, sq, dev = swag_posterior.flat_moments(layers)
    torch.testing.assert_close(mean, theta.mean(0), atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(sq, theta.square().mean(0), atol=1e-12, rtol=1e-10)
    # deviations of the last R snapshots from the running mean *after* their update
    running = torch.cumsum(theta, 0) / torch.arange(1, t + 1, dtype=theta.dtype)[:, None]
    naive_dev = (theta - running)[-4:]
    order = [(i % 4) for i in range(t - 4, t)]  # ring buffer rows
    torch.testing.assert_close(dev[order], naive_dev, atol=1e-12, rtol=1e-10)
    low_rank = naive_dev.T @ naive_dev / 3
    torch.testing.assert_close(dev.T @ dev / 3, low_rank, atol=1e-12, rtol=1e-10)
    # the working copies now hold θ̄ (the SWA network); the base weights never moved
    params = dict(bnn.named_posterior_parameters())
    torch.testing.assert_close(
        torch.cat([params[n].reshape(-1) for n, _, _ in swag_posterior.parameter_keys(layers)]),
        theta.mean(0))
    assert all(torch.equal(a, b) for a, b in zip(original, bnn.base_parameters()))


def test_sample_formula_and_covariance():
    loader = data((4,))
    bnn = bayesify(mlp(), "swag", max_rank=5, snapshot_every_steps=1, lr=0.05)
    fit(bnn, loader, epochs=2, progress=False)
    layers = swag_state.layers(bnn)
    mean, sq, dev = swag_posterior.flat_moments(layers)
    r = dev.shape[0]
    assert r == 5
    var = (sq - mean**2).clamp_min(1e-30)
    # documented draw order: z2 [R] first, then z1 parameter by parameter
    g = swag_posterior.member_generator(3, 2)
    z2 = torch.randn(r, generator=g)
    z1 = torch.cat([torch.randn(p.shape, generator=g).reshape(-1) for p in bnn.base_parameters()])
    expected = mean + math.sqrt(0.5) * (var.sqrt() * z1.double() + dev.T @ z2.double() / math.sqrt(r - 1))
    got = torch.cat([v.reshape(-1) for v in bnn.method.sample(bnn, 2, seed=3).values()])
    torch.testing.assert_close(got, expected)
    # empirical covariance of many samples ≈ ½(diag + DᵀD/(R−1))
    samples = torch.stack([torch.cat([v.reshape(-1) for v in bnn.method.sample(bnn, m, seed=0).values()])
                           for m in range(2000)])
    cov = 0.5 * (torch.diag(var) + dev.T @ dev / (r - 1))
    emp = torch.cov(samples.T)
    assert (emp - cov).abs().max() < 0.1 * cov.diagonal().max()


def test_diag_variant_scale_one_and_swa_single_member():
    loader = data((4,))
    diag = bayesify(mlp(), "swag", variant="diag", snapshot_every_steps=1, lr=0.05)
    fit(diag, loader, epochs=1, progress=False)
    layers = swag_state.layers(diag)
    mean, sq, _ = swag_posterior.flat_moments(layers)
    g = swag_posterior.member_generator(0, 0)
    z1 = torch.cat([torch.randn(p.shape, generator=g).reshape(-1) for p in diag.base_parameters()])
    got = torch.cat([v.reshape(-1) for v in diag.method.sample(diag, 0, seed=0).values()])
    torch.testing.assert_close(got, mean + (sq - mean**2).clamp_min(1e-30).sqrt() * z1.double())
    swa = bayesify(mlp(), "swag", variant="swa", snapshot_every_steps=1, lr=0.05)
    fit(swa, loader, epochs=1, progress=False)
    x = loader.dataset.tensors[0][:5]
    members = swa.predictor().member_logits(x)
    assert members.shape == (1, 5, 3)
    torch.testing.assert_close(members.double(), swa(x).detach()[None])


def test_batchnorm_recomputation_restores_original_statistics():
    loader = data((1, 6, 6))
    net = convnet().double()
    update_bn(loader, net)  # the original net's statistics: cumulative average over the data
    reference = {k: v.clone() for k, v in net.state_dict().items() if "running" in k}
    net.eval()
    # lr = 0: every snapshot equals the pretrained weights, so the sample equals the mean
    bnn = bayesify(net, "swag", lr=0.0, momentum=0.0, weight_decay=0.0, snapshot_every_steps=1)
    fit(bnn, loader, epochs=1, progress=False)
    stats = bnn.method.member_batchnorm(bnn, 2, seed=0)
    for member in stats:
        for key, value in reference.items():
            torch.testing.assert_close(member[key], value, atol=1e-6, rtol=1e-5)
    for key, value in reference.items():  # the mean network installed with its statistics
        torch.testing.assert_close(bnn.model.get_buffer(key), value, atol=1e-6, rtol=1e-5)
    x = loader.dataset.tensors[0][:6]
    members = bnn.predictor(samples_per_component=2).member_logits(x)
    torch.testing.assert_close(members.double(), net(x).detach().expand(2, -1, -1), atol=1e-5, rtol=1e-5)


def test_prediction_is_reproducible_and_chunk_independent():
    loader = data((1, 6, 6), dtype=torch.float32)
    bnn = bayesify(convnet(), "swag", snapshot_every_steps=1, lr=0.05, bn_update_fraction=0.5)
    fit(bnn, loader, epochs=1, progress=False)
    x = loader.dataset.tensors[0][:8]
    whole = bnn.predictor(samples_per_component=5, max_rows=4096).member_logits(x)
    chunked = bnn.predictor(samples_per_component=5, max_rows=8).member_logits(x)  # one member per chunk
    assert whole.shape == (5, 8, 3)
    torch.testing.assert_close(whole, chunked, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(whole[0], whole[1])  # different sampled networks
    other_seed = bnn.predictor(samples_per_component=5, seed=1).member_logits(x)
    assert not torch.allclose(whole, other_seed)


@pytest.mark.parametrize("own_generator", [True, False])
def test_sampled_statistics_do_not_depend_on_the_passes_before(own_generator):
    """A member's recomputed BatchNorm statistics depend on the posterior and its seed, not on
    how many passes came before: with a shuffling training loader (its own generator, or the
    global RNG) a scale predicts the same after other scales were installed and another pass
    over the loader, and neither RNG stream is moved by the pass."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 1, 6, 6, generator=g)
    y = torch.randint(0, 3, (48,), generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True,
                        generator=torch.Generator().manual_seed(5) if own_generator else None)
    bnn = bayesify(convnet(), "swag", snapshot_every_steps=1, lr=0.05, bn_update_fraction=0.5)
    fit(bnn, loader, epochs=2, progress=False)
    cfg = bnn.method.config

    def member_logits(scale: float) -> torch.Tensor:
        swag_state.install_scale(bnn, cfg, scale)
        return bnn.predictor(samples_per_component=3).member_logits(x[:8])

    first = member_logits(0.5)
    member_logits(30.0)
    for _ in loader:  # another pass moves the loader's RNG (the Laplace heads' curvature)
        pass
    member_logits(2.0)
    loader_state = loader.generator.get_state() if own_generator else None
    global_state = torch.random.get_rng_state()
    again = member_logits(0.5)
    torch.testing.assert_close(again, first, atol=0, rtol=0)
    assert torch.equal(torch.random.get_rng_state(), global_state)
    if own_generator:
        assert torch.equal(loader.generator.get_state(), loader_state)


def test_moments_on_cpu_ignore_module_moves():
    bnn = bayesify(mlp().float(), "swag", moments_on_cpu=True)
    bnn.to(torch.float64)
    layer = next(iter(bnn.bayesian_layers().values()))
    assert layer.base_layer.weight.dtype == torch.float64
    assert layer.moments.mean("weight").dtype == torch.float32


def test_errors_are_explicit():
    with pytest.raises(BayesifyError, match="variant"):
        bayesify(mlp(), "swag", variant="multiswag")
    bnn = bayesify(mlp(), "swag", snapshot_every=5.0)
    with pytest.raises(BayesifyError, match="would collect 0 snapshot"):
        fit(bnn, data((4,)), epochs=1, progress=False)
    with pytest.raises(BayesifyError, match="unknown fit option"):
        fit(bayesify(mlp(), "swag"), data((4,)), progress=False, bogus=1)


def _swag_temperatures() -> list[float]:
    from bayesify.train.tuning import TEMPERATURES

    return [t for t in TEMPERATURES if t >= 1.0]


def _brute_force_nll(bnn, loader, scales) -> torch.Tensor:
    """``[V, T, n]`` per-example NLL of the public predictor at every scale and temperature
    SWAG's search considers (T ≥ 1: it does not sharpen)."""
    TEMPERATURES = _swag_temperatures()

    out = []
    x, y = loader.dataset.tensors
    for scale in scales:
        bnn.state.set("swag_scale", scale)
        swag_state.forget_batchnorm(bnn)
        pred = bnn.predictor(seed=0, temperature=1.0).predict(x)
        out.append(torch.stack([pred.scaled(t).nll(y).double() for t in TEMPERATURES]))
    return torch.stack(out)


def test_scale_chosen_on_validation_matches_brute_force_and_round_trips(tmp_path):
    """Both rules of the joint (scale, temperature) search against a brute force over the
    public predictor: 'min' — the lowest clean validation NLL; 'shift' — the lowest NLL on
    the shift loader among pairs within one paired SE (at most 0.005) of the calibrated start."""
    from bayesify.core.selection import choose_joint

    TEMPERATURES = _swag_temperatures()
    # labels a network can learn: on random labels every SWAG fit ends worse on validation
    # than its start, and fit hands the start back (train.best) instead of the searched state
    loader, val = learnable_data(), learnable_data(n=24, batch=24)
    shifted = DataLoader(TensorDataset(3.0 * val.dataset.tensors[0], val.dataset.tensors[1]),
                         batch_size=24)
    grid = (0.1, 100.0, 4)
    scales = torch.logspace(-1, 2, 4, dtype=torch.float64).tolist()
    chosen, temps, on_grid = {}, {}, {}
    for rule in ("min", "shift"):
        bnn = bayesify(mlp(), "swag", max_rank=4, snapshot_every_steps=2, lr=0.05, predict_samples=6,
                       scale_method="val_nll", scale_grid=grid, val_rule=rule,
                       laplace_heads=False)  # SWAG's own search (the heads search after it)
        info = fit(bnn, loader, epochs=2, progress=False, val_loader=val, shift_loader=shifted)
        chosen[rule], temps[rule] = bnn.method.scale(bnn), bnn.state.value("temperature")
        assert info.history[-1]["scale"] == chosen[rule]
        assert info.history[-1]["temperature"] == pytest.approx(temps[rule])
        # the grid's choice (a temperature the shift did not decide is refined between its
        # grid neighbours: at most half a step, tuning.refined_temperature)
        on_grid[rule] = info.history[-1]["temperature_on_grid"]
        assert on_grid[rule] / 1.1 < temps[rule] < on_grid[rule] * 1.1
    clean, shift = _brute_force_nll(bnn, val, scales), _brute_force_nll(bnn, shifted, scales)
    flat = int(clean.mean(-1).argmin())
    assert chosen["min"] == pytest.approx(scales[flat // len(TEMPERATURES)])
    assert on_grid["min"] == pytest.approx(TEMPERATURES[flat % len(TEMPERATURES)])
    x, y = val.dataset.tensors
    logits = mlp()(x).detach().double()
    base = torch.stack([nn.functional.cross_entropy(logits / t, y, reduction="none")
                        for t in TEMPERATURES])
    reference = base[int(base.mean(1).argmin())]
    v, t = choose_joint(clean, shift, reference, prefer="largest", grid=scales)
    assert chosen["shift"] == pytest.approx(scales[v])
    assert on_grid["shift"] == pytest.approx(TEMPERATURES[t])
    # the shift rule is never clearly worse than the calibrated start on clean data
    diff = clean[v, t] - reference
    # (or, when no pair is that close, the pair with the lowest clean NLL of all)
    assert (diff.mean() <= min(diff.std() / math.sqrt(diff.numel()), 0.005) + 1e-12
            or (v, t) == divmod(int(clean.mean(-1).argmin()), len(TEMPERATURES)))
    # the chosen scale travels with the saved posterior
    bnn.state.set("swag_scale", chosen["shift"])
    bnn.save_posterior(tmp_path)
    fresh = load_posterior(mlp(), tmp_path)
    assert fresh.method.scale(fresh) == pytest.approx(chosen["shift"])
    with pytest.raises(BayesifyError, match="val_loader"):
        fit(bayesify(mlp(), "swag", scale_method="val_nll", snapshot_every_steps=1), loader,
            progress=False)
    with pytest.raises(BayesifyError, match="scale_grid"):
        bayesify(mlp(), "swag", scale_grid=(10.0, 1.0, 3))


def _foreign_statistics_net(loader: DataLoader) -> nn.Module:
    """A BatchNorm CNN whose statistics came from other data (shifted and widened, as ImageNet
    statistics under new images) and whose classifier was then fitted through them on
    ``loader``'s data in eval mode, as a linear probe on frozen features is."""
    net = convnet().double()
    update_bn(loader, net)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):  # per channel: other data, other statistics
                shape = m.running_mean.shape
                m.running_mean.add_(2.0 * torch.randn(shape, generator=g, dtype=torch.float64))
                m.running_var.mul_(torch.exp(2.0 * torch.randn(shape, generator=g,
                                                               dtype=torch.float64)))
    net.eval()
    return fit_full_batch(net, net[-1].parameters(), *loader.dataset.tensors, lr=0.05)


def _probe_task() -> DataLoader:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 1, 6, 6, generator=g, dtype=torch.float64)
    y = (x[:, 0, :3].mean((1, 2)) > 0).long() + (x[:, 0, 3:].mean((1, 2)) > 0.2).long()
    return DataLoader(TensorDataset(x, y), batch_size=8)


def _still_swag(net: nn.Module):
    return bayesify(net, "swag", variant="diag", scale=0.1, lr=0.0, momentum=0.0,
                    weight_decay=0.0, snapshot_every_steps=1, predict_samples=3)


def test_statistics_from_other_data_are_kept_when_recomputing_costs_training_accuracy(
        caplog, tmp_path, monkeypatch):
    # issue 30: SWA's mean on EfficientNet-Lite0 (ImageNet statistics, a 10-way digit head)
    # fell from 0.84 to 0.17 test accuracy when its statistics were recomputed from the
    # training data; the labels of the training examples say which statistics θ̄ works with
    loader = _probe_task()
    x, y = loader.dataset.tensors
    net = _foreign_statistics_net(loader)
    reference = {k: v.clone() for k, v in net.state_dict().items() if "running" in k}
    with torch.no_grad():
        start_acc = float((net(x).argmax(-1) == y).double().mean())
    bnn = _still_swag(net)
    with caplog.at_level("WARNING", logger="bayesify.methods.swag.state"):
        result = fit(bnn, loader, epochs=1, progress=False)
    record = result.history[-1]
    assert record["swag_batchnorm"] == "pretrained"
    assert (record["swag_bn_train_accuracy_recomputed"]
            < record["swag_bn_train_accuracy_pretrained"] - swag_state.BN_TOLERANCE)
    assert int(bnn.state.value("swag_bn_members")) == swag_state.PRETRAINED_BN
    assert "keeps them" in caplog.text
    for key, value in reference.items():  # θ̄ and every member: the statistics as given
        torch.testing.assert_close(bnn.model.get_buffer(key), value)
    assert all(stats == {} for stats in bnn.method.member_batchnorm(bnn, 3, seed=0))
    with torch.no_grad():
        probs = bnn.predictor(temperature=1.0)(x).probs
    assert float((probs.argmax(-1) == y).double().mean()) >= start_acc - 0.03
    # saved and reloaded (no data): the same predictive
    bnn.save_posterior(tmp_path / "post")
    again = load_posterior(_foreign_statistics_net(loader), tmp_path / "post")
    with torch.no_grad():
        torch.testing.assert_close(again.predictor(temperature=1.0)(x).probs, probs)
    # the rule is what keeps them: accepting any loss, the recomputed statistics cost the
    # training accuracy, and only fit's start guard (no validation data) saves the run by
    # handing back the starting network
    monkeypatch.setattr(swag_state, "BN_TOLERANCE", 1.0)
    bnn2 = _still_swag(_foreign_statistics_net(loader))
    last = fit(bnn2, loader, epochs=1, progress=False).history[-1]
    assert last["swag_batchnorm"] == "recomputed"
    assert last["end_train_accuracy"] < last["start_train_accuracy"] - 0.05
    assert last["kept"] == "start"


def test_statistics_of_the_training_data_are_still_recomputed():
    loader = data((1, 6, 6))
    net = convnet().double()
    update_bn(loader, net)
    net.eval()
    bnn = bayesify(net, "swag", variant="diag", scale=0.1, snapshot_every_steps=1,
                   predict_samples=2)
    result = fit(bnn, loader, epochs=1, progress=False)
    assert result.history[-1]["swag_batchnorm"] == "recomputed"
    assert int(bnn.state.value("swag_bn_members")) == 1
