"""Pool-based deep Bayesian active learning on digits (all ten classes).

Start from a seeded, class-balanced set of ``--initial`` labelled digits; every round
acquire ``--acquire`` points from the pool with a strategy, retrain from scratch and
record the test accuracy. Strategies (``--strategies``):

- ``random``         uniform acquisition; reports both the MAP net and its iBNN posterior
                     (the labelled sets are the same, so one run serves both curves)
- ``map-entropy``    MAP DigitsCNN, max predictive entropy
- ``map-bald``       MAP BALD — degenerate: one member has zero mutual information, so
                     every score ties at 0 and top-k takes the pool in its (shuffled)
                     order, i.e. random acquisition. Off by default, kept to show it.
- ``ibnn-entropy``   iBNN posterior, max predictive entropy of the mixture
- ``ibnn-bald``      iBNN posterior, BALD (mutual information), top-k
- ``ibnn-batchbald`` iBNN posterior, greedy BatchBALD (``select(..., batch_aware=True)``)

Every round the MAP net is trained from scratch on the labelled set (a fixed number of
AdamW steps), then bayesified with iBNN and only the posterior is fitted
(``bayesify.fit``); the acquisition scores come from ``bnn.predictor()`` members.

    python examples/active_learning.py --seeds 3 --rounds 15 --out active_learning.png
    python examples/active_learning.py --quick          # tiny smoke run (seconds)
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from bayesify import acquisition, bayesify, fit
from bayesify.data.digits import load_digits_splits
from bayesify.data.models import DigitsCNN, train_map
from bayesify.predict.predictor import BasePredictor, ModelPredictor

#: strategy name → (model that scores the pool, acquisition score, batch_aware)
STRATEGIES: dict[str, tuple[str, str, bool]] = {
    "random": ("map", "random", False),
    "map-entropy": ("map", "max_entropy", False),
    "map-bald": ("map", "bald", False),
    "ibnn-entropy": ("ibnn", "max_entropy", False),
    "ibnn-bald": ("ibnn", "bald", False),
    "ibnn-batchbald": ("ibnn", "bald", True),
}
DEFAULT_STRATEGIES = ("random", "map-entropy", "ibnn-entropy", "ibnn-bald")
REPORT_AT = (20, 50, 100, 150, 170)


@dataclass(frozen=True)
class Settings:
    """Loop sizes and training budgets (defaults: a few minutes on 2 CPU cores)."""

    initial: int = 20
    acquire: int = 10
    rounds: int = 15
    width: int = 16
    map_steps: int = 100
    batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 5e-4
    ibnn_epochs: int = 5
    ibnn_steps_per_epoch: int = 12
    components: int = 4
    predict_samples: int = 2
    init_mean_std: float = 0.25
    prior_std: float = 0.1
    ibnn_targets: str = "all"
    ibnn_exclude: tuple[str, ...] = ()
    ibnn_base_lr: float = 0.0
    pool_subset: int | None = 300
    train_ibnn_for_random: bool = True


QUICK = Settings(initial=20, acquire=10, rounds=2, width=8, map_steps=20, ibnn_epochs=2,
                 ibnn_steps_per_epoch=5, predict_samples=2, pool_subset=200)


def balanced_initial(labels: torch.Tensor, n: int, *, seed: int) -> list[int]:
    """``n`` seeded pool indices, as equal a number per class as ``n`` allows."""
    rng = np.random.default_rng(seed)
    classes = sorted(set(labels.tolist()))
    per_class = [rng.permutation(np.flatnonzero(labels.numpy() == c)).tolist() for c in classes]
    chosen: list[int] = []
    while len(chosen) < n:
        for idx in per_class:
            if idx and len(chosen) < n:
                chosen.append(idx.pop())
    return chosen


def steps_loader(x: torch.Tensor, y: torch.Tensor, *, steps: int, batch_size: int, seed: int) -> DataLoader:
    """Loader of exactly ``steps`` batches drawn with replacement: the training cost per
    round stays fixed however few points are labelled."""
    data = TensorDataset(x, y)
    sampler = RandomSampler(data, replacement=True, num_samples=steps * batch_size,
                            generator=torch.Generator().manual_seed(seed))
    return DataLoader(data, batch_size=batch_size, sampler=sampler)


def train_models(x: torch.Tensor, y: torch.Tensor, *, settings: Settings, seed: int,
                 with_ibnn: bool) -> dict[str, BasePredictor]:
    """Train the MAP net from scratch; optionally bayesify it (iBNN) and fit the posterior."""
    torch.manual_seed(seed)
    net = DigitsCNN(num_classes=10, width=settings.width)
    loader = steps_loader(x, y, steps=settings.map_steps, batch_size=settings.batch_size, seed=seed)
    train_map(net, loader, epochs=1, lr=settings.lr, weight_decay=settings.weight_decay, seed=seed)
    predictors: dict[str, BasePredictor] = {"map": ModelPredictor(net)}
    if with_ibnn:
        torch.manual_seed(seed + 1)
        bnn = bayesify(net, "ibnn", components=settings.components, samples=2,
                       init_mean_std=settings.init_mean_std, prior_std=settings.prior_std,
                       predict_samples=settings.predict_samples,
                       targets=settings.ibnn_targets, exclude=settings.ibnn_exclude)
        loader = steps_loader(x, y, steps=settings.ibnn_steps_per_epoch,
                              batch_size=settings.batch_size, seed=seed + 2)
        fit(bnn, loader, epochs=settings.ibnn_epochs, kl_anneal_epochs=settings.ibnn_epochs / 2,
            n_train=len(y), base_lr=settings.ibnn_base_lr, progress=False)
        predictors["ibnn"] = bnn.predictor(seed=seed)
    return predictors


def test_accuracy(predictor: BasePredictor, loader: DataLoader) -> float:
    logits, labels = predictor.collect(loader)
    probs = logits.softmax(-1).mean(0)
    return (probs.argmax(-1) == labels).float().mean().item()


def run_strategy(strategy: str, *, splits, settings: Settings, seed: int,
                 labelled_out: list[int] | None = None) -> dict[str, list[float]]:
    """One active-learning run; ``{model name: accuracy per round}`` (``rounds + 1`` values).

    ``labelled_out``, when given, receives the final labelled pool indices in acquisition order.
    """
    scorer, score, batch_aware = STRATEGIES[strategy]
    pool_x, pool_y = splits.train.tensors
    test_loader = DataLoader(splits.test, batch_size=1024)
    labelled = balanced_initial(pool_y, settings.initial, seed=seed)
    generator = torch.Generator().manual_seed(seed)
    with_ibnn = scorer == "ibnn" or (score == "random" and settings.train_ibnn_for_random)
    curves: dict[str, list[float]] = {}
    for round_ in range(settings.rounds + 1):
        idx = torch.tensor(labelled)
        predictors = train_models(pool_x[idx], pool_y[idx], settings=settings,
                                  seed=1000 * seed + round_, with_ibnn=with_ibnn)
        for name, predictor in predictors.items():
            curves.setdefault(name, []).append(test_accuracy(predictor, test_loader))
        if round_ == settings.rounds:
            if labelled_out is not None:
                labelled_out.extend(labelled)
            break
        unlabelled = torch.tensor(sorted(set(range(len(pool_y))) - set(labelled)))
        # score a seeded random subset of the pool (standard in deep BAL; saves compute)
        if settings.pool_subset is not None and settings.pool_subset < len(unlabelled):
            perm = torch.randperm(len(unlabelled), generator=generator)
            unlabelled = unlabelled[perm[: settings.pool_subset]]
        else:
            unlabelled = unlabelled[torch.randperm(len(unlabelled), generator=generator)]
        pool_loader = DataLoader(TensorDataset(pool_x[unlabelled]), batch_size=1024)
        chosen = acquisition.select(predictors[scorer], pool_loader, settings.acquire,
                                    score=score, batch_aware=batch_aware, generator=generator,
                                    num_samples=500, candidates=100)
        labelled.extend(unlabelled[chosen].tolist())
    return curves


def run_active_learning(
    *, seeds: int = 3, strategies: tuple[str, ...] = DEFAULT_STRATEGIES,
    settings: Settings = Settings(), verbose: bool = True,
) -> dict:
    """All strategies × seeds. Returns ``{"labels": [...], "curves": {curve: [[acc]·seeds]}}``."""
    splits = load_digits_splits(seed=0, all_classes=True)
    labels = [settings.initial + r * settings.acquire for r in range(settings.rounds + 1)]
    curves: dict[str, list[list[float]]] = {}
    seconds: dict[str, float] = {}
    for strategy in strategies:
        if strategy not in STRATEGIES:
            raise SystemExit(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")
        start = time.perf_counter()
        for seed in range(seeds):
            result = run_strategy(strategy, splits=splits, settings=settings, seed=seed)
            for model, accs in result.items():
                name = f"{model}-random" if strategy == "random" else strategy
                if strategy != "random" and model != STRATEGIES[strategy][0]:
                    continue
                curves.setdefault(name, []).append(accs)
        seconds[strategy] = time.perf_counter() - start
        if verbose:
            print(f"[{strategy}] {seeds} seed(s) in {seconds[strategy]:.1f}s", flush=True)
    return {"labels": labels, "curves": curves, "seconds": seconds, "settings": vars(settings),
            "pool_size": len(splits.train), "test_size": len(splits.test)}


def mean_se(values: list[float]) -> tuple[float, float]:
    arr = np.asarray(values, dtype=float)
    se = arr.std(ddof=1) / math.sqrt(len(arr)) if len(arr) > 1 else 0.0
    return float(arr.mean()), float(se)


def format_table(results: dict, at: tuple[int, ...] = REPORT_AT) -> str:
    """Markdown table: accuracy (mean ± SE over seeds) at the requested label counts."""
    labels = results["labels"]
    cols = [n for n in at if n in labels]
    lines = ["| strategy | " + " | ".join(f"{n} labels" for n in cols) + " |",
             "|---" * (len(cols) + 1) + "|"]
    for name, runs in results["curves"].items():
        cells = []
        for n in cols:
            m, se = mean_se([run[labels.index(n)] for run in runs])
            cells.append(f"{100 * m:.1f} ± {100 * se:.1f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_curves(results: dict) -> str:
    labels = results["labels"]
    names = list(results["curves"])
    width = max(len(n) for n in names)
    lines = ["labels  " + "  ".join(n.rjust(width) for n in names)]
    for i, n in enumerate(labels):
        row = [f"{100 * mean_se([r[i] for r in results['curves'][k]])[0]:.1f}" for k in names]
        lines.append(f"{n:6d}  " + "  ".join(v.rjust(width) for v in row))
    return "\n".join(lines)


def save_plot(results: dict, path: str | Path) -> Path:
    """PNG of test accuracy vs number of labels (mean ± SE band), MAP and iBNN panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = np.asarray(results["labels"])
    panels = {"MAP (DigitsCNN)": "map", "iBNN posterior": "ibnn"}
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, (title, prefix) in zip(axes, panels.items()):
        for name, runs in results["curves"].items():
            if not name.startswith(prefix):
                continue
            arr = 100 * np.asarray(runs)
            mean = arr.mean(0)
            se = arr.std(0, ddof=1) / math.sqrt(len(arr)) if len(arr) > 1 else 0 * mean
            ax.plot(labels, mean, marker="o", ms=3, label=name)
            ax.fill_between(labels, mean - se, mean + se, alpha=0.2)
        ax.set_title(title)
        ax.set_xlabel("number of labelled digits")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    axes[0].set_ylabel("test accuracy (%)")
    n_seeds = len(next(iter(results["curves"].values())))
    fig.suptitle(f"Active learning on digits (10 classes), mean ± SE over {n_seeds} seed(s)")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def load_results(paths: list[str]) -> dict:
    """Merge the curves of several ``--json`` files (same label schedule required)."""
    merged: dict | None = None
    for path in paths:
        results = json.loads(Path(path).read_text())
        if merged is None:
            merged = results
            continue
        if results["labels"] != merged["labels"]:
            raise SystemExit(f"{path}: label schedule differs from {paths[0]}")
        merged["curves"].update(results["curves"])
        merged["seconds"].update(results["seconds"])
    assert merged is not None
    return merged


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--seeds", type=int, default=3, help="number of seeds (0..N-1)")
    parser.add_argument("--rounds", type=int, default=None, help="acquisition rounds (15)")
    parser.add_argument("--out", default="active_learning.png", help="PNG path")
    parser.add_argument("--json", default=None, help="optional JSON path for the raw curves")
    parser.add_argument("--strategies", nargs="+", default=list(DEFAULT_STRATEGIES),
                        choices=list(STRATEGIES))
    parser.add_argument("--quick", action="store_true", help="tiny settings for a smoke run")
    parser.add_argument("--load", nargs="+", default=None, metavar="JSON",
                        help="merge the curves of earlier --json outputs instead of running")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.load:
        results = load_results(args.load)
    else:
        settings = QUICK if args.quick else Settings()
        if args.rounds is not None:
            settings = replace(settings, rounds=args.rounds)
        seeds = 1 if args.quick and args.seeds == 3 else args.seeds
        results = run_active_learning(seeds=seeds, strategies=tuple(args.strategies),
                                      settings=settings)
    print("\ntest accuracy (%) by number of labels, mean over seeds")
    print(format_curves(results))
    print("\naccuracy (%) mean ± SE over seeds")
    print(format_table(results))
    print(f"\nwrote {save_plot(results, args.out)}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
