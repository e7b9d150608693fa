"""The synthetic query process gives each head the adjacent-step similarity its profile asks for."""

import pytest
import torch

from experiments.workloads.query_process import ProfileQueryProcess, map_profile


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
    from experiments.producers.infinigen_skew import skew_bases  # noqa: F401  (the skew command records queries the same way)
    from experiments.producers.profile import adjacent_similarity

    q = torch.randn(1, 4, 8)  # [B, H, D], H = 2 KV heads x group 2
    flip = q.clone()
    flip[:, :2] *= -1  # KV head 0's queries point the other way each step, KV head 1's stay
    sims = adjacent_similarity([q, flip, q], group=2)
    assert sims.shape == (2, 1, 2)
    torch.testing.assert_close(sims[:, 0], torch.tensor([[-1.0, 1.0], [-1.0, 1.0]]))


def _lag_cos(proc, layer, q0, steps, lags, speculative=False):
    """Mean cosine (over batch rows) of the process's query at step t with step t - lag, per query head."""
    out = [proc.query(layer, q0, advance=True)]
    for _ in range(steps):
        out.append(proc.query(layer, torch.randn_like(q0), advance=True, speculative=speculative))
    u = torch.nn.functional.normalize(torch.stack(out), dim=-1)  # [T, B, H, D]
    return {lag: (u[lag:] * u[:-lag]).sum(-1).mean((0, 1)) for lag in lags}


def test_persistent_process_follows_its_fitted_lag_curve():
    c = torch.tensor([[0.7, 0.4], [0.0, 0.85]])
    rho = torch.tensor([[0.5, 0.8], [0.9, 0.3]])
    proc = ProfileQueryProcess(
        torch.ones(2, 2), group=2, device=torch.device("cpu"), source="test", persistent=c, rho=rho
    )
    torch.manual_seed(0)
    q0 = torch.randn(32, 4, 64) * 2.0
    first = proc.query(1, q0, advance=True)
    torch.testing.assert_close(first, q0)  # the first step is the model's own query
    for layer in (0, 1):
        got = _lag_cos(proc, layer, q0, 200, (1, 2, 4, 8))
        for lag, cos in got.items():
            want = (c[layer] + (1 - c[layer]) * rho[layer] ** lag).repeat_interleave(2)
            torch.testing.assert_close(cos, want, atol=0.03, rtol=0)
    same = proc.query(0, torch.randn(32, 4, 64), advance=False)
    again = proc.query(0, torch.randn(32, 4, 64), advance=False)
    torch.testing.assert_close(
        torch.nn.functional.normalize(same, dim=-1), torch.nn.functional.normalize(again, dim=-1)
    )


@pytest.mark.slow
def test_speculative_query_is_at_its_target_cosine():
    spec = torch.tensor([[1.0, 1.0], [0.93, 0.6]])
    proc = ProfileQueryProcess(
        torch.ones(2, 2),
        group=2,
        device=torch.device("cpu"),
        source="test",
        persistent=torch.full((2, 2), 0.7),
        rho=torch.full((2, 2), 0.5),
        spec_cos=spec,
    )
    torch.manual_seed(0)
    q = torch.randn(256, 4, 64)
    proc.query(1, q, advance=True)
    cos, spec_lag1, prev = [], [], None
    for _ in range(40):  # as the decoder calls it: the speculative call advances, the layer's own reads
        s = proc.query(1, torch.randn_like(q), advance=True, speculative=True)
        r = proc.query(1, torch.randn_like(q), advance=False)
        cos.append(torch.nn.functional.cosine_similarity(s, r, dim=-1).mean(0))
        if prev is not None:
            spec_lag1.append(torch.nn.functional.cosine_similarity(s, prev, dim=-1).mean())
        prev = s
    torch.testing.assert_close(torch.stack(cos).mean(0), spec[1].repeat_interleave(2), atol=0.01, rtol=0)
    # the speculative queries of adjacent steps are as alike as the real ones (c + (1 - c) rho = 0.85)
    assert abs(torch.stack(spec_lag1).mean() - 0.85) < 0.03
    torch.testing.assert_close(proc.query(1, q, advance=False, speculative=False).norm(dim=-1), q.norm(dim=-1))


