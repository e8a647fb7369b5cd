"""The knob search's robustness signal: perturbations, their calibrated strength, the joint rule.

* every perturbation against its formula (noise scaled by the batch std, mask = positional
  mean, mix = convex combination with the permuted batch), level 0 the identity;
* token inputs: masks, type ids and the first token untouched, padding never changed;
* ``calibrate_shift`` picks, per kind, the smallest ladder level at which the start's
  accuracy falls to half-way between chance and its clean accuracy (brute force);
* ``choose_joint`` against a brute force of its rule.
"""

from __future__ import annotations

import math

import pytest
import torch

from bayesify.core.batch import Batch
from bayesify.core.selection import choose_joint, favourable_examples, feasible
from bayesify.train.shift import LADDERS, ShiftSignal, calibrate_shift, perturb


def _batch(x: torch.Tensor, y: torch.Tensor | None = None, **kwargs) -> Batch:
    return Batch((x,) if x is not None else (), kwargs, y)


def test_level_zero_is_the_identity_and_labels_are_kept():
    b = _batch(torch.randn(6, 3), torch.arange(6))
    for kind in LADDERS:
        assert perturb(b, kind, 0.0, seed=1) is b
        shifted = perturb(b, kind, 0.5, seed=1)
        assert torch.equal(shifted.labels, b.labels)
        assert not torch.equal(shifted.args[0], b.args[0])


