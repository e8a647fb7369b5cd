"""Acquisition scores, top-k / BatchBALD selection, and a smoke run of the AL example."""

from __future__ import annotations

import importlib.util
import itertools
import math
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bayesify import acquisition
from bayesify.errors import BayesifyError
from bayesify.predict import ModelPredictor

ROOT = Path(__file__).resolve().parents[1]


def _entropy(p: list[float]) -> float:
    return -sum(v * math.log(v) for v in p if v > 0)


def test_scores_match_hand_computed_values() -> None:
    p1, p2 = [0.7, 0.2, 0.1], [0.1, 0.6, 0.3]
    probs = torch.tensor([
        [p1, [1 / 3] * 3, [0.5, 0.5, 0.0]],
        [p2, [1 / 3] * 3, [0.5, 0.0, 0.5]],
    ])  # [M=2, N=3, C=3]
    mean = [(a + b) / 2 for a, b in zip(p1, p2)]  # [0.4, 0.4, 0.2]
    h_mean = _entropy(mean)
    expected_mi = h_mean - (_entropy(p1) + _entropy(p2)) / 2
    # point 2: mean [0.5, 0.25, 0.25], each member has entropy log 2
    h2 = _entropy([0.5, 0.25, 0.25])
    torch.testing.assert_close(
        acquisition.max_entropy(probs), torch.tensor([h_mean, math.log(3), h2]))
    torch.testing.assert_close(
        acquisition.bald(probs), torch.tensor([expected_mi, 0.0, h2 - math.log(2)]),
        atol=1e-6, rtol=1e-5)
    # argmaxes: point 0 votes {0, 1} -> 1 - 1/2; point 1 ties at class 0 twice -> 0;
    # point 2 votes {0, 0} -> 0
    torch.testing.assert_close(acquisition.variation_ratio(probs), torch.tensor([0.5, 0.0, 0.0]))
    # population std of two values a, b is |a - b| / 2
    std0 = sum(abs(a - b) / 2 for a, b in zip(p1, p2)) / 3
    std2 = (0 + 0.25 + 0.25) / 3
    torch.testing.assert_close(acquisition.mean_std(probs), torch.tensor([std0, 0.0, std2]))


def test_random_score_is_seeded_and_uniform() -> None:
    probs = torch.full((3, 50, 4), 0.25)
    a = acquisition.random(probs, generator=torch.Generator().manual_seed(3))
    b = acquisition.random(probs, generator=torch.Generator().manual_seed(3))
    assert a.shape == (50,) and torch.equal(a, b)
    assert ((a >= 0) & (a < 1)).all() and a.unique().numel() == 50


def test_bald_zero_when_members_agree_and_log_c_for_confident_disagreement() -> None:
    torch.manual_seed(0)
    shared = torch.randn(7, 5).softmax(-1)
    agree = shared.expand(6, 7, 5)
    torch.testing.assert_close(acquisition.bald(agree), torch.zeros(7), atol=1e-6, rtol=0)
    # M = 2C members, each one-hot on a distinct class, every class covered twice
    c = 4
    onehot = torch.eye(c).repeat(2, 1).unsqueeze(1)  # [M=8, N=1, C=4]
    torch.testing.assert_close(acquisition.bald(onehot), torch.tensor([math.log(c)]))
    assert acquisition.bald(onehot) >= acquisition.bald(torch.randn(8, 100, c).softmax(-1)).max()
    # a single member (MAP) has no epistemic spread: BALD, variation ratio, mean std all 0
    single = torch.randn(1, 9, c).softmax(-1)
    for score in (acquisition.bald, acquisition.variation_ratio, acquisition.mean_std):
        assert torch.count_nonzero(score(single)) == 0


