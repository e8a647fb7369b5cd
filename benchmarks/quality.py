"""Quality frontier: every bayesify family with its defaults against the network it starts
from, temperature scaling, a 5-member deep ensemble and the peer libraries.

Protocol: ``benchmarks/protocols.py`` (noisy digits, a pretrained CNN at ≈ 96 %, 200
fine-tuning images, 4 shifts the library never synthesises beside 3 it knows, near and far
OOD). Rows:

* ``map`` (the pretrained network), ``map+ts`` (its temperature by LBFGS on validation NLL);
* ``deep-ensemble-x5``: 5 networks trained like the pretrained one (member 0 is it), their
  training time counted in full;
* every registered family, **defaults only**: ``fit(bnn, train, val_loader=val)``;
* peers: ``laplace-torch`` (last-layer KFAC, marginal-likelihood prior, probit GLM),
  ``bayesian-torch`` (``dnn_to_bnn`` + MOPED), ``mc-dropout``.

Columns: accuracy, clean NLL / ECE, NLL under every shift (and their mean over the unseen
and the seen kinds), OOD AUROC by predictive entropy (near and far pooled; MI in the JSON),
fit and predict seconds. Standard errors: bootstrap over test points (shared indices, so
differences between rows are paired), combined over seeds. A PNG draws the frontier
(clean NLL against shift NLL, one point per row) and every family's validation search
curve (clean against shifted validation NLL per knob value).

    python benchmarks/quality.py --seeds 0 1 2 --jobs 2     # the recorded run
    python benchmarks/quality.py --quick                    # 1 seed, fewer rows' epochs
    python benchmarks/quality.py --protocol digits-vit      # protocol 2: a tiny ViT (LayerNorm)
    python benchmarks/quality.py --protocol minilm-text     # protocol 3: the real MiniLM, text

``--variant LABEL FAMILY key=value … fit.key=value …`` adds a row of a family with other
options (e.g. ``--variant ibnn-authors ibnn per_network=False fit.base_lr=1e-4``).
``--protocol`` picks the protocol of ``benchmarks/protocols.py`` (default ``digits-cnn``);
``--save-seeds`` writes every finished seed's raw scores beside the tables and ``--merge``
reads such files back (their seeds are not re-run; rows of one seed in several files are
joined, the first file's row winning), so seeds and rows can run in separate processes.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from protocols import PROTOCOLS, Protocol
from quality_table import aggregate
from text_protocol import input_rows, model_input, take

import bayesify
from bayesify import metrics
from bayesify.core.batch import call_model
from bayesify.core.outputs import logits_of
from bayesify.core.prediction import Prediction
from bayesify.evaluation import peers
from bayesify.predict.predictor import BasePredictor, ModelPredictor

PEER_RECIPES: dict[str, dict[str, Any]] = {
    "laplace-torch": {"subset_of_weights": "last_layer", "hessian_structure": "kron",
                      "prior_precision": "marglik", "predictive": "glm + probit"},
    "bayesian-torch": {"dnn_to_bnn": "Reparameterization", "moped_delta": 0.1, "prior": "N(0, 1)",
                       "posterior_rho_init": -3.0, "kl": "sum over weights / N_train",
                       "optimizer": "adam", "lr": 1e-3, "epochs": 40, "members": 16},
    "mc-dropout": {"p": 0.1, "where": "before every Conv/Linear but the stem",
                   "fine_tune": "all weights, adamw lr 1e-3", "epochs": 40, "members": 16},
    "ddu-density": {"features": "input of the classifier (penultimate)", "density": "Gaussian "
                    "per class, tied covariance + 1e-3·mean-variance shrinkage, fitted post hoc "
                    "on the 200 training images", "ood_score": "-log p(φ(x))",
                    "predictive": "the pretrained network (MAP)"},
    "deep-ensemble-x5": {"members": 5, "training": "5 pretrained networks (seeds), member 0 "
                         "= the starting network; all training time counted"},
}


@torch.no_grad()
def predictions(predictor: BasePredictor, x: torch.Tensor, batch: int = 512) -> Prediction:
    """The predictor's :class:`Prediction` of ``x`` at its temperature (the temperature acts
    on the predictive's log-probabilities; entropy and epistemic as the library reports)."""
    parts = [predictor.predict(model_input(take(x, i, i + batch))).to("cpu")
             for i in range(0, input_rows(x), batch)]
    return Prediction.cat(parts).scaled(predictor.temperature)


