"""One check many tests make: a predictor exported to ``path`` and run from the file gives
the in-process probabilities and epistemic part."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from bayesify.predict.export import export_predictor, run_exported


def assert_export_matches(predictor: Any, path: Path, inputs: Any, *,
                          rtol: float = 1e-5, atol: float = 1e-5) -> None:
    got = predictor(inputs)
    export_predictor(predictor, path, inputs)
    probs, epistemic = run_exported(path, inputs)
    torch.testing.assert_close(probs, got.probs, rtol=rtol, atol=atol)
    torch.testing.assert_close(epistemic, got.epistemic, rtol=1e-4, atol=atol)