def test_float_perturbations_follow_their_formulas():
    torch.manual_seed(0)
    x = torch.randn(8, 5) * 3 + 1
    b = _batch(x)
    noisy = perturb(b, "noise", 2.0, seed=3).args[0]
    g = torch.Generator().manual_seed(3)
    torch.randperm(8, generator=g)  # the permutation is drawn first
    eps = torch.randn(x.shape, generator=g)
    torch.testing.assert_close(noisy, x + 2.0 * x.std() * eps)

    masked = perturb(b, "mask", 0.5, seed=4).args[0]
    changed = masked != x
    assert 0 < changed.float().mean() < 1
    mean = x.mean(0, keepdim=True).expand_as(x)
    torch.testing.assert_close(masked[changed], mean[changed])

    mixed = perturb(b, "mix", 0.25, seed=5).args[0]
    perm = torch.randperm(8, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(mixed, 0.75 * x + 0.25 * x[perm])


def test_tokens_are_replaced_but_structure_and_padding_are_not():
    torch.manual_seed(0)
    ids = torch.randint(5, 1000, (6, 12))
    mask = torch.ones(6, 12, dtype=torch.long)
    mask[:, 9:] = 0  # padding
    types = torch.zeros(6, 12, dtype=torch.long)
    b = Batch((), {"input_ids": ids, "attention_mask": mask, "token_type_ids": types},
              torch.arange(6))
    assert torch.equal(perturb(b, "noise", 8.0, seed=0).kwargs["input_ids"], ids)
    out = perturb(b, "mask", 0.9, seed=0).kwargs
    assert torch.equal(out["attention_mask"], mask) and torch.equal(out["token_type_ids"], types)
    new = out["input_ids"]
    assert torch.equal(new[:, 0], ids[:, 0])          # the [CLS]-like first token
    assert torch.equal(new[:, 9:], ids[:, 9:])        # padding positions
    assert (new[:, 1:9] != ids[:, 1:9]).float().mean() > 0.5


def test_tokens_keep_every_rows_first_and_last_attended_token_and_take_none_of_them():
    """``<s> … <eos>`` of every length (right and left padding): the edges stay, no edge token
    moves into another row, so every row keeps exactly one ``<eos>`` — BART's and T5's
    classifiers pool its state and refuse a batch whose rows hold different numbers of it
    ("All examples must have the same number of <eos> tokens": every family's validation
    search failed on them before)."""
    g = torch.Generator().manual_seed(1)
    bos, eos, rows, length = 3, 2, 16, 14
    ids = torch.randint(5, 1000, (rows, length), generator=g)
    lens = torch.randint(4, length + 1, (rows,), generator=g)
    positions = torch.arange(length)
    for left in (False, True):
        mask = (positions[None] < lens[:, None]) if not left else (
            positions[None] >= length - lens[:, None])
        first = torch.where(mask, positions, length).amin(1)
        last = torch.where(mask, positions, -1).amax(1)
        x = torch.where(mask, ids, torch.zeros_like(ids))
        x[torch.arange(rows), first], x[torch.arange(rows), last] = bos, eos
        b = Batch((), {"input_ids": x, "attention_mask": mask.long()}, torch.arange(rows))
        for kind in ("mask", "mix"):
            new = perturb(b, kind, 0.9, seed=0).kwargs["input_ids"]
            assert torch.equal((new == eos).sum(1), torch.ones(rows, dtype=torch.long))
            assert torch.equal((new == bos).sum(1), torch.ones(rows, dtype=torch.long))
            assert torch.equal(new[~mask], x[~mask])  # padding
            assert (new[mask] != x[mask]).float().mean() > 0.4  # the content moved


def test_signal_copies_are_reproducible_per_batch_position():
    b = _batch(torch.randn(4, 3))
    signal = ShiftSignal({"noise": 1.0, "mix": 0.5}, seed=7)
    first, again = signal.copies(b, 2), signal.copies(b, 2)
    assert len(first) == 2
    for a, c in zip(first, again):
        assert torch.equal(a.args[0], c.args[0])
    assert not torch.equal(signal.copies(b, 3)[0].args[0], first[0].args[0])


def test_calibrated_strength_is_the_smallest_level_reaching_the_target():
    torch.manual_seed(0)
    classes, n = 4, 256
    y = torch.randint(0, classes, (n,))
    x = torch.nn.functional.one_hot(y, classes).float() * 3.0 + 0.3 * torch.randn(n, classes)
    batches = [_batch(x[i:i + 32], y[i:i + 32]) for i in range(0, n, 32)]

    def logits(b: Batch) -> torch.Tensor:
        return b.args[0]

    signal = calibrate_shift(logits, lambda: iter(batches), seed=11)

    def accuracy(kind: str, level: float) -> float:
        hits = sum(float((perturb(b, kind, level, seed=11 + 1009 * i).args[0].argmax(-1)
                          == b.labels).sum()) for i, b in enumerate(batches))
        return hits / n

    clean = float((x.argmax(-1) == y).float().mean())
    target = 1 / classes + 0.5 * (clean - 1 / classes)
    for kind, ladder in LADDERS.items():
        expected = next((lv for lv in ladder if accuracy(kind, lv) <= target), ladder[-1])
        assert signal.levels[kind] == expected, (kind, signal.levels)
    assert signal.levels["noise"] > LADDERS["noise"][0]  # the check is not trivially the first


def _brute_force(clean, shifted, reference, grid, prefer, favourable=0):
    values, temps, n = clean.shape
    feasible = {}
    for v in range(values):
        for t in range(temps):
            d = clean[v, t] - reference
            se = float(d.std() / math.sqrt(n))
            feasible[v, t] = float(d.mean()) <= min(se, 0.005 - 1.5 * se)
            rest = sorted(d.tolist())[favourable:]  # without the k most favourable examples
            feasible[v, t] &= sum(rest) / len(rest) <= 0.005
    pool = [k for k, ok in feasible.items() if ok]
    if not pool:
        flat = int(clean.mean(-1).argmin())
        return flat // temps, flat % temps
    best = min(float(shifted[v, t].mean()) for v, t in pool)
    ties = [(v, t) for v, t in pool if float(shifted[v, t].mean()) <= best + 1e-9]
    v = (max if prefer == "largest" else min)(ties, key=lambda k: grid[k[0]])[0]
    t = min((k for k in ties if k[0] == v), key=lambda k: float(shifted[k].mean()))[1]
    return v, t


@pytest.mark.parametrize("seed", range(6))
def test_choose_joint_matches_a_brute_force_of_its_rule(seed):
    g = torch.Generator().manual_seed(seed)
    values, temps, n = 5, 3, 40
    reference = torch.rand(n, generator=g, dtype=torch.float64)
    clean = reference + 0.01 * torch.randn(values, temps, n, generator=g, dtype=torch.float64) \
        + 0.004 * (torch.arange(values, dtype=torch.float64).view(-1, 1, 1) - 1)
    shifted = torch.rand(values, temps, n, generator=g, dtype=torch.float64) * 2
    grid = [0.0, 0.25, 0.5, 1.0, 2.0]
    got = choose_joint(clean, shifted, reference, prefer="largest", grid=grid)
    assert got == _brute_force(clean, shifted, reference, grid, "largest")
    heavy = clean.clone()
    heavy[:, :, :3] -= 0.3 * torch.arange(values, dtype=torch.float64).view(-1, 1, 1)
    for k in (0, 2, 4):
        got = choose_joint(heavy, shifted, reference, prefer="largest", grid=grid, favourable=k)
        assert got == _brute_force(heavy, shifted, reference, grid, "largest", favourable=k)


def test_favourable_examples_is_one_binomial_sd_of_the_start_errors():
    assert favourable_examples(300, 34 / 300) == 6  # √(300 · 0.113 · 0.887) = 5.49
    assert favourable_examples(217, 9 / 217) == 3  # √8.63 = 2.94
    assert favourable_examples(100, 0.5) == 5
    assert favourable_examples(300, 0.0) == 0 and favourable_examples(0, 0.2) == 0


def test_a_clean_gain_resting_on_a_few_examples_is_not_feasible():
    """The held-out token transformer of the stress matrix (seed 0): Laplace's chosen
    predictive was 0.026 nats below the calibrated start on 300 validation examples (1.4 SE)
    and 0.007 above it on 400 test examples — the whole gain was five confidently wrong
    examples (without them +0.0045), on a split with 11 % errors where the test split had
    7.5 %. A candidate whose gain survives losing its k most favourable examples stays
    feasible; one whose gain is those examples does not."""
    n, k = 300, 6
    reference = torch.full((n,), 0.4, dtype=torch.float64)
    spread = torch.linspace(-0.01, 0.01, n, dtype=torch.float64)
    few = reference + 0.02 + spread  # +0.02 on most examples ...
    few[:k] -= 2.0  # ... and 2 nats better on six: mean −0.02
    many = reference - 0.01 + spread  # 0.01 better nearly everywhere
    clean = torch.stack([many, few]).unsqueeze(1)  # [V=2, T=1, n]; value 1 the broader
    shifted = torch.tensor([2.0, 1.0], dtype=torch.float64).view(2, 1, 1).expand(2, 1, n)
    assert float((few - reference).mean()) < -0.01
    assert choose_joint(clean, shifted, reference, grid=[0, 1]) == (1, 0)
    assert choose_joint(clean, shifted, reference, grid=[0, 1], favourable=k) == (0, 0)
    assert feasible(clean, reference, favourable=k).tolist() == [[True], [False]]


def test_choose_joint_gives_up_at_most_0_005_nats_of_clean_nll():
    """Feasible: within one paired SE of the start, and at most 0.005 nats of clean cost
    even 1.5 SE above its mean. A noisy split (SE 0.03) vouches for no candidate that is
    worse on clean data, however much better it is under shift; a quieter one (SE 0.002)
    admits 0.001 worse, never 0.004 (more than one SE) or 0.02; at SE 0.003 not even 0.001
    (0.001 + 1.5 · 0.003 > 0.005, where one SE would have admitted it)."""
    g = torch.Generator().manual_seed(0)
    n = 200
    reference = torch.rand(n, generator=g, dtype=torch.float64)
    noise = torch.randn(n, generator=g, dtype=torch.float64)
    noise = (noise - noise.mean()) / noise.std() * math.sqrt(n)  # SE exactly 1
    shifted = torch.tensor([4.0, 3.0, 2.0, 1.0],
                           dtype=torch.float64).view(4, 1, 1).expand(4, 1, n)
    for se, chosen in [(0.03, 0), (0.002, 1), (0.003, 0)]:
        clean = torch.stack([reference, reference + 0.001 + se * noise,
                             reference + 0.004 + se * noise,
                             reference + 0.02 + se * noise]).unsqueeze(1)  # [V=4, T=1, n]
        assert choose_joint(clean, shifted, reference, grid=[0, 1, 2, 3]) == (chosen, 0)


def test_choose_joint_admits_only_the_values_it_is_told():
    reference = torch.zeros(10, dtype=torch.float64)
    clean = torch.zeros(3, 1, 10, dtype=torch.float64)
    shifted = torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64).view(3, 1, 1).expand(3, 1, 10)
    assert choose_joint(clean, shifted, reference, grid=[0, 1, 2]) == (2, 0)
    admissible = torch.tensor([True, True, False])
    assert choose_joint(clean, shifted, reference, grid=[0, 1, 2], admissible=admissible) == (1, 0)


