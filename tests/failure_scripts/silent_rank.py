"""Worker for tests/test_failure_distributed.py: rank 1 stops answering.

Run as two processes with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set. Rank 0
calls a collective; rank 1 sleeps. Rank 0 prints the error it got as JSON.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from bayesify.train.distributed import all_reduce_mean, setup_distributed

if __name__ == "__main__":
    timeout_s = float(sys.argv[1])
    ctx = setup_distributed(None, torch.device("cpu"), timeout_s=timeout_s)
    if ctx.rank == 1:
        time.sleep(120)  # hung: never joins the collective (the test kills it)
        sys.exit(0)
    start = time.monotonic()
    try:
        all_reduce_mean(torch.ones(3), ctx)
        print(json.dumps({"error": None}), flush=True)
    except Exception as err:  # noqa: BLE001 - reported to the test
        print(json.dumps({"type": type(err).__name__, "error": str(err),
                          "seconds": time.monotonic() - start}), flush=True)
    sys.stdout.flush()
    import os

    os._exit(0)  # do not wait for the silent peer in destroy_process_group
