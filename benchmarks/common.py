"""Timing and reporting shared by the kernel benchmarks.

Latency is the median (with p20/p80) over many timed calls after warm-up. On CUDA each
call is timed with events and L2 is flushed before it (cold cache), as streaming kernels
see in a real decode step. Every call of an in-place op starts from the same inputs
(``restorer`` as time_fn's untimed setup). Speed-ups are ratios to baselines timed in the
same run; bandwidth is reported as a fraction of a device-to-device copy timed in the same
run the same way.
"""

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

import qspec_ext

# Peak HBM bandwidth (bytes/s) of the GPUs we report a fraction of peak for.
PEAK_BANDWIDTH = {"H200": 4.8e12, "H100": 3.35e12, "B200": 8.0e12, "A100": 2.0e12}


@dataclass
class Timing:
    median_us: float
    p20_us: float
    p80_us: float
    samples: int


@dataclass
class Row:
    op: str
    dtype: str
    shape: str
    bytes: int
    ours: Timing
    baselines: dict[str, Timing] = field(default_factory=dict)

    def gbps(self) -> float:
        return self.bytes / (self.ours.median_us * 1e-6) / 1e9

    def fraction(self, bandwidth: float) -> float:
        """Achieved bytes/s over bandwidth (bytes/s)."""
        return self.gbps() * 1e9 / bandwidth


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--check", action="store_true", help="verify against the reference before timing")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    parser.add_argument("--min-time", type=float, default=0.3, help="seconds of timed calls per measurement")


def time_fn(
    fn: Callable[[], object], device: str, min_time: float = 0.3, max_samples: int = 2000, min_samples: int = 10,
    setup: Callable[[], None] | None = None,
) -> Timing:
    """Median/p20/p80 latency of fn() in microseconds, over at least min_samples calls.

    setup, if given, runs before every call (warm-up included), outside the timed interval.
    """
    is_cuda = device.startswith("cuda")
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=device) if is_cuda else None
    setup = setup or (lambda: None)
    for _ in range(min(3, min_samples)):
        setup()
        fn()
    samples: list[float] = []
    deadline = time.perf_counter() + min_time
    while len(samples) < max_samples and (len(samples) < min_samples or time.perf_counter() < deadline):
        setup()
        if is_cuda:
            flush.zero_()  # after setup, so that its copy leaves nothing in L2
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
    q = statistics.quantiles(samples, n=10)
    return Timing(statistics.median(samples), q[1], q[7], len(samples))


def restorer(*tensors: torch.Tensor) -> Callable[[], None]:
    """A time_fn setup that puts the tensors back to their present values: in-place ops timed in a
    loop would otherwise feed on their own outputs (RMSNorm re-applied drifts into denormals)."""
    pristine = [t.clone() for t in tensors]

    def restore() -> None:
        for t, p in zip(tensors, pristine):
            t.copy_(p)

    return restore


def copy_bandwidth(device: str, min_time: float) -> float:
    """Bytes/s of dst.copy_(src) (read + write), 1 GiB on CUDA, 256 MiB on CPU, timed by time_fn."""
    # Filled, not empty: untouched CPU pages all map to the one zero page, which reads from cache.
    src = torch.ones(2**30 if device.startswith("cuda") else 2**28, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (time_fn(lambda: dst.copy_(src), device, min_time).median_us * 1e-6)


def peak_bandwidth(device: str) -> float | None:
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(device)
    return next((bw for key, bw in PEAK_BANDWIDTH.items() if key in name), None)


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def report(title: str, rows: list[Row], device: str, json_path: str | None, copy_bw: float) -> None:
    peak = peak_bandwidth(device)
    names = list(dict.fromkeys(name for row in rows for name in row.baselines))
    header = ["op", "dtype", "shape", "median us", "p20-p80 us", "GB/s", "% copy"] + (["% datasheet"] if peak else [])
    for name in names:
        header += [f"{name} us", f"x vs {name}"]
    table = []
    for row in rows:
        line = [
            row.op, row.dtype, row.shape, f"{row.ours.median_us:.1f}",
            f"{row.ours.p20_us:.1f}-{row.ours.p80_us:.1f}", f"{row.gbps():.1f}", f"{100 * row.fraction(copy_bw):.0f}%",
        ]
        if peak:
            line.append(f"{100 * row.fraction(peak):.0f}%")
        for name in names:
            base = row.baselines.get(name)
            line += [f"{base.median_us:.1f}", f"{base.median_us / row.ours.median_us:.2f}"] if base else ["-", "-"]
        table.append(line)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *table)]
    print(f"\n{title} on {device_name(device)} (torch {torch.__version__}, qspec_ext {qspec_ext.__version__}, "
          f"copy bandwidth {copy_bw / 1e9:.1f} GB/s)")
    for line in [header, ["-" * w for w in widths], *table]:
        print("  ".join(str(x).rjust(w) for x, w in zip(line, widths)))
    if json_path:
        meta = dict(title=title, device=device_name(device), torch=torch.__version__, build=qspec_ext.build_info(),
                    peak_bandwidth=peak, copy_bandwidth=copy_bw, argv=sys.argv)
        out = [asdict(r) | {"gbps": r.gbps(), "fraction_of_copy": r.fraction(copy_bw)} for r in rows]
        worst = sorted(out, key=lambda r: r["fraction_of_copy"])[:3]
        worst = [dict(op=r["op"], shape=r["shape"], dtype=r["dtype"], fraction=r["fraction_of_copy"]) for r in worst]
        with open(json_path, "w") as f:
            json.dump({"meta": meta, "rows": out, "worst_rows": worst}, f, indent=1)
        print(f"wrote {json_path}")


# --check: kernel vs reference, about one unit in the last place of the dtype.
CHECK_TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def finish(title: str, rows: list[Row], args, failures: int) -> int:
    """Prints (and writes) the report and the --check verdict; the exit code."""
    report(title, rows, args.device, args.json, copy_bandwidth(args.device, args.min_time))
    if args.check:
        print("check: all outputs match the reference" if failures == 0 else f"check: {failures} mismatches")
    return 1 if failures else 0


def compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=False)


RESULT_PREFIX = "RESULT "


def print_child_result(result) -> None:
    """A benchmark child process's answer to :func:`run_child`: one JSON line on stdout."""
    print(RESULT_PREFIX + json.dumps(result))


def run_child(command: list[str], what: str, env: dict | None = None):
    """Runs a benchmark's child process (a fresh process: its own pinning, peak memory, engine) and
    returns what it printed with :func:`print_child_result`; exits naming ``what`` when it fails."""
    proc = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        sys.exit(f"{what} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len(RESULT_PREFIX):])