def point_stats(pred: Prediction, labels: torch.Tensor | None) -> dict[str, torch.Tensor]:
    log_probs = pred.log_probs.float()
    probs = log_probs.exp()
    out = {"entropy": pred.entropy.float(), "epistemic": pred.epistemic.float()}
    if labels is not None:
        conf, pred = probs.max(-1)
        out.update(nll=metrics.per_example_nll(log_probs, labels), correct=(pred == labels).float(),
                   confidence=conf, brier=metrics.per_example_brier(probs, labels))
    return out


# -- rows ---------------------------------------------------------------------------------------
def family_row(name: str, options: dict[str, Any] | None = None,
               fit_options: dict[str, Any] | None = None,
               ) -> Callable[..., tuple[BasePredictor, dict[str, Any]]]:
    def build(base: torch.nn.Module, p: Protocol, loaders: dict[str, Any], **_: Any):
        bnn = bayesify.bayesify(copy.deepcopy(base), name, **(options or {}))
        result = bayesify.fit(bnn, loaders["train"], val_loader=loaders["val"], progress=False,
                              **(fit_options or {}))
        return bnn.predictor(), {k: v for k, v in result.last.items()
                                 if isinstance(v, (int, float, list, str, dict))}
    return build


def build_laplace_torch(base, p, loaders, **_):
    la = peers.fit_laplace_torch(base, loaders["train"], prior="marglik")
    return peers.LaplaceTorchPredictor(la), {}


def build_bayesian_torch(base, p, loaders, *, context, **_):
    recipe = PEER_RECIPES["bayesian-torch"]
    model = peers.to_bayesian_torch(base, moped_delta=recipe["moped_delta"],
                                    posterior_rho_init=recipe["posterior_rho_init"])
    peers.fit_bayesian_torch(model, loaders["train"], epochs=_epochs(recipe["epochs"], context),
                             lr=recipe["lr"])
    return peers.SampledModelPredictor(model, recipe["members"], seed=context["seed"]), {}


def build_mc_dropout(base, p, loaders, *, context, **_):
    recipe = PEER_RECIPES["mc-dropout"]
    model = peers.insert_dropout(base, recipe["p"])
    peers.fit_plain(model, loaders["train"], epochs=_epochs(recipe["epochs"], context))
    return peers.SampledModelPredictor(model, recipe["members"], seed=context["seed"],
                                       stochastic=(torch.nn.Dropout,)), {}


def build_deep_ensemble(base, p, loaders, *, context, **_):
    members = [base] + [context["spec"].pretrained(p, context["seed"], i,
                                                   epochs=context["map_epochs"])
                        for i in range(1, PEER_RECIPES["deep-ensemble-x5"]["members"])]
    return ModelPredictor(members), {}


class FeatureDensityPredictor(ModelPredictor):
    """DDU-style baseline (Mukhoti et al. 2023): the pretrained network's predictive, and as
    OOD score the negative log density of its penultimate features under a Gaussian
    class-conditional model fitted post hoc (class means, tied shrunk covariance)."""

    def __init__(self, model: torch.nn.Module, loader: Any) -> None:
        super().__init__(model)
        feats, labels = [], []
        for x, y in loader:
            feats.append(self.features(x))
            labels.append(y)
        f, y = torch.cat(feats).double(), torch.cat(labels)
        classes = sorted(set(y.tolist()))
        self.means = torch.stack([f[y == c].mean(0) for c in classes])
        centred = f - self.means[torch.searchsorted(torch.tensor(classes), y)]
        cov = centred.T @ centred / max(1, f.shape[0] - len(classes))
        cov += 1e-3 * cov.diagonal().mean() * torch.eye(cov.shape[0], dtype=cov.dtype)
        self.precision = torch.linalg.inv(cov)
        self.log_prior = torch.log(torch.tensor([float((y == c).sum()) for c in classes],
                                                dtype=torch.float64) / y.numel())

    @torch.no_grad()
    def features(self, x: torch.Tensor) -> torch.Tensor:
        head = [m for m in self.models[0].modules() if isinstance(m, torch.nn.Linear)][-1]
        got: list[torch.Tensor] = []
        handle = head.register_forward_pre_hook(lambda _m, args: got.append(args[0]))
        try:
            self.models[0].eval()(x)
        finally:
            handle.remove()
        return got[0].flatten(1)

    def ood_score(self, x: torch.Tensor) -> torch.Tensor:
        diff = self.features(x).double()[:, None, :] - self.means[None]  # [N, K, D]
        maha = torch.einsum("nkd,de,nke->nk", diff, self.precision, diff)
        return -torch.logsumexp(self.log_prior - 0.5 * maha, dim=1).float()


