"""Configuration of the MNF family (multiplicative normalizing flows, Louizos & Welling 2017)."""

from __future__ import annotations

from dataclasses import dataclass

from bayesify.core.config import MethodConfig, laplace_heads_on, option, require

INVERSE_MODELS = ("node", "paper")


@dataclass(frozen=True)
class MNFConfig(MethodConfig):
    """Multiplicative normalizing flows: a flow over node noise z, Gaussian q(W|z) (Louizos & Welling)."""

    laplace_heads: bool = laplace_heads_on()  # on by default (bayesify.kit.laplace_heads)
    flow_depth: int = option(
        2, "T: masked affine coupling layers of the flow of q(z) (the authors' 2). 0: q(z) is "
        "a diagonal Gaussian — with weight_std=0 exactly iBNN with components=1.")
    inverse_flow_depth: int = option(
        0, "Coupling layers of the flow f_r inside the auxiliary r(z_T | W) (training only). "
        "The authors' 2 suits inverse_model='paper'; with 'node' r is already near exact and "
        "its variance v_i tiny, so a flow on its argument faces a curvature σ₀²/(v_i·N_train) "
        "that SGD at the family's step size cannot follow (a pretrained digits CNN diverged "
        "within 10 steps).")
    flow_hidden: int = option(
        50, "Hidden units of every coupling network of q(z) (the authors' 50; r's flow uses "
        "twice as many).")
    init_std: float = option(
        0.05, "Std of q(z_0) at the start (its mean is 1: the pretrained network); the "
        "iBNN paper's 5 per cent multiplicative node noise.")
    weight_std: float = option(
        0.05, "δ: σ of q(W | z) starts at δ·max(|w|, init_floor), relative to each pretrained "
        "weight w (the mean of q(W | z) is z_i·w). 0: no weight noise — q(W | z) is the point "
        "mass at diag(z)·W and the bound is KL(q(z_T) ‖ N(1, prior_std²)).")
    init_floor: float = option(
        1e-3, "Floor on |w| for the relative stds (zero weights get a posterior and a prior too).")
    prior_std: float = option(
        0.1, "s: the prior rescales every node's pretrained fan-out weights by t ~ N(1, s²) "
        "(iBNN's prior on z, 0.1), plus per-weight jitter prior_weight_std.")
    prior_weight_std: float = option(
        0.05, "δ_p: per-weight jitter of the prior, N(0, (δ_p·max(|w|, init_floor))²) — equal to "
        "weight_std, so the KL of the weight noise starts at its minimum.")
    inverse_model: str = option(
        "node", "r(z_T | W): 'paper' — eq. 11–12, a global projection tanh(cᵀW) scaled per node; "
        "'node' (default) — the same combined with each node's own statistic "
        "a_i = ⟨W_i, w_i⟩/‖w_i‖² (what W says about z_i). With 'paper' r cannot see z_i in W, "
        "the bound cancels the entropy of q(z) and its KL shrinks the node noise towards 0.")
    kl_samples: int = option(
        16, "K: samples of z_T averaged in every step's KL term. Only node-level terms depend "
        "on z (the weight-level ones are computed once), so 16 cost little and cut the "
        "gradient noise of the one-sample bound, which on a small training set (KL/N_train "
        "large) random-walks z.")
    samples: int = option(
        2, "S: training repeats of every example, each with its own z and weight noise (iBNN's 2).")
    predict_samples: int = option(
        10, "M: members at prediction, each with its own z and pre-activation noise (fixed per "
        "member; meanfield's 10).")
    learn_std: bool = option(
        True, "Train the std of q(z_0) and of q(W | z); False keeps them at their init.")

    def validate(self) -> None:
        for name in ("flow_depth", "inverse_flow_depth"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 0,
                    f"{name} must be an integer >= 0 (0: no flow), got {value!r}")
        require(isinstance(self.flow_hidden, int) and self.flow_hidden > 0,
                f"flow_hidden must be a positive integer, got {self.flow_hidden!r}")
        require(self.init_std > 0, f"init_std must be > 0 (q(z_0) needs a spread; the tuned "
                                   f"mnf_noise_scale = 0 gives the mean network), got {self.init_std}")
        require(self.weight_std >= 0, f"weight_std must be >= 0 (0: no weight noise), "
                                      f"got {self.weight_std}")
        require(self.init_floor > 0, f"init_floor must be > 0, got {self.init_floor}")
        require(self.inverse_model in INVERSE_MODELS,
                f"inverse_model must be one of {INVERSE_MODELS}, got {self.inverse_model!r}")
        require(isinstance(self.samples, int) and self.samples > 0,
                f"samples must be a positive integer, got {self.samples!r}")
        require(isinstance(self.predict_samples, int) and self.predict_samples > 0,
                f"predict_samples must be a positive integer, got {self.predict_samples!r}")