def test_choose_joint_falls_back_to_the_lowest_clean_nll_when_nothing_is_feasible():
    reference = torch.zeros(10, dtype=torch.float64)
    clean = torch.ones(3, 2, 10, dtype=torch.float64) + torch.tensor([[0.5, 0.2], [0.1, 0.9],
                                                                       [0.3, 0.4]]).unsqueeze(-1)
    shifted = torch.zeros(3, 2, 10, dtype=torch.float64)
    assert choose_joint(clean, shifted, reference, grid=[0, 1, 2]) == (1, 0)


def test_a_sharpening_family_sharpens_only_the_values_that_need_it():
    """Laplace may go below the network's own floor only for knob values no temperature at
    or above it makes feasible (a broad posterior brought back to the start's clean NLL);
    a value feasible unsharpened keeps T ≥ floor."""
    from bayesify.train.tuning import _sharpen_only_if_needed

    n = 50
    reference = torch.full((n,), 0.2, dtype=torch.float64)
    # two values × temperatures [0.1, 0.5, 1.0]; the floor is 1 (0.1 and 0.5 below it)
    clean = torch.tensor([[0.25, 0.2, 0.2],     # narrow: feasible at T = 1 already
                          [0.2, 0.3, 0.6]],     # broad: feasible only sharpened
                         dtype=torch.float64).unsqueeze(-1).expand(2, 3, n)
    admissible = torch.ones(2, 3, dtype=torch.bool)
    got = _sharpen_only_if_needed(clean, reference, admissible, [True, True, False])
    assert got.tolist() == [[False, False, True], [True, True, True]]
    shifted = torch.tensor([[1.0, 1.0, 3.0], [2.0, 2.5, 2.5]],
                           dtype=torch.float64).unsqueeze(-1).expand(2, 3, n)
    # without the rule the narrow value's sharpened column (shift 1.0) would win
    assert choose_joint(clean, shifted, reference, grid=[10.0, 0.1], prefer="smallest") == (0, 1)
    assert choose_joint(clean, shifted, reference, grid=[10.0, 0.1], prefer="smallest",
                        admissible=got) == (1, 0)


