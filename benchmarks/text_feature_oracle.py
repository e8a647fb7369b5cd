"""What a last-layer Laplace could reach on the text protocol if the feature layers pooled
their tokens over the attention mask (they are off for masked token inputs in the library):
every (τ, T) of a grid scored on the **test** split (an oracle: it shows the frontier, not
what a validation search picks).

Three variances, the probit predictive with the temperature on its log-probabilities as the
library computes it, the feature curvature σ = 10 (``bayesify.kit.laplace_heads.LOGIT_STD``):
``phi`` (the classifier's input alone), ``phi+trunk`` (plus the mask-pooled, standardised
outputs of the LayerNorms ``'auto'`` picks, a separate block: ``bayesify.kit.feature_layers``)
and ``trunk`` alone. Per variance: the best mean NLL under the protocol's shifts among the
points whose clean test NLL is within 0.005 of the start's at its best validation
temperature, its AUROC (entropy), the best AUROC among the same points, and the best shift
NLL with T ≥ 1 (the library's token rule).

    BAYESIFY_BENCH_CACHE=cache python benchmarks/text_feature_oracle.py --seed 0 [--layers all]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
from sklearn.metrics import roc_auc_score

sys.path.insert(0, str(Path(__file__).resolve().parent))

import text_protocol
from curvature_oracle import TAUS, TEMPERATURES, entropy, frontier, nll, scored
from protocols import PROTOCOLS

from bayesify.core.walker import find_classifier
from bayesify.kit import feature_layers
from bayesify.methods.laplace.curvature import augmented_features

SIGMA = 10.0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", choices=["auto", "all"], default="auto",
                        help="the LayerNorms 'auto' picks, or every LayerNorm of the encoder")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    spec = PROTOCOLS["minilm-text"]
    p, tx, ty, shifted, ood = spec.evaluation_sets(args.seed)
    model = spec.pretrained(p, args.seed).eval()
    classifier = find_classifier(model)
    names = (feature_layers.auto_layers(model, classifier) if args.layers == "auto" else
             [n for n, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)])
    modules = [model.get_submodule(n) for n in names]
    seen: dict[str, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    model.get_submodule(classifier).register_forward_hook(
        lambda m, i, o: seen.__setitem__("a", i[0].detach()))
    for k, m in enumerate(modules):
        m.register_forward_hook(lambda m_, i, o, k=k: outputs.__setitem__(k, o.detach()))

    @torch.no_grad()
    def features(x: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        feats, logits, pooled = [], [], []
        n = text_protocol.input_rows(x)
        for i in range(0, n, 64):
            batch = text_protocol.take(x, i, min(n, i + 64))
            logits.append(model(**batch).double())
            feats.append(augmented_features(seen["a"].double(), True))
            mask = batch["attention_mask"].double().unsqueeze(-1)
            pooled.append(torch.cat([(outputs[k].double() * mask).sum(1) / mask.sum(1)
                                     for k in range(len(modules))], 1))
        return torch.cat(feats), torch.cat(logits), torch.cat(pooled)

    ftr, _, ptr = features(p.train.tensors[0])
    xv, yv = p.val.tensors
    sets = {"val": features(xv), "test": features(tx), "ood": features(ood),
            **{k: features(v) for k, v in shifted.items()}}
    c, d = sets["test"][1].shape[1], ftr.shape[1]
    eig, q = torch.linalg.eigh(torch.kron(torch.eye(c, dtype=ftr.dtype), ftr.T @ ftr) / SIGMA**2)
    eig = eig.clamp_min(0)
    trunk = feature_layers.TrunkPosterior(feature_layers.batch_sums(ptr, ftr[:, :-1]),
                                          [m.normalized_shape[0] for m in modules], SIGMA)
    projections = {k: trunk.projections(v[2]) for k, v in sets.items()}
    t0 = min(TEMPERATURES, key=lambda t: nll(torch.log_softmax(sets["val"][1] / t, -1), yv))
    start_clean = nll(torch.log_softmax(sets["test"][1] / t0, -1), ty)
    start_shift = sum(nll(torch.log_softmax(sets[k][1], -1), ty) for k in shifted) / len(shifted)
    is_ood = [0] * len(ty) + [1] * len(sets["ood"][1])

    def auroc(inside: torch.Tensor, outside: torch.Tensor) -> float:
        return float(roc_auc_score(is_ood, torch.cat([entropy(inside), entropy(outside)])))

    start_auc = auroc(torch.log_softmax(sets["test"][1], -1), torch.log_softmax(sets["ood"][1], -1))
    print(f"seed {args.seed}: layers {names}\n  start clean {start_clean:.4f} (T {t0:.3g}), "
          f"shift {start_shift:.3f}, AUROC {start_auc:.4f}")
    for mode in ("phi", "phi+trunk", "trunk"):
        points = []
        for tau in TAUS:
            cov = (q / (eig + tau)) @ q.T
            blocks = cov.view(c, d, c, d).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
            lp = {}
            for k, (f, logits, _) in sets.items():
                if k == "val":
                    continue
                var = (torch.einsum("bd,cde,be->bc", f, blocks, f) if mode != "trunk"
                       else torch.zeros_like(logits))
                if mode != "phi":
                    var = var + (projections[k] @ (1.0 / (trunk.eig + tau))).unsqueeze(-1)
                lp[k] = torch.log_softmax(logits / torch.sqrt(1 + math.pi / 8 * var), -1)
            points += scored(tau, lp, ty, list(shifted), auroc)
        feasible, best, top = frontier(points, start_clean)
        soft = min((pt for pt in feasible if pt[1] >= 0.999), key=lambda pt: pt[3])
        print(f"  {mode:9s} best shift {best[3] / start_shift:.3f}x (τ {best[0]:.3g}, T "
              f"{best[1]:.3g}, AUROC {best[4]:.4f}) | best AUROC {top[4]:.4f} (shift "
              f"{top[3] / start_shift:.3f}x) | T ≥ 1: shift {soft[3] / start_shift:.3f}x, AUROC "
              f"{soft[4]:.4f}", flush=True)


if __name__ == "__main__":
    main()
