"""Which op of a CUDA trace bounds the exported batch axis: run with TORCH_LOGS=dynamic."""

import sys

import torch

import bayesify
from bayesify.data.models import DigitsCNN

device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
torch.manual_seed(0)
bnn = bayesify.bayesify(DigitsCNN(num_classes=5, width=8).eval().to(device), "ibnn")
try:
    bnn.predictor(seed=1).export("/tmp/guard.pt2", torch.rand(2, 1, 8, 8, device=device))
    print("export ok")
except Exception as err:  # noqa: BLE001 - the diagnosis prints it
    print("export failed:", str(err)[:300])
