"""The synthetic query process gives each head the adjacent-step similarity its profile asks for."""
import torch

from clo.query_process import ProfileQueryProcess, map_profile


def test_adjacent_similarity_follows_rho():
    s_hat = torch.tensor([[0.95, 0.6], [0.85, 0.3]])
    proc = ProfileQueryProcess(s_hat, group=2, device=torch.device("cpu"), source="test")
    torch.manual_seed(0)
    q0 = torch.randn(64, 4, 128) * 3.0
    prev = proc.query(0, q0, advance=True)
    sims = []
    for _ in range(20):
        q = proc.query(0, torch.randn(64, 4, 128) * 3.0, advance=True)
        sims.append(torch.nn.functional.cosine_similarity(q, prev, dim=-1))
        prev = q
    mean = torch.stack(sims).mean((0, 1))  # per query head
    torch.testing.assert_close(mean, torch.tensor([0.95, 0.95, 0.6, 0.6]), atol=0.02, rtol=0)
    same = proc.query(0, torch.randn(64, 4, 128), advance=False)
    assert torch.allclose(same / same.norm(dim=-1, keepdim=True), prev / prev.norm(dim=-1, keepdim=True), atol=1e-6)


def test_profile_mapping_keeps_the_distribution():
    src = torch.linspace(0.5, 1.0, 90).view(30, 3)
    mapped = map_profile(src, 32, 8)
    assert mapped.shape == (32, 8)
    assert abs(mapped.mean() - src.mean()) < 0.01 and mapped.min() >= 0.5 and mapped.max() <= 1.0
