"""Mistakes a new user makes in the first hour get bayesify's answer, naming the fix
(issue 37, items 8, 9, 10, 12, 13). Tiny networks: the messages are the point."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import bayesify
from bayesify.core.batch import split_batch
from bayesify.errors import BayesifyError


class TinyCNN(nn.Module):
    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.conv(x)).flatten(1))


class DictImages(Dataset):
    """🤗 datasets' image sets: ``{"image": x, "label": y}`` (keys configurable)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, image_key: str = "image",
                 label_key: str = "label") -> None:
        self.x, self.y, self.ik, self.lk = x, y, image_key, label_key

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return {self.ik: self.x[i], self.lk: self.y[i]}


def data(n: int = 16, classes: int = 3):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, classes, (n,), generator=g)


# -- item 8: mappings without 'labels' -------------------------------------------------------
@pytest.mark.parametrize("image_key,label_key", [("image", "label"), ("img", "labels"),
                                                 ("pixel_values", "labels")])
def test_image_mappings_are_read_and_fit(image_key, label_key):
    x, y = data()
    loader = DataLoader(DictImages(x, y, image_key, label_key), batch_size=8)
    batch = split_batch(next(iter(loader)))
    assert len(batch.args) == 1 and not batch.kwargs and torch.equal(batch.labels, y[:8])
    torch.manual_seed(0)
    bnn = bayesify.bayesify(TinyCNN(), method="ibnn")
    bayesify.fit(bnn, loader, epochs=1, progress=False)
    probs = bnn.predictor(2)({image_key: x[:4]}).probs
    assert probs.shape == (4, 3)


def test_pixel_values_alone_predicts():
    x, _ = data()
    bnn = bayesify.bayesify(TinyCNN(), method="ibnn")
    assert bnn.predictor(2)({"pixel_values": x[:2]}).probs.shape == (2, 3)


def test_mapping_with_other_label_key_is_refused_with_a_batch_fn_example():
    x, y = data()
    loader = [{"x": x[:8], "y": y[:8]}]
    bnn = bayesify.bayesify(TinyCNN(), method="ibnn")
    with pytest.raises(BayesifyError) as err:
        bayesify.fit(bnn, loader, n_train=8, epochs=1, progress=False)
    msg = str(err.value)
    assert "'labels' or 'label'" in msg and "batch_fn=lambda b: (b['x'], b['y'])" in msg


def test_the_batch_fn_example_splits_inputs_from_the_label_not_an_input_from_itself():
    """A mapping whose input key the model does not take: the example used to read
    ``(b['pics'], b['pics'])`` when the check saw the inputs without their label."""
    x, y = data()
    loader = [{"pics": x[:8], "label": y[:8]}]
    bnn = bayesify.bayesify(TinyCNN(), method="ibnn")
    with pytest.raises(BayesifyError) as err:
        bayesify.fit(bnn, loader, n_train=8, epochs=1, progress=False)
    msg = str(err.value)
    assert "b['pics'], b['pics']" not in msg
    assert ("batch_fn=lambda b: (b['pics'], b['label'])" in msg
            or "batch_fn=lambda b: (b['pics'], b['labels'])" in msg)


def test_mapping_keys_the_model_does_not_take_are_refused():
    x, _ = data()
    bnn = bayesify.bayesify(TinyCNN(), method="ibnn")
    with pytest.raises(BayesifyError) as err:
        bnn.predictor(2)({"images": x[:2]})
    msg = str(err.value)
    assert "TinyCNN.forward() takes no argument 'images'" in msg and "batch_fn=" in msg
    assert "unexpected keyword" not in msg


# -- item 9: a list of batches ----------------------------------------------------------------
def test_list_of_batches_says_what_n_train_is_for():
    x, y = data()
    bnn = bayesify.bayesify(TinyCNN(), method="ibnn")
    with pytest.raises(BayesifyError) as err:
        bayesify.fit(bnn, [(x[:8], y[:8]), (x[8:], y[8:])], epochs=1, progress=False)
    msg = str(err.value)
    assert "KL" in msg and "n_train=16" in msg and "number of training examples" in msg
    bayesify.fit(bnn, [(x[:8], y[:8]), (x[8:], y[8:])], epochs=1, n_train=16, progress=False)


