"""Assemble benchmarks/RESULTS.md, organised by capability, from benchmarks/results/*.md.

Each benchmark script writes its own fragment (command, machine, date, figures) under
``benchmarks/results/``; this file says which part of which fragment answers which
question (quality, speed, scale, export, persistence) and which command regenerates
it, and stamps every part with the commit and date its fragment was last written::

    python benchmarks/collect_results.py

A part is a whole fragment (its title dropped), one ``## `` section of it, or one
``**bold**``-headed paragraph group of it. Nothing is re-measured here.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).parent
RESULTS = HERE / "results"


@dataclass(frozen=True)
class Part:
    fragment: str  # file under benchmarks/results/
    title: str  # heading in RESULTS.md
    command: str  # what regenerates it
    section: str | None = None  # "## heading" / "**bold**" prefix inside the fragment; None: all


CAPABILITIES: list[tuple[str, str, list[Part]]] = [
    ("The first hour", ("What a newcomer waits for: the demo, the README's first example, the "
     "tests."), [
        Part("session29.md", "Three messages a user of the defaults should not get: a training "
             "NLL far above the start's where the predictive kept its accuracy, the heads' τ "
             "at its narrow end, pytest without pytest-xdist",
             "BAYESIFY_STRESS_SEED=1 pytest -m slow -n 0 tests/test_stress_pretrained.py::"
             "test_every_family_with_defaults_on_every_trap -k 'logits_x20 and (ibnn or epinet "
             "or abnn)' --log-cli-level=INFO; the tables as in the stress part",
             section="## 1. Messages"),
        Part("session28.md", "The tests on one worker process per core (pytest-xdist): 10 min "
             "50 s instead of 20 min 32 s on two cores",
             "time pytest -q; time pytest -q -n 0 --durations=0; time bash .ci/run",
             section="## 1. The test suite"),
        Part("first_hour.md", "bayesify demo, the first example and the tests: time and verdict",
             "OMP_NUM_THREADS=1 /usr/bin/time -v bayesify demo --no-progress"),
        Part("ibnn_per_network.md", "iBNN's default spread on a deep real network "
             "(EfficientNet-Lite0): per network, not per layer",
             "OMP_NUM_THREADS=1 PYTHONPATH=.:src python benchmarks/ibnn_per_network.py --fit"),
        Part("first_fit.md", "A default fit on a real network (EfficientNet-Lite0): its duration, "
             "said early", "OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/first_fit_lite0.py "
             "--train 300 --val 30"),
    ]),
    ("Quality", ("How good the posteriors are: NLL, calibration, shift and OOD against peers "
     "and the starting network."), [
        Part("issue13.md", "Defaults on a pretrained network, every family",
             "python benchmarks/defaults.py --seeds 0 1 2"),
        Part("issue21.md", "What the step budget and the shift-aware knob search bought, and "
             "why it is not more", "python benchmarks/quality.py --seeds 0 1 2 --jobs 2 "
             "--threads 1 (the figures); the text is written by hand"),
        Part("quality.md", "Every family's defaults under shift, against the starting network, "
             "a deep ensemble and other libraries (noisy-digits protocol, mnf included)",
             "python benchmarks/quality.py --seeds 0 1 2 --jobs 2 --threads 1"),
        Part("issue29.md", "One temperature on the predictive: Laplace's τ × T frontier, "
             "families before/after", "python benchmarks/temperature29.py --seeds 0 1 2; "
             "python benchmarks/quality.py --seeds 0 1 2 --methods laplace ibnn swag ensemble "
             "deep-ensemble-x5 laplace-torch (main and this change)"),
        Part("issue36_summary.md", "ABNN and the epinet against the start, a deep ensemble, "
             "laplace-torch and a feature-density baseline (issue 36)",
             "python benchmarks/quality.py --seeds 0 1 2 --jobs 2 --threads 1 --methods abnn "
             "epinet ibnn laplace-torch deep-ensemble-x5 ddu-density (issue36.md); --methods abnn "
             "(issue36_abnn_grid.md); python benchmarks/abnn_init.py; the text is written by hand"),
        Part("session38.md", "Layers whose parent computes with their weights (Swin V2, BEiT, "
             "EVA, DINOv3, WavLM) and quantisation-aware networks: another network or a crash "
             "for up to seven families; a silent-fault hunt over 86 timm architectures and 52 "
             "Hugging Face classes",
             "OMP_NUM_THREADS=1 python benchmarks/identity_hunt.py NAMES [--export]; python "
             "benchmarks/identity_hunt.py --scan timm|hf; python benchmarks/hf_classes.py "
             "squeezebert,...; EPOCHS=1 OMP_NUM_THREADS=1 python benchmarks/held_out_nets.py NET "
             "0 F.jsonl (before: PYTHONPATH=<worktree>/src); the text is written by hand"),
        Part("session37.md", "Layers with their own forward (weight-standardised and "
             "same-padded convolutions: BiT, NFNet, TensorFlow-ported EfficientNets) computed "
             "as another network by six families; ABNN on norm-activation layers; a crash hunt "
             "that reads accuracy",
             "OMP_NUM_THREADS=1 python benchmarks/hf_classes.py hf_bit,...; EPOCHS=1 "
             "OMP_NUM_THREADS=1 python benchmarks/held_out_nets.py NET 0 F.jsonl (NET: "
             "nf_regnet, tf_effnet and the timm kinds of TIMM_KINDS); python "
             "benchmarks/lite0_families.py --classes 10 --seed S --epochs default --families "
             "abnn (before: PYTHONPATH=<ed29f7c worktree>/src); the text is written by hand"),
        Part("session36.md", "Where a layer's input keeps the batch: sequence-first networks "
             "(XLNet, nn.TransformerEncoder batch_first=False) and shared tables (Swin V2's "
             "position-bias MLP); a crash hunt on 18 more kinds of network; unseen errors in "
             "every candidate's clean score, tried and not kept",
             "OMP_NUM_THREADS=1 python benchmarks/hf_classes.py wav2vec2,...,hf_clip; EPOCHS=1 "
             "OMP_NUM_THREADS=1 python benchmarks/held_out_nets.py NET 0 F.jsonl; "
             "BAYESIFY_BENCH_CACHE=cache python benchmarks/quality.py --protocol P --seeds 0 1 2 "
             "--methods laplace (with the branch tried/unseen-candidates); the text is written "
             "by hand"),
        Part("session35.md", "Every family's Laplace heads on decoder and distilled "
             "classifiers; faults of real model kinds (BART/T5 <eos> pooling, RMSNorm, "
             "torch.compile, gradient checkpointing, heads after a custom loop); "
             "EfficientNet-B0 seed 2's rank1 and swag",
             "EPOCHS=1 OMP_NUM_THREADS=1 python benchmarks/held_out_nets.py deit_distilled 0 F.jsonl "
             "(before: PYTHONPATH=<3c1ba0a worktree>/src); python benchmarks/hf_classes.py "
             "llama,bart,...; python benchmarks/held_out_nets.py effb0 2 F rank1,swag; the text is "
             "written by hand"),
        Part("session34.md", "Faults of model and run kinds no test had (distributed streams, "
             "NCCL counters, decoder and one-logit classifiers, DataParallel, FrozenBatchNorm2d, "
             "bf16 serving); a clean-budget rule tried and not kept, with why",
             "EPOCHS=1 OMP_NUM_THREADS=1 python benchmarks/held_out_nets.py NET SEED F.jsonl "
             "(before: PYTHONPATH=<9b66ca2 worktree>/src); python benchmarks/hf_classes.py gpt2; "
             "the text is written by hand"),
        Part("session33.md", "A crash hunt on model and loader kinds no test had (distilled "
             "heads, weight/spectral norm, log_softmax endings, streams, one-shot iterators); the "
             "real Lite0 with every family's default budget; EfficientNet-B0 at seed 2",
             "EPOCHS=1 OMP_NUM_THREADS=1 python benchmarks/held_out_nets.py NET 0 F.jsonl; python "
             "benchmarks/hf_classes.py bert,roberta,...; python benchmarks/lite0_families.py "
             "--epochs default ...; the text is written by hand"),
        Part("session32.md", "How far the families may sharpen an under-confident start: the "
             "temperature floor on 255 validation splits (label-smoothed networks among them; bar "
             "misses 86 → 27, worst 0.149 → 0.034 nats), every family before and after on five "
             "under-confident held-out networks",
             "BAYESIFY_BENCH_CACHE=cache OMP_NUM_THREADS=1 python benchmarks/under_confidence.py "
             "--nets NETS --logits kept; python benchmarks/under_confidence.py --rules kept; "
             "python benchmarks/held_out_nets.py {tied_ls,gru_text_ls,swin} 0 F [families] (before: "
             "c090b98); the text is written by hand"),
        Part("session31.md", "A crash hunt on nine architectures no stress network has, Hugging "
             "Face model classes and dtypes: four faults fixed (Laplace heads on a network whose "
             "last layer is not a Linear classifier, int32 labels, float64 and bfloat16 networks, "
             "HF ViT's weight.dtype); held-out ResNet-18 and ViT at seed 0 (24 cells, no miss)",
             "EPOCHS=1 OMP_NUM_THREADS=1 python benchmarks/held_out_nets.py NET 0 F (NET: gn_resnet "
             "frozen_bn_resnet squeezenet googlenet densenet gru_text conv1d tied swin); "
             "python benchmarks/held_out_nets.py {gru_text,conv1d,tied,resnet18,vit} 0 F; "
             "python benchmarks/hf_classes.py gpt2,distilbert,hf_vit,hf_resnet; the text is written "
             "by hand"),
        Part("session30.md", "Held-out ResNet-18 and ViT at seed 2 (24 cells, no miss); SWAG's "
             "stress column at seeds 0, 1 and 2, with and without validation (66 cells, no miss); "
             "EfficientNet-B0 at seed 1",
             "OMP_NUM_THREADS=1 python benchmarks/held_out_nets.py {resnet18,vit} 2 F; "
             "python benchmarks/held_out_nets.py effb0 1 F; "
             "BAYESIFY_STRESS_SEED=S BAYESIFY_STRESS_TEST=1 BAYESIFY_STRESS_TABLE=F pytest -m slow "
             "-n 2 --dist load tests/test_stress_pretrained.py::"
             "test_every_family_with_defaults_on_every_trap -k swag; "
             "python benchmarks/stress_table.py F"),
        Part("session29.md", "The stress matrix without validation at seeds 1 and 2 (187 cells); "
             "held-out architectures at seed 1",
             "BAYESIFY_STRESS_SEED=S BAYESIFY_STRESS_TEST=1 BAYESIFY_STRESS_TABLE=F pytest -m slow "
             "-n 2 --dist load tests/test_stress_pretrained.py::"
             "test_every_family_with_defaults_on_every_trap -k 'False and (...)'; "
             "python benchmarks/held_out_nets.py {resnet18,vit} 1 F; "
             "python benchmarks/stress_table.py F",
             section="## 2. The stress matrix"),
        Part("session28.md", "The stress matrix at this code: seed 1 group A and seed 2 group B "
             "with validation",
             "BAYESIFY_STRESS_SEED=S BAYESIFY_STRESS_TEST=1 BAYESIFY_STRESS_TABLE=F pytest -m slow "
             "-n 2 --dist load tests/test_stress_pretrained.py::"
             "test_every_family_with_defaults_on_every_trap -k 'True and (...)'; "
             "python benchmarks/stress_table.py F",
             section="## 2. The stress matrix"),
        Part("session27.md", "The text protocol's cost at this code and where a text fit's time "
             "goes; a held-out EfficientNet-B0; stress seed 1 group B and seed 2 group A with "
             "validation, seed 2 group B without",
             "BAYESIFY_BENCH_CACHE=cache python benchmarks/quality.py --protocol minilm-text "
             "--seeds 0 --save-seeds --threads 1 --methods <12 families> deep-ensemble-x5; "
             "python benchmarks/per_seed.py F; python benchmarks/profile_fit.py meanfield "
             "--protocol minilm-text --seed 0; python benchmarks/held_out_nets.py effb0 0 F; "
             "BAYESIFY_STRESS_SEED=S BAYESIFY_STRESS_TEST=1 pytest -m slow "
             "tests/test_stress_pretrained.py::test_every_family_with_defaults_on_every_trap "
             "-k '<True|False> and ...'; the text is written by hand"),
        Part("session26.md", "Messages a default fit should not give; what last-layer Laplace "
             "can reach at the clean bar; the real Lite0 and stress group B at this code",
             "BAYESIFY_BENCH_CACHE=cache python benchmarks/laplace_oracle.py --protocol P "
             "--seeds 0 1 2 --feature-weights 0.01 1 --json F; python benchmarks/quality.py "
             "--protocol digits-vit --seeds 0 --methods ensemble deep-ensemble-x5 --variant "
             "ens-rand ensemble head_init=random ...; python benchmarks/lite0_families.py "
             "--classes 10 --seed 0 --epochs default --families laplace ibnn swag mnf meanfield; "
             "BAYESIFY_STRESS_SEED=0 BAYESIFY_STRESS_TEST=1 pytest -m slow "
             "tests/test_stress_pretrained.py::test_every_family_with_defaults_on_every_trap "
             "-k 'True and ...'; the text is written by hand"),
        Part("session25.md", "A start is under-confident only if its gain survives one more "
             "error; every family on both image protocols at torch 2.14.1",
             "BAYESIFY_BENCH_CACHE=cache python benchmarks/temperature_floor.py --json F; "
             "BAYESIFY_BENCH_CACHE=cache python benchmarks/quality.py --protocol P --seeds S "
             "--save-seeds --threads 1 --methods <12 families> deep-ensemble-x5; python "
             "benchmarks/per_seed.py ... --json; python benchmarks/which_family.py ... --json; "
             "BAYESIFY_STRESS_SEED=S BAYESIFY_STRESS_TEST=1 pytest -m slow "
             "tests/test_stress_pretrained.py::test_every_family_with_defaults_on_every_trap "
             "-k 'True and ...'; the text is written by hand"),
        Part("session24.md", "The search's passes counted; iBNN predicts with 8 members; "
             "stress seed 2 group B and the real Lite0's seed 1 at this code",
             "python -m cProfile (fit of ibnn on minilm-text); BAYESIFY_BENCH_CACHE=cache "
             "python benchmarks/quality.py --protocol P --seeds S --save-seeds --threads 1 "
             "--methods ibnn [deep-ensemble-x5] --variant ibnn-n2 ibnn predict_samples=2; "
             "bayesify demo --seed S; BAYESIFY_STRESS_SEED=2 BAYESIFY_STRESS_TEST=1 pytest -m "
             "slow tests/test_stress_pretrained.py::test_every_family_with_defaults_on_every_trap; "
             "python benchmarks/lite0_families.py --classes 10 --seed 1 --families ...; the text "
             "is written by hand"),
        Part("session23.md", "The never-worse rules across a resume and after a custom loop; "
             "SWAG's stress column and the real Lite0 at this code",
             "python -m pytest tests/test_resume_never_worse.py tests/test_tune_start.py "
             "tests/test_ddp.py; BAYESIFY_STRESS_SEED=S BAYESIFY_STRESS_TEST=1 "
             "BAYESIFY_STRESS_TABLE=F pytest -m slow "
             "tests/test_stress_pretrained.py::test_every_family_with_defaults_on_every_trap "
             "-k 'swag and True'; python benchmarks/lite0_families.py --classes 10 --seed 0 "
             "--families ... --out F; the text is written by hand"),
        Part("session22.md", "A trained family weighed against the network with its own "
             "Laplace heads",
             "BAYESIFY_BENCH_CACHE=cache python benchmarks/quality.py --protocol P --seeds S "
             "--save-seeds --threads 1 --methods ibnn ensemble rank1 batchensemble dropout abnn "
             "meanfield hypernet mnf epinet swag laplace [deep-ensemble-x5] (0114638 and this "
             "stop); --protocol minilm-text --methods batchensemble rank1 laplace ibnn swag "
             "ensemble; python benchmarks/per_seed.py ... --json; python benchmarks/which_family.py "
             "...; BAYESIFY_STRESS_SEED=S BAYESIFY_STRESS_TEST=1 pytest -m slow "
             "tests/test_stress_pretrained.py::test_every_family_with_defaults_on_every_trap"),
        Part("session21.md", "The search's temperature between grid points; what the text "
             "encoder's features can reach",
             "BAYESIFY_BENCH_CACHE=cache python benchmarks/quality.py --protocol P --seeds S "
             "--save-seeds --methods abnn batchensemble dropout ensemble epinet hypernet ibnn "
             "laplace meanfield mnf rank1 swag deep-ensemble-x5 laplace-torch (978080e; ViT at "
             "cc8a62d, the same choices); python benchmarks/per_seed.py ...; "
             "BAYESIFY_STRESS_SEED=S BAYESIFY_STRESS_TEST=1 pytest -m slow "
             "tests/test_stress_pretrained.py::test_every_family_with_defaults_on_every_trap; "
             "python benchmarks/text_feature_oracle.py --seed S; bayesify demo --seed S"),
        Part("session20.md", "A third protocol on a real text encoder: the search's "
             "sharpening made every family worse under wording shifts, and no longer does",
             "BAYESIFY_BENCH_CACHE=cache python benchmarks/quality.py --protocol minilm-text "
             "--seeds S --save-seeds --methods abnn batchensemble dropout ensemble epinet "
             "hypernet ibnn laplace meanfield mnf rank1 swag deep-ensemble-x5 laplace-torch "
             "(dafed43 and 9d8aed5); python benchmarks/per_seed.py ...; BAYESIFY_STRESS_SEED=S "
             "BAYESIFY_STRESS_TEST=1 pytest -m slow tests/test_stress_pretrained.py::"
             "test_every_family_with_defaults_on_every_trap -k 'minilm and True and not swag'; "
             "the text is written by hand"),
        Part("session19.md", "A clean gain that rests on a few validation examples is not "
             "vouched for; the no-validation column; the real Lite0's rank1",
             "python benchmarks/quality.py --protocol P --seeds 0 1 2 --save-seeds --methods "
             "abnn batchensemble dropout ensemble epinet hypernet ibnn laplace meanfield mnf "
             "rank1 swag deep-ensemble-x5 laplace-torch (without the cache) at 0610a50; python "
             "benchmarks/which_family.py ...; BAYESIFY_STRESS_SEED=S BAYESIFY_STRESS_TEST=1 "
             "pytest -m slow tests/test_stress_pretrained.py::"
             "test_every_family_with_defaults_on_every_trap (with and without validation); "
             "benchmarks/lite0_families.py --families rank1 --seed S; the text is written by hand"),
        Part("session18.md", "The heads' feature layers count each example once, the heads' "
             "error rule, the start with heads weighed by the search's rule, SWAG's BatchNorm "
             "batches", "python benchmarks/quality.py --protocol P --seeds 0 1 2 --save-seeds "
             "--methods abnn batchensemble dropout ensemble epinet hypernet ibnn laplace "
             "meanfield mnf rank1 swag deep-ensemble-x5 laplace-torch (without the cache: the "
             "fit column) at ea133e6, d9c17ea and d7cc795; python benchmarks/which_family.py "
             "...; BAYESIFY_STRESS_SEED=S BAYESIFY_STRESS_TEST=1 pytest -m slow "
             "tests/test_stress_pretrained.py::test_every_family_with_defaults_on_every_trap; "
             "bayesify demo --seed S; the text is written by hand"),
        Part("session17.md", "A stricter clean rule (1.5 SE), SWAG's heads fixed and on by "
             "default, the search's shift signal under torchrun",
             "python benchmarks/quality.py --protocol P --seeds 0 1 2 --save-seeds --methods "
             "abnn batchensemble dropout ensemble epinet hypernet ibnn laplace meanfield mnf "
             "rank1 swag deep-ensemble-x5 laplace-torch (without the cache: the fit column); "
             "--methods swag --variant swag-h swag laplace_heads=True; the clean rule's "
             "multiple patched in for the sweep; BAYESIFY_STRESS_SEED=S BAYESIFY_STRESS_TEST=1 "
             "pytest -m slow tests/test_stress_pretrained.py::"
             "test_every_family_with_defaults_on_every_trap -k 'True and (...)' / -k swag; "
             "python benchmarks/which_family.py ...; python benchmarks/lite0_families.py "
             "--classes 10 --seed 0 --families swag; bayesify demo; the text is written by hand"),
        Part("session16.md", "Feature layers: the posterior sees earlier depths (Laplace and "
             "every family's heads); the heads' spread counts as epistemic",
             "BAYESIFY_BENCH_CACHE=cache python benchmarks/quality.py --protocol P --seeds 0 1 2 "
             "--save-seeds --methods laplace --variant laplace-last laplace feature_layers=None "
             "(P = digits-cnn, digits-vit, wide-cnn); quality.py --methods abnn batchensemble "
             "dropout ensemble epinet hypernet ibnn meanfield mnf rank1 (this stop's first and "
             "last commits); BAYESIFY_STRESS_SEED=S BAYESIFY_STRESS_TEST=1 pytest -m slow "
             "tests/test_stress_pretrained.py -k 'True and (...)'; python "
             "benchmarks/lite0_families.py --classes 10 --seed S --families laplace epinet "
             "ensemble; python benchmarks/held_out_nets.py NET 0 cells.jsonl laplace,epinet; "
             "bayesify demo --seed S; the text is written by hand"),
        Part("session15.md", "The feature curvature: Laplace and every family's member-wise "
             "heads count every training example alike",
             "BAYESIFY_BENCH_CACHE=cache python benchmarks/curvature_oracle.py --protocol P "
             "--seed S; BAYESIFY_BENCH_CACHE=cache python benchmarks/quality.py --protocol P "
             "--seeds 0 1 2 --save-seeds --methods laplace --variant laplace-ggn laplace "
             "curvature=ggn [--variant lap-sS laplace logit_std=S] (P = digits-cnn, digits-vit, "
             "wide-cnn); quality.py --methods abnn batchensemble dropout ensemble epinet hypernet "
             "ibnn laplace meanfield mnf rank1 swag; BAYESIFY_STRESS_SEED=2 BAYESIFY_STRESS_TEST=1 "
             "pytest -m slow tests/test_stress_pretrained.py -k 'True and (...)'; python "
             "benchmarks/lite0_families.py --classes 10 --seed S --families laplace epinet "
             "ensemble; the text is written by hand"),
        Part("session14.md", "Member-wise Laplace heads for the hypernet, MNF and the epinet "
             "(SWAG's as an option); a spread knob's 0 scored with one sample",
             "BAYESIFY_BENCH_CACHE=cache python benchmarks/quality.py --protocol P --seeds 0 1 2 "
             "--save-seeds --methods hypernet mnf epinet --variant hyp-h hypernet "
             "laplace_heads=True --variant mnf-h mnf laplace_heads=True --variant epi-h epinet "
             "laplace_heads=True (before the default changed), --methods swag --variant swag-h swag "
             "laplace_heads=True; BAYESIFY_STRESS_SEED=S "
             "BAYESIFY_STRESS_TEST=1 pytest -m slow tests/test_stress_pretrained.py -k "
             "'(hypernet or mnf or epinet) and True'; python benchmarks/held_out_nets.py NET 0 "
             "cells.jsonl hypernet,mnf; the text is written by hand"),
        Part("session13.md", "Architectures outside the stress matrix (ResNet-18, a timm ViT, "
             "ConvNeXt); never worse within the search's accuracy tolerance; two search rules "
             "measured and dropped",
             "OMP_NUM_THREADS=1 python benchmarks/held_out_nets.py NET 0 cells.jsonl; "
             "BAYESIFY_STRESS_SEED=S BAYESIFY_STRESS_TEST=1 pytest -m slow "
             "tests/test_stress_pretrained.py -k 'every_family and True'; "
             "BAYESIFY_BENCH_CACHE=cache python benchmarks/quality.py --protocol P --seeds 0 1 2 "
             "--save-seeds --methods ... (each variant); the text is written by hand"),
        Part("session12.md", "The temperature floor on a split the start separates; a finer "
             "temperature grid and a lower floor measured and dropped; a MobileNetV3 and the "
             "stress matrix without validation",
             "BAYESIFY_BENCH_CACHE=cache python benchmarks/quality.py --protocol P --seeds 0 1 2 "
             "--save-seeds --methods ... (each variant); BAYESIFY_STRESS_SEED=S "
             "BAYESIFY_STRESS_TEST=1 pytest -m slow tests/test_stress_pretrained.py -k "
             "'every_family and True' (and 'False'); bayesify demo --seed S; the MobileNetV3 "
             "probe is a /tmp script; the text is written by hand"),
        Part("session11.md", "The knob search walks its grid coarse to fine; SWAG's "
             "BatchNorm pass in a fixed order; every family on two protocols again",
             "BAYESIFY_BENCH_CACHE=cache_m0 python benchmarks/quality.py --protocol P --seeds 0 "
             "1 2 --save-seeds --methods ...; python benchmarks/which_family.py ...; "
             "BAYESIFY_STRESS_TEST=1 BAYESIFY_STRESS_TABLE=F pytest -m slow "
             "tests/test_stress_pretrained.py -k 'every_family and True'; the text is written "
             "by hand"),
        Part("session10.md", "Laplace over more than the last layer (the library's subnetwork "
             "diagonal; laplace-torch's KFAC over the last block and every layer), the "
             "hypernet's fit halved, the step guard's per-step copy, the search's skipped "
             "shifted passes; every family on two protocols again", "BAYESIFY_BENCH_CACHE=cache python benchmarks/quality.py "
             "--protocol P --seeds 0 1 2 --methods laplace --variant lap-last2 laplace "
             "targets=last:2 structure=diag ...; python benchmarks/laplace_block29.py --protocol "
             "P --seeds S --json F; python benchmarks/which_family.py ...; the text is written "
             "by hand"),
        Part("session9.md", "The exact last-layer GGN where it is affordable: Laplace's "
             "default and the member-wise heads; Laplace without validation keeps every "
             "training decision; every family on two protocols again",
             "BAYESIFY_BENCH_CACHE=cache python benchmarks/quality.py --protocol P --seeds 0 1 2 "
             "--save-seeds --methods ... [--variant laplace-kron laplace structure=kron]; python "
             "benchmarks/which_family.py ...; BAYESIFY_STRESS_SEED=S BAYESIFY_STRESS_TEST=1 "
             "BAYESIFY_STRESS_TABLE=cells.jsonl pytest -m slow tests/test_stress_pretrained.py; "
             "the text is written by hand"),
        Part("session8.md", "A real network without validation data: SWAG's BatchNorm "
             "statistics chosen by the training labels, the start guard, Bayes by Backprop "
             "per network (tried), MNF diagnosed", "python benchmarks/lite0_families.py --classes 10 --seed S "
             "[--no-val] --families ...; python benchmarks/quality.py --seeds 0 --methods "
             "meanfield --variant meanfield-per-layer meanfield per_network=False; the text is "
             "written by hand"),
        Part("session7.md", "MultiSWAG, fine-tuned copies of one network against a deep "
             "ensemble; every family on the real EfficientNet-Lite0 (10 classes); the demo's "
             "AUROC", "BAYESIFY_BENCH_CACHE=cache python benchmarks/multiswag31.py --protocol "
             "digits-cnn|digits-vit --seeds 0 1 2 --time-member; python "
             "benchmarks/lite0_families.py --classes 10 --seed S; the text is written by hand"),
        Part("session6.md", "Member-wise Laplace heads: the default of seven families, a wide "
             "network, the heads' reference", "BAYESIFY_BENCH_CACHE=cache python "
             "benchmarks/quality.py [--protocol digits-vit|wide-cnn] --seeds 0 1 2 --save-seeds "
             "--methods ibnn ensemble rank1 batchensemble dropout abnn meanfield; python "
             "benchmarks/which_family.py ...; BAYESIFY_STRESS_TABLE=cells.jsonl pytest -m slow "
             "tests/test_stress_pretrained.py -k 'True and ibnn'; the text is written by hand"),
        Part("which_family.md", "Which family: every family on two protocols, as ratios",
             "python benchmarks/quality.py --save-seeds (both protocols, families and peers); "
             "python benchmarks/which_family.py; the text is written by hand"),
        Part("protocol2.md", "Second protocol (tiny ViT, LayerNorm)",
             "python benchmarks/quality.py --protocol digits-vit --seeds 0 1 2 --jobs 1 "
             "--threads 1 --save-seeds (three row sets, joined with --merge); python "
             "benchmarks/per_seed.py; python benchmarks/temperature29.py --protocol digits-vit "
             "--seeds 0 1 2 --ensemble; the text is written by hand"),
        Part("search_rules.md", "The validation search's rules: every family before/after on "
             "both protocols, Laplace's sharpening and curvature, rank-one spreads per network, "
             "iBNN's entropy-weighted ELBO, the stress matrix on this stop's code",
             "python benchmarks/quality.py [--protocol digits-vit] --seeds 0 1 2 --save-seeds "
             "[--variant ...]; python benchmarks/per_seed.py; BAYESIFY_STRESS_TABLE=cells.jsonl "
             "pytest -m slow tests/test_stress_pretrained.py; the text is written by hand"),
        Part("held_out.md", "Post-hoc MC dropout, a wider feasibility margin tried, the stress "
             "matrix on held-out seeds and test splits",
             "python benchmarks/quality.py [--protocol digits-vit] --seeds 0 1 2 --save-seeds "
             "--methods dropout --variant dropout-finetuned dropout train_weights=True; "
             "BAYESIFY_STRESS_SEED=S BAYESIFY_STRESS_TEST=1 BAYESIFY_STRESS_TABLE=cells.jsonl "
             "pytest -m slow tests/test_stress_pretrained.py; python benchmarks/stress_table.py "
             "cells.jsonl; the text is written by hand"),
        Part("session5.md", "Small batches, a spread guard without validation, MNF's "
             "per-network rate: the held-out stress matrix",
             "BAYESIFY_STRESS_SEED=S BAYESIFY_STRESS_TEST=1 BAYESIFY_STRESS_TABLE=cells.jsonl "
             "pytest -m slow tests/test_stress_pretrained.py -k 'batch_of_one or False or mnf'; "
             "python benchmarks/stress_table.py cells.jsonl; python benchmarks/quality.py "
             "[--protocol digits-vit] --seeds 0 1 2 --save-seeds --methods mnf; the text is "
             "written by hand"),
        Part("stress30.md", "Stress matrix: every family's defaults on trap networks (issue 30)",
             "BAYESIFY_STRESS_TABLE=cells.jsonl pytest -m slow tests/test_stress_pretrained.py"),
        Part("issue7.md", "Temperature scaling, every family",
             "python benchmarks/issue7.py --out benchmarks/results/issue7.json",
             section="## Temperature scaling"),
        Part("issue4.md", "Batch-tiled families on the digits demo",
             "bayesify demo --methods ibnn,rank1,batchensemble,dropout,ensemble --seed S",
             section="## Digits demo protocol"),
        Part("issue5.md", "SWAG and Laplace on the digits demo",
             "bayesify demo --methods laplace,swag --seed S", section="## Digits protocol"),
        Part("issue6.md", "Mean-field and hypernet on the digits demo",
             "bayesify demo --methods meanfield,hypernet --seed S",
             section="## 3. Digits protocol"),
        Part("issue15.md", "Laplace's epistemic part",
             "bayesify fit --method laplace --map-epochs 10 && bayesify evaluate",
             section="**Laplace epistemic part**"),
        Part("issue9.md", "Active learning (BALD and friends) on digits",
             "python examples/active_learning.py --seeds 3 --rounds 15 "
             "--out benchmarks/results/active_learning.png --json al.json"),
    ]),
    ("Speed and overhead", ("What a posterior costs against the plain model, in training and "
     "prediction."), [
        Part("overhead.md", "Every family vs the plain model (CPU)",
             "python benchmarks/overhead.py --reps 10 --threads 1"),
        Part("issue4.md", "Batch-tiled families (timm resnet18)",
             "python benchmarks/overhead_tiled.py --steps 10 --warmup 2 --threads 1",
             section="## Overhead on timm resnet18"),
        Part("issue5.md", "SWAG and Laplace", "python benchmarks/overhead_posthoc.py --reps 10",
             section="## Overhead"),
        Part("issue6.md", "Mean-field and hypernet (timm resnet18)",
             "python benchmarks/overhead_weightspace.py --skip-memory",
             section="## 1. Overhead"),
        Part("issue6.md", "ResNet-50 memory of the weight-space families",
             "python benchmarks/overhead_weightspace.py --skip-timing",
             section="## 2. ResNet-50 memory"),
        Part("gpu.md", "GPU: every family's step and prediction on an H100",
             "python benchmarks/gpu.py --json benchmarks/results/gpu.json"),
    ]),
    ("Scale: data parallel", "Throughput and equivalence under torchrun (DDP).", [
        Part("issue3.md", "Data-parallel throughput", "python benchmarks/ddp_scaling.py --json "
             "bench.json"),
        Part("issue15.md", "Two ranks equal one process, every family",
             'pytest tests/test_one_loop.py -k "torchrun or ranks"',
             section="**Data-parallel equivalence of the one loop**"),
    ]),
    ("Export", "Plain torch.export / ONNX modules that predict like the in-process predictor.", [
        Part("issue7.md", "Export round trips",
             "python benchmarks/issue7.py --out benchmarks/results/issue7.json",
             section="## Export round trips"),
        Part("issue7.md", "Exported vs in-process throughput (CPU)",
             "python benchmarks/issue7.py --out benchmarks/results/issue7.json",
             section="## Exported vs in-process predictor throughput"),
    ]),
    ("Persistence", "Saving the posterior alone, loading it onto the base network, resuming.", [
        Part("issue7.md", "Posterior files", "python benchmarks/issue7.py --out "
             "benchmarks/results/issue7.json", section="## Persistence"),
        Part("issue15.md", "Posterior state round trips",
             "pytest tests/test_one_loop.py tests/test_registry_state.py",
             section="**Posterior state**"),
    ]),
]

HEADER = """# bayesify benchmark results

