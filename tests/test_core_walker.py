"""Walker, BayesianModel structure and bad-input handling."""

import copy

import pytest
import torch
import torchvision
from torch import nn

from bayesify import BayesianModel, BayesifyError, bayesify, list_methods
from bayesify.core.walker import find_classifier, name_matches
from bayesify.data.models import DigitsCNN


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
    )


def state_equal(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_registry_lists_ibnn():
    assert "ibnn" in list_methods()


def test_default_targets_every_conv_and_linear():
    bnn = bayesify(small_net(), "ibnn")
    assert bnn.targets == ["0", "3", "7"]
    assert bnn.num_nodes() == 3 + 8 + 8


def test_presets_include_exclude():
    net = small_net()
    assert bayesify(net, "ibnn", targets="last_layer").targets == ["7"]
    assert bayesify(net, "ibnn", targets="first:2").targets == ["0", "3"]
    assert bayesify(net, "ibnn", targets="last:1").targets == ["7"]
    assert bayesify(net, "ibnn", include=["0", "7"]).targets == ["0", "7"]
    with pytest.raises(BayesifyError, match="no layer matched"):
        bayesify(net, "ibnn", exclude=[r"\d"])
    assert bayesify(net, "ibnn", exclude=["0"]).targets == ["3", "7"]
    cnn = DigitsCNN()
    assert bayesify(cnn, "ibnn", targets="last_layer").targets == ["fc"]
    assert bayesify(cnn, "ibnn", include=[r"features\.\d+"]).targets == [
        "features.0", "features.3", "features.7"]


def test_pattern_matching_rules():
    assert name_matches("layer1.0.conv1", "conv1")  # .suffix
    assert name_matches("layer1.0.conv1", "layer1.0.conv1")  # exact
    assert name_matches("layer1.0.conv1", r"layer1\..*")  # regex full match
    assert not name_matches("layer1.0.conv1", "layer1")  # no partial regex match
    assert not name_matches("layer1.0.conv12", "conv1")


def test_classifier_detection_torchvision_and_timm():
    import timm

    assert find_classifier(torchvision.models.resnet18()) == "fc"
    assert find_classifier(timm.create_model("resnet18")) == "fc"
    assert find_classifier(timm.create_model("convnext_atto")) == "head.fc"


@pytest.mark.parametrize("method", ["epinet", "hypernet", "mnf", "meanfield", "ensemble"])
def test_the_classifier_of_a_wrapped_model_is_the_users(method):
    """In a bayesified model the classifier is the wrapper's ``base_layer``, never a Linear
    the wrapper adds after it (a hypernet's generator, MNF's flow, the epinet's learner: the
    last Linear in module order before), on a plain MLP and a timm model alike; the saved
    manifest's class count is the user's head's."""
    import timm

    from bayesify.persistence import head_classes

    for net, head in [(small_net(), None),
                      (timm.create_model("resnet18", num_classes=7), "fc.base_layer")]:
        bnn = bayesify(copy.deepcopy(net), method)
        name = find_classifier(bnn.model)
        want = head or f"{find_classifier(net)}.base_layer"
        assert name == want, (method, name)
        assert head_classes(bnn.model) == head_classes(net)


def test_errors_are_clear_and_model_unchanged():
    net = small_net()
    before = copy.deepcopy(net)
    with pytest.raises(BayesifyError, match="unknown method 'nope'.*ibnn"):
        bayesify(net, "nope")
    with pytest.raises(BayesifyError, match="no layer matched.*supported types"):
        bayesify(net, "ibnn", include=["does_not_exist"])
    with pytest.raises(BayesifyError, match="components must be a positive integer"):
        bayesify(net, "ibnn", components=0)
    with pytest.raises(BayesifyError, match="components must be a positive integer"):
        bayesify(net, "ibnn", components=-3)
    with pytest.raises(BayesifyError, match="unknown option.*'compnents'"):
        bayesify(net, "ibnn", compnents=4)
    with pytest.raises(BayesifyError, match="is a BatchNorm2d.*cannot wrap"):
        bayesify(net, "ibnn", targets=["1"])
    with pytest.raises(BayesifyError, match="unknown targets preset"):
        bayesify(net, "ibnn", targets="everything")
    with pytest.raises(TypeError, match="torch.nn.Module"):
        bayesify("resnet50", "ibnn")
    assert state_equal(net, before)
    assert [type(m) for m in net.modules()] == [type(m) for m in before.modules()]
    assert all(p.requires_grad for p in net.parameters())


def test_already_bayesified_is_an_error():
    bnn = bayesify(small_net(), "ibnn")
    with pytest.raises(BayesifyError, match="already bayesified"):
        bayesify(bnn, "ibnn")
    with pytest.raises(BayesifyError, match="already bayesified"):
        bayesify(bnn.model, "ibnn")


def test_deep_copy_by_default_and_inplace():
    net = small_net()
    bnn = bayesify(net, "ibnn")
    assert isinstance(net[0], nn.Conv2d) and bnn.model is not net
    assert all(p.requires_grad for p in net.parameters())  # caller's flags untouched
    bnn2 = bayesify(net, "ibnn", inplace=True)
    assert bnn2.model is net and not isinstance(net[0], nn.Conv2d)


def test_base_frozen_and_posterior_trainable():
    bnn = bayesify(small_net(), "ibnn", components=3)
    assert all(not p.requires_grad for p in bnn.base_parameters())
    assert all(p.requires_grad for p in bnn.posterior_parameters())
    names = dict(bnn.named_posterior_parameters())
    assert set(names) == {f"{m}.{p}" for m in ("0", "3", "7") for p in ("mean", "rho")}
    assert names["3.mean"].shape == (3, 8)
    base_names = [n for n, _ in bnn.named_base_parameters()]
    assert base_names == [n for n, _ in small_net().named_parameters()]


def test_unwrap_restores_state_dict_bitwise():
    net = small_net()
    bnn = bayesify(net, "ibnn")
    with torch.no_grad():
        for p in bnn.posterior_parameters():
            p.add_(1.0)
    restored = bnn.unwrap()
    assert state_equal(restored, net)
    assert [type(m) for m in restored.modules()] == [type(m) for m in net.modules()]
    assert all(p.requires_grad for p in restored.parameters())


def test_parent_reading_child_weights_is_skipped():
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.mha(x, x, x)[0].mean(1))

    bnn = bayesify(Attn(), "ibnn")
    assert bnn.targets == ["head"]
    assert "mha.out_proj" in bnn.skipped
    out = bnn(torch.randn(2, 5, 8))
    assert out.shape == (2, 3)


