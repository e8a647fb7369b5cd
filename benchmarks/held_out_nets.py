"""Every family with its defaults on architectures outside the stress matrix (issue 30's
"held-out networks of those kinds"): rows in the stress matrix's format, for
``benchmarks/stress_table.py``.

Networks (trained here on 600 three-channel digits at 32 px, a few minutes on one CPU
thread; validation 300, test 400 images of the same distribution):

* ``resnet18`` — torchvision's ResNet-18 (BatchNorm, residual, 11 M parameters), AdamW;
* ``vit`` — timm's ``VisionTransformer`` (patch 4, 4 blocks of width 96, LayerNorm, dropout
  0.1, stochastic depth 0.1 — random in train mode);
* ``convnext`` — torchvision's ConvNeXt as ``tests/stress_nets.py::convnext`` (now also in
  the stress matrix);
* ``effb0`` — torchvision's EfficientNet-B0 (squeeze-excitation, SiLU, BatchNorm,
  stochastic depth 0.2, dropout 0.2 before the head);
* kinds no stress network has (thirty-first stop): ``gn_resnet`` (GroupNorm, no BatchNorm),
  ``frozen_bn_resnet`` (torchvision's FrozenBatchNorm2d, detection-style), ``squeezenet``
  (a 1×1-convolution classifier: no Linear at all), ``googlenet`` (auxiliary classifiers,
  a tuple output in train mode), ``densenet`` (concatenated features), ``gru_text``
  (a bidirectional GRU on tokens), ``conv1d`` (1-D convolutions, BatchNorm1d, a head
  without bias), ``tied`` (one Linear applied twice, SELU, AlphaDropout), ``swin`` (timm's
  Swin: shifted windows, relative position bias);
* ``NAME_ls`` — any of them trained with label smoothing 0.1 (thirty-second stop: an
  under-confident start, as real pretrained networks trained that way are).

    OMP_NUM_THREADS=1 python benchmarks/held_out_nets.py vit 0 cells.jsonl [family,family]
    NOVAL=1 ...   # also every family without val_loader
    EPOCHS=1 ...  # one epoch each: a crash hunt
    VAL=100 ...   # a validation split of its first 100 examples
    python benchmarks/stress_table.py cells.jsonl
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from stress_nets import _train, convnext, digits_tensors, image_loaders, rgb_digits, token_tensors
from test_defaults import base_metrics, bnn_metrics
from test_stress_pretrained import calibrated_nll, finite_posterior, held_out_reference

import bayesify


def resnet18(seed: int):
    import torchvision

    torch.manual_seed(seed)
    d = rgb_digits(seed=seed, test=True)
    model = torchvision.models.resnet18(num_classes=10)
    _train(model, d[0], d[1], steps=400, lr=1e-3, weight_decay=0.01, seed=seed)
    return image_loaders(model, *d, seed=seed, batchnorm=True)


def vit(seed: int):
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(seed)
    d = rgb_digits(seed=seed, test=True)
    model = VisionTransformer(img_size=32, patch_size=4, embed_dim=96, depth=4, num_heads=3,
                              num_classes=10, drop_rate=0.1, drop_path_rate=0.1)
    _train(model, d[0], d[1], steps=800, lr=1e-3, weight_decay=0.05, seed=seed)
    return image_loaders(model, *d, seed=seed)


def effb0(seed: int):
    import torchvision

    torch.manual_seed(seed)
    d = rgb_digits(seed=seed, test=True)
    model = torchvision.models.efficientnet_b0(num_classes=10, stochastic_depth_prob=0.2)
    _train(model, d[0], d[1], steps=600, lr=2e-3, weight_decay=0.05, seed=seed)
    return image_loaders(model, *d, seed=seed, batchnorm=True)


def _train_any(model, x, y, *, steps, lr, weight_decay, batch=32, seed=0):
    """``stress_nets._train`` for a model whose train-mode output may be ``(logits, aux…)``
    (GoogLeNet with auxiliary classifiers: their losses weigh 0.3, as in its paper)."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    model.train()
    for _ in range(steps):
        idx = torch.randint(0, len(y), (batch,), generator=gen)
        out = model(x[idx])
        outs = list(out) if isinstance(out, tuple) else [out]
        loss = sum(F.cross_entropy(o, y[idx]) * (1.0 if i == 0 else 0.3)
                   for i, o in enumerate(outs) if o is not None)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def gn_resnet(seed):
    from torchvision.models.resnet import BasicBlock, ResNet

    torch.manual_seed(seed)
    d = rgb_digits(seed=seed, test=True)
    model = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10, norm_layer=lambda c: nn.GroupNorm(8, c))
    _train_any(model, d[0], d[1], steps=300, lr=1e-3, weight_decay=0.01, seed=seed)
    return image_loaders(model, *d, seed=seed)