Organised by capability: the first hour, quality, speed and overhead, scale (data
parallel), export, persistence. Every part names the command that regenerates it and the commit and date its
numbers come from (the fragment under `benchmarks/results/` the script wrote). Machines
here are shared and noisy: compare ratios measured in the same run, not absolute times
across runs. Unless a part says otherwise the machine is the 2-core CPU sandbox with no
GPU; one session had an H100 for 30 minutes (the "GPU" part of "Speed and overhead"); the
GPU parts of `overhead.py` and `ddp_scaling.py` have not been run yet. This file is
assembled by `python benchmarks/collect_results.py`; edit the fragments, not this file.
"""


def provenance(path: Path) -> str:
    """``commit (date)`` of the last commit that wrote ``path`` ("uncommitted" otherwise)."""
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%h (%ad)", "--date=short", "--",
                              str(path)], capture_output=True, text=True, cwd=HERE, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown commit"
    return out.stdout.strip() or "uncommitted"


def section_of(lines: list[str], section: str | None) -> list[str]:
    """The lines of ``section`` (a ``## `` heading or a ``**bold**`` paragraph prefix up to
    the next one of the same kind); the whole fragment without its ``# `` title for None."""
    if section is None:
        return lines[1:] if lines and lines[0].startswith("# ") else lines
    start = next((i for i, line in enumerate(lines) if line.startswith(section)), None)
    if start is None:
        raise SystemExit(f"section {section!r} not found")
    bold = section.startswith("**")
    end = len(lines)
    for i in range(start + 1, len(lines)):
        line = lines[i]
        if (bold and line.startswith("**")) or (not bold and line.startswith("## ")):
            end = i
            break
    body = lines[start:end]
    return body[1:] if not bold else body  # a ## heading is replaced by the part's title