def test_repr_and_summary():
    bnn = bayesify(small_net(), "ibnn", components=2)
    text = repr(bnn)
    assert "NodeNoiseLayer" in text and "base_layer" in text and "method=ibnn" in text
    summary = bnn.summary()
    assert "random nodes per member: 19" in summary
    assert f"posterior values: {2 * 2 * 19} trainable + 2 state" in summary  # T, noise scale
    assert isinstance(bnn, BayesianModel)


def test_bn_stays_in_eval_during_training():
    bnn = bayesify(small_net(), "ibnn")
    bnn.train()
    assert not bnn.model[1].training and bnn.model[0].training
    bnn.bn_train = True
    bnn.train()
    assert bnn.model[1].training


# -- real-model correctness (issue 14) ----------------------------------------------------
@pytest.mark.parametrize("method", ["ibnn", "rank1"])
def test_noise_never_broadcasts_over_a_wrong_channel_count(method):
    """A 1-channel image into a 3-channel model: the plain conv refuses it, so must the
    wrapped one (the [R, 3, 1, 1] noise would otherwise broadcast it to 3 channels)."""
    net = small_net().eval()
    gray = torch.randn(2, 1, 8, 8)
    with pytest.raises(RuntimeError):
        net(gray)
    bnn = bayesify(net, method)
    with pytest.raises(BayesifyError, match=r"3 channels.*\(2, 1, 8, 8\) has 1 along axis 1"):
        bnn(gray)
    with pytest.raises(BayesifyError, match="3 channels"):
        bnn.predictor()(gray)
    assert bnn(torch.randn(2, 3, 8, 8)).shape == (2, 4)  # the right input still works


