"""Issue 31, item 2: members that really differ, and MultiSWAG where it pays.

On a quality protocol (``benchmarks/protocols.py``; ``--protocol digits-cnn`` or
``digits-vit``), per seed, against the start and a 5-member deep ensemble trained from
scratch on the whole pretraining split (members cached with ``$BAYESIFY_BENCH_CACHE``):

* ``copies-x5``: five fine-tuned copies of the pretrained network, each with its classifier
  re-initialised (its own seed), every layer fine-tuned ``--epochs`` epochs with Adam on the
  200 fine-tuning images in its own data order (the issue's "5 fine-tuned copies");
* ``copies-x5+T``: the same at the temperature of the lowest clean validation NLL;
* ``swag``: the library's SWAG on the start (defaults + ``val_loader``);
* ``multiswag-copies``: the library's SWAG (defaults + ``val_loader``) around each of the five
  copies, the mixture of the five searched predictives (Wilson & Izmailov 2020's MultiSWAG
  from one pretrained network);
* ``multiswag-deep``: the same around each of the deep ensemble's five members (MultiSWAG as
  its authors build it: it needs the deep ensemble first, so it costs more than it).

Columns: accuracy, clean NLL, mean NLL over the protocol's shifts, OOD AUROC by predictive
entropy (near + far OOD), fit seconds (the copies' fine-tuning included; the deep ensemble's
training for ``multiswag-deep``). Writes ``results/multiswag31_<protocol>.json``.

    BAYESIFY_BENCH_CACHE=~/.cache/bayesify-bench python benchmarks/multiswag31.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))

from protocols import PROTOCOLS
from quality import point_stats, predictions

import bayesify
from bayesify import metrics
from bayesify.core.prediction import temper
from bayesify.core.walker import find_classifier
from bayesify.predict import BasePredictor, MixturePredictor, ModelPredictor
from bayesify.train.tuning import TEMPERATURES

MEMBERS = 5


def fine_tuned_copy(base: nn.Module, train: Any, *, seed: int, epochs: int,
                    lr: float = 1e-3) -> nn.Module:
    """``base`` with its classifier re-initialised (seed ``seed``), every layer trained
    ``epochs`` epochs with Adam in its own data order."""
    model = copy.deepcopy(base)
    torch.manual_seed(seed)
    head = model.get_submodule(find_classifier(model))
    head.reset_parameters()
    g = torch.Generator().manual_seed(seed)
    loader = DataLoader(train, batch_size=32, shuffle=True, generator=g)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(epochs):
        for xb, yb in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
    return model.eval()


def swag(model: nn.Module, loaders: dict[str, Any]) -> BasePredictor:
    bnn = bayesify.bayesify(copy.deepcopy(model), "swag")
    bayesify.fit(bnn, loaders["train"], val_loader=loaders["val"], progress=False)
    return bnn.predictor()


@torch.no_grad()
def validation_temperature(predictor: BasePredictor, p: Any) -> float:
    """The temperature of :data:`~bayesify.train.tuning.TEMPERATURES` with the lowest clean
    validation NLL (the copies are over-confident: 200 images, 30 epochs)."""
    vx, vy = p.val.tensors
    log_probs = predictor.predict(vx).log_probs
    nll = [metrics.per_example_nll(temper(log_probs, t), vy).mean().item() for t in TEMPERATURES]
    return TEMPERATURES[min(range(len(nll)), key=nll.__getitem__)]


def multiswag(networks: list[nn.Module], p: Any, seed: int) -> tuple[BasePredictor, float]:
    """SWAG (defaults + ``val_loader``) around each network, mixed; and its seconds."""
    t0 = time.perf_counter()
    parts = []
    for k, model in enumerate(networks):
        torch.manual_seed(seed + k)
        parts.append(swag(model, p.loaders(seed)))
    return MixturePredictor(parts), time.perf_counter() - t0


def score(predictor: BasePredictor, tx, ty, shifted, ood) -> dict[str, float]:
    clean = point_stats(predictions(predictor, tx), ty)
    o = point_stats(predictions(predictor, ood), None)
    shift = {k: point_stats(predictions(predictor, xs), ty)["nll"].mean().item()
             for k, xs in shifted.items()}
    return {"acc": clean["correct"].mean().item(), "clean_nll": clean["nll"].mean().item(),
            "shift_nll": sum(shift.values()) / len(shift), "shift_by_kind": shift,
            "auroc": metrics.auroc(clean["entropy"], o["entropy"])}


def run_seed(seed: int, args: argparse.Namespace) -> dict[str, Any]:
    spec = PROTOCOLS[args.protocol]
    torch.manual_seed(seed)
    p = spec.build(seed)
    tx, ty = p.test.tensors
    shifted = spec.shifts(tx, seed)
    ood = torch.cat([p.ood_near, p.ood_far])
    out: dict[str, Any] = {"seed": seed, "rows": {}}
    t0 = time.perf_counter()
    deep = [spec.pretrained(p, seed, i, epochs=spec.map_epochs) for i in range(MEMBERS)]
    deep_s = time.perf_counter() - t0
    if args.time_member:  # a cached network loads in a moment: train one afresh, × 5
        t0 = time.perf_counter()
        spec.pretrained.__wrapped__(p, seed, 1, epochs=spec.map_epochs)
        deep_s = MEMBERS * (time.perf_counter() - t0)
    out["deep_seconds"] = deep_s
    base = deep[0]

    def row(name: str, predictor: BasePredictor, fit_s: float) -> None:
        r = score(predictor, tx, ty, shifted, ood)
        r["fit_seconds"] = fit_s
        out["rows"][name] = r
        print(f"{args.protocol} seed {seed} {name:18s} acc {r['acc']:.4f} clean "
              f"{r['clean_nll']:.4f} shift {r['shift_nll']:.3f} auroc {r['auroc']:.4f} "
              f"fit {fit_s:.1f}s", flush=True)

    row("map", ModelPredictor(base), 0.0)
    row("deep-ensemble-x5", ModelPredictor(deep), deep_s)
    loaders = p.loaders(seed)
    t0 = time.perf_counter()
    row("swag", swag(base, loaders), time.perf_counter() - t0)
    t0 = time.perf_counter()
    copies = [fine_tuned_copy(base, p.train, seed=1000 * seed + k, epochs=args.epochs)
              for k in range(MEMBERS)]
    copies_s = time.perf_counter() - t0
    row("copies-x5", ModelPredictor(copies), copies_s)
    tempered = ModelPredictor(copies, temperature=validation_temperature(ModelPredictor(copies), p))
    row("copies-x5+T", tempered, copies_s)
    predictor, seconds = multiswag(copies, p, seed)
    row("multiswag-copies", predictor, copies_s + seconds)
    predictor, seconds = multiswag(deep, p, seed)
    row("multiswag-deep", predictor, deep_s + seconds)
    return out


def table(runs: list[dict[str, Any]]) -> str:
    """Markdown: per row the means over seeds of accuracy − the start's, clean NLL − the
    start's, shift NLL × the start's and × the deep ensemble's, AUROC − the start's, fit
    seconds × the deep ensemble's training (within each seed)."""
    names = list(runs[0]["rows"])
    header = ("| row | accuracy − start | clean NLL − start | shift × start (× ens.) | "
              "AUROC − start | fit × ens. |")
    lines = [header, "|---|---|---|---|---|---|"]
    for name in names:
        cells = []
        for run in runs:
            r, m, d = run["rows"][name], run["rows"]["map"], run["rows"]["deep-ensemble-x5"]
            deep_s = run.get("deep_seconds") or d["fit_seconds"]
            cells.append((r["acc"] - m["acc"], r["clean_nll"] - m["clean_nll"],
                          r["shift_nll"] / m["shift_nll"], r["shift_nll"] / d["shift_nll"],
                          r["auroc"] - m["auroc"], r["fit_seconds"] / deep_s))
        mean = [sum(c[i] for c in cells) / len(cells) for i in range(6)]
        lines.append(f"| {name} | {mean[0] * 100:+.1f} pts | {mean[1]:+.4f} | {mean[2]:.2f} "
                     f"({mean[3]:.2f}) | {mean[4]:+.3f} | {mean[5]:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--table", nargs="+", metavar="JSON",
                        help="print the markdown table of saved runs instead of running")
    parser.add_argument("--protocol", default="digits-cnn", choices=sorted(PROTOCOLS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--epochs", type=int, default=30,
                        help="fine-tuning epochs of each re-initialised copy")
    parser.add_argument("--time-member", action="store_true",
                        help="train one deep-ensemble member afresh (not from the cache) and "
                        "count 5× its time as the deep ensemble's training")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.table:
        for path in args.table:
            print(f"{path}:\n{table(json.loads(Path(path).read_text()))}\n")
        return
    torch.set_num_threads(1)
    runs = [run_seed(seed, args) for seed in args.seeds]
    out = Path(args.out or Path(__file__).parent / "results" / f"multiswag31_{args.protocol}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
