"""What a last-layer Laplace can reach on a quality protocol, by curvature: the softmax GGN
against the curvature of a Gaussian likelihood on the logits (``curvature='features'``),
every (τ, T) of a grid scored on the **test** split (an oracle: it shows the frontier, not
what a validation search picks; ``quality.py`` measures that).

Per curvature the best NLL under shift (mean over the protocol's shifts) among the points
whose clean test NLL is within 0.005 of the start's at its best validation temperature,
and the best OOD AUROC (entropy) among the same points. The exact GGN ``Σ_n Λ_n ⊗ ã ãᵀ``
and ``s·I ⊗ Σ ã ãᵀ`` (s = 1/σ², σ = ``--logit-std``) over θ = vec([W | b]); the probit
predictive with the temperature on its log-probabilities, as the library computes it.

    BAYESIFY_BENCH_CACHE=cache python benchmarks/curvature_oracle.py --protocol digits-cnn \\
        --seed 0 --logit-std 2 6.3 10 20
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from sklearn.metrics import roc_auc_score

sys.path.insert(0, str(Path(__file__).resolve().parent))

from protocols import PROTOCOLS

from bayesify.core.walker import find_classifier
from bayesify.methods.laplace.curvature import augmented_features, last_layer_full

TAUS = torch.logspace(-6, 4, 21).tolist()
TEMPERATURES = torch.logspace(math.log10(0.05), math.log10(4), 18).tolist()


def nll(log_probs: torch.Tensor, y: torch.Tensor) -> float:
    return float(-log_probs.gather(1, y[:, None]).mean())


def entropy(log_probs: torch.Tensor) -> torch.Tensor:
    return -(log_probs.exp() * log_probs).sum(-1)


def scored(tau: float, log_probs: dict[str, torch.Tensor], labels: torch.Tensor,
           shifted: Iterable[str], auroc: Callable[[torch.Tensor, torch.Tensor], float],
           ) -> list[tuple[float, ...]]:
    """``(τ, T, clean, shift, AUROC)`` at every temperature of the predictive ``log_probs``
    (``'test'``, ``'ood'`` and every shift's key) at one τ."""
    out = []
    for t in TEMPERATURES:
        scaled = {k: torch.log_softmax(v / t, -1) for k, v in log_probs.items()}
        shift = sum(nll(scaled[k], labels) for k in shifted) / len(list(shifted))
        out.append((tau, t, nll(scaled["test"], labels), shift,
                    auroc(scaled["test"], scaled["ood"])))
    return out


def frontier(points: list[tuple[float, ...]], start_clean: float,
             ) -> tuple[list[tuple[float, ...]], tuple[float, ...], tuple[float, ...]]:
    """Of ``(τ, T, clean, shift, AUROC)`` points: those within 0.005 of the start's clean
    NLL, the one with the lowest shift NLL among them and the one with the highest AUROC."""
    feasible = [pt for pt in points if pt[2] <= start_clean + 0.005]
    return (feasible, min(feasible, key=lambda pt: pt[3]),
            max(feasible, key=lambda pt: pt[4]))


def probit(feats: torch.Tensor, logits: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The probit GLM predictive's log-probabilities from the class blocks ``Σ_cc [C, D', D']``."""
    var = torch.einsum("bd,cde,be->bc", feats, blocks, feats)
    return torch.log_softmax(logits / torch.sqrt(1 + math.pi / 8 * var), -1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--protocol", choices=sorted(PROTOCOLS), default="digits-cnn")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logit-std", type=float, nargs="+", default=[2.0, 6.3, 10.0, 20.0],
                        help="σ of the feature curvature's Gaussian likelihood (one row each)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    spec = PROTOCOLS[args.protocol]
    p, tx, ty, shifted, ood = spec.evaluation_sets(args.seed)
    model = spec.pretrained(p, args.seed).eval()
    head = model.get_submodule(find_classifier(model))
    seen: dict[str, torch.Tensor] = {}
    head.register_forward_hook(lambda m, i, o: seen.__setitem__("a", i[0].detach()))

    @torch.no_grad()
    def features(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        feats, logits = [], []
        for i in range(0, len(x), 256):
            logits.append(model(x[i:i + 256]).double())
            feats.append(augmented_features(seen["a"].reshape(len(logits[-1]), -1).double(),
                                            head.bias is not None))
        return torch.cat(feats), torch.cat(logits)

    (xtr, _), (xv, yv) = p.train.tensors, p.val.tensors
    ftr, ltr = features(xtr)
    sets = {"val": features(xv), "test": features(tx), "ood": features(ood),
            **{k: features(v) for k, v in shifted.items()}}
    c, d = ltr.shape[1], ftr.shape[1]
    curvatures = {"ggn": last_layer_full(ftr, ltr.softmax(-1))}
    for sigma in args.logit_std:
        curvatures[f"features σ={sigma:g}"] = torch.kron(torch.eye(c, dtype=ftr.dtype),
                                                         ftr.T @ ftr) / sigma**2
    t0 = min(TEMPERATURES, key=lambda t: nll(torch.log_softmax(sets["val"][1] / t, -1), yv))
    start_t = nll(torch.log_softmax(sets["test"][1] / t0, -1), ty)
    start_shift = sum(nll(torch.log_softmax(sets[k][1], -1), ty) for k in shifted) / len(shifted)
    is_ood = [0] * len(ty) + [1] * len(sets["ood"][1])

    def auroc(lp_in: torch.Tensor, lp_out: torch.Tensor) -> float:
        return float(roc_auc_score(is_ood, torch.cat([entropy(lp_in), entropy(lp_out)]).numpy()))

    start_auc = auroc(torch.log_softmax(sets["test"][1], -1), torch.log_softmax(sets["ood"][1], -1))
    print(f"{args.protocol} seed {args.seed}: D' = {d}, start clean {start_t:.4f} (at T = "
          f"{t0:.3g}), shift {start_shift:.3f}, AUROC {start_auc:.4f}")
    for name, h in curvatures.items():
        eig, q = torch.linalg.eigh(h)
        eig = eig.clamp_min(0)
        points = []
        for tau in TAUS:
            cov = (q / (eig + tau)) @ q.T
            blocks = cov.view(c, d, c, d).diagonal(dim1=0, dim2=2).permute(2, 0, 1)

            lp = {k: probit(f, logits, blocks) for k, (f, logits) in sets.items() if k != "val"}
            points += scored(tau, lp, ty, list(shifted), auroc)
        _, best, top = frontier(points, start_t)
        print(f"  {name:16s} best shift {best[3]:.3f} ({best[3] / start_shift:.3f}× start; τ "
              f"{best[0]:.3g}, T {best[1]:.3g}, clean {best[2]:.4f}, AUROC {best[4]:.4f}) | best "
              f"AUROC {top[4]:.4f} (τ {top[0]:.3g}, T {top[1]:.3g}, shift "
              f"{top[3] / start_shift:.3f}×)", flush=True)


if __name__ == "__main__":
    main()
