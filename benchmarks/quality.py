"""Quality benchmark: every bayesify family vs the peer libraries on the digits protocol.

Protocol (per seed): scikit-learn digits, classes 0–4 in distribution (stratified
train/val/test split), classes 5–9 out of distribution; one "pretrained" DigitsCNN
(``train_map``) that every method starts from. Rows:

* ``map`` / ``map+ts`` (temperature by LBFGS on the validation NLL);
* every registered bayesify family with its library defaults and the validation
  split (``bayesify:NAME``: ``fit(bnn, train, val_loader=val)``, which tunes the
  family's predictive-scale knob), plus a tuned iBNN row (``--ibnn-recipe``; the
  recipe used is written out);
* peers: ``laplace-torch`` (last-layer KFAC, marginal-likelihood prior precision,
  probit GLM predictive), ``bayesian-torch`` (``dnn_to_bnn`` + MOPED, ELBO with the
  KL *summed* / N_train, see ``peers.py``), ``mc-dropout`` and ``deep-ensemble×5``
  (plain, independently trained DigitsCNNs).

Columns: accuracy, NLL, ECE, Brier, OOD AUROC (entropy; MI in the JSON), NLL and
accuracy averaged over each corruption sweep, fit and predict seconds. Standard
errors: bootstrap over test points (resampled indices shared by all rows of a seed,
so differences are paired), combined over seeds as sqrt(Σ SE_s²)/S.

    python benchmarks/quality.py --seeds 0 1 2          # full (see quality.md for timing)
    python benchmarks/quality.py --quick                # 1 seed, short schedules
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

from quality_table import aggregate, write_markdown

import bayesify
from bayesify import metrics
from bayesify.data.digits import digits_loaders, load_digits_splits
from bayesify.data.models import DigitsCNN, train_map
from bayesify.evaluation import peers
from bayesify.evaluation.corruptions import DEFAULT_SWEEPS, corrupt
from bayesify.predict.predictor import BasePredictor, ModelPredictor

#: the tuned iBNN recipe of the benchmark (the demo recipe runs as 'bayesify:ibnn' too)
IBNN_TUNED = json.dumps({
    "options": {"components": 4, "samples": 2, "init_mean_std": 0.5, "prior_std": 0.3},
    "fit": {"epochs": 30, "kl_anneal_epochs": 10},
    "predictor": {"samples_per_component": 5},
    "calibrate": True,
})
QUICK_SWEEPS = {"gaussian": (0.2, 0.4, 0.6), "salt_pepper": (0.1, 0.3), "rotation": (30.0, 60.0)}


# -- per-example statistics ------------------------------------------------------------------

@torch.no_grad()
def member_logits(predictor: BasePredictor, x: torch.Tensor, batch: int = 512) -> torch.Tensor:
    """``[M, N, C]`` calibrated member logits over a tensor of inputs."""
    outs = [predictor.member_logits(x[i:i + batch]) for i in range(0, x.shape[0], batch)]
    return torch.cat(outs, dim=1).float() / predictor.temperature


def point_stats(logits: torch.Tensor, labels: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Per-example NLL, correctness, confidence, Brier, entropy and MI from ``[M, N, C]``."""
    log_probs = metrics.mixture_log_probs(logits)
    probs = log_probs.exp()
    entropy = metrics.entropy(probs)
    epistemic = (entropy - metrics.expected_entropy(logits.softmax(-1))).clamp_min(0)
    out = {"entropy": entropy, "epistemic": epistemic}
    if labels is not None:
        conf, pred = probs.max(-1)
        out.update(nll=metrics.per_example_nll(log_probs, labels), correct=(pred == labels).float(),
                   confidence=conf, brier=metrics.per_example_brier(probs, labels))
    return out


