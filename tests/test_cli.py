"""The command line's main job runs and checks the bundled kernels."""

from kernels_neuron.cli import main


def test_examples_runs_every_example_and_passes(capsys):
    assert main(["examples"]) == 0
    out = capsys.readouterr().out
    for name in ("tiled_matmul", "transpose_2d", "row_softmax", "layernorm", "spmd_scaled_add"):
        assert name in out
    assert "FAIL" not in out and out.count("PASS") == 5
    assert "nc_matmul" in out  # the trace summary of the first example


def test_examples_single_example_on_trn1(capsys):
    assert main(["examples", "--example", "row_softmax", "--target", "trn1"]) == 0
    assert "trace on trn1" in capsys.readouterr().out


def test_an_unknown_example_is_refused_naming_the_real_ones(capsys):
    assert main(["examples", "--example", "row_sofmax"]) == 2
    out = capsys.readouterr().out
    assert "no example kernel 'row_sofmax'" in out and "row_softmax" in out and "PASS" not in out


def test_choices_come_from_the_real_tables():
    import pytest

    from kernels_neuron.cost.hardware import HARDWARE
    from kernels_neuron.paths import EXAMPLES_DIR

    assert (EXAMPLES_DIR / "sft.py").is_file() and set(HARDWARE) == {"trn1", "trn2", "trn3"}
    with pytest.raises(SystemExit):  # argparse: not a target the cost model has
        main(["bench", "--target", "trn9"])
    with pytest.raises(SystemExit):  # not a script in examples/
        main(["examples", "nope"])


def test_demo_kernelizes_qwen3_and_matches(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "13 swapped, 0 kept their own forward" in out  # 9 norms, 2 MLPs and 2 attention modules
    assert "same tokens: yes" in out and "demo passed" in out
    assert (
        "modelled Trn2 estimate, not measured" in out and "rmsnorm_fwd" in out and "flash_decode_fwd" in out
    )  # a 16-token prompt: the decode kernel
