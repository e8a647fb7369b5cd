"""What last-layer Laplace (defaults: feature curvature, feature layers) can reach at all on
a quality protocol: every (τ, T) of a grid scored **on the test split** (an oracle, not a
selection), keeping those whose clean test NLL is within 0.005 nats of the start's at its
best test temperature (issue 29's and 31's clean bar), and reporting the lowest NLL under
the protocol's shifts (mean over every kind, as ``per_seed.py``) and the highest OOD AUROC
(predictive entropy) among them, beside the library's own choice.

``--feature-weights``: multipliers λ of the feature layers' prior precision relative to the
classifier's (τ_feature = λ·τ; not a library option — the question is whether one τ for
both parts is what caps the AUROC; λ = 1 is the library).

    BAYESIFY_BENCH_CACHE=/tmp/cache OMP_NUM_THREADS=1 python benchmarks/laplace_oracle.py \
        --protocol digits-vit --seeds 0 1 2 --feature-weights 0.01 1 --json out.json

``--net NAME`` (thirty-seventh stop): a network of ``held_out_nets.py`` instead of a protocol
(its test split, its shift; no OOD set there: the AUROC column is the start's test errors
against its correct examples by predictive entropy, as a stand-in).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from protocols import PROTOCOLS

import bayesify
from bayesify.kit import feature_layers
from bayesify.metrics import ood_auroc

TAUS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0)
TEMPERATURES = (0.05, 0.07, 0.1, 0.14, 0.2, 0.28, 0.35, 0.5, 0.7, 1.0, 1.4, 2.0)
CLEAN_BAR = 0.005


def _entropy(log_probs: torch.Tensor) -> torch.Tensor:
    return -(log_probs.exp() * log_probs).sum(-1)


def _nll(log_probs: torch.Tensor, y: torch.Tensor) -> float:
    return float(-log_probs.gather(1, y[:, None]).mean())


class _FeatureWeight:
    """τ_feature = λ·τ inside :meth:`TrunkPosterior.variance` while the benchmark runs."""

    def __init__(self) -> None:
        self.weight = 1.0
        self.original = feature_layers.TrunkPosterior.variance
        weight = self

        def variance(posterior, psi, tau):
            return weight.original(posterior, psi, tau * weight.weight)

        feature_layers.TrunkPosterior.variance = variance


@torch.no_grad()
def one_seed(protocol: str, seed: int, weights: list[float]) -> dict:
    spec = PROTOCOLS[protocol]
    p, tx, ty, shifted, ood = spec.evaluation_sets(seed)
    base = spec.pretrained(p, seed, 0, epochs=spec.map_epochs).eval()
    z, zo = base(tx), base(ood)
    start = {"clean": _nll(z.log_softmax(-1), ty),
             "clean_at_best_t": min(_nll((z / t).log_softmax(-1), ty) for t in TEMPERATURES),
             "shift": sum(_nll(base(v).log_softmax(-1), ty) for v in shifted.values())
             / len(shifted),
             "auroc": ood_auroc(_entropy(z.log_softmax(-1)), _entropy(zo.log_softmax(-1)))}
    bnn = bayesify.bayesify(copy.deepcopy(base), "laplace")
    with torch.enable_grad():
        record = bayesify.fit(bnn, p.loaders(seed)["train"], val_loader=p.loaders(seed)["val"],
                              progress=False).last
    chosen_tau = record["prior_precision"]
    chosen_tau = float(chosen_tau[0] if isinstance(chosen_tau, list) else chosen_tau)
    chosen_t = float(record["temperature"])
    shift_weight = _FeatureWeight()

    def score(tau: float, t: float) -> tuple[float, float, float]:
        bnn.method.set_prior_precision(bnn, tau)
        predictor = bnn.predictor(temperature=t)
        clean = predictor.predict(tx).scaled(t).log_probs
        away = predictor.predict(ood).scaled(t).log_probs
        shift = sum(_nll(predictor.predict(v).scaled(t).log_probs, ty)
                    for v in shifted.values()) / len(shifted)
        return _nll(clean, ty), shift, ood_auroc(_entropy(clean), _entropy(away))

    try:
        out = {"start": start, "chosen": dict(zip(("clean", "shift", "auroc"),
                                                  score(chosen_tau, chosen_t)),
                                              tau=chosen_tau, T=chosen_t), "oracle": {}}
        bar = start["clean_at_best_t"] + CLEAN_BAR
        for weight in weights:
            shift_weight.weight = weight
            cells = [(tau, t, *score(tau, t)) for tau in TAUS for t in TEMPERATURES]
            ok = [c for c in cells if c[2] <= bar]
            best_shift = min(ok, key=lambda c: c[3], default=None)
            best_auroc = max(ok, key=lambda c: c[4], default=None)
            out["oracle"][str(weight)] = {
                name: None if c is None else dict(zip(("tau", "T", "clean", "shift", "auroc"), c))
                for name, c in (("lowest_shift", best_shift), ("highest_auroc", best_auroc))}
    finally:
        feature_layers.TrunkPosterior.variance = shift_weight.original
    return out


def one_net(net: str, seed: int) -> dict:
    """:func:`one_seed` on a held-out network (``held_out_nets.NETS``): the shift is that
    script's (noise and rotation, or replaced tokens); the "AUROC" tells the start's test
    errors from its correct examples by entropy (no OOD set there)."""
    from held_out_nets import NETS, shifted_loader

    model, train, val, test = NETS[net](seed)  # trained here: with gradients
    with torch.no_grad():
        return _score_net(model, train, val, test, shifted_loader(test, seed))


def _score_net(model, train, val, test, shift) -> dict:

    def stack(loader):
        xs, ys = zip(*[(x, y) for x, y in loader])
        return torch.cat(xs), torch.cat(ys)

    tx, ty = stack(test)
    sx, _ = stack(shift)
    model.eval()
    z = model(tx)
    errors = z.argmax(-1) != ty
    start = {"clean": _nll(z.log_softmax(-1), ty),
             "clean_at_best_t": min(_nll((z / t).log_softmax(-1), ty) for t in TEMPERATURES),
             "shift": _nll(model(sx).log_softmax(-1), ty),
             "auroc": ood_auroc(_entropy(z.log_softmax(-1))[~errors],
                                _entropy(z.log_softmax(-1))[errors])}
    bnn = bayesify.bayesify(copy.deepcopy(model), "laplace")
    with torch.enable_grad():
        record = bayesify.fit(bnn, train, val_loader=val, progress=False).last
    chosen_tau = record["prior_precision"]
    chosen_tau = float(chosen_tau[0] if isinstance(chosen_tau, list) else chosen_tau)
    chosen_t = float(record["temperature"])

    def score(tau: float, t: float) -> tuple[float, float, float]:
        bnn.method.set_prior_precision(bnn, tau)
        predictor = bnn.predictor(temperature=t)
        clean = predictor.predict(tx).scaled(t).log_probs
        shifted = predictor.predict(sx).scaled(t).log_probs
        entropy = _entropy(clean)
        return _nll(clean, ty), _nll(shifted, ty), ood_auroc(entropy[~errors], entropy[errors])

    out = {"start": start, "chosen": dict(zip(("clean", "shift", "auroc"),
                                              score(chosen_tau, chosen_t)),
                                          tau=chosen_tau, T=chosen_t), "oracle": {}}
    bar = start["clean_at_best_t"] + CLEAN_BAR
    cells = [(tau, t, *score(tau, t)) for tau in TAUS for t in TEMPERATURES]
    ok = [c for c in cells if c[2] <= bar]
    out["oracle"]["1.0"] = {
        name: None if c is None else dict(zip(("tau", "T", "clean", "shift", "auroc"), c))
        for name, c in (("lowest_shift", min(ok, key=lambda c: c[3], default=None)),
                        ("highest_auroc", max(ok, key=lambda c: c[4], default=None)))}
    out["cells"] = cells
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--protocol", choices=sorted(PROTOCOLS), default="digits-cnn",
                        help="the quality protocol (benchmarks/protocols.py)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="its seeds")
    parser.add_argument("--feature-weights", type=float, nargs="+", default=[1.0],
                        help="λ: the feature layers' prior precision is λ·τ (1: the library)")
    parser.add_argument("--net", default=None,
                        help="a network of held_out_nets.py instead of --protocol")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    results = {}
    for seed in args.seeds:
        r = (one_net(args.net, seed) if args.net
             else one_seed(args.protocol, seed, args.feature_weights))
        results[str(seed)] = r
        s, c = r["start"], r["chosen"]
        print(f"{args.net or args.protocol} seed {seed}: start clean {s['clean']:.4f} (best T "
              f"{s['clean_at_best_t']:.4f}) shift {s['shift']:.3f} AUROC {s['auroc']:.4f}; "
              f"chosen tau {c['tau']:.3g} T {c['T']:.3g}: clean {c['clean']:.4f} shift "
              f"{c['shift']:.3f} ({c['shift'] / s['shift']:.3f}x) AUROC {c['auroc']:.4f}")
        for weight, o in r["oracle"].items():
            low, high = o["lowest_shift"], o["highest_auroc"]
            print(f"  lambda {weight}: at the clean bar, lowest shift "
                  + ("none" if low is None else
                     f"{low['shift']:.3f} ({low['shift'] / s['shift']:.3f}x; tau {low['tau']:g} "
                     f"T {low['T']:g} clean {low['clean']:.4f})")
                  + ", highest AUROC "
                  + ("none" if high is None else
                     f"{high['auroc']:.4f} (tau {high['tau']:g} T {high['T']:g})"), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
