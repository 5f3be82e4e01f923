"""Two builds of qspec_ext, one op microbenchmark: old against new in alternating processes.

    python benchmarks/compare_builds.py --old OLD_PYTHONPATH --new NEW_PYTHONPATH [--rounds 3] \
        -- benchmarks/bench_norm_rope.py --tokens 1 16 --no-compile

Each round runs the benchmark once with each build's package first on PYTHONPATH (old, new, old,
new, ...: the machine's drift hits both), reads its --json rows and prints, per row, the median
over rounds of each build's median time, the range of those medians (the spread) and new / old.
Only the op's own time is compared (the baselines are the same PyTorch in both).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_once(benchmark: list[str], pythonpath: str, json_path: Path) -> dict[tuple, float]:
    env = os.environ | {"PYTHONPATH": pythonpath}
    subprocess.run([sys.executable, *benchmark, "--json", str(json_path)], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    data = json.loads(json_path.read_text())
    found = data["build"] if "build" in data else data["meta"]["build"]
    print(f"  {pythonpath}: qspec_ext {found['version']} built with torch {found['built_with_torch']}"
          f"{', ' + found['abi'] if 'abi' in found else ''}", flush=True)
    return {(r["op"], r["dtype"], r["shape"]): r["ours"]["median_us"] for r in data["rows"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, help="PYTHONPATH of the old build (its package's parent)")
    parser.add_argument("--new", required=True, help="PYTHONPATH of the new build")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("benchmark", nargs=argparse.REMAINDER, help="-- the benchmark script and its arguments")
    args = parser.parse_args()
    benchmark = args.benchmark[1:] if args.benchmark[:1] == ["--"] else args.benchmark
    times: dict[str, dict[tuple, list[float]]] = {"old": {}, "new": {}}
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            print(f"round {round_ + 1} of {args.rounds}", flush=True)
            for name in ("old", "new"):
                rows = run_once(benchmark, getattr(args, name), Path(scratch) / f"{name}.json")
                for key, us in rows.items():
                    times[name].setdefault(key, []).append(us)
    print(f"\n{' '.join(benchmark)}: median of {args.rounds} rounds (range), microseconds")
    header = ["op", "dtype", "shape", "old us", "old range", "new us", "new range", "new / old"]
    table = []
    for key, old in times["old"].items():
        new = times["new"].get(key)
        if not new:
            continue
        table.append([*key, f"{statistics.median(old):.1f}", f"{min(old):.1f}-{max(old):.1f}",
                      f"{statistics.median(new):.1f}", f"{min(new):.1f}-{max(new):.1f}",
                      f"{statistics.median(new) / statistics.median(old):.2f}"])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *table)]
    for line in [header, ["-" * w for w in widths], *table]:
        print("  ".join(str(x).rjust(w) for x, w in zip(line, widths)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