def temperature_scale(predictor: BasePredictor, val_x: torch.Tensor, val_y: torch.Tensor,
                      val_loader: Any) -> float:
    """Fit the predictor's temperature on validation NLL (library ``calibrate`` if present)."""
    if hasattr(predictor, "calibrate"):
        predictor.calibrate(val_loader)
        return float(predictor.temperature)
    logits = member_logits(predictor, val_x) * predictor.temperature
    log_t = torch.zeros((), requires_grad=True)
    opt = torch.optim.LBFGS([log_t], lr=0.1, max_iter=100, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = metrics.per_example_nll(metrics.mixture_log_probs(logits / log_t.exp()), val_y).mean()
        loss.backward()
        return loss

    opt.step(closure)
    predictor.temperature = float(log_t.exp())
    return predictor.temperature


# -- the candidates --------------------------------------------------------------------------

def bayesify_builder(name: str, recipe: dict[str, Any]) -> Callable[..., BasePredictor]:
    def build(base: torch.nn.Module, loaders: dict[str, Any], **_: Any) -> BasePredictor:
        fit_kwargs = dict(recipe.get("fit", {}))
        if isinstance(fit_kwargs.get("val_loader"), str):  # recipes name a split, e.g. "val"
            fit_kwargs["val_loader"] = loaders[fit_kwargs["val_loader"]]
        bnn = bayesify.bayesify(copy.deepcopy(base), name, **recipe.get("options", {}))
        bayesify.fit(bnn, loaders["train"], progress=False, **fit_kwargs)
        predictor = bnn.predictor(**recipe.get("predictor", {}))
        if recipe.get("calibrate"):  # temperature on the validation NLL, part of the recipe
            predictor.calibrate(loaders["val"])
        return predictor

    return build


def _shorten(recipe: dict[str, Any], quick: bool) -> None:
    if quick and "epochs" in recipe.get("fit", {}):
        recipe["fit"]["epochs"] = max(2, recipe["fit"]["epochs"] // 3)
        if "kl_anneal_epochs" in recipe["fit"]:
            recipe["fit"]["kl_anneal_epochs"] = max(1, recipe["fit"]["kl_anneal_epochs"] // 3)


def candidates(args: argparse.Namespace) -> dict[str, tuple[str, Callable[..., BasePredictor], dict]]:
    """``{row: (group, builder, recipe)}`` in table order."""
    out: dict[str, tuple[str, Callable[..., BasePredictor], dict]] = {}
    for name in bayesify.list_methods():
        if args.methods and name not in args.methods:
            continue
        recipe: dict[str, Any] = {"options": {}, "fit": {"val_loader": "val"}}  # defaults
        rows_for = [(name, recipe)]
        if name == "ibnn" and args.ibnn_recipe:
            rows_for.append(("ibnn-tuned", json.loads(args.ibnn_recipe)))
        for row_name, recipe in rows_for:
            _shorten(recipe, args.quick)
            out[f"bayesify:{row_name}"] = ("bayesify", bayesify_builder(name, recipe), recipe)
    for name, (builder, recipe) in PEERS.items():
        if args.methods and name not in args.methods:
            continue
        out[name] = ("peer", builder, recipe)
    return out


# -- the peers (recipes are written into the results) -----------------------------------------

PEER_RECIPES: dict[str, dict[str, Any]] = {
    "laplace-torch": {"subset_of_weights": "last_layer", "hessian_structure": "kron",
                      "prior_precision": "marglik", "predictive": "glm + probit"},
    "bayesian-torch": {"dnn_to_bnn": "Reparameterization", "moped_delta": 0.1, "prior": "N(0, 1)",
                       "posterior_rho_init": -3.0, "kl": "sum over weights / N_train",
                       "optimizer": "adam", "lr": 1e-3, "epochs": 20, "members": 16},
    "mc-dropout": {"p": 0.1, "where": "before every Conv/Linear but the stem",
                   "fine_tune": "all weights, adamw lr 1e-3", "epochs": 10, "members": 16},
    "deep-ensemble-x5": {"members": 5, "training": "train_map from scratch, member 0 = the MAP net"},
}


def _epochs(n: int, context: dict[str, Any]) -> int:
    return max(2, n // 3) if context["quick"] else n


def build_laplace_torch(base: torch.nn.Module, loaders: dict[str, Any], *,
                        context: dict[str, Any]) -> BasePredictor:
    la = peers.fit_laplace_torch(base, loaders["train"], prior="marglik")
    return peers.LaplaceTorchPredictor(la)


def build_bayesian_torch(base: torch.nn.Module, loaders: dict[str, Any], *,
                         context: dict[str, Any]) -> BasePredictor:
    recipe = PEER_RECIPES["bayesian-torch"]
    model = peers.to_bayesian_torch(base, moped_delta=recipe["moped_delta"],
                                    posterior_rho_init=recipe["posterior_rho_init"])
    context.setdefault("notes", {})["bayesian-torch kl"] = peers.kl_scaling_note(model)
    peers.fit_bayesian_torch(model, loaders["train"], epochs=_epochs(recipe["epochs"], context),
                             lr=recipe["lr"])
    return peers.SampledModelPredictor(model, recipe["members"], seed=context["seed"])


def build_mc_dropout(base: torch.nn.Module, loaders: dict[str, Any], *,
                     context: dict[str, Any]) -> BasePredictor:
    recipe = PEER_RECIPES["mc-dropout"]
    model = peers.insert_dropout(base, recipe["p"])
    peers.fit_plain(model, loaders["train"], epochs=_epochs(recipe["epochs"], context))
    return peers.SampledModelPredictor(model, recipe["members"], seed=context["seed"],
                                       stochastic=(torch.nn.Dropout,))


def build_deep_ensemble(base: torch.nn.Module, loaders: dict[str, Any], *,
                        context: dict[str, Any]) -> BasePredictor:
    splits, seed = context["splits"], context["seed"]
    models = [base]
    for i in range(1, PEER_RECIPES["deep-ensemble-x5"]["members"]):
        member_loader = digits_loaders(splits, batch_size=64, seed=1000 * seed + i)["train"]
        models.append(train_map(DigitsCNN(splits.num_classes), member_loader,
                                epochs=context["map_epochs"], seed=1000 * seed + i))
    return ModelPredictor(models)


PEERS: dict[str, tuple[Callable[..., BasePredictor], dict[str, Any]]] = {
    "laplace-torch": (build_laplace_torch, PEER_RECIPES["laplace-torch"]),
    "bayesian-torch": (build_bayesian_torch, PEER_RECIPES["bayesian-torch"]),
    "mc-dropout": (build_mc_dropout, PEER_RECIPES["mc-dropout"]),
    "deep-ensemble-x5": (build_deep_ensemble, PEER_RECIPES["deep-ensemble-x5"]),
}


# -- one seed --------------------------------------------------------------------------------

def run_seed(seed: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(seed)
    splits = load_digits_splits(seed=seed)
    loaders = digits_loaders(splits, batch_size=64, seed=seed)
    test_x, test_y = splits.test.tensors
    val_x, val_y = splits.val.tensors
    ood_x = splits.ood.tensors[0]
    sweeps = QUICK_SWEEPS if args.quick else DEFAULT_SWEEPS
    corrupted = {kind: [corrupt(test_x, kind, level, seed=seed) for level in levels]
                 for kind, levels in sweeps.items()}
    map_epochs = args.map_epochs // 3 if args.quick else args.map_epochs

    start, cpu = time.perf_counter(), time.process_time()
    base = train_map(DigitsCNN(splits.num_classes), loaders["train"], epochs=map_epochs, seed=seed)
    map_fit = (time.perf_counter() - start, time.process_time() - cpu)
    context = {"seed": seed, "map_epochs": map_epochs, "map_fit_seconds": map_fit[0],
               "splits": splits, "quick": args.quick}

    rows: dict[str, Any] = {}

    def score(name: str, group: str, predictor: BasePredictor, fit_s: tuple[float, float],
              recipe: dict) -> None:
        start = time.perf_counter()
        test_logits = member_logits(predictor, test_x)
        predict_s = time.perf_counter() - start
        entry: dict[str, Any] = {
            "group": group, "recipe": recipe, "members": int(test_logits.shape[0]),
            "temperature": float(predictor.temperature), "fit_seconds": fit_s[0],
            "fit_cpu_seconds": fit_s[1], "predict_seconds": predict_s,
            "test": point_stats(test_logits, test_y),
            "ood": point_stats(member_logits(predictor, ood_x), None),
            "sweeps": {},
        }
        for kind, xs in corrupted.items():
            per_level = [point_stats(member_logits(predictor, xc), test_y) for xc in xs]
            entry["sweeps"][kind] = {
                "nll": torch.stack([s["nll"] for s in per_level]).mean(0),
                "correct": torch.stack([s["correct"] for s in per_level]).mean(0),
                "entropy_by_level": [s["entropy"].mean().item() for s in per_level],
                "epistemic_by_level": [s["epistemic"].mean().item() for s in per_level],
            }
        rows[name] = entry
        print(f"  seed {seed} {name:28s} acc {entry['test']['correct'].mean():.4f} "
              f"nll {entry['test']['nll'].mean():.4f} fit {fit_s[0]:.1f}s", flush=True)

    score("map", "baseline", ModelPredictor(base), map_fit, {"epochs": map_epochs})
    start, cpu = time.perf_counter(), time.process_time()
    ts = ModelPredictor(copy.deepcopy(base))
    temperature_scale(ts, val_x, val_y, loaders["val"])
    score("map+ts", "baseline", ts,
          (map_fit[0] + time.perf_counter() - start, map_fit[1] + time.process_time() - cpu),
          {"temperature": "LBFGS on validation NLL"})
    for name, (group, build, recipe) in candidates(args).items():
        torch.manual_seed(seed)
        fresh = digits_loaders(splits, batch_size=64, seed=seed)  # same shuffles for every row
        start, cpu = time.perf_counter(), time.process_time()
        try:
            predictor = build(base, fresh, context=context)
        except Exception as err:  # noqa: BLE001 - a broken family must not stop the run
            traceback.print_exc()
            rows[name] = {"group": group, "recipe": recipe, "error": f"{type(err).__name__}: {err}"}
            continue
        fit_s = (time.perf_counter() - start, time.process_time() - cpu)
        if name == "deep-ensemble-x5":  # member 0 is the MAP net: its training counts too
            fit_s = (fit_s[0] + map_fit[0], fit_s[1] + map_fit[1])
        score(name, group, predictor, fit_s, recipe)
    return {"seed": seed, "rows": rows, "notes": context.get("notes", {}), "sweeps": {k: list(v) for k, v in sweeps.items()},
            "n_test": int(test_y.numel()), "n_ood": int(ood_x.shape[0])}


def _run_seed_job(job: tuple[int, argparse.Namespace]) -> dict[str, Any]:
    seed, args = job
    torch.set_num_threads(args.threads)
    print(f"seed {seed}", flush=True)
    cpu = time.process_time()
    out = run_seed(seed, args)
    out["cpu_seconds"] = time.process_time() - cpu
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=None,
                        help="seeds (data split, MAP net, posteriors); default 0 1 2 (quick: 0)")
    parser.add_argument("--quick", action="store_true",
                        help="short schedules, fewer sweep levels and bootstrap resamples")
    parser.add_argument("--methods", nargs="*", default=None,
                        help="restrict to these bayesify families / peers (default: all)")
    parser.add_argument("--map-epochs", type=int, default=40)
    parser.add_argument("--bootstrap", type=int, default=None, help="resamples (default 200)")
    parser.add_argument("--ibnn-recipe", default=IBNN_TUNED,
                        help="JSON recipe of the extra 'bayesify:ibnn-tuned' row ('' for none)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per process")
    parser.add_argument("--jobs", type=int, default=1, help="seeds run in parallel processes")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    seeds = args.seeds if args.seeds is not None else ([0] if args.quick else [0, 1, 2])
    boots = args.bootstrap or (50 if args.quick else 200)

    wall = time.perf_counter()
    if args.jobs > 1:  # one process per seed, each with --threads torch threads
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            per_seed = list(pool.map(_run_seed_job, [(seed, args) for seed in seeds]))
        cpu_children = sum(run.pop("cpu_seconds") for run in per_seed)
    else:
        per_seed = [_run_seed_job((seed, args)) for seed in seeds]
        cpu_children = sum(run.pop("cpu_seconds") for run in per_seed)
    summary = aggregate(per_seed, num_boot=boots)
    summary["meta"] = {
        "command": "python benchmarks/quality.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "seeds": seeds, "quick": args.quick, "bootstrap": boots, "threads": args.threads,
        "wall_seconds": time.perf_counter() - wall, "cpu_seconds": cpu_children, "jobs": args.jobs,
        "machine": f"{platform.machine()} {platform.processor() or ''} "
                   f"{torch.get_num_threads()} torch threads".strip(),
        "torch": torch.__version__, "peers": _peer_versions(),
        "date": time.strftime("%Y-%m-%d"),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "quality_quick" if args.quick else "quality"
    (out / f"{name}.json").write_text(json.dumps(summary, indent=1, default=_jsonable))
    (out / f"{name}.md").write_text(write_markdown(summary))
    print((out / f"{name}.md").read_text())


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
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
