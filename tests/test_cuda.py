"""CUDA: every family's AMP fit is finite, a CUDA predictor exports, nccl at world size 1.

Skipped without CUDA (CI has none); run on a GPU machine with ``pytest tests/test_cuda.py``.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import bayesify
from bayesify.data.digits import load_digits_splits
from bayesify.data.models import DigitsCNN
from bayesify.predict.export import run_exported

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def data():
    splits = load_digits_splits(seed=0)
    return splits


def _base() -> torch.nn.Module:
    torch.manual_seed(0)
    return DigitsCNN(num_classes=5, width=8).eval()


@pytest.mark.parametrize("method", bayesify.list_methods())
def test_amp_fit_is_finite_for_every_family(method, data, digits_map):
    x, y = data.train.tensors
    loader = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
    bnn = bayesify.bayesify(copy.deepcopy(digits_map), method)
    options = {"epochs": 2, "amp": True} if bnn.method.step().optimizes else {}
    bayesify.fit(bnn, loader, device="cuda", progress=False, seed=0, **options)
    assert next(bnn.parameters()).device.type == "cuda"
    for name, p in bnn.named_posterior_parameters():
        assert torch.isfinite(p).all(), f"{method}: {name} not finite after an AMP fit"
    prediction = bnn.predictor()(data.test.tensors[0][:64].cuda())
    assert torch.isfinite(prediction.probs).all()
    torch.testing.assert_close(prediction.probs.sum(-1),
                               torch.ones(64, device=prediction.probs.device), atol=1e-4, rtol=0)
    accuracy = (prediction.probs.argmax(-1).cpu() == data.test.tensors[1][:64]).float().mean()
    assert accuracy > 0.8, f"{method}: accuracy {accuracy:.2f} after an AMP fit on digits"


@pytest.mark.parametrize("fmt", ["pt2", "onnx"])
def test_a_cuda_predictor_exports_and_matches(fmt, data, digits_map, tmp_path):
    if fmt == "onnx":
        pytest.importorskip("onnxruntime")
    x, y = data.train.tensors
    bnn = bayesify.bayesify(copy.deepcopy(digits_map), "ibnn")
    bayesify.fit(bnn, DataLoader(TensorDataset(x, y), batch_size=32), epochs=1, device="cuda",
                 progress=False, seed=0)
    predictor = bnn.predictor(seed=1)
    xs = data.test.tensors[0][:17].cuda()
    info = predictor.export(tmp_path / f"cuda.{fmt}", xs[:2], format=fmt)
    assert info["max_abs_diff"] <= 1e-4
    probs, epistemic = run_exported(tmp_path / f"cuda.{fmt}", xs)
    reference = predictor(xs)
    torch.testing.assert_close(probs.to(reference.probs.device), reference.probs, atol=1e-4, rtol=0)
    torch.testing.assert_close(epistemic.to(reference.epistemic.device), reference.epistemic,
                               atol=1e-4, rtol=0)


WORKER = textwrap.dedent("""
    import json, sys
    import torch, torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset
    import bayesify
    from bayesify.data.digits import load_digits_splits
    from bayesify.data.models import DigitsCNN
    dist.init_process_group("nccl")
    torch.manual_seed(0)
    base = DigitsCNN(num_classes=5, width=8).eval()
    torch.manual_seed(1)
    bnn = bayesify.bayesify(base, "ibnn")
    x, y = load_digits_splits(seed=0).train.tensors
    bayesify.fit(bnn, DataLoader(TensorDataset(x, y), batch_size=32), epochs=2, device="cuda",
                 progress=False, seed=3, amp=False)
    out = {n: p.detach().cpu().flatten().tolist() for n, p in bnn.named_posterior_parameters()}
    json.dump({"backend": dist.get_backend(), "world": dist.get_world_size(), "params": out},
              open(sys.argv[1], "w"))
    dist.destroy_process_group()
""")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_nccl_at_world_size_one_equals_one_process(data, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "src")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1",
                           f"--master_port={_free_port()}", str(script), str(tmp_path / "out.json")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    ddp = json.loads((tmp_path / "out.json").read_text())
    assert ddp["backend"] == "nccl" and ddp["world"] == 1
    base = _base()
    torch.manual_seed(1)
    bnn = bayesify.bayesify(base, "ibnn")
    x, y = data.train.tensors
    bayesify.fit(bnn, DataLoader(TensorDataset(x, y), batch_size=32), epochs=2, device="cuda",
                 progress=False, seed=3, amp=False)
    for name, p in bnn.named_posterior_parameters():
        theirs = torch.tensor(ddp["params"][name])
        torch.testing.assert_close(p.detach().cpu().flatten(), theirs, atol=1e-4, rtol=1e-4)


def test_collectives_take_cpu_counters_on_an_nccl_group(tmp_path):
    """NCCL has no CPU backend ("No backend type associated with device type cpu"): the
    library's sums of CPU counters (an epoch's example count, the stream's lockstep flag) run
    on the group's device and come back where they came from. A one-rank NCCL group, read as
    distributed so the collectives run."""
    import torch.distributed as dist

    from bayesify.train.distributed import DistContext, all_reduce_mean, all_reduce_sum

    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        ctx = DistContext(rank=0, world_size=2, device=torch.device("cuda", 0))
        out = all_reduce_sum(torch.tensor([3.0], dtype=torch.float64), ctx)
        assert out.device.type == "cpu" and out.item() == 3.0
        assert all_reduce_mean(torch.tensor([4.0]), ctx).item() == 2.0  # ÷ ctx.world_size
        on_gpu = all_reduce_sum(torch.ones(2, device="cuda"), ctx)
        assert on_gpu.device.type == "cuda"
    finally:
        dist.destroy_process_group()
