"""Worker for tests/test_failure_save.py: kill a re-save at every point, and at random.

Usage: ``save_kill.py MODE DIR [N]`` with MODE

- ``points``: save posterior A into DIR, then for every kill point k fork a child that
  re-saves posterior B and ``os._exit``s just before / just after the k-th call of a
  file-system primitive (``open``, ``write``, ``fsync``, ``replace``, ``unlink``,
  ``close``) or halfway through writing a file; after each child dies the directory is
  loaded and compared with A and B. Ends when a child finishes without reaching k.
- ``sigkill``: N times fork a child that re-saves A and B in a loop and SIGKILL it
  after a random delay, then load.
- ``concurrent``: N forked children save their own posterior into DIR at the same
  time (several rounds); then load.
- ``ckpt-points``: like ``points`` for training checkpoints: checkpoint A is written,
  then a child writes checkpoint B (the next step) and prunes A as ``fit`` does
  (``keep_checkpoints=1``); after each kill ``resume=DIR`` must find A or B.

Prints one JSON line: ``{"tries": ..., "loaded": ..., "a": ..., "b": ..., "failures": [...]}``.
Forking (after ``torch.set_num_threads(1)``) avoids importing torch once per try.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

torch.set_num_threads(1)

from bayesify import bayesify, load_posterior
from bayesify.persistence import save_posterior


def base() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)).eval()


def posterior(seed: int):
    bnn = bayesify(base(), "ibnn", components=2)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in bnn.posterior_parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.1)
    return bnn


def tensors(bnn) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in bnn.posterior_tensors().items()}


def which(directory: Path, known: dict[str, dict[str, torch.Tensor]]) -> str:
    """'a', 'b', ... (the posterior the directory loads as) or the error."""
    try:
        loaded = tensors(load_posterior(base(), directory))
    except Exception as err:  # noqa: BLE001 - reported
        return f"error: {type(err).__name__}: {err}"
    for name, expected in known.items():
        if loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k])
                                                    for k in loaded):
            return name
    return "error: loaded a posterior that is neither of the saved ones"


class _Killer:
    """Counts calls of file-system primitives; ``os._exit``s at the chosen point."""

    def __init__(self, target: int) -> None:
        self.target, self.count = target, 0

    def point(self) -> None:
        if self.count == self.target:
            os._exit(17)
        self.count += 1

    def wrap(self, fn):
        def wrapped(*args, **kwargs):
            self.point()
            out = fn(*args, **kwargs)
            self.point()
            return out

        return wrapped

    def install(self) -> None:
        for name in ("replace", "rename", "fsync", "unlink", "close", "write", "link"):
            setattr(os, name, self.wrap(getattr(os, name)))
        os.open = self.wrap(os.open)
        original_fdopen = os.fdopen
        killer = self

        def fdopen(*args, **kwargs):
            fh = original_fdopen(*args, **kwargs)
            raw_write = fh.write

            def write(data):  # a kill halfway through writing the file
                half = len(data) // 2
                raw_write(data[:half])
                fh.flush()
                killer.point()
                return half + raw_write(data[half:])

            fh.write = write
            return fh

        os.fdopen = fdopen


def kill_points(directory: Path) -> dict:
    a, b = posterior(1), posterior(2)
    known = {"a": tensors(a), "b": tensors(b)}
    save_posterior(a, directory)
    outcomes, k = [], 0
    while True:
        pid = os.fork()
        if pid == 0:
            _Killer(k).install()
            save_posterior(b, directory)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        outcomes.append(which(directory, known))
        if os.waitstatus_to_exitcode(status) == 0:  # the save ran past every point
            break
        save_posterior(a, directory)  # start every try from A
        k += 1
    return summarise(outcomes)


def sigkill_loop(directory: Path, tries: int) -> dict:
    a, b = posterior(1), posterior(2)
    known = {"a": tensors(a), "b": tensors(b)}
    save_posterior(a, directory)
    rng = random.Random(0)
    outcomes = []
    for _ in range(tries):
        pid = os.fork()
        if pid == 0:
            while True:
                save_posterior(b, directory)
                save_posterior(a, directory)
        time.sleep(rng.uniform(0.01, 0.25))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        outcomes.append(which(directory, known))
    return summarise(outcomes)


def concurrent(directory: Path, writers: int) -> dict:
    models = [posterior(10 + i) for i in range(writers)]
    known = {chr(ord("a") + i): tensors(m) for i, m in enumerate(models)}
    outcomes = []
    for _ in range(3):
        pids = []
        for model in models:
            pid = os.fork()
            if pid == 0:
                for _ in range(3):
                    save_posterior(model, directory)
                os._exit(0)
            pids.append(pid)
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        result = which(directory, known)
        outcomes.append(result if all(c == 0 for c in codes) else f"error: exit codes {codes}")
    return summarise(outcomes)


def _checkpoint(step: int) -> dict:
    from bayesify.train.checkpoint import FORMAT, VERSION, content_checksum

    generator = torch.Generator().manual_seed(step)
    payload = {"format": FORMAT, "version": VERSION,
               "meta": json.dumps({"epoch": 0, "step": step, "global_step": step}),
               "posterior": {"w": torch.randn(64, 64, generator=generator)}, "base": {},
               "buffers": {"bn.running_var": torch.rand(8, generator=generator)},
               "optimizer": {}, "rng": [{"cpu": torch.get_rng_state(),
                                          "noise": generator.get_state()}]}
    payload["checksum"] = content_checksum(payload)
    return payload


def checkpoint_points(directory: Path) -> dict:
    from bayesify.train.checkpoint import atomic_save, checkpoint_name, load_resumable, prune

    def write(step: int) -> None:
        atomic_save(_checkpoint(step), directory / checkpoint_name(0, step))
        prune(directory, 1)

    def loaded() -> str:
        try:
            _path, payload = load_resumable(directory)
        except Exception as err:  # noqa: BLE001 - reported
            return f"error: {type(err).__name__}: {err}"
        return {1: "a", 2: "b"}.get(payload["meta"]["global_step"], "error: another step")

    outcomes, k = [], 0
    while True:
        for path in directory.glob("*") if directory.is_dir() else []:
            path.unlink()
        write(1)
        pid = os.fork()
        if pid == 0:
            _Killer(k).install()
            write(2)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        outcomes.append(loaded())
        if os.waitstatus_to_exitcode(status) == 0:
            break
        k += 1
    return summarise(outcomes)


def summarise(outcomes: list[str]) -> dict:
    failures = [o for o in outcomes if o.startswith("error")]
    counts = {name: outcomes.count(name) for name in sorted(set(outcomes)) if len(name) == 1}
    return {"tries": len(outcomes), "loaded": len(outcomes) - len(failures), **counts,
            "failures": failures[:5]}


if __name__ == "__main__":
    mode, directory = sys.argv[1], Path(sys.argv[2])
    count = int(sys.argv[3]) if len(sys.argv) > 3 else 5
    run = {"points": lambda: kill_points(directory),
           "sigkill": lambda: sigkill_loop(directory, count),
           "concurrent": lambda: concurrent(directory, count),
           "ckpt-points": lambda: checkpoint_points(directory)}[mode]
    print(json.dumps(run()), flush=True)
