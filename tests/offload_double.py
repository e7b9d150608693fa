"""A test double of kvoffload.offload.host.Offload: the prefill's host copies as late as the CUDA path allows."""

import torch

from kvoffload.offload.host import Offload

CPU = torch.device("cpu")


class DeferredOffload(Offload):
    """Runs each offload as late as the CUDA path may: when the next one starts or at finish. Remembers whether a
    layer's prefill found the previous layer's offload still pending (it must wait for it first)."""

    def __init__(self):
        super().__init__(CPU)
        self.waiting = None
        self.deferred = 0

    def start(self, kv, host, encode=None):
        self.finish()
        self.waiting = (kv, host, encode)

    def finish(self):
        if self.waiting is not None:
            kv, host, encode = self.waiting
            self.waiting = None
            host.copy_(kv)
            if encode is not None:
                encode()
            self.deferred += 1
