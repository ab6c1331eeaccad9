"""What each rank runs in the distributed tests: one training step of a tiny kernelized model under
DDP, FSDP2, tensor parallelism (torch's ``parallelize_module`` and transformers' own plan) and FSDP2 +
TP on a 2-D mesh, each compared with the same step of the un-kernelized model in one process.

``python workers.py '<json>'`` is the launcher: a fresh interpreter that imports what the ranks use
(torch, transformers, kernels_neuron) once, then starts each group of ranks with
``torch.multiprocessing`` by forking itself, so no rank pays those imports again and none inherits the
test process's state. The ranks use the gloo backend on localhost; each writes what it measured to
``<out>/<rank>.json`` and the test asserts on it. A group's scenarios run in its processes one after
the other.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import socket
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=64,
    use_cache=False,
)
BATCH, SEQ = 4, 24  # above DECODE_MAX_QUERIES: training runs the flash-attention forward


def tiny(arch: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, f"{arch}Config")(**CONFIG)
    return getattr(transformers, f"{arch}ForCausalLM")(config).train()


def batch() -> torch.Tensor:
    return torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def step(model: torch.nn.Module, ids: torch.Tensor, data_parallel=None) -> tuple[float, dict, list[str]]:
    """One forward/backward: the loss (averaged over the ``data_parallel`` group, whose ranks each took a
    slice of the batch), every gradient (whole tensors) and the NKI kernels that ran."""
    from kernels_neuron import sim

    with sim.capture() as traces:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    grads = {name.removeprefix("module."): full(p.grad).detach().clone() for name, p in model.named_parameters()}
    loss = loss.detach()
    if data_parallel is not None:
        dist.all_reduce(loss, group=data_parallel)
        loss /= dist.get_world_size(data_parallel)
    return float(loss), grads, sorted({t.kernel for t in traces})


def compare(got: tuple, want: tuple) -> dict:
    loss, grads, kernels = got
    ref_loss, ref_grads, _ = want
    assert grads.keys() == ref_grads.keys(), set(grads) ^ set(ref_grads)
    return {
        "loss": loss,
        "loss_error": abs(loss - ref_loss),
        "kernels": kernels,
        "grad_error": max(float((grads[n] - ref_grads[n]).abs().max()) for n in grads),
        "smallest_grad": min(float(ref_grads[n].abs().max()) for n in ref_grads),
    }


def report(model: torch.nn.Module) -> dict:
    rows = model.kernels_neuron_report
    return {
        "swapped": [r.path for r in rows.swapped],
        "fallbacks": {r.path: r.reason for r in rows.fallbacks},
        "call_time_fallbacks": {r.path: r.call_time_fallback for r in rows.call_time_fallbacks},
    }


def kernelize(model: torch.nn.Module) -> torch.nn.Module:
    import kernels_neuron

    return kernels_neuron.kernelize(model, device="neuron")


def ddp(rank: int, world: int, model_dir: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    want = step(tiny("Qwen3"), batch())
    model = kernelize(tiny("Qwen3"))
    got = step(DistributedDataParallel(model), batch().chunk(world)[rank], dist.group.WORLD)
    return {**compare(got, want), **report(model)}


def fsdp2(rank: int, world: int, model_dir: str) -> dict:
    from torch.distributed.fsdp import fully_shard

    want = step(tiny("Qwen3"), batch())
    model = kernelize(tiny("Qwen3"))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    got = step(model, batch().chunk(world)[rank], dist.group.WORLD)
    return {**compare(got, want), **report(model)}


def _torch_tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }


def torch_tp(rank: int, world: int, model_dir: str) -> dict:
    """torch's column/row-parallel plan on a Llama (heads and the MLP split over the ranks), then kernelize."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    want = step(tiny("Llama"), batch())
    model = tiny("Llama")
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        parallelize_module(layer, mesh, _torch_tp_plan())
    kernelize(model)
    return {**compare(step(model, batch()), want), **report(model)}