@pytest.mark.parametrize("family, walks", [("dropout", False), ("ibnn", True),
                                           pytest.param("mnf", True, marks=pytest.mark.slow)])
def test_the_search_skips_only_passes_the_choice_cannot_read(digits, digits_map, family, walks,
                                                             monkeypatch):
    """A value no temperature makes feasible on the clean split is never chosen by its shifted
    NLL, so the search skips its shifted pass; and the walk coarse to fine (a knob that walks:
    not dropout's) scores every other value, then the neighbours of its choice and of the
    feasibility edge: the same choice, temperature and validation NLLs as scoring every
    value on both splits, the skipped values' entries ``None``."""
    import copy
    import math

    from torch.utils.data import DataLoader

    import bayesify
    from bayesify.train import best, tuning

    x, y = digits.val.tensors
    val = DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64)
    x, y = digits.train.tensors
    train = DataLoader(torch.utils.data.TensorDataset(x[:128], y[:128]), batch_size=32)

    def searched(every: bool) -> dict:
        # the family's own search stays in the record (not the start with heads, searched
        # with its knob fixed)
        monkeypatch.setattr(best, "START_SHIFT_SE", math.inf)
        if every:  # the skip's own test passes every value, and the walk scores every value
            monkeypatch.setattr(tuning._KnobWalk, "could_be_chosen", lambda self, c, e: True)
            monkeypatch.setattr(tuning, "COARSE_TO_FINE", False)
        torch.manual_seed(0)
        bnn = bayesify.bayesify(copy.deepcopy(digits_map), family)
        record = bayesify.fit(bnn, train, val_loader=val, epochs=1, progress=False, seed=0).last
        monkeypatch.undo()
        return record

    skipping, scoring = searched(False), searched(True)
    knob = next(k[:-len("_shift_nll")] for k in skipping if k.endswith("_shift_nll"))
    if walks:
        assert None in skipping[f"{knob}_val_nll"], "the walk scored every value: it tests nothing"
    else:
        assert None not in skipping[f"{knob}_val_nll"]
        assert any(c is not None and s is None for c, s in zip(
            skipping[f"{knob}_val_nll"], skipping[f"{knob}_shift_nll"])), \
            "no scored value's shifted pass was skipped: the test tests nothing"
    assert None not in scoring[f"{knob}_shift_nll"] and None not in scoring[f"{knob}_val_nll"]
    for key in (knob, "temperature", "val_nll", "val_shift_nll"):
        assert skipping[key] == scoring[key], key
    for curve in ("_val_nll", "_shift_nll"):
        for mine, every in zip(skipping[knob + curve], scoring[knob + curve], strict=True):
            assert mine is None or mine == every


