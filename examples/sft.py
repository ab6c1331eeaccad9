"""The reference training workflow, at tiny scale on the CPU: supervised fine-tuning of a kernelized
Qwen3 with TRL's ``SFTTrainer``, sequences packed to a fixed length padded to a multiple of 128 (the
Neuron backend compiles static shapes), the trainer's default precision (bf16 autocast), in one process
and with FSDP2 on 2 gloo ranks; then the checkpoint saved as a standard transformers model, reloaded in
plain transformers, kernelized again and used to ``generate`` with a static cache.

Every run is repeated without kernels, and the losses are printed side by side. On the CPU the NKI
kernels run on the simulator, so this is about behaviour, not speed.

    kernels-neuron examples sft        # or: python examples/sft.py [--steps N] [--no-fsdp]

What it shows, in order: ``kernelize(model)`` before the trainer wraps it; TRL's padding-free packed
batches reaching the kernel's packed-sequence path (``cu_seq_lens_q/k``); gradient checkpointing and
autocast around the kernels; ``fully_shard`` per decoder layer through the trainer's FSDP2 config; and a
checkpoint with nothing kernel-specific in it.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

# A tiny Qwen3 whose every norm is one the RMSNorm kernel takes (head_dim 64 for the q/k norms).
MODEL = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    tie_word_embeddings=True,
)
PACKED_LENGTH = 256  # sequences packed into rows of this many tokens ...
PAD_MULTIPLE = 128  # ... padded to a multiple of this (static shapes on Neuron)
TOLERANCE = 0.01  # largest relative loss difference bf16 training noise explains (measured: ~1e-4)


def tokenizer():
    """A word-level tokenizer built in memory (nothing is downloaded): numbers 0..99 and a few words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>", "count", "from", ":"] + [str(i) for i in range(100)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def dataset(samples: int = 96):
    """Texts of 10 to 130 tokens, "count from 17 : 17 18 19 ...", which a model can learn in a few steps."""
    from datasets import Dataset

    generator = torch.Generator().manual_seed(0)
    texts = []
    for _ in range(samples):
        start, length = (int(torch.randint(low, high, (1,), generator=generator)) for low, high in ((0, 100), (6, 126)))
        texts.append(f"count from {start} : " + " ".join(str((start + i) % 100) for i in range(length)))
    return Dataset.from_dict({"text": texts})


def model(kernelized: bool):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    vocab = tokenizer()
    config = Qwen3Config(
        **MODEL,
        vocab_size=len(vocab),
        pad_token_id=vocab.pad_token_id,
        eos_token_id=vocab.eos_token_id,
        bos_token_id=vocab.eos_token_id,
    )
    result = Qwen3ForCausalLM(config)
    if kernelized:
        import kernels_neuron

        kernels_neuron.kernelize(result.train(), device="neuron")
    return result


def _quiet() -> None:
    """Keep the console to the results: no progress bars, no per-step log dicts, no info logs."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()


def config(**overrides):
    """The trainer's arguments: TRL's defaults (bf16 autocast on the CPU, gradient checkpointing),
    packing into fixed-length rows, a few logged steps."""
    from trl import SFTConfig

    return SFTConfig(
        **{
            **dict(
                output_dir=tempfile.mkdtemp(),
                per_device_train_batch_size=2,
                packing=True,
                max_length=PACKED_LENGTH,
                pad_to_multiple_of=PAD_MULTIPLE,
                learning_rate=1e-3,
                logging_steps=1,
                report_to=[],
                use_cpu=True,
                save_strategy="no",
                seed=0,
                dataloader_num_workers=0,
                disable_tqdm=True,
            ),
            **overrides,
        }
    )


def train(kernelized: bool, steps: int) -> tuple[list[float], object]:
    """``SFTTrainer`` with its default precision on a fresh model: the losses per step, and the trainer."""
    from transformers import PrinterCallback
    from trl import SFTTrainer

    trainer = SFTTrainer(
        model=model(kernelized), args=config(max_steps=steps), train_dataset=dataset(), processing_class=tokenizer()
    )
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry], trainer


def train_fully_sharded(kernelized: bool, steps: int) -> tuple[list[float], bool, list[str]]:
    """FSDP2 on this rank's process group: ``fully_shard`` per decoder layer, then the model; TRL's data
    pipeline (packing, padding-free batches) from an ``SFTTrainer``, the trainer's bf16 autocast, AdamW.

    The loop is written out because Accelerate applies FSDP only on accelerators: on the CPU it wraps
    the model in DDP (``fsdp_config`` is ignored, and a model already sharded with ``fully_shard``
    fails in DDP's constructor), with or without kernels. On Trainium, ``SFTTrainer(args=SFTConfig(
    fsdp=True, fsdp_config={"fsdp_version": 2, ...}))`` shards the model itself."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from trl import SFTTrainer

    network = model(kernelized).train()
    for layer in network.model.layers:
        fully_shard(layer)
    fully_shard(network)
    trainer = SFTTrainer(
        model=network, args=config(max_steps=steps), train_dataset=dataset(), processing_class=tokenizer()
    )
    optimizer = torch.optim.AdamW(network.parameters(), lr=1e-3)
    losses = []
    for _, batch in zip(range(steps), trainer.get_train_dataloader()):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = network(**batch, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
    sharded = all(isinstance(p, DTensor) for p in network.parameters())
    report = getattr(network, "kernels_neuron_report", None)
    return losses, sharded, [r.path for r in report.call_time_fallbacks] if report else []


def _fsdp_rank(out: str, steps: int) -> None:
    """One of the 2 ranks torch.distributed.run starts: both trainings under FSDP2, losses to ``out``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    _quiet()
    dist.init_process_group("gloo")
    results = {}
    for kernelized in (False, True):
        losses, sharded, fallbacks = train_fully_sharded(kernelized, steps)
        results["kernelized" if kernelized else "transformers"] = {
            "losses": losses,
            "sharded": sharded,
            "call_time_fallbacks": fallbacks,
        }
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fsdp(steps: int) -> dict:
    """Both trainings on 2 gloo ranks, started the standard way (torch.distributed.run)."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch, "losses.json")
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(_free_port()),
            __file__,
            "--fsdp-rank",
            str(out),
            "--steps",
            str(steps),
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"the FSDP2 ranks failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
        return json.loads(out.read_text())


def generate_from_checkpoint(path: str) -> tuple[bool, list[int]]:
    """Reload the checkpoint in plain transformers, kernelize it for inference and generate greedily with a
    static cache: the same tokens as the plain model?"""
    from transformers import AutoModelForCausalLM

    import kernels_neuron

    vocab = tokenizer()
    prompt = vocab("count from 40 : 40 41 42", return_tensors="pt").input_ids
    settings = dict(max_new_tokens=8, do_sample=False, cache_implementation="static", pad_token_id=vocab.pad_token_id)
    plain = AutoModelForCausalLM.from_pretrained(path).eval()
    kernelized = kernels_neuron.kernelize(AutoModelForCausalLM.from_pretrained(path).eval(), device="neuron")
    with torch.no_grad():
        expected, got = plain.generate(prompt, **settings), kernelized.generate(prompt, **settings)
    return torch.equal(got, expected), got[0, prompt.shape[1] :].tolist()


def _close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) > 0 and all(abs(x - y) <= TOLERANCE * abs(y) for x, y in zip(a, b))


