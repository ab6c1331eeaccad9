"""The training workflow example (examples/sft.py) runs as ``kernels-neuron examples sft``: SFTTrainer on
a kernelized tiny Qwen3 with packing and default precision, FSDP2 on 2 gloo ranks, then save, reload,
kernelize and generate with a static cache; every loss within bf16 noise of the un-kernelized run."""

import re

import pytest

from kernels_neuron import cli


@pytest.mark.slow
def test_kernels_neuron_examples_sft_passes(capsys):
    assert cli.main(["examples", "sft", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "sft example passed" in out
    rows = re.findall(r"│ (1 process|FSDP2, 2 ranks) +│ +(\d) │ +([\d.]+) │ +([\d.]+) │", out)
    assert [(run, step) for run, step, *_ in rows] == [
        ("1 process", "1"),
        ("1 process", "2"),
        ("FSDP2, 2 ranks", "1"),
        ("FSDP2, 2 ranks", "2"),
    ]
    for _, _, want, got in rows:
        assert abs(float(got) - float(want)) <= 0.01 * float(want)
    assert "the same tokens as the plain model" in out