def test_no_family_accepts_a_wrong_channel_count():
    gray = torch.randn(2, 1, 8, 8)
    for method in list_methods():
        bnn = bayesify(small_net().eval(), method)
        with pytest.raises((BayesifyError, RuntimeError), match="channels"):
            bnn(gray)


def test_linear_noise_checks_the_feature_axis():
    bnn = bayesify(nn.Sequential(nn.Linear(4, 3)), "ibnn")
    with pytest.raises(BayesifyError, match="4 channels.*has 1 along axis -1"):
        bnn(torch.randn(5, 1))
    assert bnn(torch.randn(5, 7, 4)).shape == (5, 7, 3)  # tokens [B, N, C] still fine


class SharedHead(nn.Module):
    """One Linear registered under two names (``head`` and ``alias``)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)
        self.alias = self.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x).relu()
        return self.head(h) + self.alias(h)


def test_module_under_two_names_is_wrapped_once_and_both_names_see_it():
    torch.manual_seed(0)
    net = SharedHead()
    bnn = bayesify(net, "ibnn", init_mean_std=0.5)
    assert bnn.model.head is bnn.model.alias  # one wrapper, under both names
    assert sorted(bnn.bayesian_layers()) == ["body", "head"]
    x = torch.randn(6, 4)
    # deterministic: both paths use the same component means, so f = 2·head(z ∘ h)
    with bnn.context.use(torch.zeros(6, dtype=torch.long), deterministic=True):
        out = bnn(x)
        h = bnn.model.body(x).relu()
        once = bnn.model.head(h)
    torch.testing.assert_close(out, 2 * once)
    plain = bnn.unwrap()
    assert plain.head is plain.alias and isinstance(plain.head, nn.Linear)
    assert state_equal(plain, net)


def test_torchscript_module_is_refused_with_advice():
    scripted = torch.jit.script(small_net())
    with pytest.raises(TypeError, match="TorchScript.*pass the nn.Module"):
        bayesify(scripted, "ibnn")
    traced = torch.jit.trace(small_net().eval(), torch.randn(1, 3, 8, 8))
    with pytest.raises(TypeError, match="eager PyTorch module"):
        bayesify(traced, "ibnn")


def test_unknown_target_names_are_refused_with_close_matches():
    net = small_net()
    before = copy.deepcopy(net)
    with pytest.raises(BayesifyError, match=r"'7x' matches no module.*close matches: \['7'\]"):
        bayesify(net, "ibnn", targets=["0", "7x"])
    tv = torchvision.models.resnet18(num_classes=3)
    with pytest.raises(BayesifyError, match=r"'layer4.0.conv3'.*close matches: \['layer4.0.conv2', 'layer4.0.conv1'"):
        bayesify(tv, "ibnn", targets=["fc", "layer4.0.conv3"])
    with pytest.raises(BayesifyError, match=r"matches \['layer1.0.bn1', 'layer1.0.bn2'\] of type\(s\) \['BatchNorm2d'\], none of which.*can wrap"):
        bayesify(tv, "ibnn", targets=["fc", r"layer1\.0\.bn.*"])
    assert bayesify(tv, "ibnn", targets=["fc", "layer4.0.conv1"]).targets == ["layer4.0.conv1", "fc"]
    assert state_equal(net, before)


@pytest.mark.parametrize(("options", "match"), [
    ({"targets": 5}, "targets must be a preset.*got 5"),
    ({"targets": [nn.Linear]}, "targets must be.*list of module names"),
    ({"targets": {"fc": 1}}, "targets must be"),
    ({"exclude": (3,)}, r"exclude(\[0\])? must be"),
])
def test_wrong_target_types_are_type_errors(options, match):
    with pytest.raises(TypeError, match=match):
        bayesify(small_net(), "ibnn", **options)
