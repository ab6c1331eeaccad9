"""A kernelized model trains under DDP, FSDP2 (``fully_shard`` per decoder layer), tensor parallelism
(torch's ``parallelize_module`` plan, and transformers' own) and FSDP2 + TP on a 2-D mesh: 2 (and 4)
ranks on the gloo backend, forked by ``torch.multiprocessing`` from one fresh interpreter (workers.py);
each step's loss and every gradient match the same step of the un-kernelized model in one process, and
the NKI kernels ran."""

import json
import subprocess
import sys

import pytest
import workers

GRAD_TOL = 2e-5  # fp32: reductions across ranks and kernels round in a different order than one process
GROUPS = {"2": ["ddp", "fsdp2", "torch_tp", "sequence_parallel", "transformers_tp"], "4": ["fsdp2_tp"]}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[str, list[dict]]:
    """Every group's ranks, from one launcher: {world size: each rank's results}."""
    out = tmp_path_factory.mktemp("ranks")
    model_dir = tmp_path_factory.mktemp("tiny_qwen3")
    workers.tiny("Qwen3").save_pretrained(model_dir)
    request = {"groups": GROUPS, "out": str(out), "model_dir": str(model_dir)}
    done = subprocess.run(
        [sys.executable, workers.__file__, json.dumps(request)], capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stderr[-3000:]
    failures = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        world: failures[world] or [json.loads((out / world / f"{rank}.json").read_text()) for rank in range(int(world))]
        for world in GROUPS
    }


def _group(ranks: dict, world: str) -> list[dict]:
    """A group's per-rank results; fails with the launcher's traceback if its ranks did not run."""
    results = ranks[world]
    assert not isinstance(results, str), f"the {world} ranks failed:\n{results}"
    return results


def _check(
    result: dict, kernels=("flash_attn_bwd", "flash_attn_fwd", "mlp_bwd", "mlp_fwd", "rmsnorm_bwd", "rmsnorm_fwd")
) -> None:
    assert "error" not in result, result.get("error")
    assert result["smallest_grad"] > 0, "a reference gradient is zero: the comparison would prove less"
    assert result["loss_error"] < 1e-5, result
    assert result["grad_error"] < GRAD_TOL, result
    assert set(kernels) <= set(result["kernels"]), result["kernels"]
    assert result["call_time_fallbacks"] == {}, result["call_time_fallbacks"]


@pytest.mark.slow
@pytest.mark.parametrize("scenario, swapped", [("ddp", 13), ("fsdp2", 13), ("torch_tp", 9)])
def test_a_training_step_matches_one_process(ranks, scenario, swapped):
    """Qwen3: 9 norms (q/k norms included), 2 MLPs, 2 attention modules; Llama: 5 norms."""
    for result in _group(ranks, "2"):
        _check(result[scenario])
        assert result[scenario]["fallbacks"] == {}
        assert len(result[scenario]["swapped"]) == swapped


@pytest.mark.slow
def test_a_sequence_parallel_mlp_runs_its_own_forward_and_is_right(ranks):
    """Sharded weights behind hooks of a layout the fused layer does not reproduce (tokens split across
    ranks): the MLP keeps its own forward, with the reason, instead of summing other ranks' tokens."""
    for result in _group(ranks, "2"):
        result = result["sequence_parallel"]
        assert result["error"] is None, result["error"]
        assert result["output_error"] < 1e-5
        assert list(result["fallbacks"]) == ["<model>"] and result["swapped"] == []
        assert "gate_proj has hooks" in result["fallbacks"]["<model>"]


@pytest.mark.slow
def test_transformers_tensor_parallel_plan(ranks):
    """Qwen3's per-head q/k norms carry the plan's gradient all-reduce in a replaced forward: they keep
    it (reported); everything else runs the kernels on its shards."""
    for result in _group(ranks, "2"):
        result = result["transformers_tp"]
        _check(result)
        norms = {path for path in result["fallbacks"]}
        assert norms == {f"model.layers.{i}.self_attn.{n}" for i in range(2) for n in ("q_norm", "k_norm")}
        assert all("forward was replaced" in reason for reason in result["fallbacks"].values())
        assert {f"model.layers.{i}.mlp" for i in range(2)} <= set(result["swapped"])


@pytest.mark.slow
def test_fsdp2_and_tensor_parallel_on_a_2d_mesh(ranks):
    """4 ranks: FSDP2 over 2 data-parallel groups of 2 tensor-parallel ranks."""
    for result in _group(ranks, "4"):
        _check(result["fsdp2_tp"])
        assert len(result["fsdp2_tp"]["swapped"]) == 9
