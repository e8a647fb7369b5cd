"""``EnsemblePredictor``: M posterior members in one tiled forward, plus evaluation."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from bayesify import metrics
from bayesify.predict.prediction import Prediction

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel


def _batches(loader: Iterable, device: torch.device) -> Iterable[tuple[torch.Tensor, torch.Tensor | None]]:
    for batch in loader:
        if isinstance(batch, (tuple, list)):
            x, y = batch[0], batch[1] if len(batch) > 1 else None
        else:
            x, y = batch, None
        yield x.to(device), None if y is None else y.to(device)


class BasePredictor:
    """Shared prediction/evaluation on top of ``member_logits(x) -> [M, B, C]``."""

    temperature: float = 1.0

    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    def member_logits(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> Prediction:
        return Prediction(self.member_logits(x) / self.temperature)

    def calibrate(self, val_loader: Iterable, method: str = "temperature", **kwargs: Any) -> Any:
        """Fit ``self.temperature`` on validation data; see ``bayesify.predict.calibration``."""
        from bayesify.predict.calibration import calibrate

        return calibrate(self, val_loader, method=method, **kwargs)

    def export(self, path: Any, example_input: torch.Tensor, format: str = "pt2", **kwargs: Any) -> Any:
        """Save a plain ``x → (probs, epistemic)`` module; see ``bayesify.predict.export``."""
        from bayesify.predict.export import export_predictor

        return export_predictor(self, path, example_input, format=format, **kwargs)

    def collect(self, loader: Iterable) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Member logits ``[M, N, C]`` (CPU, uncalibrated) and labels ``[N]`` over a loader."""
        logits, labels = [], []
        for x, y in _batches(loader, self.device):
            logits.append(self.member_logits(x).cpu())
            if y is not None:
                labels.append(y.cpu())
        return torch.cat(logits, dim=1), (torch.cat(labels) if labels else None)

    def evaluate(self, loader: Iterable, ood_loader: Iterable | None = None, *, n_bins: int = 15) -> dict[str, Any]:
        """Accuracy, error, NLL, ECE, Brier, mean entropy/MI; OOD AUROC when given.

        Streams over the loader keeping only per-example statistics.
        """
        stats = self._stream(loader, with_labels=True)
        labels = stats["labels"]
        probs = stats["probs"]
        conf, pred = probs.max(-1)
        correct = (pred == labels).float()
        out: dict[str, Any] = {
            "n": int(labels.numel()),
            "members": int(stats["members"]),
            "accuracy": correct.mean().item(),
            "error": 1.0 - correct.mean().item(),
            "nll": stats["nll"].mean().item(),
            "ece": metrics.ece_from_confidence(conf, correct, n_bins),
            "brier": metrics.per_example_brier(probs, labels).mean().item(),
            "entropy": stats["entropy"].mean().item(),
            "aleatoric": stats["aleatoric"].mean().item(),
            "epistemic": stats["epistemic"].mean().item(),
        }
        if ood_loader is not None:
            ood = self._stream(ood_loader, with_labels=False)
            num_classes = probs.shape[-1]
            out.update({
                "ood_auroc_entropy": metrics.auroc(stats["entropy"], ood["entropy"]),
                "ood_auroc_mi": metrics.auroc(stats["epistemic"], ood["epistemic"]),
                "ood_entropy": ood["entropy"].mean().item(),
                "ood_entropy_cdf_auc": metrics.entropy_cdf_auc(ood["entropy"], num_classes),
            })
        return out

    def _stream(self, loader: Iterable, *, with_labels: bool) -> dict[str, Any]:
        keep: dict[str, list[torch.Tensor]] = {
            k: [] for k in ("probs", "entropy", "aleatoric", "epistemic", "nll", "labels")
        }
        members = 0
        for x, y in _batches(loader, self.device):
            pred = self(x)
            members = pred.num_members
            keep["probs"].append(pred.probs.cpu())
            keep["entropy"].append(pred.entropy.cpu())
            keep["aleatoric"].append(pred.aleatoric.cpu())
            keep["epistemic"].append(pred.epistemic.cpu())
            if with_labels and y is not None:
                keep["labels"].append(y.cpu())
                keep["nll"].append(metrics.per_example_nll(pred.log_probs, y).cpu())
        out = {k: torch.cat(v) if v else torch.empty(0) for k, v in keep.items()}
        out["members"] = members
        return out


class ModelPredictor(BasePredictor):
    """Plain network(s) behind the predictor interface: MAP (one model) or a list.

    A list of models is a deep ensemble with M = len(models) members.
    """

    def __init__(self, models: torch.nn.Module | list[torch.nn.Module], *, temperature: float = 1.0) -> None:
        self.models = list(models) if isinstance(models, (list, tuple)) else [models]
        self.temperature = float(temperature)

    @property
    def device(self) -> torch.device:
        for p in self.models[0].parameters():
            return p.device
        return torch.device("cpu")

    @torch.no_grad()
    def member_logits(self, x: torch.Tensor) -> torch.Tensor:
        from bayesify.core.method import logits_of

        outs = []
        for model in self.models:
            was_training = model.training
            model.eval()
            outs.append(logits_of(model(x.to(self.device))).float())
            model.train(was_training)
        return torch.stack(outs)


class EnsemblePredictor(BasePredictor):
    """Calls a :class:`BayesianModel` as an ensemble of M fixed members.

    ``samples_per_component``: n draws of every component (M = K·n for iBNN).
    ``max_rows``: rows per forward pass; members are chunked to stay under it.
    ``seed``: fixes the members' noise, so repeated calls see the same M networks.
    ``temperature``: logits are divided by it (see ``calibrate``).
    """

    def __init__(
        self,
        bnn: BayesianModel,
        samples_per_component: int | None = None,
        *,
        max_rows: int = 4096,
        seed: int = 0,
        temperature: float = 1.0,
    ) -> None:
        if samples_per_component is not None and samples_per_component <= 0:
            from bayesify.errors import BayesifyError

            raise BayesifyError(
                f"samples_per_component must be positive, got {samples_per_component}"
            )
        self.bnn = bnn
        self.samples_per_component = (
            samples_per_component or bnn.method.default_samples_per_component()
        )
        self.max_rows = int(max_rows)
        self.seed = seed
        self.temperature = float(temperature)

    @property
    def device(self) -> torch.device:
        return self.bnn.device

    @torch.no_grad()
    def member_logits(self, x: torch.Tensor) -> torch.Tensor:
        """``[M, B, C]`` raw (uncalibrated) member logits in eval mode."""
        was_training = self.bnn.training
        self.bnn.eval()
        try:
            return self.bnn.member_logits(
                x.to(self.device),
                samples_per_component=self.samples_per_component,
                max_rows=self.max_rows,
                seed=self.seed,
            ).float()
        finally:
            self.bnn.train(was_training)

    def __repr__(self) -> str:
        return (f"EnsemblePredictor(method={self.bnn.method_name}, members="
                f"{self.bnn.method.components}×{self.samples_per_component}, "
                f"temperature={self.temperature:.4g})")

