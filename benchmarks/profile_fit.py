"""Where a default fit's time goes: ``cProfile`` of ``fit(bayesify(net, method=FAMILY),
train, val_loader=val)`` on a quality protocol's network (``benchmarks/protocols.py``).

    OMP_NUM_THREADS=1 BAYESIFY_BENCH_CACHE=DIR python benchmarks/profile_fit.py meanfield \\
        --protocol minilm-text --seed 0 [--option predict_samples=8] [--top 60]

Prints the fit's seconds, what it kept, and the profile sorted by cumulative time.
"""

from __future__ import annotations

import argparse
import ast
import cProfile
import io
import pstats
import time

import torch
from protocols import PROTOCOLS

import bayesify


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("family", help="the bayesify family (bayesify.list_methods())")
    parser.add_argument("--protocol", default="digits-cnn", choices=sorted(PROTOCOLS),
                        help="the quality protocol whose seed-S network and loaders are used")
    parser.add_argument("--seed", type=int, default=0, help="protocol and fit seed")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="a family option (a Python literal), repeatable")
    parser.add_argument("--top", type=int, default=60, help="profile rows to print")
    args = parser.parse_args(argv)
    options = {k: ast.literal_eval(v) for k, v in (o.split("=", 1) for o in args.option)}
    spec = PROTOCOLS[args.protocol]
    torch.manual_seed(args.seed)
    p = spec.build(args.seed)
    loaders = p.loaders(args.seed)
    base = spec.pretrained(p, args.seed)
    torch.manual_seed(args.seed)  # the posterior's initial draw, whatever building the net used
    bnn = bayesify.bayesify(base, method=args.family, **options)
    profile = cProfile.Profile()
    began = time.perf_counter()
    profile.enable()
    result = bayesify.fit(bnn, loaders["train"], val_loader=loaders["val"], progress=False,
                          seed=args.seed)
    profile.disable()
    kept = {k: v for k, v in result.last.items() if k in ("kept", "temperature", "val_nll")}
    print(f"fit {time.perf_counter() - began:.1f} s {kept}")
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(args.top)
    print(out.getvalue())


if __name__ == "__main__":
    main()