def frozen_bn_resnet(seed):
    from torchvision.models.resnet import BasicBlock, ResNet
    from torchvision.ops.misc import FrozenBatchNorm2d

    torch.manual_seed(seed)
    d = rgb_digits(seed=seed, test=True)
    model = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10)
    _train_any(model, d[0], d[1], steps=300, lr=1e-3, weight_decay=0.01, seed=seed)
    from torch.optim.swa_utils import update_bn
    update_bn(DataLoader(TensorDataset(d[0]), batch_size=50), model)
    # detectron-style: BatchNorm frozen into buffers
    def freeze(module):
        for name, child in module.named_children():
            if isinstance(child, nn.BatchNorm2d):
                f = FrozenBatchNorm2d(child.num_features, eps=child.eps)
                f.weight.copy_(child.weight.detach()); f.bias.copy_(child.bias.detach())
                f.running_mean.copy_(child.running_mean); f.running_var.copy_(child.running_var)
                setattr(module, name, f)
            else:
                freeze(child)
    freeze(model)
    return image_loaders(model, *d, seed=seed)


def squeezenet(seed):
    import torchvision

    torch.manual_seed(seed)
    d = rgb_digits(seed=seed, size=48, test=True)
    model = torchvision.models.squeezenet1_1(num_classes=10)
    _train_any(model, d[0], d[1], steps=500, lr=1e-3, weight_decay=0.01, seed=seed)
    return image_loaders(model, *d, seed=seed)


def googlenet(seed):
    import torchvision

    torch.manual_seed(seed)
    d = rgb_digits(seed=seed, size=48, test=True)
    model = torchvision.models.googlenet(num_classes=10, aux_logits=True, init_weights=True,
                                         transform_input=False)
    _train_any(model, d[0], d[1], steps=300, lr=1e-3, weight_decay=0.01, seed=seed)
    return image_loaders(model, *d, seed=seed, batchnorm=False)


def densenet(seed):
    from torchvision.models.densenet import DenseNet

    torch.manual_seed(seed)
    d = rgb_digits(seed=seed, test=True)
    model = DenseNet(growth_rate=12, block_config=(3, 3), num_init_features=24, bn_size=4,
                     num_classes=10)
    _train_any(model, d[0], d[1], steps=400, lr=2e-3, weight_decay=0.01, seed=seed)
    return image_loaders(model, *d, seed=seed, batchnorm=True)