class _LookupNet(nn.Module):
    """Maps an index input ``[B, 1]`` to fixed logits ``[B, C]`` (one member of a test pool)."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("table", logits)
        self.dummy = nn.Linear(1, 1)  # gives the predictor a device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table[x[:, 0].long()]


def _pool_predictor(member_probs: torch.Tensor) -> tuple[ModelPredictor, DataLoader]:
    nets = [_LookupNet(p.clamp_min(1e-12).log()) for p in member_probs]
    n = member_probs.shape[1]
    loader = DataLoader(TensorDataset(torch.arange(n).float().unsqueeze(1)), batch_size=4)
    return ModelPredictor(nets), loader


def test_select_returns_top_k_of_the_score() -> None:
    torch.manual_seed(1)
    probs = (3 * torch.randn(5, 11, 3)).softmax(-1)
    predictor, loader = _pool_predictor(probs)
    for name in ("bald", "max_entropy", "mean_std"):
        chosen = acquisition.select(predictor, loader, 4, score=name)
        scores = acquisition.SCORES[name](probs)
        assert chosen.tolist() == scores.argsort(descending=True)[:4].tolist()
    chosen = acquisition.select(predictor, loader, 11, score="random",
                                generator=torch.Generator().manual_seed(0))
    assert sorted(chosen.tolist()) == list(range(11))
    # a callable score works too
    chosen = acquisition.select(predictor, loader, 2, score=lambda p: -p[0, :, 0])
    assert chosen.tolist() == probs[0, :, 0].argsort()[:2].tolist()


def _duplicates_pool() -> torch.Tensor:
    """4 members, 2 classes. Point 0 splits members {0,1} vs {2,3}; points 1, 2 are copies
    of it; point 3 splits {0,2} vs {1,3} slightly less confidently; point 4 is agreed on."""
    a, b, e = [0.999, 0.001], [0.001, 0.999], 0.95
    split_a = [a, a, b, b]
    split_b = [[e, 1 - e], [1 - e, e], [e, 1 - e], [1 - e, e]]
    agree = [[0.5, 0.5]] * 4
    return torch.tensor([split_a, split_a, split_a, split_b, agree]).transpose(0, 1)


def test_batch_aware_selection_skips_duplicates() -> None:
    probs = _duplicates_pool()
    bald = acquisition.bald(probs)
    assert bald[3] < bald[0]  # the distinct point ranks below the duplicated one
    predictor, loader = _pool_predictor(probs)
    assert acquisition.select(predictor, loader, 2, score="bald").tolist() == [0, 1]
    chosen = acquisition.select(predictor, loader, 2, score="bald", batch_aware=True)
    assert chosen.tolist() == [0, 3]


def _brute_force_mi(probs: torch.Tensor, idx: list[int]) -> float:
    """I(y_idx; w) by enumerating every joint label configuration."""
    m, _, c = probs.shape
    joint_entropy = 0.0
    for labels in itertools.product(range(c), repeat=len(idx)):
        per_member = torch.ones(m, dtype=torch.float64)
        for i, y in zip(idx, labels):
            per_member = per_member * probs[:, i, y]
        p = per_member.mean().item()
        joint_entropy -= p * math.log(p)
    cond = sum(acquisition.metrics.expected_entropy(probs[:, [i]]).item() for i in idx)
    return joint_entropy - cond


@pytest.mark.parametrize("max_configs", [1000, 1])  # exhaustive, then sampled after step 1
def test_batch_bald_matches_brute_force_greedy(max_configs: int) -> None:
    torch.manual_seed(0)
    probs = (2 * torch.randn(6, 10, 3)).softmax(-1).double()
    greedy: list[int] = []
    for _ in range(4):
        rest = [i for i in range(10) if i not in greedy]
        greedy.append(max(rest, key=lambda i: _brute_force_mi(probs, greedy + [i])))
    chosen = acquisition.batch_bald(probs, 4, max_configs=max_configs, num_samples=20000,
                                    generator=torch.Generator().manual_seed(0))
    assert chosen.tolist() == greedy
    assert len(set(chosen.tolist())) == 4


def test_batch_bald_first_pick_is_top_bald_and_errors() -> None:
    probs = (2 * torch.randn(5, 30, 4)).softmax(-1)
    assert acquisition.batch_bald(probs, 1).item() == acquisition.bald(probs).argmax().item()
    predictor, loader = _pool_predictor(probs)
    with pytest.raises(BayesifyError, match="score='bald'"):
        acquisition.select(predictor, loader, 2, score="max_entropy", batch_aware=True)
    with pytest.raises(BayesifyError, match="k must be"):
        acquisition.select(predictor, loader, 31)
    with pytest.raises(BayesifyError, match="unknown acquisition score"):
        acquisition.select(predictor, loader, 2, score="entropyy")
    with pytest.raises(BayesifyError, match=r"\[M, N, C\]"):
        acquisition.bald(probs[0])


def _load_example():
    path = ROOT / "examples" / "active_learning.py"
    spec = importlib.util.spec_from_file_location("active_learning_example", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses need the module registered
    spec.loader.exec_module(module)
    return module


def test_active_learning_example_smoke(tmp_path: Path) -> None:
    example = _load_example()
    start = time.process_time()  # CPU time: the shared test machine's wall clock is noisy
    out = tmp_path / "al.png"
    results = example.main(["--quick", "--rounds", "1", "--strategies", "random", "ibnn-bald",
                            "--out", str(out), "--json", str(tmp_path / "al.json")])
    assert time.process_time() - start < 15
    assert results["labels"] == [20, 30]
    assert set(results["curves"]) == {"map-random", "ibnn-random", "ibnn-bald"}
    for runs in results["curves"].values():
        assert len(runs) == 1 and len(runs[0]) == 2
        assert all(0.0 <= acc <= 1.0 for acc in runs[0])
    assert out.stat().st_size > 0
    merged = example.load_results([str(tmp_path / "al.json")])
    assert merged["curves"] == results["curves"]
    # the labelled set grows by exactly `acquire` distinct pool points per round
    labelled: list[int] = []
    splits = example.load_digits_splits(seed=0, all_classes=True)
    example.run_strategy("ibnn-batchbald", splits=splits, settings=example.QUICK, seed=1,
                         labelled_out=labelled)
    assert len(labelled) == len(set(labelled)) == 20 + 10 * example.QUICK.rounds
    counts = torch.bincount(splits.train.tensors[1][torch.tensor(labelled[:20])], minlength=10)
    assert counts.tolist() == [2] * 10  # balanced, seeded start
