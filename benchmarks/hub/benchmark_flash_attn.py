"""`kernels benchmark` script for neuron-flash-attn (shipped in the Hub repo's benchmarks/).

The kernels CLI synchronises only CUDA/XPU/MPS devices, so on Trainium this benchmark
synchronises the Neuron device itself after each call. On CPU (the simulator) the shapes are small.
"""

import torch
from kernels.benchmark import Benchmark

# Llama-3-8B-like attention: 32 query heads, 8 KV heads, head_dim 128.
HEADS, KV_HEADS, HEAD_DIM, SEQ = 32, 8, 128, 2048


def _synchronize(device) -> None:
    if torch.device(device).type == "neuron":
        torch.neuron.synchronize()


class FlashAttnBenchmark(Benchmark):
    seed = 0

    def setup(self):
        on_cpu = torch.device(self.device).type == "cpu"
        dtype = torch.float32 if on_cpu else torch.bfloat16
        heads, kv_heads, seq = (4, 2, 256) if on_cpu else (HEADS, KV_HEADS, SEQ)  # the CPU simulator is slow
        self.q = torch.randn(1, heads, seq, HEAD_DIM, dtype=dtype, device=self.device)
        self.k = torch.randn(1, kv_heads, seq, HEAD_DIM, dtype=dtype, device=self.device)
        self.v = torch.randn(1, kv_heads, seq, HEAD_DIM, dtype=dtype, device=self.device)
        self.q_decode = self.q[:, :, -1:].contiguous()

    def benchmark_causal_prefill(self):
        self.out = self.kernel.flash_attention(self.q, self.k, self.v, causal=True)
        _synchronize(self.device)

    def verify_causal_prefill(self):
        return self.kernel.attention_reference(self.q, self.k, self.v, causal=True)

    def benchmark_sliding_window(self):
        self.out = self.kernel.flash_attention(self.q, self.k, self.v, causal=True, window=64)
        _synchronize(self.device)

    def verify_sliding_window(self):
        return self.kernel.attention_reference(self.q, self.k, self.v, causal=True, window=64)

    def benchmark_decode(self):
        self.out = self.kernel.flash_attention(self.q_decode, self.k, self.v, causal=True)
        _synchronize(self.device)

    def verify_decode(self):
        return self.kernel.attention_reference(self.q_decode, self.k, self.v, causal=True)
