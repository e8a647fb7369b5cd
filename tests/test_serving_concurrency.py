"""A served model across threads, forks and input dtypes.

- ``with bnn.deterministic():`` and a direct ``bnn(x)`` in one thread never change
  what a predictor returns in another thread, and never fail with a false error;
- a forked child (pre-fork servers, DataLoader workers) never inherits a held lock;
- floating inputs are computed in the model's dtype, integer images are refused with
  how to convert them, ``max_rows`` must be a positive integer.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bayesify import BayesifyError, bayesify, fit
from bayesify.core.locks import model_lock


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)).eval()


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)).eval()


@pytest.fixture
def fast_switching():
    """Switch threads as often as the interpreter allows, so races show within a test."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def _run_threads(*targets) -> list[str]:
    errors: list[str] = []

    def guarded(fn):
        def run():
            try:
                fn()
            except Exception as err:  # noqa: BLE001 - collected for the assertion
                errors.append(f"{type(err).__name__}: {err}")
        return run

    threads = [threading.Thread(target=guarded(t)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a thread is stuck"
    return errors


def test_deterministic_block_in_one_thread_leaves_other_threads_predictions_alone(fast_switching):
    bnn = bayesify(mlp(), "ibnn", components=2)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 6, generator=g)
    predictor = bnn.predictor(samples_per_component=2)
    reference = predictor(x).probs
    with bnn.deterministic():
        det_reference = bnn(x)
    assert not torch.allclose(reference.log(), det_reference.log_softmax(-1), atol=1e-3)
    differ: list[int] = []
    det_differ: list[int] = []

    def predict() -> None:
        for i in range(400):
            if not torch.equal(predictor(x).probs, reference):
                differ.append(i)

    def deterministic() -> None:
        for i in range(400):
            with bnn.deterministic():
                if not torch.equal(bnn(x), det_reference):
                    det_differ.append(i)

    errors = _run_threads(predict, deterministic)
    assert errors == [] and differ == [] and det_differ == []


def test_direct_forward_concurrent_with_a_predictor(fast_switching):
    bnn = bayesify(mlp(), "ibnn", components=2)
    x = torch.randn(6, 6, generator=torch.Generator().manual_seed(2))
    predictor = bnn.predictor(samples_per_component=3)
    reference = predictor(x).probs
    shapes: list[tuple[int, ...]] = []

    def predict() -> None:
        for _ in range(150):
            assert torch.equal(predictor(x).probs, reference)

    def forward() -> None:
        for _ in range(150):
            shapes.append(tuple(bnn(x).shape))

    assert _run_threads(predict, forward) == []
    assert set(shapes) == {(6, 3)}


def _wait_child(pid: int, limit_s: float) -> int | None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_does_not_inherit_a_held_model_lock():
    bnn = bayesify(mlp(), "ibnn", components=2)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    predictor = bnn.predictor(samples_per_component=2)
    reference = predictor(x).probs
    held, release = threading.Event(), threading.Event()

    def hold() -> None:  # another thread is mid-prediction when the process forks
        with model_lock(bnn):
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(10)
    pid = os.fork()
    if pid == 0:  # child: only the forking thread exists; its first prediction must run
        code = 1
        try:
            signal.alarm(20)
            code = 0 if torch.equal(predictor(x).probs, reference) else 2
        finally:
            os._exit(code)
    try:
        status = _wait_child(pid, 15.0)
    finally:
        release.set()
        holder.join()
    assert status is not None, "the child's first prediction blocked on the parent's lock"
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_floating_inputs_run_in_the_model_s_dtype():
    bnn = bayesify(cnn(), "ibnn", components=2)
    predictor = bnn.predictor(samples_per_component=2)
    x = torch.rand(3, 3, 8, 8, generator=torch.Generator().manual_seed(4))
    reference = predictor(x).probs
    assert torch.equal(predictor(x.double()).probs, reference)
    assert torch.equal(predictor(x.half()).probs, predictor(x.half().float()).probs)
    assert bnn(x.double()).dtype == torch.float32
    assert model_predictor_probs(cnn(), x.double()).dtype == torch.float32


def model_predictor_probs(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    from bayesify import ModelPredictor

    return ModelPredictor(model)(x).probs


def test_integer_images_are_refused_with_how_to_convert_them():
    bnn = bayesify(cnn(), "ibnn", components=2)
    predictor = bnn.predictor(samples_per_component=2)
    pixels = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    for bad in (pixels, pixels.long()):
        with pytest.raises(BayesifyError, match=r"x\.float\(\) / 255") as err:
            predictor(bad)
        assert str(bad.dtype) in str(err.value) and "float32" in str(err.value)
        with pytest.raises(BayesifyError, match=r"x\.float\(\) / 255"):
            bnn(bad)
    tabular = torch.randint(0, 5, (2, 6))  # int64 features into a Linear
    with pytest.raises(BayesifyError, match=r"torch\.int64.*x\.float\(\)"):
        bayesify(mlp(), "ibnn", components=2).predictor()(tabular)
    loader = DataLoader(TensorDataset(pixels, torch.tensor([0, 1])), batch_size=2)
    with pytest.raises(BayesifyError, match=r"x\.float\(\) / 255"):  # before any step
        fit(bnn, loader, epochs=1, progress=False)


def test_max_rows_must_be_a_positive_integer():
    bnn = bayesify(mlp(), "ibnn", components=2)
    for bad in (0, -1, -4096):
        with pytest.raises(BayesifyError, match="max_rows must be a positive integer"):
            bnn.predictor(max_rows=bad)
    for bad in (1.5, "64", True):
        with pytest.raises(TypeError, match="max_rows"):
            bnn.predictor(max_rows=bad)
    assert bnn.predictor(max_rows=1).max_rows == 1
