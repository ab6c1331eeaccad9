"""`kernels benchmark` script for neuron-moe (shipped in the Hub repo's benchmarks/).

The kernels CLI synchronises only CUDA/XPU/MPS devices, so on Trainium this benchmark
synchronises the Neuron device itself after each call. On CPU (the simulator) the shapes are small.
"""

import torch
from kernels.benchmark import Benchmark

# Mixtral-8x7B's experts: hidden 4096, intermediate 14336, 8 experts, top-2; a 2048-token prefill and an
# 8-token decode, routed by a random softmax router (the router stays in torch).
HIDDEN, INTERMEDIATE, EXPERTS, TOP_K, TOKENS, DECODE_TOKENS = 4096, 14336, 8, 2, 2048, 8


def _synchronize(device) -> None:
    if torch.device(device).type == "neuron":
        torch.neuron.synchronize()


def _route(tokens, experts, top_k, generator, device):
    probs = torch.randn(tokens, experts, generator=generator).softmax(-1)
    weights, index = torch.topk(probs, top_k, dim=-1)
    return index.to(device), (weights / weights.sum(-1, keepdim=True)).to(device)


class MoEExpertsBenchmark(Benchmark):
    seed = 0

    def setup(self):
        on_cpu = torch.device(self.device).type == "cpu"
        dtype = torch.float32 if on_cpu else torch.bfloat16
        # the simulator is slow: small experts on the CPU
        hidden, inter, tokens = (256, 384, 128) if on_cpu else (HIDDEN, INTERMEDIATE, TOKENS)
        generator = torch.Generator().manual_seed(self.seed)
        self.x = torch.randn(tokens, hidden, dtype=dtype, device=self.device)
        self.w_gate_up = torch.randn(EXPERTS, 2 * inter, hidden, dtype=dtype, device=self.device) * hidden**-0.5
        self.w_down = torch.randn(EXPERTS, hidden, inter, dtype=dtype, device=self.device) * inter**-0.5
        self.index, self.weights = _route(tokens, EXPERTS, TOP_K, generator, self.device)
        self.x_decode = self.x[:DECODE_TOKENS].contiguous()
        self.index_decode, self.weights_decode = self.index[:DECODE_TOKENS], self.weights[:DECODE_TOKENS]

    def benchmark_prefill(self):
        self.out = self.kernel.moe_experts(self.x, self.index, self.weights, self.w_gate_up, self.w_down, "silu")
        _synchronize(self.device)

    def verify_prefill(self):
        return self.kernel.moe_experts_reference(self.x, self.index, self.weights, self.w_gate_up, self.w_down, "silu")

    def benchmark_decode(self):
        self.out = self.kernel.moe_experts(
            self.x_decode, self.index_decode, self.weights_decode, self.w_gate_up, self.w_down, "silu"
        )
        _synchronize(self.device)

    def verify_decode(self):
        return self.kernel.moe_experts_reference(
            self.x_decode, self.index_decode, self.weights_decode, self.w_gate_up, self.w_down, "silu"
        )
