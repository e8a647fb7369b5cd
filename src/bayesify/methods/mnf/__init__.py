"""MNF: multiplicative normalizing flows for variational BNNs (Louizos & Welling 2017).

Design notes (in the style of DESIGN.md §4; the mathematics is in the module docstrings of
``flows`` (the flow), ``layers`` (the forward pass) and ``bound`` (prior, KL, r)):

- Before every target Conv/Linear the input is multiplied per row and per input channel
  (shared over pixels / tokens) by ``z = f_T ∘ … ∘ f_1(z_0)``, ``z_0 ~ N(μ_z, σ_z²)``, and
  the weights are Gaussian given z: ``q(W|z) = Π N(z_i w_ij, σ_ij²)`` around the pretrained
  weights w (frozen; ``base_lr > 0`` fine-tunes them as iBNN's U). Local
  reparameterisation: mean ``op(x∘z, w) + b``, variance ``op(x², σ²)``.
- Init: μ_z = 1, σ_z = 0.05 (iBNN's), σ = 0.05·|w| (meanfield's δ), flows exactly the
  identity — the wrapped network *is* the pretrained one (``deterministic()`` bit for bit).
- Prior: each node's fan-out weights rescaled by ``t ~ N(1, 0.1²)`` (iBNN's prior on z)
  plus relative jitter ``N(0, (0.05·|w|)²)`` — a rank-one-plus-diagonal Gaussian per node,
  KL in closed form. Not N(0, I) (pulls pretrained weights to 0) nor a per-weight relative
  prior (pins z_i to s/√fan-out and makes SGD on z diverge).
- Bound: ``KL(q(W|z_T)‖p(W)) + log q(z_T) − log r(z_T|W)`` per layer, one sample per step,
  r = eq. 11–12 plus each node's own statistic of W (``inverse_model``); divided by N_train
  by the trainer. ``weight_std=0``: ``KL(q(z_T)‖N(1, s²))``; with ``flow_depth=0`` too the
  family *is* iBNN with ``components=1`` (equal loss on the same batch and noise).
- Training: ElboStep, every example repeated S = 2 times, SGD Nesterov at iBNN's per-network 0.2/√L
  (z, flow and log-scale stds are O(1) whatever the network). Prediction: M = 10 members,
  each a fixed draw of z and of the pre-activation noise; export freezes those draws (the
  pre-activation noise has the example's spatial size / sequence length, as meanfield's).
- Knob: ``mnf_noise_scale`` multiplies σ_z and σ at prediction (0 = the mean network).
"""

from bayesify.methods.mnf.bound import InverseModel, node_prior_kl, node_view
from bayesify.methods.mnf.config import MNFConfig
from bayesify.methods.mnf.flows import Coupling, CouplingFlow
from bayesify.methods.mnf.layers import MNFLayer
from bayesify.methods.mnf.method import MNFMethod

__all__ = ["Coupling", "CouplingFlow", "InverseModel", "MNFConfig", "MNFLayer", "MNFMethod",
           "node_prior_kl", "node_view"]
