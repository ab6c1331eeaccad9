"""The main job: a tiny Qwen3 model, kernelized for Trainium, run on the NKI simulator.

It builds the model from a config (nothing is downloaded), kernelizes a copy for ``neuron``,
runs a forward pass and a short greedy ``generate`` through both, and prints the swap report,
how far the kernelized model deviates from the original, and the modelled (not measured) Trn2
time of the NKI kernels that ran.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console
from rich.table import Table

from . import cost, sim

if TYPE_CHECKING:
    from transformers import Qwen3ForCausalLM

DEMO_CONFIG: dict[str, Any] = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=128,
    max_position_embeddings=256,
)
PROMPT_TOKENS = 16
NEW_TOKENS = 8


@dataclass
class DemoResult:
    swapped: int
    fallbacks: int
    max_logit_deviation: float
    same_tokens: bool
    modelled_us_by_kernel: dict[str, tuple[int, float]]  # kernel -> (launches, total modelled µs)


def build_model(seed: int = 0) -> Qwen3ForCausalLM:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(**DEMO_CONFIG)).eval()


def _greedy_tokens(model: Any, prompt: torch.Tensor) -> torch.Tensor:
    """``model.generate`` without sampling. ``model`` is typed loosely: transformers annotates ``generate``
    with a self-type its own model classes do not satisfy under mypy."""
    return model.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False)


def run(target: str = "trn2", console: Console | None = None) -> DemoResult:
    from . import kernelize

    console = console or Console()
    sim.install()  # the kernels run on this process's simulator, so their traces can be captured
    original = build_model()
    model = kernelize(copy.deepcopy(original), device="neuron")
    report = model.kernels_neuron_report
    console.print(report.table())

    prompt = torch.randint(0, DEMO_CONFIG["vocab_size"], (2, PROMPT_TOKENS), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = original(prompt).logits
        with sim.capture() as traces:
            got = model(prompt).logits
        generated_ref, generated = _greedy_tokens(original, prompt), _greedy_tokens(model, prompt)
    deviation = float((got - expected).abs().max())
    same = bool(torch.equal(generated, generated_ref))

    by_kernel: dict[str, list[float]] = defaultdict(list)
    for trace in traces:
        by_kernel[trace.kernel].append(cost.estimate_trace(trace, target).time_us)
    timing = Table(title=f"NKI kernels in one forward pass — modelled {target.capitalize()} estimate, not measured")
    for column in ("kernel", "launches", "modelled µs per launch", "modelled µs total"):
        timing.add_column(column, justify="left" if column == "kernel" else "right")
    for kernel, times in sorted(by_kernel.items()):
        timing.add_row(kernel, str(len(times)), f"{sum(times) / len(times):.2f}", f"{sum(times):.2f}")
    console.print(timing)
    console.print(f"max |logit deviation| from the un-kernelized model: {deviation:.3g} (fp32)")
    console.print(f"greedy generate ({NEW_TOKENS} new tokens) gives the same tokens: {'yes' if same else 'NO'}")
    return DemoResult(
        len(report.swapped), len(report.fallbacks), deviation, same, {k: (len(v), sum(v)) for k, v in by_kernel.items()}
    )