def build_ddu(base, p, loaders, **_):
    return FeatureDensityPredictor(base, loaders["train"]), {}


PEERS = {"laplace-torch": build_laplace_torch, "ddu-density": build_ddu, "bayesian-torch": build_bayesian_torch,
         "mc-dropout": build_mc_dropout, "deep-ensemble-x5": build_deep_ensemble}


def _epochs(n: int, context: dict[str, Any]) -> int:
    return max(2, n // 3) if context["quick"] else n


def candidates(args: argparse.Namespace) -> dict[str, tuple[str, Callable[..., Any], Any]]:
    out: dict[str, tuple[str, Callable[..., Any], Any]] = {}
    for name in bayesify.list_methods():
        if not args.methods or name in args.methods:
            out[f"bayesify:{name}"] = ("bayesify", family_row(name), "library defaults + val_loader")
    for name, build in PEERS.items():
        if not args.methods or name in args.methods:
            out[name] = ("peer", build, PEER_RECIPES[name])
    for label, family, options, fit_options in parse_variants(args.variant or []):
        recipe = ", ".join([f"{k}={v!r}" for k, v in options.items()]
                           + [f"fit {k}={v!r}" for k, v in fit_options.items()])
        out[f"bayesify:{label}"] = ("bayesify", family_row(family, options, fit_options),
                                    f"{family}: {recipe} + val_loader")
    return out


def parse_variants(specs: list[list[str]]) -> list[tuple[str, str, dict, dict]]:
    """``--variant LABEL FAMILY [key=value ...] [fit.key=value ...]`` → (label, family,
    family options, fit options); values are Python literals (else strings)."""
    import ast

    out = []
    for spec in specs:
        if len(spec) < 2:
            raise SystemExit(f"--variant needs LABEL FAMILY [key=value ...], got {spec}")
        label, family, *pairs = spec
        options: dict[str, Any] = {}
        fit_options: dict[str, Any] = {}
        for pair in pairs:
            key, sep, raw = pair.partition("=")
            if not sep:
                raise SystemExit(f"--variant option {pair!r} is not key=value")
            try:
                value = ast.literal_eval(raw)
            except (ValueError, SyntaxError):
                value = raw
            target = fit_options if key.startswith("fit.") else options
            target[key.removeprefix("fit.")] = value
        out.append((label, family, options, fit_options))
    return out


def temperature_scale(model: torch.nn.Module, p: Protocol) -> ModelPredictor:
    """MAP + temperature: LBFGS on log T of the validation NLL."""
    vx, vy = p.val.tensors
    with torch.no_grad():
        logits = logits_of(call_model(model, model_input(vx)))
    log_t = torch.zeros((), requires_grad=True)
    opt = torch.optim.LBFGS([log_t], lr=0.1, max_iter=100, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(logits / log_t.exp(), vy)
        loss.backward()
        return loss

    opt.step(closure)
    return ModelPredictor(model, temperature=float(log_t.exp()))


# -- one seed ---------------------------------------------------------------------------------
def run_seed(seed: int, args: argparse.Namespace) -> dict[str, Any]:
    spec = PROTOCOLS[args.protocol]
    p, tx, ty, shifted, ood = spec.evaluation_sets(seed)
    map_epochs = spec.quick_map_epochs if args.quick else spec.map_epochs
    start = time.perf_counter()
    base = spec.pretrained(p, seed, 0, epochs=map_epochs)
    map_s = time.perf_counter() - start
    context = {"seed": seed, "quick": args.quick, "map_epochs": map_epochs, "spec": spec}
    rows: dict[str, Any] = {}

    def score(name: str, group: str, predictor: BasePredictor, fit_s: float, recipe: Any,
              record: dict[str, Any] | None = None) -> None:
        start = time.perf_counter()
        logits = predictions(predictor, tx)
        _ = logits.log_probs
        predict_s = time.perf_counter() - start
        entry = {"group": group, "recipe": recipe, "members": int(logits.num_members),
                 "temperature": float(predictor.temperature), "fit_seconds": fit_s,
                 "fit_cpu_seconds": fit_s, "predict_seconds": predict_s,
                 "test": point_stats(logits, ty), "ood": point_stats(predictions(predictor, ood), None),
                 "sweeps": {}, "search": record or {}}
        if hasattr(predictor, "ood_score"):  # feature-density rows: their OOD score in the H column
            entry["test"]["entropy"] = predictor.ood_score(tx)
            entry["ood"]["entropy"] = predictor.ood_score(ood)
        for kind, xs in shifted.items():
            s = point_stats(predictions(predictor, xs), ty)
            entry["sweeps"][kind] = {"nll": s["nll"], "correct": s["correct"],
                                     "entropy_by_level": [s["entropy"].mean().item()],
                                     "epistemic_by_level": [s["epistemic"].mean().item()]}
        rows[name] = entry
        print(f"  seed {seed} {name:26s} acc {entry['test']['correct'].mean():.4f} nll "
              f"{entry['test']['nll'].mean():.4f} shift "
              f"{torch.stack([v['nll'] for v in entry['sweeps'].values()]).mean():.3f} "
              f"fit {fit_s:.1f}s", flush=True)

    score("map", "baseline", ModelPredictor(base), map_s, {"epochs": map_epochs})
    start = time.perf_counter()
    ts = temperature_scale(base, p)
    score("map+ts", "baseline", ts, map_s + time.perf_counter() - start, "LBFGS on val NLL")
    for name, (group, build, recipe) in candidates(args).items():
        torch.manual_seed(seed)
        loaders = p.loaders(seed)
        start = time.perf_counter()
        try:
            predictor, record = build(copy.deepcopy(base), p, loaders, context=context)
        except Exception as err:  # noqa: BLE001 - a broken row must not stop the run
            traceback.print_exc()
            rows[name] = {"group": group, "recipe": recipe, "error": f"{type(err).__name__}: {err}"}
            continue
        fit_s = time.perf_counter() - start + (map_s if name == "deep-ensemble-x5" else 0.0)
        score(name, group, predictor, fit_s, recipe, record)
    return {"seed": seed, "rows": rows, "sweeps": {k: [1] for k in shifted},
            "n_test": int(ty.numel()), "n_ood": input_rows(ood), "notes": {},
            "map_seconds": map_s}


def _run_seed_job(job: tuple[int, argparse.Namespace]) -> dict[str, Any]:
    seed, args = job
    torch.set_num_threads(args.threads)
    out = run_seed(seed, args)
    for entry in out["rows"].values():  # searches are not tensors: keep them beside
        entry.setdefault("search", {})
    return out


# -- tables and the frontier --------------------------------------------------------------------
def markdown(summary: dict[str, Any]) -> str:
    rows, meta = summary["rows"], summary["meta"]
    spec = PROTOCOLS[meta.get("protocol", "digits-cnn")]
    UNSEEN, SEEN = spec.unseen, spec.seen
    ref = rows["map"]["metrics"]
    lines = ["# Quality frontier: every family's defaults on a held-out-style protocol", "",
             f"Command: `{meta['command']}`  ",
             (f"Seeds {meta['seeds']}; bootstrap resamples {meta['bootstrap']}; torch "
             f"{meta['torch']}; peers {meta['peers']}; {meta['machine']}, {meta['date']}; "
             f"wall time {meta['wall_seconds']:.0f} s."), "",
             (f"Protocol: `benchmarks/protocols.py` `{spec.name}` ({spec.description}). Mean "
             "over seeds ± bootstrap SE. `shift ratio` = unseen-shift NLL / the starting "
             "network's."), "",
             ("| row | M | acc | clean NLL | ECE | unseen-shift NLL | shift ratio | seen-shift NLL "
             "| OOD AUROC (H) | OOD AUROC (MI) | T | fit s | predict s |"),
             "|" + "---|" * 13]
    base_unseen = _mean_of(ref, UNSEEN)
    for name, row in rows.items():
        m = row["metrics"]
        if not m:
            lines.append(f"| {name} | failed: {'; '.join(row['errors'])[:160]} |")
            continue
        unseen = _mean_of(m, UNSEEN)
        seen_txt = f"{_mean_of(m, SEEN):.3f}" if SEEN else "—"
        mi = m.get("ood_auroc_mi", {}).get("value")
        lines.append(
            f"| {name} | {row['members']} | {m['accuracy']['value']:.3f} | "
            f"{m['nll']['value']:.3f} ± {m['nll']['se']:.3f} | {m['ece']['value']:.3f} | "
            f"{unseen:.3f} | {unseen / base_unseen:.2f} | {seen_txt} | "
            f"{m['ood_auroc']['value']:.3f} | {'n/a' if mi is None else f'{mi:.3f}'} | "
            f"{row['temperature']:.2f} | {row['fit_seconds']:.1f} | {row['predict_seconds']:.3f} |")
    lines += ["", "NLL under every shift:", "",
              "| row | " + " | ".join(UNSEEN + SEEN) + " |", "|" + "---|" * (1 + len(UNSEEN + SEEN))]
    for name, row in rows.items():
        if row["metrics"]:
            lines.append(f"| {name} | " + " | ".join(
                f"{row['metrics'][f'{k}_nll']['value']:.3f}" for k in UNSEEN + SEEN) + " |")
    lines += ["", "Choices of the validation search (seed 0): knob, temperature, shift signal:", ""]
    for name, search in summary.get("searches", {}).items():
        keys = {k: v for k, v in search.items() if not isinstance(v, list)
                and not k.startswith(("loss", "nll", "kl", "beta", "lr", "seconds", "images",
                                      "world", "steps", "epoch", "val_", "start_val_"))}
        lines.append(f"- `{name}`: {json.dumps(keys, default=str)[:300]}")
    return "\n".join(lines) + "\n"


def _mean_of(m: dict[str, Any], kinds: tuple[str, ...]) -> float:
    return sum(m[f"{k}_nll"]["value"] for k in kinds) / len(kinds)


def frontier_png(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    UNSEEN = PROTOCOLS[summary["meta"].get("protocol", "digits-cnn")].unseen
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5.5))
    for name, row in rows.items():
        if not row["metrics"]:
            continue
        m = row["metrics"]
        x, y = m["nll"]["value"], _mean_of(m, UNSEEN)
        style = {"baseline": ("k", "s"), "peer": ("tab:red", "^")}.get(row["group"], ("tab:blue", "o"))
        ax.scatter(x, y, c=style[0], marker=style[1], s=40)
        ax.annotate(name.replace("bayesify:", ""), (x, y), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    ax.set_xlabel("clean test NLL")
    ax.set_ylabel(f"NLL under unseen shifts (mean of {len(UNSEEN)} kinds)")
    ax.set_title("frontier (lower-left is better); squares: MAP, MAP+TS")
    for name, search in summary.get("searches", {}).items():
        knob = next((k for k in search if f"{k}_grid" in search and f"{k}_shift_nll" in search),
                    None)
        if knob is None:
            continue
        xs = search[f"{knob}_val_nll"]
        ys = [math.nan if v is None else v for v in search[f"{knob}_shift_nll"]]  # None: skipped
        bx.plot(xs, ys, "-o", ms=3, label=f"{name.replace('bayesify:', '')} ({knob})")
        value = search[knob][0] if isinstance(search[knob], list) else search[knob]
        grid = search[f"{knob}_grid"]
        chosen = min(range(len(grid)), key=lambda i: abs(math.log(grid[i] + 1e-12)
                                                         - math.log(value + 1e-12)))
        bx.scatter([xs[chosen]], [ys[chosen]], s=60, facecolors="none", edgecolors="k")
    bx.set_xlabel("clean validation NLL (at the chosen temperature)")
    bx.set_ylabel("shifted validation NLL")
    bx.set_title("validation search curves, seed 0 (circle: chosen)")
    bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="seeds (data split, pretrained net, posteriors); default 0 1 2")
    parser.add_argument("--quick", action="store_true", help="1 seed, shorter peer training")
    parser.add_argument("--methods", nargs="*", default=None,
                        help="restrict to these bayesify families / peers (default: all)")
    parser.add_argument("--variant", nargs="+", action="append", metavar="ARG",
                        help="an extra row: LABEL FAMILY [key=value ...] [fit.key=value ...] "
                        "(family options, fit options; repeatable), e.g. --variant ibnn-g2 "
                        "ibnn entropy_weight=2")
    parser.add_argument("--bootstrap", type=int, default=200, help="bootstrap resamples")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--jobs", type=int, default=1, help="seeds run in parallel processes")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--protocol", choices=sorted(PROTOCOLS), default="digits-cnn",
                        help="the quality protocol of benchmarks/protocols.py (default digits-cnn)")
    parser.add_argument("--save-seeds", action="store_true",
                        help="write each finished seed's raw scores to OUT/NAME_seedS.pt")
    parser.add_argument("--merge", nargs="*", default=[],
                        help="NAME_seedS.pt files of earlier runs (same protocol) to join")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    seeds = args.seeds if args.seeds is not None else ([0] if args.quick else [0, 1, 2])
    wall = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = ("quality" + ("" if args.protocol == "digits-cnn" else f"_{args.protocol}")
            + ("_quick" if args.quick else ""))
    merged = _merge(args.merge)
    seeds = [seed for seed in seeds if seed not in merged]
    jobs = [(seed, args) for seed in seeds]
    if args.jobs > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            per_seed = list(pool.map(_run_seed_job, jobs))
    else:
        per_seed = []
        for job in jobs:
            per_seed.append(_run_seed_job(job))
            if args.save_seeds:
                _save_seed(per_seed[-1], out / f"{name}_seed{job[0]}.pt")
    if args.jobs > 1 and args.save_seeds:
        for run in per_seed:
            _save_seed(run, out / f"{name}_seed{run['seed']}.pt")
    per_seed = sorted(per_seed + list(merged.values()), key=lambda run: run["seed"])
    seeds = [run["seed"] for run in per_seed]
    searches = {name: entry.get("search", {}) for name, entry in per_seed[0]["rows"].items()
                if entry.get("search")}
    summary = aggregate(per_seed, num_boot=args.bootstrap)
    summary["searches"] = searches
    summary["meta"] = {
        "command": "python benchmarks/quality.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "seeds": seeds, "bootstrap": args.bootstrap, "threads": args.threads,
        "wall_seconds": time.perf_counter() - wall, "torch": torch.__version__,
        "peers": _peer_versions(), "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {torch.get_num_threads()} torch thread(s)",
        "protocol": args.protocol, "merged": args.merge,
    }
    (out / f"{name}.json").write_text(json.dumps(summary, indent=1, default=_jsonable))
    (out / f"{name}.md").write_text(markdown(summary))
    frontier_png(summary, out / f"{name}_frontier.png")
    print((out / f"{name}.md").read_text())


def _save_seed(run: dict[str, Any], path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(run, tmp)
    tmp.replace(path)


def _merge(paths: list[str]) -> dict[int, dict[str, Any]]:
    """Seed runs saved by ``--save-seeds`` (loaded with ``weights_only=True``), one per seed:
    rows of the same seed from several files joined, the first file's row kept."""
    runs: dict[int, dict[str, Any]] = {}
    for path in paths:
        run = torch.load(path, weights_only=True)
        if run["seed"] in runs:
            for row, entry in run["rows"].items():
                runs[run["seed"]]["rows"].setdefault(row, entry)
        else:
            runs[run["seed"]] = run
    return runs


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return str(value)


def _peer_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("laplace-torch", "bayesian-torch"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = "not installed"
    return out


if __name__ == "__main__":
    main()
