"""A rank that stops answering: the others fail after ``timeout_s`` naming it.

Two real gloo processes on the CPU; rank 1 sleeps instead of joining a
collective. Without the timeout option this would block for gloo's 30 minutes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bayesify import BayesifyError
from bayesify.train.distributed import DEFAULT_TIMEOUT_S, check_timeout, setup_distributed

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "failure_scripts" / "silent_rank.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_silent_rank_is_named_after_the_timeout():
    port = _free_port()
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "src")]))
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), "2"], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    start = time.monotonic()
    try:
        out, err = procs[0].communicate(timeout=90)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    elapsed = time.monotonic() - start
    report = json.loads(out.strip().splitlines()[-1])
    assert report["type"] == "BayesifyError", (out, err[-2000:])
    assert "rank 1 of 2 did not answer" in report["error"]
    assert "2 s timeout" in report["error"] and "timeout_s" in report["error"]
    assert 1.5 <= report["seconds"] < 30  # the option's timeout, not gloo's 30 minutes
    assert elapsed < 60


def test_timeout_option_is_validated_and_defaults_to_ten_minutes():
    assert DEFAULT_TIMEOUT_S == 600.0 and check_timeout(None) == 600.0 and check_timeout(5) == 5.0
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(BayesifyError, match="timeout_s"):
            check_timeout(bad)
    for bad in ("60", True):
        with pytest.raises(TypeError, match="timeout_s"):
            check_timeout(bad)
    with pytest.raises(BayesifyError, match="timeout_s"):  # checked even without torchrun
        setup_distributed(None, torch.device("cpu"), timeout_s=-3)
    ctx = setup_distributed(None, torch.device("cpu"), timeout_s=42)
    assert not ctx.distributed
