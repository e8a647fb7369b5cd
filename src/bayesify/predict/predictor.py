"""``EnsemblePredictor``: M posterior members in one tiled forward, plus evaluation.

Predictors are safe to call from several threads (one lock per model, see
:mod:`bayesify.predict.serving`), refuse NaN/inf inputs and non-finite predictives
unless ``nonfinite="propagate"``, and accept only finite temperatures > 0.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from bayesify import metrics
from bayesify.core.batch import (
    as_inputs,
    call_model,
    iter_batches,
    limited_batches,
    replayed_order,
)
from bayesify.core.checks import explain_shapes
from bayesify.core.extensions import provide
from bayesify.core.fitting import BatchSource
from bayesify.core.outputs import logits_of
from bayesify.core.prediction import Prediction
from bayesify.errors import BayesifyError
from bayesify.kit import laplace_heads
from bayesify.kit.laplace_heads_export import export_heads
from bayesify.kit.stacked import StackedModels
from bayesify.predict.serving import (
    check_inputs,
    check_max_rows,
    check_nonfinite_policy,
    check_prediction,
    check_temperature,
    model_lock,
)
from bayesify.predict.stats import per_example_stats, summarize
from bayesify.progress import progress_bar, timed

if TYPE_CHECKING:
    from bayesify.core.model import BayesianModel

logger = logging.getLogger(__name__)


class BasePredictor:
    """Shared prediction/evaluation on top of ``predict(inputs) -> Prediction``.

    Every entry point takes batches by the convention of :mod:`bayesify.core.batch`:
    ``predictor(x)``, ``predictor(**inputs)``, ``predictor(mapping)``; loaders of
    ``(x, y)`` pairs or mappings with ``labels`` (``batch_fn=`` for other layouts).
    """

    batch_fn: Any = None
    #: "error" (default): NaN/inf inputs, and non-finite predictives of finite inputs,
    #: are a BayesifyError; "propagate": no checks (see bayesify.predict.serving)
    nonfinite: str = "error"
    #: the class names of this predictor's last export that named them (``export(...,
    #: class_names=...)``): later exports without ``class_names`` reuse them
    class_names: list[str] | None = None
    _base_temperature: float = 1.0

    @property
    def temperature(self) -> float:
        """``T`` of the predictive ``softmax(log p̄ / T)``; a finite number > 0 (checked when set)."""
        return self._base_temperature

    @temperature.setter
    def temperature(self, value: float) -> None:
        self._base_temperature = check_temperature(value)

    @property
    def device(self) -> torch.device:
        raise NotImplementedError

    def checked_predict(self, inputs: Any, *, where: str = "predictor") -> Prediction:
        """:meth:`predict` with the input / output checks of ``nonfinite``."""
        check_inputs(inputs, self.nonfinite, where=where)
        prediction = self.predict(inputs)
        check_prediction(prediction, inputs, self.nonfinite, family=self.family, where=where)
        return prediction

    @property
    def family(self) -> str:
        return type(self).__name__

    def member_logits(self, x: Any) -> torch.Tensor:
        """``[M, B, C]`` raw (uncalibrated) member logits (Gaussian: fixed-seed samples)."""
        return self.predict(x).member_logits

    def predict(self, inputs: Any) -> Prediction:
        """The raw (temperature 1) predictive of ``inputs`` (a tensor or a Batch)."""
        return Prediction(self.member_logits(inputs))

    def __call__(self, *args: Any, **kwargs: Any) -> Prediction:
        inputs = as_inputs(*args, **kwargs)
        if inputs.size == 0:
            raise BayesifyError("the predictor got an empty batch (0 rows); pass at least one input")
        return self.checked_predict(inputs.to(self.device).model_input()).scaled(self.temperature)

    def calibrate(self, val_loader: Iterable, method: str = "temperature", **kwargs: Any) -> Any:
        """Fit ``self.temperature`` on validation data; see ``bayesify.predict.calibration``."""
        from bayesify.predict.calibration import calibrate

        return calibrate(self, val_loader, method=method, **kwargs)

    def export(self, path: Any, example_input: Any, format: str | None = None, **kwargs: Any) -> Any:
        """Save a plain ``x → (probs, epistemic)`` module (format from the suffix, metadata and
        a sha256 record with it); see ``bayesify.predict.export``."""
        from bayesify.predict.export import export_predictor

        return export_predictor(self, path, example_input, format=format, **kwargs)

    def export_members(self, example: Any) -> torch.nn.Module:
        """The plain ``inputs → [M, B, C]`` member logits module that ``export`` wraps
        (``example``: an inputs-only ``Batch`` on this predictor's device)."""
        raise BayesifyError(f"cannot export a {type(self).__name__}; use an "
                            "EnsemblePredictor (bnn.predictor()) or a ModelPredictor")

    def collect(self, loader: Iterable, *, where: str = "collect",
                progress: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Member logits ``[M, N, C]`` (CPU, uncalibrated) and labels ``[N]`` over a loader."""
        prediction, labels = self.collect_predictions(loader, where=where, progress=progress)
        return prediction.member_logits, labels

    def collect_predictions(self, loader: Iterable, *, where: str = "predictor",
                            progress: bool = True) -> tuple[Prediction, torch.Tensor | None]:
        """The raw :class:`Prediction` (CPU) and labels ``[N]`` over a whole loader
        (``progress``: a bar named ``where``, rank 0 only)."""
        parts, labels = [], []
        batches = progress_bar(loader, where, enabled=progress) if progress else loader
        for batch in iter_batches(batches, device=self.device, batch_fn=self.batch_fn):
            parts.append(self.checked_predict(batch.model_input(), where=where).to("cpu"))
            if batch.labels is not None:
                labels.append(batch.labels.cpu())
        if not parts:
            raise BayesifyError("the loader produced no batches")
        return Prediction.cat(parts), (torch.cat(labels) if labels else None)

    def evaluate(self, loader: Iterable, ood_loader: Iterable | None = None, *, n_bins: int = 15,
                 progress: bool = True) -> dict[str, Any]:
        """Accuracy, error, NLL, ECE, Brier, mean entropy/MI; OOD AUROC when given.

        Streams over the loader keeping only per-example statistics; ``progress``: a
        bar per loader (rank 0) and an INFO log line with the result and seconds.
        """
        with timed(logger, f"evaluate ({self.family})") as note:
            stats = per_example_stats(self, loader, device=self.device, batch_fn=self.batch_fn,
                                      progress=progress, desc="evaluate")
            out = summarize(stats, n_bins=n_bins)
            if ood_loader is not None:
                ood = per_example_stats(self, ood_loader, device=self.device,
                                        batch_fn=self.batch_fn, labels=False,
                                        progress=progress, desc="evaluate OOD")
                num_classes = int(stats["num_classes"])
                out.update({
                    "ood_auroc_entropy": metrics.ood_auroc(stats["entropy"], ood["entropy"]),
                    "ood_auroc_mi": metrics.ood_auroc(stats["epistemic"], ood["epistemic"]),
                    "ood_entropy": ood["entropy"].mean().item(),
                    "ood_entropy_cdf_auc": metrics.entropy_cdf_auc(ood["entropy"], num_classes),
                })
            if "accuracy" in out:
                note["result"] = (f"{out['n']} examples, accuracy {out['accuracy']:.4f}, "
                                  f"NLL {out['nll']:.4f}")
        return out


class ModelPredictor(BasePredictor):
    """Plain network(s) behind the predictor interface: MAP (one model) or a list.

    A list of models is a deep ensemble with M = len(models) members.
    """

    def __init__(self, models: torch.nn.Module | list[torch.nn.Module], *, temperature: float = 1.0,
                 nonfinite: str = "error", output_fn: Any = None) -> None:
        from bayesify.core.outputs import resolve_output_fn

        self.models = list(models) if isinstance(models, (list, tuple)) else [models]
        self.temperature = temperature
        self.nonfinite = check_nonfinite_policy(nonfinite)
        self.output_fn = resolve_output_fn(output_fn)

    @property
    def device(self) -> torch.device:
        for p in self.models[0].parameters():
            return p.device
        return torch.device("cpu")

    @torch.no_grad()
    def member_logits(self, x: Any) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            x = x.to(self.device)
        outs = []
        for model in self.models:
            with model_lock(model):
                was_training = model.training
                model.eval()
                try:
                    out = call_model(model, x)
                finally:
                    model.train(was_training)
            outs.append(logits_of(self.output_fn(out) if self.output_fn else out).float())
        return torch.stack(outs)

    def export_members(self, example: Any) -> torch.nn.Module:
        return StackedModels(self.models)


class EnsemblePredictor(BasePredictor):
    """Calls a :class:`BayesianModel` as an ensemble of M fixed members.

    ``samples_per_component``: n draws of every component (M = K·n for iBNN).
    ``max_rows``: rows per forward pass; members are chunked to stay under it.
    ``seed``: fixes the members' noise, so repeated calls see the same M networks.
    ``temperature``: acts on the predictive, ``softmax(log p̄ / T)`` (see ``calibrate``).
    ``bn_loader``: training inputs from which families that recompute BatchNorm
    statistics per sampled network (SWAG) draw them for members ``fit`` did not store
    (another ``seed`` or more members); kept in ``bnn.runtime``, never saved.
    """

    def __init__(
        self,
        bnn: BayesianModel,
        samples_per_component: int | None = None,
        *,
        max_rows: int = 4096,
        seed: int = 0,
        temperature: float | None = None,
        batch_fn: Any = None,
        nonfinite: str = "error",
        bn_loader: Iterable | None = None,
    ) -> None:
        if samples_per_component is not None and (
                isinstance(samples_per_component, bool)
                or not isinstance(samples_per_component, numbers.Integral)
                or samples_per_component <= 0):
            raise BayesifyError(
                f"samples_per_component must be a positive integer, got {samples_per_component!r}"
            )
        self.nonfinite = check_nonfinite_policy(nonfinite)
        self.bnn = bnn
        if bn_loader is not None:  # inputs for the BatchNorm statistics of sampled networks
            bnn.runtime["bn_source"] = BatchSource(batches=lambda fraction: replayed_order(
                limited_batches(bn_loader, fraction=fraction, device=bnn.device,
                                batch_fn=batch_fn), bn_loader, bnn.device))
        self.samples_per_component = (
            samples_per_component or bnn.posterior_config.default_samples()
        )
        self.max_rows = check_max_rows(max_rows)
        self.seed = seed
        self.batch_fn = batch_fn
        #: defaults to the temperature saved with the posterior (1 until calibrated)
        self._temperature = (None if temperature is None
                             else check_temperature(temperature, where="temperature"))

    @property
    def temperature(self) -> float:  # type: ignore[override]
        if self._temperature is not None:
            return self._temperature
        return check_temperature(self.bnn.state.value("temperature"),
                                 where="the temperature stored with the posterior")

    @temperature.setter
    def temperature(self, value: float) -> None:
        """Setting it (``calibrate`` does) also stores it with the posterior."""
        value = check_temperature(value)
        self._temperature = value
        self.bnn.state.set("temperature", value)

    @property
    def family(self) -> str:
        return self.bnn.method_name

    @property
    def device(self) -> torch.device:
        return self.bnn.device

    @torch.no_grad()
    def predict(self, inputs: Any) -> Prediction:
        """The raw predictive (members or moments) in eval mode."""
        if isinstance(inputs, torch.Tensor):
            inputs = inputs.to(self.device)
        with model_lock(self.bnn):  # the sampling plan and modes are shared: one at a time
            was_training = self.bnn.training
            self.bnn.eval()
            try:
                return self.bnn.predictive(
                    inputs, samples_per_component=self.samples_per_component,
                    max_rows=self.max_rows, seed=self.seed,
                )
            except Exception:  # a shape mistake: the layer, the user's shape and the fix
                self._explain_shapes(inputs)
                raise
            finally:
                self.bnn.train(was_training)

    #: set by fit's own validation: SWAG's epochs before the last validate the current
    #: iterate on purpose (the moments are built at the end)
    during_fit: bool = False

    def _explain_shapes(self, inputs: Any) -> None:
        """After a failed forward: re-run the posterior mean on the untiled ``inputs`` with
        a check before every conv / linear layer (:func:`explain_shapes`)."""
        bnn = self.bnn
        with bnn.deterministic():
            explain_shapes(bnn.model, lambda: call_model(bnn.model, inputs), inputs=inputs,
                           where="predictor")

    def require_posterior(self, what: str) -> None:
        """Refuse ``what`` on a family whose posterior only ``fit`` builds (Laplace's
        curvature, SWAG's moments, snapshot ensembles) before it exists: the predictive
        would be the pretrained network's with epistemic 0, and nothing would say so."""
        bnn = self.bnn
        if not self.during_fit and not bnn.method.step().ready(bnn):
            raise BayesifyError(
                f"{what}: method {bnn.method_name!r} builds its posterior in bayesify.fit, and "
                "this model has none yet (its predictions would be the pretrained network's, "
                "with epistemic uncertainty 0). Run bayesify.fit(bnn, train_loader) first, or "
                "load a saved one with bayesify.load_posterior(base_model, directory)")

    def __call__(self, *args: Any, **kwargs: Any) -> Prediction:
        self.require_posterior("predictor(x)")
        return super().__call__(*args, **kwargs)

    def evaluate(self, loader: Iterable, ood_loader: Iterable | None = None,
                 **kwargs: Any) -> dict[str, Any]:
        self.require_posterior("predictor.evaluate")
        return super().evaluate(loader, ood_loader, **kwargs)

    def calibrate(self, val_loader: Iterable, method: str = "temperature", **kwargs: Any) -> Any:
        self.require_posterior("predictor.calibrate")
        return super().calibrate(val_loader, method=method, **kwargs)

    def export_members(self, example: Any) -> torch.nn.Module:
        """The family's frozen members (``Method.export_module``) in eval mode; with fitted
        member-wise Laplace heads their probit members (:mod:`bayesify.kit.laplace_heads_export`)."""
        bnn = self.bnn
        heads = laplace_heads.enabled(bnn) and laplace_heads.fitted(bnn)
        was_training = bnn.training
        bnn.eval()
        try:
            build = export_heads if heads else bnn.method.export_module
            return build(bnn, samples_per_component=self.samples_per_component,
                         seed=self.seed, example_input=example)
        finally:
            bnn.train(was_training)

    def __repr__(self) -> str:
        return (f"EnsemblePredictor(method={self.bnn.method_name}, members="
                f"{self.bnn.method.components}×{self.samples_per_component}, "
                f"temperature={self.temperature:.4g})")


provide("predictor", EnsemblePredictor)  # bnn.predictor(...)