class GRUText(nn.Module):
    def __init__(self, vocab=32, dim=32, num_classes=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.gru = nn.GRU(dim, dim, batch_first=True, bidirectional=True)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(2 * dim, num_classes)

    def forward(self, tokens):
        h, _ = self.gru(self.embed(tokens))
        return self.head(self.drop(h.mean(1)))


def gru_text(seed):
    torch.manual_seed(seed)
    x, y = token_tensors(400, seed=seed)
    xv, yv = token_tensors(300, seed=seed + 1)
    xt, yt = token_tensors(400, seed=seed + 2)
    model = GRUText()
    _train_any(model, x, y, steps=300, lr=3e-3, weight_decay=0.01, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    return (model, DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=gen),
            DataLoader(TensorDataset(xv, yv), batch_size=100),
            DataLoader(TensorDataset(xt, yt), batch_size=100))


class Conv1dNet(nn.Module):
    """1-D convolutions with BatchNorm1d over a 64-step signal; bias-free head."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv1d(1, 16, 5, padding=2), nn.BatchNorm1d(16), nn.ReLU(),
            nn.Conv1d(16, 32, 5, padding=2, stride=2), nn.BatchNorm1d(32), nn.ReLU(),
            nn.Conv1d(32, 32, 3, padding=1, groups=4), nn.BatchNorm1d(32), nn.ReLU(),
            nn.AdaptiveAvgPool1d(1), nn.Flatten())
        self.head = nn.Linear(32, 10, bias=False)

    def forward(self, x):
        return self.head(self.body(x))


def conv1d(seed):
    torch.manual_seed(seed)
    x, y, xv, yv, xt, yt = digits_tensors(size=8, n_train=600, seed=seed, n_test=400)
    flat = lambda t: t.reshape(len(t), 1, 64)
    model = Conv1dNet()
    _train_any(model, flat(x), y, steps=400, lr=3e-3, weight_decay=0.01, seed=seed)
    return image_loaders(model, flat(x), y, flat(xv), yv, flat(xt), yt, seed=seed, batchnorm=True)


class TiedMLP(nn.Module):
    """One Linear applied twice (a shared module), SELU + AlphaDropout, then the head."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(256, 64)
        self.shared = nn.Linear(64, 64)
        self.drop = nn.AlphaDropout(0.1)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        h = F.selu(self.inp(x.flatten(1)))
        h = F.selu(self.shared(h))
        h = F.selu(self.shared(self.drop(h)))
        return self.head(h)


def tied(seed):
    torch.manual_seed(seed)
    x, y, xv, yv, xt, yt = digits_tensors(size=16, n_train=600, seed=seed, n_test=400)
    model = TiedMLP()
    _train_any(model, x, y, steps=400, lr=2e-3, weight_decay=0.01, seed=seed)
    return image_loaders(model, x, y, xv, yv, xt, yt, seed=seed)


def swin(seed):
    from timm.models.swin_transformer import SwinTransformer

    torch.manual_seed(seed)
    d = rgb_digits(seed=seed, test=True)
    model = SwinTransformer(img_size=32, patch_size=2, window_size=4, embed_dim=32,
                            depths=(2, 2), num_heads=(2, 4), num_classes=10, drop_path_rate=0.1)
    _train_any(model, d[0], d[1], steps=500, lr=1e-3, weight_decay=0.05, seed=seed)
    return image_loaders(model, *d, seed=seed)


def deit_distilled(seed):
    """timm's distilled DeiT: two heads (``head``, ``head_dist``) whose outputs are averaged
    in eval mode."""
    from timm.models.deit import VisionTransformerDistilled

    torch.manual_seed(seed)
    d = rgb_digits(seed=seed, test=True)
    model = VisionTransformerDistilled(img_size=32, patch_size=4, embed_dim=64, depth=3,
                                       num_heads=2, num_classes=10, drop_rate=0.1)
    _train_any(model, d[0], d[1], steps=500, lr=1e-3, weight_decay=0.05, seed=seed)
    return image_loaders(model, *d, seed=seed)


def shufflenet(seed):
    """torchvision's ShuffleNetV2 ×0.5 (channel shuffle, split branches, depthwise)."""
    import torchvision

    torch.manual_seed(seed)
    d = rgb_digits(seed=seed, test=True)
    model = torchvision.models.shufflenet_v2_x0_5(num_classes=10)
    _train_any(model, d[0], d[1], steps=500, lr=2e-3, weight_decay=0.01, seed=seed)
    return image_loaders(model, *d, seed=seed, batchnorm=True)


def channels_last(seed):
    """A ResNet trained and served in ``torch.channels_last`` memory format."""
    from torchvision.models.resnet import BasicBlock, ResNet

    torch.manual_seed(seed)
    d = rgb_digits(seed=seed, test=True)
    d = tuple(t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t for t in d)
    model = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10).to(memory_format=torch.channels_last)
    _train_any(model, d[0], d[1], steps=300, lr=1e-3, weight_decay=0.01, seed=seed)
    return image_loaders(model, *d, seed=seed, batchnorm=True)


class NormedMLP(nn.Module):
    """Linear layers under ``torch.nn.utils.parametrizations``: weight norm on every layer
    (the head too), or spectral norm on the hidden ones (SNGP-style)."""

    def __init__(self, kind: str):
        super().__init__()
        wrap = (nn.utils.parametrizations.weight_norm if kind == "weight"
                else nn.utils.parametrizations.spectral_norm)
        self.body = nn.Sequential(wrap(nn.Linear(256, 128)), nn.ReLU(), nn.Dropout(0.1),
                                  wrap(nn.Linear(128, 64)), nn.ReLU())
        self.head = wrap(nn.Linear(64, 10)) if kind == "weight" else nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.body(x.flatten(1)))


def _normed(kind):
    def build(seed):
        torch.manual_seed(seed)
        x, y, xv, yv, xt, yt = digits_tensors(size=16, n_train=600, seed=seed, n_test=400)
        model = NormedMLP(kind)
        _train_any(model, x, y, steps=400, lr=2e-3, weight_decay=0.01, seed=seed)
        return image_loaders(model, x, y, xv, yv, xt, yt, seed=seed)
    build.__name__ = f"{kind}_norm_mlp"
    return build