def run(steps: int = 4, with_fsdp: bool = True, console=None) -> bool:
    """The whole workflow; prints the losses and returns whether everything matched."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    _quiet()
    ok = True
    with tempfile.TemporaryDirectory() as checkpoint:
        expected, _ = train(False, steps)
        losses, trainer = train(True, steps)
        trainer.model.save_pretrained(checkpoint)  # a standard checkpoint: kernelize adds no state
        fallbacks = [r.path for r in trainer.model.kernels_neuron_report.call_time_fallbacks]
        runs = {"1 process": (expected, losses, fallbacks)}
        if with_fsdp:
            sharded = fsdp(steps)
            runs["FSDP2, 2 ranks"] = (
                sharded["transformers"]["losses"],
                sharded["kernelized"]["losses"],
                sharded["kernelized"]["call_time_fallbacks"],
            )
            ok &= sharded["kernelized"]["sharded"]
        same_tokens, tokens = generate_from_checkpoint(checkpoint)
    table = Table(
        title=f"SFTTrainer, packed to {PACKED_LENGTH} tokens (padded to a multiple of {PAD_MULTIPLE}), "
        "default precision (bf16 autocast on the CPU)"
    )
    for column in ("run", "step", "loss: transformers", "loss: kernelized", "relative difference"):
        table.add_column(column, justify="left" if column == "run" else "right")
    for name, (want, got, fallbacks) in runs.items():
        ok &= _close(got, want) and not fallbacks
        for step, (w, g) in enumerate(zip(want, got), 1):
            table.add_row(name, str(step), f"{w:.5f}", f"{g:.5f}", f"{abs(g - w) / abs(w):.1e}")
        if fallbacks:
            console.print(f"[red]{name}: modules fell back to their own forward: {fallbacks}[/]")
    console.print(table)
    if with_fsdp:
        console.print(
            "FSDP2 rows: fully_shard per decoder layer, TRL's packed batches, bf16 autocast, AdamW, in a "
            "loop: on the CPU Accelerate wraps models in DDP instead of applying fsdp_config (with or "
            "without kernels); on Trainium SFTConfig(fsdp=True, fsdp_config={'fsdp_version': 2}) does it."
        )
    text = tokenizer().decode(tokens)
    console.print(
        f"checkpoint reloaded in plain transformers, kernelized, generate with a static cache: {text!r} - "
        + ("the same tokens as the plain model" if same_tokens else "[red]different tokens[/]")
    )
    return ok and same_tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="training steps per run (default 4)")
    parser.add_argument("--no-fsdp", action="store_true", help="skip the FSDP2 runs on 2 gloo ranks")
    parser.add_argument("--fsdp-rank", help=argparse.SUPPRESS)  # set for the ranks fsdp() starts
    args = parser.parse_args(argv)
    if args.fsdp_rank:
        _fsdp_rank(args.fsdp_rank, args.steps)
        return 0
    ok = run(args.steps, with_fsdp=not args.no_fsdp)
    print("sft example passed" if ok else "sft example FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
