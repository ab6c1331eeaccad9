"""The microbenchmark suite: records, JSON schema, plot, and the CLI end to end."""

import json

import pytest

from kernels_neuron import bench
from kernels_neuron.bench.suite import CASES
from kernels_neuron.cli import main

REQUIRED = {
    "name": str,
    "kernel": str,
    "shape": dict,
    "dtype": str,
    "target": str,
    "modelled_us": float,
    "roofline_us": float,
    "tflops": float,
    "pct_tensor_peak": float,
    "hbm_gbps": float,
    "pct_hbm_peak": float,
    "sim_wall_s": float,
}
DECODE = "decode128"


@pytest.fixture(scope="module")
def decode_record():
    (case,) = [c for c in CASES if DECODE in c.name]
    return bench.run_case(case, target="trn2")


def test_suite_cases_name_real_models_and_reference_ops():
    assert len({c.name for c in CASES}) == len(CASES)
    for case in CASES:
        assert case.model in {
            "Llama-3-8B",
            "Qwen3-8B",
            "Mistral-7B",
            "Gemma-2-9B",
            "GPT-J-6B",
            "Starcoder2-7B",
            "Pythia-6.9B",
            "Command-R",
            "Mixtral-8x7B",
            "Qwen3-30B-A3B",
            "Falcon-180B",
        }
        assert case.reference_name and callable(case.prepare_reference)


def test_record_is_modelled_not_measured(decode_record):
    r = decode_record
    assert r.measured_us is None and r.reference_measured_us is None  # no Trainium here
    assert r.modelled_us >= r.roofline_us > 0 and r.bound == "memory"
    assert r.shape == {"M": 128, "K": 4096, "N": 4096} and r.dtype == "bfloat16"
    assert r.flops == 2 * 128 * 4096 * 4096


def test_json_schema(decode_record, tmp_path):
    path = tmp_path / "bench.json"
    bench.write_json([decode_record], path)
    payload = json.loads(path.read_text())
    assert payload["schema_version"] == 1 and "not measurements" in payload["note"]
    (record,) = payload["records"]
    for key, kind in REQUIRED.items():
        assert isinstance(record[key], kind), key
    assert record["measured_us"] is None


def test_roofline_plot_is_a_png(decode_record, tmp_path):
    path = tmp_path / "roofline.png"
    bench.plot_roofline([decode_record], path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_table_labels_modelled_columns(decode_record):
    from rich.console import Console

    console = Console(width=300, record=True)
    console.print(bench.render_table([decode_record]))
    text = console.export_text()
    assert "modelled" in text and "not measured" in text and DECODE in text


def test_cli_runs_a_filtered_case_end_to_end(tmp_path, capsys):
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    assert main(["bench", "--filter", DECODE, "--target", "trn1", "--json", str(out_json), "--plot", str(out_png)]) == 0
    text = capsys.readouterr().out
    assert DECODE in text and "none is measured" in text
    (record,) = json.loads(out_json.read_text())["records"]
    assert record["target"] == "trn1" and out_png.exists()


def test_cli_unknown_filter_is_a_clear_error(capsys):
    assert main(["bench", "--filter", "no-such-case"]) == 2
    assert "no benchmark case matches" in capsys.readouterr().out


def test_no_device_here():
    assert bench.device_available() is False


def test_compare_script_reports_every_changed_modelled_figure_and_ignores_wall_time(tmp_path):
    import importlib.util
    import subprocess
    import sys

    from kernels_neuron import paths

    script = paths.PACKAGE_DIR.parent / "benchmarks" / "compare.py"
    spec = importlib.util.spec_from_file_location("bench_compare", script)
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    before = {"a": {"name": "a", "modelled_us": 1.0, "sim_wall_s": 3.0}, "b": {"name": "b", "modelled_us": 2.0}}
    after = {"a": {"name": "a", "modelled_us": 1.5, "sim_wall_s": 9.0}, "c": {"name": "c", "modelled_us": 2.0}}
    assert compare.differences(before, after) == [
        "b: only in the first file",
        "c: only in the second file",
        "a: modelled_us 1.0 -> 1.5",
    ]
    assert compare.differences(before, {"a": {**before["a"], "sim_wall_s": 7.0}, "b": before["b"]}) == []
    first, second = tmp_path / "1.json", tmp_path / "2.json"
    first.write_text(json.dumps({"records": list(before.values())}))
    second.write_text(json.dumps({"records": list(before.values())}))
    same = subprocess.run([sys.executable, str(script), str(first), str(second)], capture_output=True, text=True)
    assert same.returncode == 0 and "identical: 2 cases" in same.stdout
    second.write_text(json.dumps({"records": list(after.values())}))
    assert subprocess.run([sys.executable, str(script), str(first), str(second)], capture_output=True).returncode == 1