class MLPHeadCNN(nn.Module):
    """A VGG/MobileNet-style classifier: ``Sequential(Linear, ReLU, Dropout, Linear)``."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
            nn.AdaptiveAvgPool2d(2), nn.Flatten())
        self.classifier = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Dropout(0.5),
                                        nn.Linear(64, 10))

    def forward(self, x):
        return self.classifier(self.features(x))


def mlp_head_cnn(seed):
    torch.manual_seed(seed)
    d = rgb_digits(seed=seed, test=True)
    model = MLPHeadCNN()
    _train_any(model, d[0], d[1], steps=400, lr=2e-3, weight_decay=0.01, seed=seed)
    return image_loaders(model, *d, seed=seed, batchnorm=True)


def mixer(seed):
    """timm's MLP-Mixer: token-mixing MLPs on transposed activations."""
    from timm.models.mlp_mixer import MlpMixer

    torch.manual_seed(seed)
    d = rgb_digits(seed=seed, test=True)
    model = MlpMixer(num_classes=10, img_size=32, patch_size=4, num_blocks=3, embed_dim=64)
    _train_any(model, d[0], d[1], steps=500, lr=1e-3, weight_decay=0.05, seed=seed)
    return image_loaders(model, *d, seed=seed)


def _timm_like(build, *, steps=400, lr=1e-3, weight_decay=0.05, batchnorm=False):
    """A builder: ``build()`` trained on the RGB digits (AdamW), its loaders."""
    def made(seed):
        torch.manual_seed(seed)
        d = rgb_digits(seed=seed, test=True)
        model = build()
        _train_any(model, d[0], d[1], steps=steps, lr=lr, weight_decay=weight_decay, seed=seed)
        return image_loaders(model, *d, seed=seed, batchnorm=batchnorm)
    return made


def resmlp(seed):
    """timm's ResMLP: Affine (a learnt per-channel scale and shift, no statistics) where
    others normalise, layer scale."""
    from timm.models.mlp_mixer import Affine, MlpMixer, ResBlock

    return _timm_like(lambda: MlpMixer(num_classes=10, img_size=32, patch_size=4, num_blocks=3,
                                       embed_dim=64, mlp_ratio=4, norm_layer=Affine,
                                       block_layer=functools.partial(ResBlock, init_values=1e-4)),
                      steps=500)(seed)


def xcit(seed):
    """timm's XCiT: cross-covariance attention, a BatchNorm inside every block's local patch
    interaction, class-attention layers on a class token."""
    from timm.models.xcit import Xcit

    return _timm_like(lambda: Xcit(img_size=32, patch_size=8, num_classes=10, embed_dim=48,
                                   depth=2, num_heads=4, cls_attn_layers=1, eta=1.0,
                                   tokens_norm=True), steps=500, batchnorm=True)(seed)


def cait(seed):
    """timm's CaiT: talking-heads attention, layer scale, class-attention blocks."""
    from timm.models.cait import Cait

    return _timm_like(lambda: Cait(img_size=32, patch_size=4, num_classes=10, embed_dim=48,
                                   depth=2, num_heads=4, depth_token_only=1, init_values=1e-5),
                      steps=500)(seed)


def mobilenet_v3(seed):
    """torchvision's MobileNetV3-Small: hard-swish, squeeze-excitation with hard-sigmoid,
    a Linear-Hardswish-Dropout-Linear classifier."""
    import torchvision

    return _timm_like(lambda: torchvision.models.mobilenet_v3_small(num_classes=10),
                      steps=400, lr=2e-3, weight_decay=0.01, batchnorm=True)(seed)


def maxvit(seed):
    """torchvision's MaxViT: MBConv, block and grid attention (windows partitioned into the
    batch and back), stochastic depth."""
    import torchvision

    return _timm_like(lambda: torchvision.models.MaxVit(
        input_size=(32, 32), stem_channels=16, partition_size=2, block_channels=[32, 64],
        block_layers=[1, 1], head_dim=16, stochastic_depth_prob=0.1, num_classes=10),
        steps=400, batchnorm=True)(seed)


def tv_vit(seed):
    """torchvision's VisionTransformer (class token, its own encoder blocks)."""
    import torchvision

    return _timm_like(lambda: torchvision.models.VisionTransformer(
        image_size=32, patch_size=4, num_layers=2, num_heads=2, hidden_dim=64, mlp_dim=128,
        num_classes=10), steps=600)(seed)


