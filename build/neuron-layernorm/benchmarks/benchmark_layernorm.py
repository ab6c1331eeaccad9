"""`kernels benchmark` script for neuron-layernorm (shipped in the Hub repo's benchmarks/).

The kernels CLI synchronises only CUDA/XPU/MPS devices, so on Trainium this benchmark
synchronises the Neuron device itself after each call.
"""

import torch
from kernels.benchmark import Benchmark

ROWS, HIDDEN, EPS = 4096, 4096, 1e-5


def _synchronize(device) -> None:
    if torch.device(device).type == "neuron":
        torch.neuron.synchronize()


class LayerNormBenchmark(Benchmark):
    seed = 0

    def setup(self):
        dtype = torch.float32 if torch.device(self.device).type == "cpu" else torch.bfloat16
        rows = 256 if torch.device(self.device).type == "cpu" else ROWS  # the CPU simulator is slow
        self.x = torch.randn(rows, HIDDEN, dtype=dtype, device=self.device)
        self.weight = torch.randn(HIDDEN, dtype=dtype, device=self.device) * 0.1 + 1.0
        self.bias = torch.randn(HIDDEN, dtype=dtype, device=self.device) * 0.1

    def benchmark_affine(self):
        self.out = self.kernel.layer_norm(self.x, self.weight, self.bias, EPS)
        _synchronize(self.device)

    def verify_affine(self):
        return self.kernel.layer_norm_reference(self.x, self.weight, self.bias, EPS)

    def benchmark_weight_only(self):
        self.out = self.kernel.layer_norm(self.x, self.weight, None, EPS)
        _synchronize(self.device)

    def verify_weight_only(self):
        return self.kernel.layer_norm_reference(self.x, self.weight, None, EPS)
