"""The transfer engine's CPU-gather path (the baselines' path, and CLO's ablation) against the reference."""

import pytest
import torch

from kvoffload.errors import ConfigError
from kvoffload.kernels.uva_gather import gather_rows_ref
from kvoffload.offload.transfer import TransferEngine


@pytest.mark.parametrize("threads", [1, 4])
def test_cpu_gather_fills_missed_slots_only(threads):
    g = torch.Generator().manual_seed(0)
    host = torch.randn(2, 4, 50, 2, 8, generator=g)
    heads = torch.tensor([0, 2, 3])
    idx = torch.randint(0, 50, (2, 3, 6), generator=g)
    miss = torch.tensor([[True, False, True], [False, True, True]])
    slots = torch.zeros(2, 3, 6, 2, 8)
    eng = TransferEngine("cpu_gather", threads, torch.device("cpu"))
    eng._cpu_gather(host, heads, idx, miss, slots)  # the CUDA path's code, run on host tensors
    want = torch.where(miss[..., None, None, None], gather_rows_ref(host, heads, idx), torch.zeros_like(slots))
    assert torch.equal(slots, want) and eng.host_syncs == 1


def test_bad_transfer_settings():
    with pytest.raises(ConfigError, match="cpu_threads"):
        TransferEngine("cpu_gather", 0, torch.device("cpu"))
    with pytest.raises(ConfigError, match="transfer"):
        TransferEngine("rdma", 1, torch.device("cpu"))
    with pytest.raises(ConfigError, match="uva_programs"):
        TransferEngine("uva", 1, torch.device("cpu"), uva_programs=0)