def ghostnet(seed):
    """timm's GhostNet: ghost modules (cheap depthwise features concatenated), SE, a 1x1
    conv head after pooling, dropout."""
    import timm

    return _timm_like(lambda: timm.create_model("ghostnet_050", num_classes=10),
                      steps=400, lr=2e-3, weight_decay=0.01, batchnorm=True)(seed)


def repvit(seed):
    """timm's RepViT: re-parameterisable convolution branches with BatchNorm, a distilled
    classifier (BatchNorm + Linear, two heads averaged in eval mode)."""
    import timm

    return _timm_like(lambda: timm.create_model("repvit_m0_9", num_classes=10),
                      steps=300, lr=2e-3, weight_decay=0.01, batchnorm=True)(seed)


def fastvit(seed):
    """timm's FastViT: MobileOne-style train-time branches, RepMixer token mixing,
    large-kernel convolutional position encodings."""
    import timm

    return _timm_like(lambda: timm.create_model("fastvit_t8", num_classes=10),
                      steps=300, lr=2e-3, weight_decay=0.01, batchnorm=True)(seed)


#: thirty-seventh stop: more timm kinds, built by name (model name, create_model options,
#: training steps, BatchNorm inside, what is new in it)
TIMM_KINDS = {
    "nf_regnet": ("nf_regnet_b0", {}, 300, False,
                  "normaliser-free: ScaledStdConv2d (weights standardised in forward), no norms"),
    "tf_effnet": ("tf_efficientnet_b0", {}, 300, True,
                  "TensorFlow-ported: Conv2dSame (padding computed from the input in forward)"),
    "mixnet": ("mixnet_s", {}, 300, True, "MixedConv2d: channel groups with their own kernels"),
    "efficientformerv2": ("efficientformerv2_s0", {"img_size": 32}, 300, True,
                          "4-D attention with talking heads, BatchNorm in attention"),
    "mobilevitv2": ("mobilevitv2_050", {"img_size": 32}, 300, True,
                    "separable self-attention over unfolded patches"),
    "edgenext": ("edgenext_xx_small", {}, 300, False,
                 "split depth-wise transposed attention (cross-covariance)"),
    "pvt_v2": ("pvt_v2_b0", {}, 300, False, "spatial-reduction attention, overlapping patches"),
    "hgnetv2": ("hgnetv2_b0", {}, 300, True, "learnable affine blocks after activations"),
    "fasternet": ("fasternet_t0", {}, 300, True, "partial convolution on a slice of channels"),
    "efficientvit_m": ("efficientvit_m0", {"img_size": 32}, 300, True,
                       "cascaded group attention on channel splits"),
    "levit": ("levit_128s", {"img_size": 32}, 300, True,
              "Linear + BatchNorm1d on flattened tokens, attention-bias tables"),
    "coat": ("coat_lite_tiny", {"img_size": 32}, 300, False,
             "convolutional relative position encoding on split heads"),
    "eva02": ("eva02_tiny_patch14_224", {"img_size": 32, "patch_size": 4}, 300, False,
              "rotary position embeddings, SwiGLU"),
    "pit": ("pit_ti_224", {"img_size": 32}, 300, False, "pooling layers that reshape tokens"),
    "convit": ("convit_tiny", {"img_size": 32}, 300, False, "gated positional self-attention"),
    "starnet": ("starnet_s1", {}, 300, True, "element-wise multiplication of two branches"),
    "mambaout": ("mambaout_femto", {}, 300, False, "gated CNN blocks, channels last"),
}


def _timm_kind(key):
    model_name, options, steps, batchnorm, _ = TIMM_KINDS[key]

    def build(seed):
        import timm

        return _timm_like(lambda: timm.create_model(model_name, num_classes=10, **options),
                          steps=steps, lr=2e-3, weight_decay=0.01, batchnorm=batchnorm)(seed)
    build.__name__ = key
    return build


NETS = {"resnet18": resnet18, "vit": vit, "effb0": effb0,
        "convnext": lambda seed: convnext(seed=seed, test=True),
        **{f.__name__: f for f in (gn_resnet, frozen_bn_resnet, squeezenet, googlenet, densenet,
                                   gru_text, conv1d, tied, swin, deit_distilled, shufflenet,
                                   channels_last, _normed("weight"), _normed("spectral"),
                                   mlp_head_cnn, mixer, resmlp, xcit, cait, mobilenet_v3,
                                   maxvit, tv_vit, ghostnet, repvit, fastvit)},
        **{key: _timm_kind(key) for key in TIMM_KINDS}}


