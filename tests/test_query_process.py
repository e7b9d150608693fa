"""The synthetic query process gives each head the adjacent-step similarity its profile asks for."""
import pytest
import torch

from experiments.query_process import ProfileQueryProcess, map_profile


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


@pytest.mark.gpu
def test_the_process_advances_when_replayed_from_a_cuda_graph():
    """Decode steps replay a captured graph: each replay must step the chain (cosine to the previous step
    rho), not redraw around the captured step's state (cosine rho^2)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA; run on the GPU machine")
    dev = torch.device("cuda")
    proc = ProfileQueryProcess(torch.tensor([[0.5]]), group=4, device=dev, source="test")
    q = torch.randn(64, 4, 128, device=dev)
    proc.query(0, q, advance=True)  # eager first calls, as the decode warm-up makes
    out = proc.query(0, q, advance=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = proc.query(0, q, advance=True)
    prev, sims = out.clone(), []
    for _ in range(20):
        graph.replay()
        sims.append(torch.nn.functional.cosine_similarity(out, prev, dim=-1).mean().item())
        prev = out.clone()
    assert abs(sum(sims) / len(sims) - 0.5) < 0.05


def test_profile_command_measures_adjacent_similarity():
    """The profile command's s_hat: the group-mean cosine of each query head's query to its previous one."""
    from experiments.infinigen_skew import skew_bases  # noqa: F401  (the skew command records queries the same way)
    from experiments.profile import adjacent_similarity

    q = torch.randn(1, 4, 8)  # [B, H, D], H = 2 KV heads x group 2
    flip = q.clone()
    flip[:, :2] *= -1  # KV head 0's queries point the other way each step, KV head 1's stay
    sims = adjacent_similarity([q, flip, q], group=2)
    assert sims.shape == (2, 1, 2)
    torch.testing.assert_close(sims[:, 0], torch.tensor([[-1.0, 1.0], [-1.0, 1.0]]))