def _walk_scores(monkeypatch, clean_at, shift_at, values, walk=True):
    """Run :class:`bayesify.train.tuning._KnobWalk` on synthetic per-value scores
    (``clean_at[i]``, ``shift_at[i]``: every example's NLL at T = 1, higher at every other
    temperature); returns (chosen index, indices scored)."""
    from contextlib import nullcontext

    from bayesify.core.fitting import Knob
    from bayesify.train import tuning

    temps = tuning.TEMPERATURES
    one = temps.index(1.0)
    current = [values[0]]
    n = 40

    def rows(level: float) -> torch.Tensor:
        nll = torch.full((len(temps), n), float(level), dtype=torch.float64)
        nll += torch.tensor([0.0 if i == one else 0.3 for i in range(len(temps))],
                            dtype=torch.float64).unsqueeze(1)
        return torch.cat([nll, torch.zeros(1, n, dtype=torch.float64)])

    def fake_candidate(bnn, batches, ctx, shift, shift_batches, *, clean=True,
                       samples_per_component=None):
        i = values.index(current[0])
        return (rows(clean_at[i]) if clean else None), rows(shift_at[i])

    monkeypatch.setattr(tuning, "candidate_nll", fake_candidate)
    knob = Knob(name="k", grid=tuple(values), meaning="m",
                set=lambda v: current.__setitem__(0, v), walk=walk)
    bar = nullcontext()
    bar.update = lambda k: None  # type: ignore[attr-defined]
    walk = tuning._KnobWalk(None, knob, list(values), None, None, None, lambda: iter(()),
                            reference=torch.full((n,), 0.1, dtype=torch.float64),
                            error_cap=1.0, columns=list(range(len(temps))),
                            below=[False] * len(temps), bar=bar)
    v, _ = walk.run()
    return v, sorted(walk.clean)


@pytest.mark.parametrize("case", ["valley", "edge after a flat stretch", "none feasible",
                                  "narrow end"])
def test_the_coarse_to_fine_walk_finds_the_exhaustive_choice(monkeypatch, case):
    """Synthetic curves over the 8-value spread grid: an interior valley, the lowest shifted
    NLL at the feasibility edge after a flat stretch (SWAG's shape), nothing feasible (the
    lowest clean NLL), the narrow end best: the walk chooses what scoring every value
    chooses, and scores fewer than all."""
    from bayesify.train import tuning

    values = [0.0, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0]
    ok, bad = 0.1, 0.6
    clean_at, shift_at = {
        "valley": ([ok] * 8, [2.0, 1.9, 1.8, 1.7, 1.75, 1.8, 1.9, 2.0]),
        "edge after a flat stretch": ([ok] * 5 + [bad] * 3,
                                      [2.0, 2.01, 2.0, 2.02, 1.8, 1.0, 0.9, 0.8]),
        "none feasible": ([0.7, 0.65, 0.62, 0.61, 0.6, 0.63, 0.7, 0.8], [1.0] * 8),
        "narrow end": ([ok] * 8, [1.0, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8]),
    }[case]
    expected = {"valley": 3, "edge after a flat stretch": 4, "none feasible": 4,
                "narrow end": 0}[case]
    chosen, scored = _walk_scores(monkeypatch, clean_at, shift_at, values)
    monkeypatch.setattr(tuning, "COARSE_TO_FINE", False)
    every, all_scored = _walk_scores(monkeypatch, clean_at, shift_at, values)
    assert all_scored == list(range(8)) and every == expected
    assert chosen == expected, (case, chosen, scored)
    assert len(scored) < 8, scored