def test_old_profiles_give_the_old_process():
    """A profile with only s_hat is the AR(1) chain of before, draw for draw (existing records reproduce)."""
    import json

    from experiments.workloads.query_process import map_process_fields

    proc = ProfileQueryProcess.from_profile("data/profiles/smollm2.json", 30, 3, 3, torch.device("cpu"))
    assert not proc.persistent_form and proc.spec is None and "synthetic AR(1)" in proc.description
    s_hat = torch.tensor(json.loads(open("data/profiles/smollm2.json").read())["s_hat"])
    torch.manual_seed(1)
    q0 = torch.randn(1, 9, 64)
    state, rho = q0 / q0.norm(dim=-1, keepdim=True), s_hat[4].repeat_interleave(3)[None, :, None]
    want = []
    for _ in range(3):
        e = torch.randn(1, 9, 64)
        new = rho * state + (1 - rho * rho).clamp_min(0).sqrt() * e / e.norm(dim=-1, keepdim=True)
        state = new / new.norm(dim=-1, keepdim=True)
        want.append(state * q0.norm(dim=-1, keepdim=True))
    torch.manual_seed(1)
    q0 = torch.randn(1, 9, 64)
    proc.query(4, q0, advance=True)
    got = [proc.query(4, q0, advance=True, speculative=True) for _ in range(3)]
    torch.testing.assert_close(torch.stack(got), torch.stack(want))
    new = ProfileQueryProcess.from_profile("data/profiles/smollm2-process.json", 30, 3, 3, torch.device("cpu"))
    assert new.persistent_form and new.spec is not None
    # the mapped profile carries each source head's (s_hat, c, rho) together
    src = {k: torch.rand(30, 3) for k in ("s_hat", "persistent", "rho", "spec_cos")}
    mapped = map_process_fields(src, 32, 8)
    pairs = {(a, b, c) for a, b, c in zip(*(src[k].flatten().tolist() for k in ("s_hat", "persistent", "rho")))}
    assert all(t in pairs for t in zip(*(mapped[k].flatten().tolist() for k in ("s_hat", "persistent", "rho"))))
    torch.testing.assert_close(mapped["s_hat"], map_profile(src["s_hat"], 32, 8))


def test_fit_recovers_a_persistent_curve():
    from experiments.workloads.query_process import fit_persistent

    c, rho = torch.tensor([0.7, 0.0, 0.5]), torch.tensor([0.5, 0.85, 0.0])
    lags = torch.tensor([1.0, 2, 4, 8])[:, None]
    fc, fr = fit_persistent(c + (1 - c) * rho**lags)
    torch.testing.assert_close(fc, c, atol=0.01, rtol=0)
    torch.testing.assert_close(fr[:2], rho[:2], atol=0.01, rtol=0)


@pytest.mark.gpu
def test_the_persistent_process_advances_when_replayed_from_a_cuda_graph():
    """The persistent form and its speculative query in a replayed graph: lag-1 cosine c + (1 - c) rho, the
    speculative query at spec_cos from the real one, on every replay."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA; run on the GPU machine")
    dev = torch.device("cuda")
    proc = ProfileQueryProcess(
        torch.ones(1, 1),
        group=4,
        device=dev,
        source="test",
        persistent=torch.tensor([[0.5]]),
        rho=torch.tensor([[0.5]]),
        spec_cos=torch.tensor([[0.8]]),
    )
    q = torch.randn(64, 4, 128, device=dev)
    for _ in range(2):  # eager first calls, as the decode warm-up makes
        proc.query(0, q, advance=True, speculative=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        spec = proc.query(0, q, advance=True, speculative=True)
        real = proc.query(0, q, advance=False)
    prev, sims, specs = real.clone(), [], []
    for _ in range(20):
        graph.replay()
        sims.append(torch.nn.functional.cosine_similarity(real, prev, dim=-1).mean().item())
        specs.append(torch.nn.functional.cosine_similarity(spec, real, dim=-1).mean().item())
        prev = real.clone()
    assert abs(sum(sims) / len(sims) - 0.75) < 0.05 and abs(sum(specs) / len(specs) - 0.8) < 0.02


@pytest.mark.gpu
@pytest.mark.parametrize("spec_cos", [None, [[0.9, 0.6], [0.8, 0.7]]])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_one_launch_process_equals_the_torch_process_draw_for_draw(spec_cos, dtype):
    """kvoffload.kernels.query_chain against this module's torch code (its specification): same seeds, the
    decoder's call pattern, several steps, every layer; outputs and both chains' states agree."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA; run on the GPU machine")
    dev = torch.device("cuda")
    fields = dict(persistent=torch.tensor([[0.7, 0.2], [0.0, 0.9]]), rho=torch.tensor([[0.5, 0.8], [0.95, 0.3]]))
    if spec_cos is not None:
        fields["spec_cos"] = torch.tensor(spec_cos)
    procs = [ProfileQueryProcess(torch.ones(2, 2), 4, dev, "test", fused=f, **fields) for f in (False, True)]
    q = torch.randn(5, 16, 128, device=dev, dtype=dtype)[:, ::2]  # a strided view: the kernel's out must be rows
    outs = []
    for proc in procs:
        torch.manual_seed(7)
        got = []
        for _ in range(4):
            for layer in range(2):
                if spec_cos is not None and layer + 1 < 2:
                    got.append(proc.query(layer + 1, q * (layer + 2), advance=True, speculative=True))
                got.append(proc.query(layer, q * (layer + 1), advance=not (spec_cos is not None and layer > 0)))
        outs.append(got)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    for a, b in zip(*outs):
        torch.testing.assert_close(b, a, **tol)
    torch_proc, fused_proc = procs
    for layer in range(2):
        for x, y in zip(torch_proc.state[layer], fused_proc.state[layer]):
            torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5)
        if spec_cos is not None:
            for x, y in zip(torch_proc.err[layer], fused_proc.err[layer]):
                torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5)
