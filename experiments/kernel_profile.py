"""Kernel-level view of decode steps (torch.profiler over CUPTI): the device time of each kernel per step,
including kernels replayed from a CUDA graph, where phase events cannot be placed. It answers where a graph
step's time goes; it does not see idle gaps (the step time minus the kernel time on the critical path)."""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch


class KernelProfile:
    def __init__(self, steps: int, skip: int):
        from torch.profiler import ProfilerActivity, profile, schedule

        self.steps = steps
        self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                            schedule=schedule(wait=skip, warmup=1, active=steps))

    def context(self) -> AbstractContextManager:
        return self.prof

    def step(self) -> None:
        self.prof.step()

    def table(self, top: int = 30) -> dict:
        """The `top` kernels by device time per step, and the sum over all kernels (streams overlap: the sum
        can exceed the step time)."""
        kernels = [e for e in self.prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        time_us = lambda e: getattr(e, "self_device_time_total", None) or e.self_cuda_time_total  # noqa: E731
        kernels.sort(key=time_us, reverse=True)
        return {
            "steps": self.steps,
            "kernel_us_per_step": round(sum(time_us(e) for e in kernels) / self.steps, 2),
            "top": [{"kernel": e.key[:160], "calls_per_step": e.count / self.steps,
                     "us_per_step": round(time_us(e) / self.steps, 2)} for e in kernels[:top]],
        }


def maybe_profile(steps: int, skip: int, device: torch.device) -> KernelProfile | None:
    return KernelProfile(steps, skip) if steps > 0 and device.type == "cuda" else None


def context(profile: KernelProfile | None) -> AbstractContextManager:
    return profile.context() if profile is not None else nullcontext()