def machine_note(lines: list[str]) -> list[str]:
    """The fragment's ``Machine: …`` paragraph (before its first section), if any."""
    intro: list[str] = []
    for line in lines[1:] if lines and lines[0].startswith("# ") else lines:
        if line.startswith(("## ", "**")):
            break
        intro.append(line)
    text = "\n".join(intro).split("\n\n")
    return [p.strip() for p in text if p.strip().startswith("Machine")][:1]


def render_part(part: Part) -> str:
    path = RESULTS / part.fragment
    lines = path.read_text().strip().splitlines()
    body = section_of(lines, part.section)
    if part.section is not None:
        body = machine_note(lines) + [""] + body
    # the fragment's own headings sit below the part's ### title
    depth = "##" if part.section is None else "#"
    body = [depth + line if line.startswith("#") else line for line in body]
    stamp = (f"_Regenerate: `{part.command}` · numbers: `benchmarks/results/{part.fragment}`, "
             f"commit {provenance(path)}_")
    return f"### {part.title}\n\n{stamp}\n\n" + "\n".join(body).strip() + "\n"


def main() -> None:
    parts = [HEADER]
    for title, summary, pieces in CAPABILITIES:
        parts.append(f"\n## {title}\n\n{summary}\n")
        parts.extend(render_part(piece) for piece in pieces)
    (HERE / "RESULTS.md").write_text("\n".join(parts))


if __name__ == "__main__":
    main()