def test_list_of_unlabelled_batches_fails_on_the_labels_first():
    x, _ = data()
    bnn = bayesify.bayesify(TinyCNN(), method="ibnn")
    with pytest.raises(BayesifyError, match="needs labels"):
        bayesify.fit(bnn, [x[:8], x[8:]], epochs=1, progress=False)


# -- item 12: a post-hoc posterior before fit -------------------------------------------------
@pytest.mark.parametrize("method,kwargs", [("laplace", {}), ("swag", {}),
                                           ("ensemble", {"snapshot": True, "components": 2})])
def test_predictor_before_fit_is_refused(method, kwargs):
    x, y = data()
    bnn = bayesify.bayesify(TinyCNN(), method=method, **kwargs)
    predictor = bnn.predictor()
    with pytest.raises(BayesifyError, match="builds its posterior in bayesify.fit"):
        predictor(x[:2])
    with pytest.raises(BayesifyError, match="Run bayesify.fit"):
        predictor.evaluate(DataLoader(TensorDataset(x, y), batch_size=8), progress=False)


def test_laplace_predictor_after_fit_works():
    x, y = data()
    bnn = bayesify.bayesify(TinyCNN(), method="laplace")
    bayesify.fit(bnn, DataLoader(TensorDataset(x, y), batch_size=8), progress=False)
    assert float(bnn.predictor()(x[:4]).epistemic.sum()) > 0


# -- item 13: load_posterior onto the wrong network -----------------------------------------
def test_load_posterior_with_the_wrapped_model(tmp_path):
    base = TinyCNN()
    bnn = bayesify.bayesify(base, method="ibnn")
    bnn.save_posterior(tmp_path / "post")
    for wrong in (bnn, bnn.model):
        with pytest.raises(BayesifyError, match=r"pass the base model \(`bnn.unwrap\(\)`"):
            bayesify.load_posterior(wrong, tmp_path / "post")
    assert bayesify.load_posterior(bnn.unwrap(), tmp_path / "post").method_name == "ibnn"


def test_load_posterior_onto_a_head_with_another_class_count(tmp_path):
    bnn = bayesify.bayesify(TinyCNN(classes=3), method="ibnn")
    bnn.save_posterior(tmp_path / "post")
    with pytest.raises(BayesifyError, match="the head has 5 classes, the posterior 3"):
        bayesify.load_posterior(TinyCNN(classes=5), tmp_path / "post")


# -- item 10: shape mistakes named with the layer, the user's shape and the fix ------------
@pytest.mark.parametrize("shape,fix", [
    ((8, 1, 8, 8), "x.expand(-1, 3, -1, -1)"),
    ((3, 8, 8), "add a batch dimension"),
    ((8, 8, 8, 3), "x.permute(0, 3, 1, 2)"),
])
@pytest.mark.parametrize("method", ["ibnn", "meanfield"])
def test_shape_mistakes_in_the_predictor(shape, fix, method):
    bnn = bayesify.bayesify(TinyCNN(), method=method)
    with pytest.raises(BayesifyError) as err:
        bnn.predictor(2)(torch.randn(*shape))
    msg = str(err.value)
    assert "layer 'conv' (Conv2d)" in msg and f"Your input has shape {shape}" in msg and fix in msg
    assert "160" not in msg  # never the internal tiled batch


def test_wrong_image_size_names_the_head_and_resizing():
    bnn = bayesify.bayesify(TinyCNN(), method="ibnn")
    with pytest.raises(BayesifyError) as err:
        bnn.predictor(2)(torch.randn(8, 3, 16, 16))
    msg = str(err.value)
    assert "layer 'fc' (Linear)" in msg and "resize" in msg and "(8, 3, 16, 16)" in msg


def test_shape_mistake_in_fit_names_the_users_batch():
    x = torch.randn(8, 8, 8, 3)
    bnn = bayesify.bayesify(TinyCNN(), method="ibnn")
    loader = DataLoader(TensorDataset(x, torch.zeros(8).long()), batch_size=4)
    with pytest.raises(BayesifyError) as err:
        bayesify.fit(bnn, loader, epochs=1, progress=False)
    msg = str(err.value)
    assert msg.startswith("fit: the input does not fit layer 'conv'")
    assert "(4, 8, 8, 3)" in msg and "permute" in msg
