"""Configuration of the SWAG family (defaults from Maddox et al. 2019 and its code)."""

from __future__ import annotations

from dataclasses import dataclass

from bayesify.core.config import MethodConfig, laplace_heads_on, option, require

VARIANTS = ("swa", "diag", "swag")


@dataclass(frozen=True)
class SWAGConfig(MethodConfig):
    """SWA / SWAG-diag / SWAG: a Gaussian fitted to the SGD iterates (Maddox et al.)."""

    # on by default since the seventeenth stop: with the feature layers (and the heads' first
    # prediction fixed) they lowered SWAG's shift NLL and raised its AUROC on every seed of
    # both quality protocols (benchmarks/results/session17.md)
    laplace_heads: bool = laplace_heads_on()

    variant: str = option(
        "swag", "'swa' (the running mean only), 'diag' (SWAG-diagonal) or 'swag' "
        "(diagonal + low-rank covariance)."
    )
    max_rank: int = option(20, "R: number of most recent deviations θ_i − θ̄ kept (low-rank part).")
    scale: float | None = option(
        None, "Covariance scale of the samples; None: 0.5 for 'swag', 1.0 for 'diag'."
    )
    scale_method: str = option(
        "auto", "'auto' ('val_nll' when fit gets a val_loader, else 'fixed'), 'fixed' (use "
        "scale) or 'val_nll': choose the scale from scale_grid by the validation NLL of the "
        "predictive on fit(val_loader=...) (rule: val_rule)."
    )
    scale_grid: tuple[float, float, int] = option(
        (0.1, 1e4, 9), "(low, high, count): log-spaced scale grid of scale_method='val_nll' "
        "(wide: SGD from a pretrained optimum moves little, so useful scales reach 10²–10³; 9 values: each costs a BatchNorm pass per member)."
    )
    val_rule: str = option(
        "shift", "How the validation search chooses the scale (with the temperature): 'shift' (the "
        "lowest NLL on shifted validation inputs among choices the clean split cannot tell "
        "from the calibrated starting network; see bayesify.train.tuning) or 'min' (the "
        "lowest clean validation NLL)."
    )
    lr: float = option(
        1e-3, "SGD learning rate of the collection run (fit(lr=...) overrides it). Small on "
        "purpose: from a pretrained optimum a larger step walks the network away from it; the "
        "covariance scale chosen on validation makes up for a narrow trajectory."
    )
    lr_schedule: str = option(
        "constant", "'constant', or 'cyclic': linear decay lr → lr_min within every snapshot "
        "period, snapshot at the end of the period (Izmailov et al.)."
    )
    lr_min: float = option(0.0, "Lowest learning rate of the cyclic schedule.")
    momentum: float = option(0.9, "SGD momentum of the collection run.")
    weight_decay: float = option(5e-4, "SGD weight decay of the collection run.")
    snapshot_every: float | None = option(
        None, "Snapshot period in epochs; fractions of an epoch are allowed (e.g. 0.25). "
        "None: spread max_rank snapshots evenly over the whole run (at least 2 steps needed)."
    )
    snapshot_every_steps: int = option(
        0, "Snapshot every k SGD steps instead of per epoch fraction (0: use snapshot_every)."
    )
    moments_on_cpu: bool = option(
        False, "Keep mean / mean of squares / deviations on the CPU (big models); the "
        "network itself may live on the GPU."
    )
    bn_update_fraction: float = option(
        1.0, "Fraction of the training batches used to recompute BatchNorm statistics "
        "per sampled network (0: the mean's; pretrained where recomputing costs a point "
        "of training accuracy)."
    )
    predict_samples: int = option(10, "N: sampled networks at prediction ('swa': always 1).")
    min_variance: float = option(1e-30, "Floor of the diagonal variance mean(θ²) − mean(θ)².")
    vectorize: bool = option(
        True, "Evaluate a chunk of sampled networks with torch.func.vmap (falls back to a "
        "loop when the model cannot be vmapped)."
    )

    def validate(self) -> None:
        require(self.variant in VARIANTS,
                f"variant must be one of {VARIANTS}, got {self.variant!r}")
        require(isinstance(self.max_rank, int) and self.max_rank >= 2,
                f"max_rank must be an integer >= 2, got {self.max_rank!r}")
        require(self.scale is None or self.scale >= 0, f"scale must be >= 0, got {self.scale}")
        require(self.scale_method in ("auto", "fixed", "val_nll"),
                f"scale_method must be 'auto', 'fixed' or 'val_nll', got {self.scale_method!r}")
        low, high, count = self.scale_grid
        require(0 < low < high and int(count) >= 2,
                f"scale_grid must be (low, high, count) with 0 < low < high, count >= 2; "
                f"got {self.scale_grid!r}")
        require(self.val_rule in ("shift", "min"),
                f"val_rule must be 'shift' or 'min', got {self.val_rule!r}")
        require(self.lr >= 0, f"lr must be >= 0, got {self.lr}")
        require(self.lr_schedule in ("constant", "cyclic"),
                f"lr_schedule must be 'constant' or 'cyclic', got {self.lr_schedule!r}")
        require(0 <= self.momentum < 1, f"momentum must lie in [0, 1), got {self.momentum}")
        require(self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}")
        require(self.snapshot_every is None or self.snapshot_every > 0,
                f"snapshot_every must be None or > 0, got {self.snapshot_every}")
        require(isinstance(self.snapshot_every_steps, int) and self.snapshot_every_steps >= 0,
                f"snapshot_every_steps must be an integer >= 0, got {self.snapshot_every_steps!r}")
        require(0 <= self.bn_update_fraction <= 1,
                f"bn_update_fraction must lie in [0, 1], got {self.bn_update_fraction}")
        require(isinstance(self.predict_samples, int) and self.predict_samples > 0,
                f"predict_samples must be a positive integer, got {self.predict_samples!r}")

    def default_samples(self) -> int:
        """N sampled networks at prediction (1 for 'swa': the mean network)."""
        return 1 if self.variant == "swa" else self.predict_samples

    @property
    def sample_scale(self) -> float:
        """The covariance scale actually used: 0.5 for 'swag', 1.0 for 'diag' by default."""
        if self.scale is not None:
            return float(self.scale)
        return 0.5 if self.variant == "swag" else 1.0
