"""The vLLM plugin's seams on CUDA: off unless QSPEC_VLLM_CUDA opts them in (no vLLM needed)."""

import types

import pytest
import torch

from qspec_ext.integrations import vllm as plugin


def tensor_on(device: str):
    return types.SimpleNamespace(device=torch.device(device))  # a CUDA tensor needs no GPU to be described


def test_cuda_seams_are_off_unless_named(monkeypatch):
    monkeypatch.delenv(plugin.CUDA_ENV, raising=False)
    assert plugin.cuda_seams() == frozenset()
    for value, expected in [("0", set()), ("1", set(plugin.SEAMS)), ("all", set(plugin.SEAMS)),
                            ("rms_norm, rope", {"rms_norm", "rope"})]:
        monkeypatch.setenv(plugin.CUDA_ENV, value)
        assert plugin.cuda_seams() == expected
    monkeypatch.setenv(plugin.CUDA_ENV, "rmsnorm")
    with pytest.raises(ValueError, match="QSPEC_VLLM_CUDA: unknown seam.*rmsnorm"):
        plugin.cuda_seams()


def test_a_seam_takes_cuda_tensors_only_when_opted_in(monkeypatch):
    monkeypatch.setitem(plugin._state, "cuda", frozenset())
    for seam in plugin.SEAMS:
        assert plugin._our_device(tensor_on("cpu"), seam)
        assert not plugin._our_device(tensor_on("cuda"), seam)
    monkeypatch.setitem(plugin._state, "cuda", frozenset({"rope"}))
    assert plugin._our_device(tensor_on("cuda"), "rope")
    assert not plugin._our_device(tensor_on("cuda"), "rejection_sampler")
    assert plugin._our_device(tensor_on("cpu"), "rejection_sampler"), "CPU behaviour unchanged"