def label_smoothed(build):
    """``build`` with every cross-entropy of its training smoothed by 0.1 (the recipe of most
    real pretrained image networks — timm's, torchvision's V2 weights — which leaves them
    under-confident: best at T ≈ 0.5–0.7 on held-out data)."""
    def smoothed(seed):
        original = F.cross_entropy  # torch.nn.functional: the trainers' too
        F.cross_entropy = functools.partial(original, label_smoothing=0.1)
        try:
            return build(seed)
        finally:
            F.cross_entropy = original
    return smoothed


NETS.update({f"{name}_ls": label_smoothed(build) for name, build in list(NETS.items())})


def shifted(x: torch.Tensor, seed: int) -> torch.Tensor:
    """A shift of the test inputs: Gaussian noise of half their standard deviation, then a
    25° rotation for images; 20 % of the tokens replaced by random ids for token inputs."""
    gen = torch.Generator().manual_seed(seed)
    if not x.is_floating_point():
        swap = torch.rand(x.shape, generator=gen) < 0.2
        return torch.where(swap, torch.randint(0, int(x.max()) + 1, x.shape, generator=gen), x)
    out = x + 0.5 * x.std() * torch.randn(x.shape, generator=gen)
    if x.dim() == 4:
        import torchvision.transforms.functional as TF

        out = TF.rotate(out, 25.0)
    return out


def shifted_loader(test: DataLoader, seed: int) -> DataLoader:
    """``test`` (a tensor dataset) under :func:`shifted`."""
    x, y = test.dataset.tensors
    return DataLoader(TensorDataset(shifted(x, seed), y), batch_size=test.batch_size)


def main() -> None:
    net, seed, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    families = sys.argv[4].split(",") if len(sys.argv) > 4 else bayesify.list_methods()
    uses = [True, False] if os.environ.get("NOVAL") else [True]
    # EPOCHS=1: a crash hunt (every family's code path, one epoch); unset: fit's own budget
    epochs = int(os.environ["EPOCHS"]) if os.environ.get("EPOCHS") else None
    began = time.perf_counter()
    model, train, val, test = NETS[net](seed)
    if os.environ.get("VAL"):  # VAL=100: the validation split's first 100 examples only
        val = DataLoader(TensorDataset(*(t[:int(os.environ["VAL"])] for t in val.dataset.tensors)),
                         batch_size=val.batch_size)
    reference = held_out_reference(model, val, test)
    shift = shifted_loader(test, seed)
    reference["shift_nll0"] = base_metrics(model, shift)[1]
    acc0, nll0, n = base_metrics(model, val)
    nll0_t = calibrated_nll(model, val)
    print(f"{net} built in {time.perf_counter() - began:.0f} s: validation accuracy {acc0:.4f}, "
          f"NLL {nll0:.4f} ({nll0_t:.4f} at its best temperature)", flush=True)
    for use_val in uses:
        for family in families:
            torch.manual_seed(seed)
            train.generator.manual_seed(seed)
            began = time.perf_counter()
            row = {"method": family, "net": net, "val": use_val, "seed": seed, "acc0": acc0,
                   "nll0": nll0, "nll0_t": nll0_t, "n": n, "epochs": epochs, **reference}
            try:
                bnn = bayesify.bayesify(model, method=family)
                result = bayesify.fit(bnn, train, val_loader=val if use_val else None,
                                      progress=False, seed=seed, epochs=epochs)
                acc, nll, _ = bnn_metrics(bnn, val)
                test_acc, test_nll, _ = bnn_metrics(bnn, test)
                row.update(acc=acc, nll=nll, test_acc=test_acc, test_nll=test_nll,
                           shift_nll=bnn_metrics(bnn, shift)[1],
                           finite=bool(finite_posterior(bnn)),
                           record={k: v for k, v in result.last.items()
                                   if isinstance(v, (int, float, str, bool)) or v is None})
            except Exception as err:  # noqa: BLE001 - a row says what failed
                row.update(error=f"{type(err).__name__}: {err}"[:500])
            row["seconds"] = time.perf_counter() - began
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(family, "val" if use_val else "no val",
                  {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()
                   if k in ("acc", "nll", "test_acc", "test_nll", "error", "seconds")}, flush=True)


if __name__ == "__main__":
    main()
