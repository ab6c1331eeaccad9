"""`kernels benchmark` script for neuron-rmsnorm (shipped in the Hub repo's benchmarks/).

The kernels CLI synchronises only CUDA/XPU/MPS devices, so on Trainium this benchmark
synchronises the Neuron device itself after each call.
"""

import torch
from kernels.benchmark import Benchmark

ROWS, HIDDEN, EPS = 4096, 4096, 1e-6


def _synchronize(device) -> None:
    if torch.device(device).type == "neuron":
        torch.neuron.synchronize()


class RMSNormBenchmark(Benchmark):
    seed = 0

    def setup(self):
        dtype = torch.float32 if torch.device(self.device).type == "cpu" else torch.bfloat16
        rows = 256 if torch.device(self.device).type == "cpu" else ROWS  # the CPU simulator is slow
        self.x = torch.randn(rows, HIDDEN, dtype=dtype, device=self.device)
        self.weight = torch.randn(HIDDEN, dtype=dtype, device=self.device) * 0.1 + 1.0

    def benchmark_llama(self):
        self.out = self.kernel.rms_norm(self.x, self.weight, EPS, "llama")
        _synchronize(self.device)

    def verify_llama(self):
        return self.kernel.rms_norm_reference(self.x, self.weight, EPS, "llama")

    def benchmark_gemma(self):
        self.out = self.kernel.rms_norm(self.x, self.weight, EPS, "gemma")
        _synchronize(self.device)

    def verify_gemma(self):
        return self.kernel.rms_norm_reference(self.x, self.weight, EPS, "gemma")
