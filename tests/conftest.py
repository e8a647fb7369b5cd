import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# fit(epochs=None) trains for a 300-step budget; most tests exercise mechanics, not budgets,
# and keep the old one-epoch default (subprocesses inherit it). Tests of the library's real
# defaults use the `library_budget` fixture.
os.environ["BAYESIFY_MIN_STEPS"] = "1"
# ``pytest`` runs the files on several worker processes (pytest-xdist, ``-n auto``: see
# ``pytest_cmdline_main`` below): one thread each, so two workers on two cores do not fight over them
# (the networks are small; a second thread buys little). A run without xdist keeps two.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

#: the most worker processes ``-n auto`` starts: each holds torch and its networks (~2 GB)
MAX_WORKERS = 4


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """``pytest`` runs on one worker per core (``-n auto --dist loadfile``: each file on one
    worker, so module fixtures are built once) where pytest-xdist is installed; ``-n N``,
    ``-n 0`` or ``--pdb`` choose otherwise. Without pytest-xdist (or with ``-p no:xdist``)
    the suite runs in one process instead of failing on an unknown ``-n``."""
    if hasattr(config, "workerinput") or not config.pluginmanager.hasplugin("xdist"):
        return
    if config.option.numprocesses is None and not config.getoption("usepdb", False):
        config.option.numprocesses = "auto"
        if config.option.dist == "no":
            config.option.dist = "loadfile"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core the process may use, at most ``MAX_WORKERS``."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cores))


@pytest.fixture(scope="session")
def digits():
    from bayesify.data.digits import load_digits_splits

    return load_digits_splits(seed=0)


@pytest.fixture(scope="session")
def digits_map(digits):
    """A small CNN trained on digits 0–4 (the 'pretrained' network), shared per session."""
    from bayesify.data.digits import digits_loaders
    from bayesify.data.models import DigitsCNN, train_map

    torch.manual_seed(0)
    loaders = digits_loaders(digits, batch_size=64, seed=0)
    return train_map(DigitsCNN(digits.num_classes), loaders["train"], epochs=8, seed=0)


@pytest.fixture
def library_budget(monkeypatch):
    """fit's real default step budget (not the one-epoch budget of the other tests)."""
    monkeypatch.delenv("BAYESIFY_MIN_STEPS", raising=False)
