"""Assemble benchmarks/RESULTS.md from the per-area fragments in benchmarks/results/.

Each benchmark script writes its own fragment (command, machine, date, figures);
this keeps RESULTS.md one readable document: `python benchmarks/collect_results.py`.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).parent
ORDER = [
    ("overhead.md", "Overhead of every family vs the plain model (issues 2, 4, 5, 6, 8)"),
    ("quality.md", "Quality vs peers on the digits protocol (issue 8)"),
    ("issue3.md", "Data-parallel training throughput (issue 3)"),
    ("issue4.md", "Batch-tiled families (issue 4)"),
    ("issue5.md", "SWAG and Laplace (issue 5)"),
    ("issue6.md", "Mean-field and hypernetwork posteriors (issue 6)"),
    ("issue7.md", "Calibration, export and persistence (issue 7)"),
    ("issue9.md", "Active learning (issue 9)"),
    ("issue13.md", "Defaults on a pretrained network, every family (issue 13)"),
    ("issue15.md", "One loop and posterior state (issue 15)"),
]

HEADER = """# bayesify benchmark results

Every figure below names its command, machine and date. Machines here are shared
and noisy: compare ratios measured in the same run, not absolute times across runs.
Unless a section says otherwise the machine is the 2-core CPU sandbox with no GPU
(2026-11-21); no GPU was available to the sessions that produced these numbers, so
the GPU sections of `overhead.py` and `ddp_scaling.py` have not been run yet.
This file is assembled by `python benchmarks/collect_results.py` from
`benchmarks/results/*.md`.
"""


def main() -> None:
    parts = [HEADER]
    for name, title in ORDER:
        path = HERE / "results" / name
        if not path.exists():
            continue
        body = path.read_text().strip().splitlines()
        if body and body[0].startswith("# "):
            body = body[1:]  # the fragment's own title becomes a section heading
        # demote the fragment's headings one level below its section
        body = ["#" + line if line.startswith("#") and not line.startswith("#!") else line
                for line in body]
        parts.append(f"\n## {title}\n\n_Source: `benchmarks/results/{name}`_\n\n" + "\n".join(body).strip() + "\n")
    (HERE / "RESULTS.md").write_text("\n".join(parts))


if __name__ == "__main__":
    main()
