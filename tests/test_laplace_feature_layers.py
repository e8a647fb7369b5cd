"""Laplace's feature layers (``bayesify.kit.feature_layers``): the variance they add
against a float64 brute force, the choice of ``'auto'``, the pooling of every layout,
exports, save / load (old manifests included) and clear refusals."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bayesify import BayesifyError, bayesify, fit, load_posterior
from bayesify.kit import feature_layers as trunk
from bayesify.posterior_format import MANIFEST_FILE, _manifest_checksum
from bayesify.predict.export import run_exported


def _net(norms: int = 2) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    channels = 1
    for _ in range(norms):
        layers += [nn.Conv2d(channels, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU()]
        channels = 6
    net = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, 3))
    with torch.no_grad():  # BatchNorm statistics that are not the identity
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.3, 0.3)
    return net.double().eval()


def _data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 6, 6, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 3, (n,), generator=g)


def _fitted(net: nn.Module, **options) -> object:
    options = {"curvature": "features", "prior_method": "fixed", "prior_precision": 0.3,
               **options}
    bnn = bayesify(net, "laplace", **options)
    fit(bnn, DataLoader(TensorDataset(*_data(40, 1)), batch_size=16), progress=False)
    return bnn


def _pooled_by_hand(net: nn.Module, names: list[str], x: torch.Tensor) -> torch.Tensor:
    seen = {}
    handles = [net.get_submodule(n).register_forward_hook(
        lambda m, i, o, n=n: seen.__setitem__(n, o.mean((2, 3)))) for n in names]
    with torch.no_grad():
        net(x)
    for h in handles:
        h.remove()
    return torch.cat([seen[n] for n in names], 1)


def test_the_added_variance_equals_the_brute_force_posterior_of_zero_weight_connections():
    """Every class gains ``ψ̃ᵀ (Ψ̃ᵀΨ̃/σ² + τI)⁻¹ ψ̃``, ψ̃ the pooled outputs standardised on
    the training data (mean removed, each layer scaled to the classifier input's mean
    squared norm); the bridge's row sums gain it and its total C times it."""
    net = _net()
    names = ["1", "4"]
    with_layers = _fitted(net)
    assert with_layers.method.config.feature_layers == tuple(names)
    alone = _fitted(net, feature_layers=None)
    x_train, _ = _data(40, 1)
    x = 3 * _data(7, 2)[0]
    psi_train = _pooled_by_hand(net, names, x_train)
    heads = net[:-1](x_train)
    mu = psi_train.mean(0)
    scales = []
    for part in (slice(0, 6), slice(6, 12)):
        spread = (psi_train[:, part] - mu[part]).square().sum(1).mean()
        scales.append(torch.full((6,), float(torch.sqrt(heads.square().sum(1).mean() / spread)),
                                 dtype=torch.float64))
    scale = torch.cat(scales)
    train = (psi_train - mu) * scale
    precision = train.T @ train / 10.0**2 + 0.3 * torch.eye(12, dtype=torch.float64)
    test = (_pooled_by_hand(net, names, x) - mu) * scale
    brute = (test * torch.linalg.solve(precision, test.T).T).sum(1)
    a, b = with_layers.predictive(x), alone.predictive(x)
    torch.testing.assert_close(a.mean, b.mean)
    torch.testing.assert_close((a.variance - b.variance).double(),
                               brute.unsqueeze(1).expand(-1, 3).float().double(),
                               atol=1e-5, rtol=1e-4)
    bridge, bridge_alone = (_fitted(net, link="bridge", **kw) for kw in ({}, {"feature_layers": None}))
    p, q = bridge.predictive(x), bridge_alone.predictive(x)
    torch.testing.assert_close((p.rowsum - q.rowsum).double(),
                               brute.unsqueeze(1).expand(-1, 3).float().double(), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close((p.total - q.total).double(), 3 * brute.float().double(),
                               atol=1e-5, rtol=1e-4)
    # off the data the added variance dominates the classifier's own
    assert (brute > 0).all()


def test_the_grid_pass_equals_setting_each_tau():
    """The validation search's one-forward grid adds the same variance as predicting."""
    bnn = _fitted(_net())
    x = _data(9, 3)[0]
    taus = (0.01, 1.0, 100.0)
    grid = bnn.method._grid_log_probs(bnn, x, taus)
    for tau, log_probs in zip(taus, grid, strict=True):
        bnn.method.set_prior_precision(bnn, tau)
        torch.testing.assert_close(log_probs, bnn.predictive(x).raw_log_probs,
                                   atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("fmt", ["pt2", "onnx"])
def test_the_export_equals_in_process_and_is_not_the_classifier_alone(fmt, tmp_path):
    from bayesify.predict.exported import run_exported

    if fmt == "onnx":
        pytest.importorskip("onnxruntime")
    net = _net().float()
    bnn = bayesify(net, "laplace", curvature="features", prior_method="fixed",
                   prior_precision=0.1)
    x_train, y_train = _data(40, 1)
    fit(bnn, DataLoader(TensorDataset(x_train.float(), y_train), batch_size=16), progress=False)
    x = 2 * _data(6, 4)[0].float()
    predictor = bnn.predictor(temperature=0.5)
    want = predictor(x)
    predictor.export(tmp_path / f"m.{fmt}", x)
    probs, epistemic = run_exported(tmp_path / f"m.{fmt}", x)
    torch.testing.assert_close(torch.as_tensor(probs), want.probs, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.as_tensor(epistemic), want.epistemic, atol=1e-5, rtol=0)
    # the classifier alone predicts something else
    alone = bayesify(net, "laplace", curvature="features", prior_method="fixed",
                     prior_precision=0.1, feature_layers=None)
    fit(alone, DataLoader(TensorDataset(x_train.float(), y_train), batch_size=16), progress=False)
    assert (alone.predictor(temperature=0.5)(x).probs - want.probs).abs().max() > 1e-3


def test_auto_takes_up_to_four_evenly_spaced_norms_within_the_width_bound(monkeypatch, caplog):
    net = _net(norms=6)
    bns = [n for n, m in net.named_modules() if isinstance(m, nn.BatchNorm2d)]
    assert trunk.auto_layers(net, "20") == [bns[0], bns[2], bns[3], bns[5]]
    assert trunk.auto_layers(_net(norms=3), "11") == ["1", "4", "7"]
    monkeypatch.setattr(trunk, "MAX_WIDTH", 13)  # 4 × 6 wide: two are dropped
    assert len(trunk.auto_layers(net, "20")) == 2
    mlp = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    with caplog.at_level(logging.INFO, logger="bayesify"):
        bnn = bayesify(mlp, "laplace")
    assert bnn.method.config.feature_layers == ()
    assert "no normalisation layers" in caplog.text
    assert not any("trunk" in n for n, _ in bnn.named_buffers())


def test_the_ggn_and_the_mc_link_have_none_and_names_are_checked_before_anything_changes():
    net = _net()
    assert bayesify(net, "laplace", curvature="ggn").method.config.feature_layers == ()
    assert bayesify(net, "laplace", link="mc").method.config.feature_layers == ()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    for names, match in ((["0"], "Conv2d"), (["nope"], "no such module")):
        with pytest.raises(BayesifyError, match=match):
            bayesify(net, "laplace", feature_layers=names)
    with pytest.raises(BayesifyError, match="probit or bridge"):
        bayesify(net, "laplace", feature_layers=["1"], link="mc")
    with pytest.raises(BayesifyError, match="feature_layers must be"):
        bayesify(net, "laplace", feature_layers=3)
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in before.items())


def test_pooling_of_every_layout():
    bn, ln, gn = nn.BatchNorm2d(4), nn.LayerNorm(4), nn.GroupNorm(2, 4)
    x = torch.randn(3, 4, 5, 6)
    torch.testing.assert_close(trunk.pooled(bn, x, 3), x.mean((2, 3)))
    torch.testing.assert_close(trunk.pooled(gn, x, 3), x.mean((2, 3)))
    tokens = torch.randn(3, 7, 4)  # [B, T, D]
    torch.testing.assert_close(trunk.pooled(ln, tokens, 3), tokens.mean(1))
    torch.testing.assert_close(trunk.pooled(ln, (tokens, None), 3), tokens.mean(1))
    torch.testing.assert_close(trunk.pooled(ln, x, 3), x.mean((2, 3)))  # channels first
    torch.testing.assert_close(trunk.pooled(ln, tokens[:, 0], 3), tokens[:, 0])
    assert trunk.pooled(ln, tokens.transpose(0, 1), 3) is None  # sequence first
    assert trunk.pooled(ln, torch.randn(3, 5), 3) is None


def test_pooling_of_rows_a_block_flattened_batch_major():
    """LeViT's BatchNorm1d on flattened tokens ``[B·N, C]`` and MobileViT's unfolded patches
    ``[B·P, N, C]``: each example's rows averaged (their variance part was 0: no ``[B, …]``);
    a sequence-first ``[L, B, C]`` whose length is a multiple of B is still refused."""
    bn1d, ln = nn.BatchNorm1d(4), nn.LayerNorm(4)
    tokens = torch.randn(3, 7, 4)
    torch.testing.assert_close(trunk.pooled(bn1d, tokens.flatten(0, 1), 3), tokens.mean(1))
    patches = torch.randn(3, 5, 7, 4)  # [B, P, N, C] unfolded as [B·P, N, C]
    torch.testing.assert_close(trunk.pooled(ln, patches.flatten(0, 1), 3), patches.mean((1, 2)))
    assert trunk.pooled(ln, torch.randn(6, 3, 4), 3) is None  # [L = 2·B, B, C]
    assert trunk.pooled(bn1d, torch.randn(7, 4), 3) is None  # not a multiple of B


class _FlatTokens(nn.Module):
    """LeViT's pattern: Linear + BatchNorm1d on the flattened tokens ``[B·N, C]``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 6)
        self.norm = nn.BatchNorm1d(6)
        self.fc = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, N, 3]
        b, n, _ = x.shape
        h = self.norm(self.embed(x).flatten(0, 1)).view(b, n, -1)
        return self.fc(torch.relu(h).mean(1))


def test_flattened_tokens_add_their_variance_whatever_the_batch(tmp_path):
    torch.manual_seed(0)
    net = _FlatTokens().eval()
    with torch.no_grad():
        net.norm.running_var.uniform_(0.5, 2.0)
    x = torch.randn(32, 5, 3)
    data = DataLoader(TensorDataset(x, torch.randint(0, 2, (32,))), batch_size=8)
    bnn = bayesify(net, "laplace", curvature="features", prior_method="fixed",
                   feature_layers=("norm",))
    fit(bnn, data, progress=False)
    alone = bayesify(net, "laplace", curvature="features", prior_method="fixed",
                     feature_layers=None)
    fit(alone, data, progress=False)
    probe = 3.0 * torch.randn(6, 5, 3)
    with torch.no_grad():
        added = bnn.predictive(probe).variance - alone.predictive(probe).variance
        one = torch.cat([bnn.predictive(probe[i:i + 1]).variance for i in range(6)])
    assert float(added.min()) > 0  # the flattened layer's part is there
    torch.testing.assert_close(one, bnn.predictive(probe).variance)  # per example
    predictor = bnn.predictor(temperature=0.7)
    predictor.export(tmp_path / "flat.pt2", probe[:2])  # traced: B·N rows of a symbolic B
    probs, epistemic = run_exported(tmp_path / "flat.pt2", probe)
    with torch.no_grad():
        reference = predictor(probe)
    torch.testing.assert_close(probs, reference.probs, atol=1e-5, rtol=0)
    torch.testing.assert_close(epistemic, reference.epistemic, atol=1e-5, rtol=0)


class _SequenceFirst(nn.Module):
    """A LayerNorm on a [T, B, D] sequence: no [B, d] output to pool."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 4)
        self.norm = nn.LayerNorm(4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, T, 3]
        h = self.norm(self.embed(x).transpose(0, 1))
        return self.fc(h.mean(0))


def test_a_layer_without_a_batch_first_output_warns_and_adds_nothing(caplog):
    torch.manual_seed(0)
    net = _SequenceFirst().eval()
    x = torch.randn(24, 5, 3)
    bnn = bayesify(net, "laplace", curvature="features", prior_method="fixed")
    assert bnn.method.config.feature_layers == ("norm",)
    with caplog.at_level(logging.WARNING, logger="bayesify"):
        fit(bnn, DataLoader(TensorDataset(x, torch.randint(0, 2, (24,))), batch_size=8),
            progress=False)
    assert "gave no [batch, features] output" in caplog.text
    alone = bayesify(net, "laplace", curvature="features", prior_method="fixed",
                     feature_layers=None)
    fit(alone, DataLoader(TensorDataset(x, torch.randint(0, 2, (24,))), batch_size=8),
        progress=False)
    torch.testing.assert_close(bnn.predictive(x[:4]).variance, alone.predictive(x[:4]).variance)


def test_save_and_load_are_exact_and_an_old_manifest_has_no_feature_layers(tmp_path):
    net = _net()
    bnn = _fitted(net)
    x = _data(5, 6)[0]
    bnn.save_posterior(tmp_path / "p")
    assert json.loads((tmp_path / "p" / MANIFEST_FILE).read_text())["config"][
        "feature_layers"] == ["1", "4"]
    again = load_posterior(net, tmp_path / "p")
    assert torch.equal(again.predictive(x).variance, bnn.predictive(x).variance)
    old = _fitted(net, feature_layers=None)
    old.save_posterior(tmp_path / "old")
    path = tmp_path / "old" / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    manifest["config"].pop("feature_layers")  # as a release before them saved it
    manifest["checksum"] = _manifest_checksum(manifest)
    path.write_text(json.dumps(manifest, indent=2))
    loaded = load_posterior(net, tmp_path / "old")
    assert loaded.method.config.feature_layers == ()
    torch.testing.assert_close(loaded.predictive(x).log_probs, old.predictive(x).log_probs)
    assert math.isfinite(float(loaded.predictive(x).log_probs.sum()))


class _Tokens(nn.Module):
    """Embedding → LayerNorm over [B, T, D] tokens, masked mean → classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 6)
        self.norm = nn.LayerNorm(6)
        self.fc = nn.Linear(6, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(input_ids))
        m = attention_mask.unsqueeze(-1).float()
        return self.fc((h * m).sum(1) / m.sum(1))


def test_masked_token_sequences_keep_the_feature_layers_off(caplog):
    """Pooling a LayerNorm's tokens would count the padding: with an attention mask among the
    inputs the feature layers are not fitted, the predictive is the classifier's features'
    alone, and trailing padding changes nothing."""
    torch.manual_seed(0)
    net = _Tokens().eval()
    ids = torch.randint(1, 20, (32, 5))
    mask = torch.ones_like(ids)
    mask[::2, 3:] = 0
    ids = ids * mask
    data = TensorDataset(ids, mask, torch.randint(0, 3, (32,)))

    def batches():
        return [({"input_ids": i, "attention_mask": m}, y)
                for i, m, y in DataLoader(data, batch_size=8)]

    bnn = bayesify(net, "laplace", curvature="features", prior_method="fixed")
    assert bnn.method.config.feature_layers == ("norm",)
    with caplog.at_level(logging.INFO, logger="bayesify"):
        fit(bnn, batches(), progress=False)
    assert "stay off" in caplog.text and not trunk.fitted(next(iter(
        m for m in bnn.modules() if hasattr(m, "trunk_count"))))
    x = {"input_ids": ids[:4], "attention_mask": mask[:4]}
    padded = {"input_ids": torch.cat([ids[:4], torch.zeros(4, 2, dtype=ids.dtype)], 1),
              "attention_mask": torch.cat([mask[:4], torch.zeros(4, 2, dtype=mask.dtype)], 1)}
    torch.testing.assert_close(bnn.predictor()(**padded).probs, bnn.predictor()(**x).probs)


def test_wider_than_the_examples_span_keeps_the_top_principal_directions(monkeypatch):
    """N examples of 12 pooled features: the posterior keeps its top RANK_FRACTION·N
    eigen-directions (the rest were never varied in by the examples: their posterior variance
    would be 1/τ for every input), exactly the brute force restricted to them; new examples of
    the training distribution are then far nearer than with every direction, and those off it
    stand out more."""
    g = torch.Generator().manual_seed(0)
    def draw(n):  # every one of the 12 features varies: 10 examples span 9 directions
        return torch.randn(n, 12, generator=g, dtype=torch.float64)
    psi, a = draw(10), torch.randn(10, 4, generator=g, dtype=torch.float64)
    sums = trunk.batch_sums(psi, a)
    view = trunk.TrunkPosterior(sums, [12], 10.0)
    assert view.q.shape == (12, 5) and view.eig.shape == (5,)
    mu = psi.mean(0)
    s = float(torch.sqrt(a.square().sum(1).mean() / (psi - mu).square().sum(1).mean()))
    cov = ((psi - mu) * s).T @ ((psi - mu) * s) / 100.0
    eig, q = torch.linalg.eigh(cov)
    x = torch.cat([draw(3), 5 * torch.randn(2, 12, generator=g, dtype=torch.float64)])
    proj = (((x - mu) * s) @ q[:, -5:]).square()
    torch.testing.assert_close(view.variance(x, 0.01), proj @ (1 / (eig[-5:] + 0.01)))
    kept = view.variance(x, 1e-3)
    monkeypatch.setattr(trunk, "RANK_FRACTION", None)  # every direction
    full = trunk.TrunkPosterior(sums, [12], 10.0)
    every = full.variance(x, 1e-3)
    assert full.q.shape == (12, 12)
    # the directions no example varied in made every new example far, near ones included
    assert (every[:3] > 10 * kept[:3]).all()
    assert kept[3:].min() > 3 * kept[:3].max()  # what is off the data still stands out
