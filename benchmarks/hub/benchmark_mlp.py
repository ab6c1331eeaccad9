"""`kernels benchmark` script for neuron-mlp (shipped in the Hub repo's benchmarks/).

The kernels CLI synchronises only CUDA/XPU/MPS devices, so on Trainium this benchmark
synchronises the Neuron device itself after each call. On CPU (the simulator) the shapes are small.
"""

import torch
from kernels.benchmark import Benchmark

# Llama-3-8B's MLP: hidden 4096, intermediate 14336; a 2048-token prefill and an 8-token decode.
HIDDEN, INTERMEDIATE, TOKENS, DECODE_TOKENS = 4096, 14336, 2048, 8


def _synchronize(device) -> None:
    if torch.device(device).type == "neuron":
        torch.neuron.synchronize()


class GatedMLPBenchmark(Benchmark):
    seed = 0

    def setup(self):
        on_cpu = torch.device(self.device).type == "cpu"
        dtype = torch.float32 if on_cpu else torch.bfloat16
        hidden, inter, tokens = (256, 640, 128) if on_cpu else (HIDDEN, INTERMEDIATE, TOKENS)  # the simulator is slow
        self.x = torch.randn(tokens, hidden, dtype=dtype, device=self.device)
        self.w_gate = torch.randn(inter, hidden, dtype=dtype, device=self.device) * hidden**-0.5
        self.w_up = torch.randn(inter, hidden, dtype=dtype, device=self.device) * hidden**-0.5
        self.w_down = torch.randn(hidden, inter, dtype=dtype, device=self.device) * inter**-0.5
        self.x_decode = self.x[:DECODE_TOKENS].contiguous()

    def benchmark_swiglu_prefill(self):
        self.out = self.kernel.gated_mlp(self.x, self.w_gate, self.w_up, self.w_down, "silu")
        _synchronize(self.device)

    def verify_swiglu_prefill(self):
        return self.kernel.gated_mlp_reference(self.x, self.w_gate, self.w_up, self.w_down, "silu")

    def benchmark_geglu_prefill(self):
        self.out = self.kernel.gated_mlp(self.x, self.w_gate, self.w_up, self.w_down, "gelu_tanh")
        _synchronize(self.device)

    def verify_geglu_prefill(self):
        return self.kernel.gated_mlp_reference(self.x, self.w_gate, self.w_up, self.w_down, "gelu_tanh")

    def benchmark_swiglu_decode(self):
        self.out = self.kernel.gated_mlp(self.x_decode, self.w_gate, self.w_up, self.w_down, "silu")
        _synchronize(self.device)

    def verify_swiglu_decode(self):
        return self.kernel.gated_mlp_reference(self.x_decode, self.w_gate, self.w_up, self.w_down, "silu")


# Starcoder2-7B's MLP: hidden 4608, intermediate 18432, biases, tanh-GELU.
PLAIN_HIDDEN, PLAIN_INTERMEDIATE = 4608, 18432


class PlainMLPBenchmark(Benchmark):
    seed = 0

    def setup(self):
        on_cpu = torch.device(self.device).type == "cpu"
        dtype = torch.float32 if on_cpu else torch.bfloat16
        hidden, inter, tokens = (256, 640, 128) if on_cpu else (PLAIN_HIDDEN, PLAIN_INTERMEDIATE, TOKENS)
        self.x = torch.randn(tokens, hidden, dtype=dtype, device=self.device)
        self.w_up = torch.randn(inter, hidden, dtype=dtype, device=self.device) * hidden**-0.5
        self.w_down = torch.randn(hidden, inter, dtype=dtype, device=self.device) * inter**-0.5
        self.b_up = torch.randn(inter, dtype=dtype, device=self.device) * 0.1
        self.b_down = torch.randn(hidden, dtype=dtype, device=self.device) * 0.1

    def benchmark_gelu_tanh_prefill(self):
        self.out = self.kernel.plain_mlp(self.x, self.w_up, self.w_down, self.b_up, self.b_down, "gelu_tanh")
        _synchronize(self.device)

    def verify_gelu_tanh_prefill(self):
        return self.kernel.plain_mlp_reference(self.x, self.w_up, self.w_down, self.b_up, self.b_down, "gelu_tanh")