def test_a_knob_that_does_not_walk_scores_every_value(monkeypatch):
    """Dropout's jagged curve (ViT protocol, seed 2: only ×0.5 beats the start, between two
    values that do not): a walk misses it; ``walk=False`` scores every
    value and finds it."""
    values = [0.0, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0]
    clean_at = [0.1, 0.6, 0.6, 0.1, 0.6, 0.6, 0.6, 0.6]
    shift_at = [2.0, 1.0, 1.0, 1.5, 1.0, 1.0, 1.0, 1.0]
    walked, scored = _walk_scores(monkeypatch, clean_at, shift_at, values)
    assert walked == 0 and 3 not in scored
    every, scored = _walk_scores(monkeypatch, clean_at, shift_at, values, walk=False)
    assert every == 3 and scored == list(range(8))


SPREAD_KNOB_FAMILIES = ["abnn", "dropout", "epinet", "hypernet", "ibnn", "meanfield", "mnf",
                        "rank1"]


@pytest.mark.parametrize("family", SPREAD_KNOB_FAMILIES)
def test_a_spread_knob_at_zero_predicts_the_same_with_one_sample(digits, digits_map, family):
    """The search scores a spread knob's 0 with one sample per component
    (``Knob.one_sample_at``): at 0 every sample of a component must be the same network, so
    the predictive equals the default S samples' to rounding — and at 1 it does not (the
    comparison sees the spread)."""
    import copy

    import bayesify

    torch.manual_seed(0)
    bnn = bayesify.bayesify(copy.deepcopy(digits_map), family)
    knob, = bnn.method.knobs(bnn)
    assert knob.one_sample_at == 0.0 and 0.0 in knob.grid
    x = digits.val.tensors[0][:64]
    bnn.eval()

    def log_probs(samples: int | None) -> torch.Tensor:
        return bnn.predictor(samples, temperature=1.0).predict(x).raw_log_probs

    default = bnn.posterior_config.default_samples()
    assert default > 1
    knob.set(1.0)
    assert (log_probs(None) - log_probs(1)).abs().max() > 1e-4, "no spread at 1: tests nothing"
    knob.set(0.0)
    torch.testing.assert_close(log_probs(1), log_probs(None), rtol=0, atol=2e-6)


def test_the_walk_scores_a_spread_knob_at_zero_with_one_sample(monkeypatch):
    """Every pass of the value 0 — clean and shifted — asks for one sample per component;
    every other value for the predictor's default."""
    from bayesify.core.fitting import Knob
    from bayesify.train import tuning

    values = [0.0, 0.5, 1.0]
    current, asked = [1.0], []
    n, temps = 20, tuning.TEMPERATURES

    def fake_candidate(bnn, batches, ctx, shift, shift_batches, *, clean=True,
                       samples_per_component=None):
        asked.append((current[0], clean, samples_per_component))
        rows = torch.full((len(temps) + 1, n), 0.1, dtype=torch.float64)
        rows[-1] = 0.0
        return (rows if clean else None), rows.clone()

    monkeypatch.setattr(tuning, "candidate_nll", fake_candidate)
    knob = Knob(name="k", grid=tuple(values), meaning="m", one_sample_at=0.0,
                set=lambda v: current.__setitem__(0, v))
    bar = type("Bar", (), {"update": lambda self, k: None})()
    walk = tuning._KnobWalk(None, knob, list(values), None, None, None, lambda: iter(()),
                            reference=torch.full((n,), 0.1, dtype=torch.float64),
                            error_cap=1.0, columns=list(range(len(temps))),
                            below=[False] * len(temps), bar=bar)
    walk.run()
    assert {(v, c) for v, c, _ in asked} == {(v, c) for v in values for c in (True, False)}
    for value, _, samples in asked:
        assert samples == (1 if value == 0.0 else None), (value, samples)


def test_a_batchs_copies_follow_its_position_in_the_split():
    """Under DDP a rank's batches are drawn from their position in the whole split
    (``first_index``: the batches of the ranks before it), so shards of whole batches see
    the copies one process would (the search then chooses what one process would:
    ``tests/test_one_loop.py``, the ensemble's heads on 2 ranks)."""
    from dataclasses import replace

    batch = Batch((torch.randn(8, 3, 4, 4),), {}, torch.zeros(8, dtype=torch.long))
    one = ShiftSignal({"noise": 0.5, "mix": 0.5}, seed=3)
    ranked = replace(one, first_index=2)
    for got, want in zip(ranked.copies(batch, 1), one.copies(batch, 3), strict=True):
        assert torch.equal(got.args[0], want.args[0])
    assert not torch.equal(one.copies(batch, 1)[0].args[0], one.copies(batch, 3)[0].args[0])
