import os
import subprocess
import sys
import textwrap

import pytest
import torch

import qspec_ext  # noqa: F401  (registers the ops)
from helpers import make_hf

from qspec_ext import NativeTarget

# Under pytest-xdist the workers, not OpenMP threads, share the cores: each worker gets its share
# (one thread on two cores). tests/test_threads.py runs the kernels' work split on two threads.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# Kernel vs reference: both compute in fp32 and round once, so they differ by at most
# about one unit in the last place of the output dtype.
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


def assert_close(actual, expected, dtype=None):
    torch.testing.assert_close(actual, expected, **TOLERANCES[dtype or expected.dtype])


def assert_cuda_script_fails_with(script: str, message: str) -> None:
    """Runs script in a child process (a device-side check kills the CUDA context) and
    asserts it failed, printing message."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          env=os.environ)
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr


@pytest.fixture(autouse=True)
def seeded():
    """Every test starts from the same random state: results never depend on test order."""
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """The tiny Qwen3 target of helpers.make_hf, saved (transformers' format)."""
    path = tmp_path_factory.mktemp("qwen3")
    make_hf().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def small_target(tmp_path_factory):
    """A 3-layer tiny target (aux layers 1, 2, 3): fast, and each compiled graph builds in seconds."""
    path = tmp_path_factory.mktemp("qwen3-small")
    make_hf(layers=3).save_pretrained(path)
    return NativeTarget.from_pretrained(path, aux_layer_ids=[1, 2, 3])
