"""A silent-fault hunt over many architectures at once: every family whose posterior has an
identity point is wrapped around a random-initialised network *at* that point, and its
members must be the network (thirty-eighth stop).

The crash hunts (``held_out_nets.py``, ``hf_classes.py``) train a network and fit every
family: minutes per network, and a family that computes another network shows only where
the data are hard enough for accuracy to fall (the thirty-seventh stop's BiT: 0.69 against
1.00). Here nothing is trained: each family is built at its identity point (``IDENTITY``,
the options of ``tests/test_own_forward_layers.py``), its deterministic members are compared
with the network's logits on one batch (``Δ`` = max |member − network| ÷ max |network|), and
its default predictor must run and be finite. Seconds per network, so hundreds of timm
architectures fit in one run.

    OMP_NUM_THREADS=1 python benchmarks/identity_hunt.py resnet18,convnext_atto,...
    OMP_NUM_THREADS=1 python benchmarks/identity_hunt.py hf:bert,hf:hf_bit   # hf_classes.build
    OMP_NUM_THREADS=1 python benchmarks/identity_hunt.py --timm-filter '*' --limit 200

``--export``: each family at its defaults is also exported to ``.pt2`` and read back, the
export's own check (probs and epistemic within 1e-5 of the in-process predictor).

One line per (network, family): ``OK`` with Δ, ``DIFF`` where Δ > 1e-4 (another network),
``NAN`` where the default predictor is not finite, ``ERR`` with the exception.

``--scan timm`` / ``--scan hf`` build every timm model / every Hugging Face sequence, image
and audio classifier (default configuration) on the meta device — no weights, no forward —
and list the module classes that read a child's weight instead of calling it
(``bayesify.core.weight_reads``) and the layer classes with their own forward
(``bayesify.kit.weightspace.has_own_forward``), with the models that have them.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

import bayesify
from bayesify.core.batch import as_inputs

warnings.simplefilter("ignore")

#: family → options whose deterministic members are the network itself
IDENTITY = {
    "meanfield": {}, "hypernet": {}, "mnf": {}, "dropout": {"train_weights": True},
    "rank1": {"init": "ones"}, "batchensemble": {"init": "ones"},
    "ensemble": {"init_noise": 0.0}, "ibnn": {"init_mean_std": 0.0}, "abnn": {"noise_std": 0.0},
}
TOLERANCE = 1e-4


def build(name: str, size: int, native: bool = False):
    """``(model, batch)``: a timm architecture (random init, 10 classes, ``size`` px, or its
    own input size with ``native``) or ``hf:NAME`` from ``hf_classes.build`` (its own data)."""
    torch.manual_seed(0)
    if name.startswith("hf:"):
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import hf_classes

        model, data = hf_classes.build(name[3:])
        batch = next(iter(torch.utils.data.DataLoader(data(6, 0), batch_size=6)))
        batch.pop("labels")
        return model.eval(), batch
    import timm

    if not native:
        try:
            return timm.create_model(name, num_classes=10, img_size=size).eval(), \
                torch.randn(6, 3, size, size)
        except TypeError:  # no img_size option
            pass
    model = timm.create_model(name, num_classes=10)
    cfg = getattr(model, "pretrained_cfg", {}) or {}
    side = cfg.get("input_size", (3, 224, 224))[-1] if native or cfg.get("fixed_input_size") \
        else size
    return model.eval(), torch.randn(2 if native else 6, 3, side, side)


def _spread_head(model):
    """The last Linear re-initialised (its default init): several timm heads start at zero
    or near it (DINOv3, EfficientViT-M: |logit| < 2e-4), where every member agrees with the
    network whatever the trunk computes, and probabilities near uniform hide an export's
    error."""
    last = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if last:
        torch.manual_seed(1)
        last[-1].reset_parameters()
        with torch.no_grad():
            last[-1].weight.mul_(4.0)
    return model


def _logits(model, batch):
    out = model(**batch) if isinstance(batch, dict) else model(batch)
    return getattr(out, "logits", out)


def _export(model, family: str, batch) -> str:
    """`` export=Ns Δ=…``: the family at its defaults (its initial spread, no fit) exported to
    ``.pt2`` and read back — ``export`` verifies probs and epistemic against the in-process
    predictor (1e-5) and raises otherwise."""
    import tempfile

    began = time.time()
    bnn = bayesify.bayesify(model, method=family).eval()
    with tempfile.TemporaryDirectory() as tmp:
        info = bnn.predictor(seed=1).export(Path(tmp) / "p.pt2", batch)
    return f" export={time.time() - began:.0f}s Δ={info['max_abs_diff']:.1e}"


def check(name: str, size: int, families: list[str], export: bool = False) -> list[str]:
    began = time.time()
    base = None
    for native in (False, True):  # at `size` px, else at the model's own input size
        try:
            model, batch = build(name, size, native)
            model = _spread_head(model)
            with torch.no_grad():
                base = _logits(model, batch).float()
            break
        except Exception as err:  # noqa: BLE001 - the network itself does not run here
            failed = f"SKIP {name} {type(err).__name__}: {str(err)[:160]}"
    if base is None:
        return [failed]
    scale = base.abs().max().clamp_min(1e-6)
    lines = []
    for family in families:
        try:
            bnn = bayesify.bayesify(model, method=family, **IDENTITY[family]).eval()
            inputs = as_inputs(batch) if isinstance(batch, dict) else batch
            with torch.no_grad():
                members = bnn.method.member_logits(bnn, inputs, samples_per_component=1,
                                                   max_rows=10_000, seed=1, deterministic=True)
                delta = float((members.float() - base).abs().max() / scale)
                probs = bnn.predictor(seed=1)(batch).probs
            verdict = ("NAN" if not torch.isfinite(probs).all() else
                       "DIFF" if not delta <= TOLERANCE else "OK  ")
            line = f"{verdict} {name} {family} Δ={delta:.2e}"
            if export:  # the family's default spread, exported and read back (verify)
                line += _export(model, family, batch)
            lines.append(line)
        except Exception as err:  # noqa: BLE001 - a line says what failed
            lines.append(f"ERR  {name} {family} {type(err).__name__}: "
                         f"{str(err)[:240]}".replace("\n", " "))
    lines.append(f"DONE {name} {time.time() - began:.1f} s")
    return lines


def _meta_models(kind: str):
    """``(name, model)`` for every timm model or HF classifier class, built on the meta
    device (what fails to build there is left out)."""
    if kind == "timm":
        import timm

        for name in timm.list_models():
            try:
                with torch.device("meta"):
                    yield name, timm.create_model(name, num_classes=10)
            except Exception:  # noqa: BLE001, S112 - a model that needs more than its name
                continue
        return
    import transformers as T
    from transformers.models.auto import modeling_auto as auto

    T.logging.set_verbosity_error()
    for mapping in (auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
                    auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
                    auto.MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES):
        for model_type, class_name in mapping.items():
            class_name = class_name[0] if isinstance(class_name, (list, tuple)) else class_name
            cls = getattr(T, class_name, None)
            try:
                with torch.device("meta"):
                    yield class_name, cls(T.AutoConfig.for_model(model_type))
            except Exception:  # noqa: BLE001, S112 - a class whose default config fails
                continue


def scan(kind: str) -> None:
    from collections import defaultdict

    from bayesify.core.weight_reads import source_weight_readers
    from bayesify.kit.weightspace import has_own_forward

    readers, own, count = defaultdict(set), defaultdict(set), 0
    for name, model in _meta_models(kind):
        count += 1
        for module in model.modules():
            for why in source_weight_readers(module).values():
                readers[why].add(name)
            if has_own_forward(module):
                own[f"{type(module).__module__}.{type(module).__qualname__}"].add(name)
    print(f"{count} {kind} models built on the meta device")
    for title, found in (("READS", readers), ("OWN FORWARD", own)):
        for why, names in sorted(found.items()):
            print(f"{title} {len(names)} models: {why} (e.g. {', '.join(sorted(names)[:3])})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="?", default="",
                        help="comma-separated timm model names or hf:NAME (hf_classes.build)")
    parser.add_argument("--timm-filter", help="every timm model name matching this pattern")
    parser.add_argument("--limit", type=int, default=0, help="at most this many of the filter")
    parser.add_argument("--skip", type=int, default=0, help="skip the filter's first N names")
    parser.add_argument("--size", type=int, default=64, help="input side in pixels (timm)")
    parser.add_argument("--families", default=",".join(IDENTITY),
                        help="comma-separated families (default: every one with an identity)")
    parser.add_argument("--export", action="store_true",
                        help="also export each family at its defaults to .pt2 and verify it")
    parser.add_argument("--scan", choices=["timm", "hf"],
                        help="list weight-reading parents and own-forward layers instead")
    args = parser.parse_args()
    if args.scan:
        scan(args.scan)
        return
    names = [n for n in args.names.split(",") if n]
    if args.timm_filter:
        import timm

        found = timm.list_models(args.timm_filter)[args.skip:]
        names += found[:args.limit] if args.limit else found
    for name in names:
        for line in check(name, args.size, args.families.split(","), args.export):
            print(line, flush=True)


if __name__ == "__main__":
    main()
