"""``MixturePredictor``: the equal-weight mixture of several calibrated predictors.

MultiSWAG (Wilson & Izmailov 2020) and its kin: a posterior around each of K networks that
were trained apart (a deep ensemble's members), mixed. Part k contributes its calibrated
predictive ``p_k = softmax(log p̄_k / T_k)`` — its own members or link, at its own searched
temperature — and the mixture is ``p = 1/K Σ_k p_k``, with one more temperature on top
(:meth:`~bayesify.predict.predictor.BasePredictor.calibrate`, 1 by default). The
:class:`~bayesify.core.prediction.Prediction` it returns has the K parts as its members, so
its epistemic part is the disagreement *between* the parts (the spread within a part counts
as aleatoric).

Measured (``benchmarks/multiswag31.py``, RESULTS "Quality"): SWAG around each member of a
5-member deep ensemble lowers the ensemble's NLL under shift; around five fine-tuned copies
of one pretrained network it does not reach the deep ensemble (the copies do not differ
enough). It pays where the networks were trained apart, so it takes predictors, not one
network::

    parts = []
    for member in deep_ensemble:                      # networks trained apart
        bnn = bayesify(member, method="swag")
        fit(bnn, train_loader, val_loader=val_loader)
        parts.append(bnn.predictor())
    multiswag = MixturePredictor(parts)               # evaluate, calibrate, export like any
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from bayesify.core.prediction import Prediction, gaussian_log_probs
from bayesify.errors import BayesifyError
from bayesify.predict.predictor import BasePredictor
from bayesify.predict.serving import check_nonfinite_policy


class MixturePredictor(BasePredictor):
    """``parts``: two or more predictors (``bnn.predictor()``, ``ModelPredictor``, another
    mixture) of the same classes, on one device. Each keeps its own temperature; this
    predictor's ``temperature`` acts on the mixture (``softmax(log p / T)``)."""

    def __init__(self, parts: Sequence[BasePredictor], *, temperature: float = 1.0,
                 nonfinite: str = "error") -> None:
        if isinstance(parts, (BasePredictor, str, bytes)) or not isinstance(parts, Sequence):
            raise BayesifyError(
                f"MixturePredictor takes a list of predictors, got {type(parts).__name__}; "
                "pass [bnn_1.predictor(), bnn_2.predictor(), ...]")
        parts = list(parts)
        wrong = [f"{i}: {type(p).__name__}" for i, p in enumerate(parts)
                 if not isinstance(p, BasePredictor)]
        if wrong:
            raise BayesifyError(
                f"MixturePredictor's parts must be predictors (bnn.predictor(), "
                f"ModelPredictor, ...); not these: {', '.join(wrong)}")
        if len(parts) < 2:
            raise BayesifyError(f"a mixture needs two or more predictors, got {len(parts)}; "
                                "use the predictor itself")
        devices = {str(p.device) for p in parts}
        if len(devices) > 1:
            raise BayesifyError(f"the parts live on different devices ({sorted(devices)}); "
                                "move every network to one device first")
        self.parts = parts
        self.temperature = temperature
        self.nonfinite = check_nonfinite_policy(nonfinite)

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def family(self) -> str:
        return self.method_name

    @property
    def method_name(self) -> str:
        """``mixture(swag, swag, ...)``: what the export's metadata calls it."""
        names = [getattr(getattr(p, "bnn", None), "method_name", None) or p.family
                 for p in self.parts]
        return f"mixture({', '.join(names)})"

    @torch.no_grad()
    def predict(self, inputs: Any) -> Prediction:
        """Members ``[K, B, C]``: part k's tempered log-probabilities."""
        parts = [p.predict(inputs).scaled(p.temperature).log_probs.float() for p in self.parts]
        shapes = {tuple(lp.shape) for lp in parts}
        if len(shapes) > 1:
            raise BayesifyError(f"the parts predict different shapes {sorted(shapes)}: "
                                "every part must classify the same classes")
        return Prediction(torch.stack(parts))

    def export_members(self, example: Any) -> nn.Module:
        return MixtureMembers([p.export_members(example) for p in self.parts],
                              [float(p.temperature) for p in self.parts])


class MixtureMembers(nn.Module):
    """``inputs → [K, B, C]``: every part's exported members (or Gaussian moments) reduced to
    its tempered log predictive, the arithmetic of :meth:`MixturePredictor.predict`."""

    def __init__(self, parts: list[nn.Module], temperatures: list[float]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.register_buffer("temperatures", torch.tensor(temperatures, dtype=torch.float32))

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = []
        for k, part in enumerate(self.parts):
            raw = part(*args, **kwargs).float()
            link = getattr(part, "gaussian_link", None)
            if link is not None:
                mean, var, rowsum = raw.unbind(0)
                log_p = gaussian_log_probs(mean, var, link, rowsum=rowsum, total=rowsum.sum(-1))
            elif getattr(part, "gaussian_members", None) is not None:  # [2, M, B, C]
                member_log_p = gaussian_log_probs(raw[0], raw[1], part.gaussian_members)
                log_p = torch.logsumexp(member_log_p, 0) - math.log(raw.shape[1])
            else:
                log_p = torch.logsumexp(torch.log_softmax(raw, -1), 0) - math.log(raw.shape[0])
            out.append(torch.log_softmax(log_p / self.temperatures[k], -1))
        return torch.stack(out)
