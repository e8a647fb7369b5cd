"""Configuration of the Laplace family (defaults from laplace-torch / Daxberger et al.)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bayesify.core.config import MethodConfig, option, require

STRUCTURES = ("auto", "kron", "diag", "full")
#: ``structure='auto'``: the exact last-layer GGN up to this many parameters, KFAC above
AUTO_FULL_PARAMS = 5000
LINKS = ("probit", "mc", "bridge")
PRIOR_METHODS = ("auto", "marglik", "val_nll", "fixed")
CURVATURES = ("auto", "ggn", "features")


def auto_structure(classifier: Any, max_full_params: int = AUTO_FULL_PARAMS) -> str:
    """What ``structure='auto'`` resolves to for the one Linear target ``classifier`` (None:
    a subnetwork): full up to :data:`AUTO_FULL_PARAMS` parameters (and the config's
    ``max_full_params``), kron above; diag for a one-logit classifier (a binary model whose
    ``output_fn`` makes the two-class logits ``[0, z]``: the layer's output is not the logits,
    so its posterior is the subnetwork's, through the model's Jacobian)."""
    if classifier is None or getattr(classifier, "out_features", 2) == 1:
        return "diag"
    params = sum(p.numel() for p in classifier.parameters())
    return "full" if params <= min(AUTO_FULL_PARAMS, max_full_params) else "kron"


@dataclass(frozen=True)
class LaplaceConfig(MethodConfig):
    """Laplace around the pretrained weights, last-layer Kron/diag/full (Daxberger et al.).

    The curvature (``curvature``): the softmax GGN, or a Gaussian likelihood on the logits."""

    targets: Any = option(
        "last_layer", "Layers under the posterior: 'last_layer' (default; kron/diag/full) or any "
        "subnetwork ('all', 'last:K', names) with structure='diag'."
    )
    structure: str = option(
        "auto", "Hessian structure: 'kron' (KFAC G ⊗ A / N), 'diag', 'full' (exact GGN; "
        "one Linear target or a distilled model's joint heads), or 'auto': full for ≤ 5000 "
        "classifier parameters (better shift NLL and OOD AUROC than kron at equal clean NLL), "
        "kron above, diag for a subnetwork."
    )
    curvature: str = option(
        "auto", "Last-layer curvature: 'ggn' (softmax GGN), 'features' (a Gaussian likelihood on "
        "the logits, std logit_std: its variance is a feature distance from the training data), "
        "or 'auto': 'features' when a val_loader chooses τ, else 'ggn'."
    )
    logit_std: float = option(10.0, "Std of curvature='features''s likelihood on the logits.")
    feature_layers: Any = option(
        "auto", "Feature curvature: normalisation layers whose pooled outputs join the "
        "variance (zero-weight links to the logits); 'auto': 4 spaced, null: off.")
    prior_precision: float = option(1.0, "τ: initial (or, with prior_method='fixed', final) prior precision.")
    prior_method: str = option(
        "auto", "How τ is chosen: 'auto' ('val_nll' when fit gets a val_loader, else "
        "'marglik'), 'marglik' (Adam on log τ maximising the Laplace marginal likelihood), "
        "'val_nll' (grid search on fit(val_loader=...)), or 'fixed'."
    )
    prior_per_layer: bool = option(False, "One τ per wrapped layer instead of one scalar (marglik).")
    keep_accuracy: float | None = option(
        0.0, "Without validation data (marglik, last layer, probit or bridge link): τ is raised "
        "×√10 until the predictive's accuracy on the first 4096 training examples is within "
        "this of the MAP's (0: no example lost on balance; None: the evidence's τ as it is)."
    )
    marglik_steps: int = option(100, "Adam steps on log τ.")
    marglik_lr: float = option(0.1, "Adam learning rate on log τ.")
    val_grid: tuple[float, float, int] = option(
        (1e-4, 1e4, 17), "(low, high, count): log-spaced τ grid of prior_method='val_nll'."
    )
    val_rule: str = option(
        "shift", "How the validation search chooses τ (with the temperature): 'shift' (the "
        "lowest NLL on shifted validation inputs among choices the clean split cannot tell "
        "from the calibrated starting network; see bayesify.train.tuning) or 'min' (the "
        "lowest clean validation NLL)."
    )
    sharpen: bool = option(
        True, "Let the validation search sharpen the predictive (T from 0.05): the GLM's "
        "variance grows off the data, so a broad posterior sharpened to the start's clean "
        "NLL stays broad there. False: T from 1 (or the start's, if under-confident).")
    link: str = option(
        "probit", "Predictive link of the linearised (GLM) predictive: 'probit' "
        "(softmax(f/sqrt(1+π/8·diag Σ_f))), 'bridge' (Laplace bridge) or 'mc' (samples)."
    )
    predict_samples: int = option(100, "Samples of the 'mc' link (members M).")
    diag_ggn: str = option(
        "exact", "Subnetwork diagonal GGN: 'exact' (C Jacobian rows per example) or 'mc' "
        "(Fisher with labels sampled from the model, cheaper for many classes)."
    )
    ggn_samples: int = option(1, "Sampled labels per example of diag_ggn='mc'.")
    max_full_params: int = option(
        20_000, "Refuse structure='full' above this many parameters (P² memory)."
    )
    jacobian_chunk: int = option(
        2**24, "Bound on B·C·P elements of one chunk of per-example Jacobians (subnetwork)."
    )

    @classmethod
    def saved_defaults(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        """A config saved before ``feature_layers`` existed had none (its posterior holds no
        feature-layer sums)."""
        kwargs.setdefault("feature_layers", None)
        return kwargs

    def default_samples(self) -> int:
        """Members of the default predictor: the MC samples of ``link='mc'``, else 1 (the
        probit / bridge predictive is one Gaussian over the logits)."""
        return self.predict_samples if self.link == "mc" else 1

    def validate(self) -> None:
        require(self.structure in STRUCTURES,
                f"structure must be one of {STRUCTURES}, got {self.structure!r}")
        require(self.val_rule in ("shift", "min"),
                f"val_rule must be 'shift' or 'min', got {self.val_rule!r}")
        require(self.curvature in CURVATURES,
                f"curvature must be one of {CURVATURES}, got {self.curvature!r}")
        require(self.logit_std > 0, f"logit_std must be > 0, got {self.logit_std}")
        layers = self.feature_layers
        require(layers is None or layers == "auto" or (
            isinstance(layers, (list, tuple)) and all(isinstance(n, str) and n for n in layers)),
            "feature_layers must be 'auto', None or a list of module names (normalisation "
            f"layers), got {layers!r}")
        require(self.link in LINKS, f"link must be one of {LINKS}, got {self.link!r}")
        require(self.prior_method in PRIOR_METHODS,
                f"prior_method must be one of {PRIOR_METHODS}, got {self.prior_method!r}")
        require(self.prior_precision > 0, f"prior_precision must be > 0, got {self.prior_precision}")
        require(isinstance(self.marglik_steps, int) and self.marglik_steps >= 0,
                f"marglik_steps must be an integer >= 0, got {self.marglik_steps!r}")
        require(self.marglik_lr > 0, f"marglik_lr must be > 0, got {self.marglik_lr}")
        require(self.keep_accuracy is None or 0 <= self.keep_accuracy < 1,
                f"keep_accuracy must be None or in [0, 1), got {self.keep_accuracy!r}")
        require(len(self.val_grid) == 3 and 0 < self.val_grid[0] < self.val_grid[1]
                and int(self.val_grid[2]) >= 2,
                f"val_grid must be (low > 0, high > low, count >= 2), got {self.val_grid!r}")
        require(isinstance(self.predict_samples, int) and self.predict_samples > 0,
                f"predict_samples must be a positive integer, got {self.predict_samples!r}")
        require(self.diag_ggn in ("exact", "mc"),
                f"diag_ggn must be 'exact' or 'mc', got {self.diag_ggn!r}")
        require(isinstance(self.ggn_samples, int) and self.ggn_samples > 0,
                f"ggn_samples must be a positive integer, got {self.ggn_samples!r}")
        require(self.jacobian_chunk > 0, f"jacobian_chunk must be > 0, got {self.jacobian_chunk}")
        require(not self.laplace_heads,
                "laplace_heads=True puts a last-layer Laplace on another family's members; the "
                "laplace family is one already (use targets='last_layer')")