def sequence_parallel(rank: int, world: int, model_dir: str) -> dict:
    """torch's sequence-parallel variant of the MLP plan (input and output split by tokens): not the layout
    the fused layer reproduces, so the MLP must run its own forward, and be right."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    reference = tiny("Llama").model.layers[0].mlp
    mlp = tiny("Llama").model.layers[0].mlp
    plan = {
        "gate_proj": ColwiseParallel(input_layouts=Shard(1)),
        "up_proj": ColwiseParallel(input_layouts=Shard(1)),
        "down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }
    parallelize_module(mlp, init_device_mesh("cpu", (world,)), plan)
    kernelize(mlp)
    x = torch.randn(2, SEQ, CONFIG["hidden_size"], generator=torch.Generator().manual_seed(2))
    local = x.chunk(world, dim=1)[rank]
    error = float((mlp(local) - reference(x).chunk(world, dim=1)[rank]).abs().max())
    return {"error": None, "output_error": error, **report(mlp)}


def transformers_tp(rank: int, world: int, model_dir: str) -> dict:
    """transformers' own TP plan (Qwen3: its per-head q/k norms all-reduce their gradients), then kernelize."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    want = step(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train(), batch())
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, distributed_config=DistributedConfig(tp_size=world)
    ).train()
    kernelize(model)
    return {**compare(step(model, batch()), want), **report(model)}


def fsdp2_tp(rank: int, world: int, model_dir: str) -> dict:
    """FSDP2 over the data-parallel dim of a (2, world / 2) mesh, torch's TP plan over the other."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    want = step(tiny("Llama"), batch())
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    model = tiny("Llama")
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], _torch_tp_plan())
    kernelize(model)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    got = step(model, batch().chunk(2)[mesh["dp"].get_local_rank()], mesh["dp"].get_group())
    return {**compare(got, want), **report(model)}


SCENARIOS = {
    "ddp": ddp,
    "fsdp2": fsdp2,
    "torch_tp": torch_tp,
    "sequence_parallel": sequence_parallel,
    "transformers_tp": transformers_tp,
    "fsdp2_tp": fsdp2_tp,
}


def run(rank: int, world: int, port: int, scenarios: list[str], out: str, model_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # A rank that fails inside a collective must not leave the others waiting for gloo's 30-minute default.
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    from kernels_neuron import sim  # the launcher put this checkout first on sys.path

    sim.install()
    results = {}
    for name in scenarios:
        try:
            results[name] = SCENARIOS[name](rank, world, model_dir)
        except Exception:  # reported to the test, which fails naming the scenario
            results[name] = {"error": traceback.format_exc()}
        dist.barrier()
    Path(out, f"{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(groups: dict[str, list[str]], out: str, model_dir: str) -> dict[str, str | None]:
    """Each group ({world size: scenarios}) on that many forked ranks, one group after the other; each
    rank's results in ``<out>/<world>/<rank>.json``. Returns each group's failure (None: its ranks ran)."""
    import torch.multiprocessing as mp

    # What the scenarios import, imported here once: the forked ranks inherit it. No collections while
    # the imports create their lasting objects (see tests/conftest.py).
    gc.disable()
    import transformers.models.llama.modeling_llama  # noqa: F401
    import transformers.models.qwen3.modeling_qwen3  # noqa: F401
    from torch.distributed import device_mesh, fsdp, tensor  # noqa: F401
    from torch.distributed.tensor import parallel  # noqa: F401

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import kernels_neuron.integration  # noqa: F401

    # Python's advice before fork() without exec(): the ranks' collections then leave the inherited
    # objects alone (no traversal, no copy-on-write of their pages).
    gc.collect()
    gc.freeze()
    gc.enable()
    failures: dict[str, str | None] = {}
    for world, scenarios in groups.items():
        group_out = Path(out, world)
        group_out.mkdir()
        try:
            mp.start_processes(
                run,
                args=(int(world), _free_port(), scenarios, str(group_out), model_dir),
                nprocs=int(world),
                start_method="fork",
            )
            failures[world] = None
        except Exception:  # a rank that raised outside its scenarios, reported to that group's tests
            failures[world] = traceback.format_exc()
    return failures


if __name__ == "__main__":
    request = json.loads(sys.argv[1])
    print(json.dumps(launch(request["groups"], request["out"], request["model_dir"])))
