"""What is loaded is what was built: every variant is checked against the sha256 digests in its
metadata.json (on install, before kernelize loads a repo, and by the variant's own ``__init__``
whichever route loads it); install is idempotent, atomic and safe under concurrent installs; a
stale build/ is warned about; registry names that would escape their folders are refused."""

import importlib
import multiprocessing
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

import kernels_neuron
from kernels_neuron import registry as registry_module
from kernels_neuron.hub import build, loading
from kernels_neuron.hub.verify import KernelIntegrityError, verify_repo, verify_variant

install_module = importlib.import_module("kernels_neuron.hub.install")
REGISTRY = registry_module.load()
RMSNORM_CPU = Path("neuron-rmsnorm/build/torch-cpu")


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=32,
        )
    ).eval()


def _copy_build(tmp_path) -> Path:
    out = tmp_path / "build"
    shutil.copytree(build.BUILD_DIR, out, ignore=shutil.ignore_patterns("__pycache__"))
    return out


def _one_percent_off(path: Path) -> None:
    """rms_norm scaled by 1.01: the edit a careless or hostile hand would make."""
    text = path.read_text()
    edited = text.replace("    return out.reshape(x.shape)", "    return (out * 1.01).reshape(x.shape)", 1)
    assert edited != text
    path.write_text(edited)


TAMPERING = {
    "edited": (lambda variant: _one_percent_off(variant / "rmsnorm.py"), "File hash mismatch for rmsnorm.py"),
    "truncated": (lambda variant: (variant / "layers.py").write_bytes(b""), "File hash mismatch for layers.py"),
    "missing": (lambda variant: (variant / "_backend.py").unlink(), "Missing file: _backend.py"),
    "extra": (
        lambda variant: (variant / "sitecustomize.py").write_text("import os\n"),
        "Unknown file: sitecustomize.py",
    ),
}


@pytest.mark.parametrize("kind", list(TAMPERING))
def test_verify_names_every_difference_from_the_digest(tmp_path, kind):
    variant = _copy_build(tmp_path) / RMSNORM_CPU
    verify_variant(variant)  # the negative control: the untouched copy verifies
    tamper, message = TAMPERING[kind]
    tamper(variant)
    with pytest.raises(KernelIntegrityError, match=message):
        verify_variant(variant)


def test_a_variant_without_a_readable_digest_is_refused(tmp_path):
    variant = _copy_build(tmp_path) / RMSNORM_CPU
    (variant / "metadata.json").write_text("{")
    with pytest.raises(KernelIntegrityError, match="unreadable metadata.json"):
        verify_variant(variant)


def test_kernelize_refuses_a_tampered_repo_before_loading_it(tmp_path, monkeypatch):
    out = _copy_build(tmp_path)
    _one_percent_off(out / RMSNORM_CPU / "rmsnorm.py")
    monkeypatch.setenv("LOCAL_KERNELS", ":".join(f"{REGISTRY.repo_id(n)}={out / n}" for n in REGISTRY.repos))
    with pytest.raises(KernelIntegrityError, match="neuron-rmsnorm.*File hash mismatch for rmsnorm.py"):
        kernels_neuron.kernelize(_tiny_llama(), device="neuron")


