"""The one-layer-ahead hook (docs/systems.md, "Speculative query"): during layer l-1 of a decode step, a system that
asks for it gets layer l's query computed from layer l-1's input, before layer l-1's attention runs."""

import torch

from baselines.fullattn import FullAttn
from kvoffload.kv.interface import KVSpec
from kvoffload.model.weights import synthetic_decoder
from tests.tiny_models import tiny_config


class Recorder(FullAttn):
    wants_speculative_query = True

    def __init__(self):
        super().__init__()
        self.events, self.spec_q, self.real_q = [], {}, {}

    def prepare(self, layer, q_spec):
        self.events.append(("prepare", layer))
        self.spec_q[layer] = q_spec.clone()

    def decode(self, layer, q, k, v):
        self.events.append(("decode", layer))
        self.real_q[layer] = q.clone()
        return super().decode(layer, q, k, v)


def test_prepare_gets_next_layers_query_one_layer_ahead():
    cfg = tiny_config(num_layers=4)
    model = synthetic_decoder(cfg, 0, torch.device("cpu"), torch.float32)
    with torch.no_grad():  # layer 0 adds nothing to the residual: layer 1's input equals layer 0's input
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        model.model.layers[0].mlp.down_proj.weight.zero_()
    kv = Recorder()
    kv.allocate(KVSpec(4, 2, 40, 4, 2, 16, torch.float32, torch.device("cpu")))
    model.prefill(torch.randint(0, 100, (2, 30)), kv)
    kv.begin_step()
    model.decode(torch.tensor([5, 7]), kv.position, kv)
    kv.end_step()
    assert kv.events == [
        ("prepare", 1),
        ("decode", 0),
        ("prepare", 2),
        ("decode", 1),
        ("prepare", 3),
        ("decode", 2),
        ("decode", 3),
    ]
    torch.testing.assert_close(kv.spec_q[1], kv.real_q[1])  # same input, so the speculation is exact
    assert not torch.allclose(kv.spec_q[2], kv.real_q[2])  # layer 1 changed the residual: an approximation
    cos = torch.nn.functional.cosine_similarity(kv.spec_q[2], kv.real_q[2], dim=-1)
    assert cos.shape == (2, 4) and (cos > 0).all()