def test_a_tampered_installed_file_is_refused_by_get_kernel(tmp_path):
    """The plain kernels-library route (no kernels_neuron in the process): the variant's own __init__
    checks its files before importing them."""
    cache = tmp_path / "cache"
    snapshots = install_module.install(cache=cache)
    _one_percent_off(snapshots[REGISTRY.repo_id("neuron-rmsnorm")] / "build" / "torch-cpu" / "rmsnorm.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "LOCAL_KERNELS", "KERNELS_"))}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache), HF_HOME=str(tmp_path / "home"))
    code = "import kernels; kernels.get_kernel('kernels-neuron/neuron-rmsnorm', version=1)"
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode != 0
    assert "KernelIntegrityError" in done.stderr and "File hash mismatch for rmsnorm.py" in done.stderr


# --- install: idempotent, repairing, atomic, concurrent --------------------------------------------------


def _state(cache: Path) -> dict:
    return {
        p.relative_to(cache).as_posix(): (p.stat().st_ino, p.stat().st_mtime_ns)
        for p in cache.rglob("*")
        if p.is_file() and ".locks" not in p.parts
    }


def test_installing_again_rewrites_nothing_and_repairs_a_damaged_snapshot(tmp_path):
    cache = tmp_path / "cache"
    snapshots = install_module.install(cache=cache)
    before = _state(cache)
    assert install_module.install(cache=cache) == snapshots
    assert _state(cache) == before  # not one file rewritten, refs included
    damaged = snapshots[REGISTRY.repo_id("neuron-rmsnorm")] / "build" / "torch-cpu" / "layers.py"
    damaged.write_bytes(b"")
    with pytest.raises(KernelIntegrityError):
        verify_repo(damaged.parents[2])
    install_module.install(cache=cache)
    verify_repo(damaged.parents[2])
    assert damaged.read_bytes() == (build.BUILD_DIR / RMSNORM_CPU / "layers.py").read_bytes()


def _install_into(cache: str) -> None:
    install_module.install(cache=Path(cache))


def _complete(cache: Path) -> list[str]:
    """What a reader following refs/v1 finds: the problems, [] when every ref names a whole snapshot."""
    problems = []
    for name in REGISTRY.repos:
        root = cache / f"kernels--{REGISTRY.org}--{name}"
        ref = root / "refs" / "v1"
        if not ref.exists():
            continue
        sha = ref.read_text()
        snapshot = root / "snapshots" / sha
        if len(sha) != 40 or not snapshot.is_dir() or install_module.content_hash(snapshot) != sha:
            problems.append(f"{name}: refs/v1 = {sha!r}")
    return problems


def test_eight_concurrent_installs_succeed_and_a_reader_never_sees_a_partial_snapshot(tmp_path):
    cache = tmp_path / "cache"
    seen, complete_reads, done = [], [0], threading.Event()

    def read():
        while not done.is_set():
            problems = _complete(cache)
            seen.extend(problems)
            complete_reads[0] += not problems and (cache / f"kernels--{REGISTRY.org}--nki-sim" / "refs").exists()

    reader = threading.Thread(target=read)
    reader.start()
    context = multiprocessing.get_context("fork")  # the children share this process's imports
    installers = [context.Process(target=_install_into, args=(str(cache),)) for _ in range(8)]
    for process in installers:
        process.start()
    for process in installers:
        process.join(120)
    done.set()
    reader.join()
    assert [p.exitcode for p in installers] == [0] * 8
    assert seen == []
    assert complete_reads[0] > 0  # the reader did look at installed snapshots
    assert _complete(cache) == []
    leftovers = [p.name for p in cache.rglob(".*") if p.is_dir() and p.name != ".locks"]
    assert leftovers == []  # no staging folder left behind


# --- a stale build/ and names that escape their folders ------------------------------------------------------


def test_kernelize_warns_when_build_is_stale(stale_nki_src, monkeypatch):
    monkeypatch.setattr(loading, "_checked", {})
    with pytest.warns(UserWarning, match=r"build/ is stale \(4 files differ.* run `kernels-neuron build`"):
        kernels_neuron.kernelize(_tiny_llama(), device="neuron", attention=False, mlp=False)


@pytest.mark.parametrize(
    "org, repo, match",
    [
        ("kernels-neuron", "../outside", "not a valid Hub repo id"),
        ("../up", "neuron-rmsnorm", "not a valid Hub repo id"),
        ("kernels-neuron", "a..b", "not a valid Hub repo id"),
        ("kernels-neuron", "Neuron_RMSNorm", "not a valid kernel name"),
    ],
    ids=["repo-dotdot", "org-dotdot", "double-dot", "not-a-kernel-name"],
)
def test_registry_names_that_would_escape_their_folders_are_refused(tmp_path, org, repo, match):
    text = textwrap.dedent(f"""
        [hub]
        org = "{org}"
        [repos."{repo}"]
        version = 1
        kind = "simulator"
    """)
    path = tmp_path / "registry.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        registry_module.load(path)
