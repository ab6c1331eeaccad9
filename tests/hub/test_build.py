"""The builder: build/ is fresh, staleness is detected, and every variant meets the kernels library's
contract (metadata.json fields, digest, self-contained packages, model cards)."""

import ast
import json
import re
import sys
from pathlib import Path

import pytest
from kernels import Metadata

from kernels_neuron import cli, hub
from kernels_neuron import registry as registry_module
from kernels_neuron.hub import build

REGISTRY = registry_module.load()
KERNEL_REPOS = [name for name, repo in REGISTRY.repos.items() if repo.kind == "kernel"]
VARIANT_DIRS = sorted(p.parent for p in build.BUILD_DIR.glob("*/build/*/metadata.json"))
PYTHON_DEPENDS = json.loads((Path(sys.modules["kernels"].__file__).parent / "python_depends.json").read_text())


# --- freshness ----------------------------------------------------------------------------------------


def test_build_check_passes_on_the_committed_build(capsys):
    assert hub.stale() == []
    assert cli.main(["build", "--check"]) == 0
    assert "up to date" in capsys.readouterr().out


def test_build_check_fails_and_names_the_files_when_a_source_changes(stale_nki_src, capsys):
    assert cli.main(["build", "--check"]) == 1
    out = capsys.readouterr().out
    assert "stale" in out
    for variant in ("torch-cpu", "torch-neuron"):
        assert f"~ neuron-rmsnorm/build/{variant}/nki_src/rmsnorm.py" in out
        assert f"~ neuron-rmsnorm/build/{variant}/metadata.json" in out  # the digest and id follow the source
    assert not any(line.strip().startswith("~ nki-sim/") for line in out.splitlines())


def test_write_reproduces_the_tree_and_stale_reports_every_kind_of_difference(tmp_path):
    out = tmp_path / "build"
    written = hub.write(out)
    assert sorted(written) == sorted(hub.build_tree())
    assert hub.stale(out) == []
    for path in written:  # byte-for-byte the committed build/
        assert (out / path).read_bytes() == (build.BUILD_DIR / path).read_bytes(), path
    changed = out / "neuron-rmsnorm/build/torch-cpu/layers.py"
    changed.write_text(changed.read_text() + "# edited\n")
    (out / "nki-sim/build/torch-cpu/isa.py").unlink()
    (out / "neuron-rmsnorm/build/torch-cpu/extra.py").write_text("")
    (out / "neuron-rmsnorm/build/torch-cpu/__pycache__").mkdir()
    (out / "neuron-rmsnorm/build/torch-cpu/__pycache__/layers.cpython-311.pyc").write_bytes(b"\0")  # ignored
    (out / "lib").mkdir()  # not a repo folder (setuptools' scratch, a user's notes): neither checked nor touched
    (out / "lib/module.py").write_text("kept")
    (out / "NOTES.md").write_text("kept")
    assert hub.stale(out) == [
        "+ nki-sim/build/torch-cpu/isa.py",
        "- neuron-rmsnorm/build/torch-cpu/extra.py",
        "~ neuron-rmsnorm/build/torch-cpu/layers.py",
    ]
    with pytest.raises(build.UnknownFilesError, match="neuron-rmsnorm/build/torch-cpu/extra.py.*--prune"):
        hub.write(out)  # refused before anything is written
    assert (out / "neuron-rmsnorm/build/torch-cpu/extra.py").exists() and not (
        out / "nki-sim/build/torch-cpu/isa.py"
    ).exists()
    hub.write(out, prune=True)
    assert hub.stale(out) == []
    assert not (out / "neuron-rmsnorm/build/torch-cpu/extra.py").exists()
    assert (out / "lib/module.py").read_text() == "kept" and (out / "NOTES.md").read_text() == "kept"


def test_the_build_is_deterministic():
    assert hub.build_tree() == hub.build_tree()


# --- metadata.json ------------------------------------------------------------------------------------


def test_every_repo_has_its_variants():
    assert [p.relative_to(build.BUILD_DIR).as_posix() for p in VARIANT_DIRS] == sorted(
        [f"{name}/build/torch-cpu" for name in REGISTRY.repos] + [f"{name}/build/torch-neuron" for name in KERNEL_REPOS]
    )


@pytest.mark.parametrize("variant_dir", VARIANT_DIRS, ids=lambda p: p.relative_to(build.BUILD_DIR).as_posix())
def test_metadata_meets_the_kernels_contract(variant_dir):
    repo_name, variant = variant_dir.parent.parent.name, variant_dir.name
    repo = REGISTRY.repos[repo_name]
    data = json.loads((variant_dir / "metadata.json").read_text())
    parsed = Metadata.read_from_file(str(variant_dir / "metadata.json"))  # the library's own (Rust) parser
    assert parsed.id == data["id"] and parsed.version == data["version"]

    assert re.fullmatch(r"[a-z][-a-z0-9]*[a-z0-9]", data["name"]) and data["name"] == repo_name
    assert data["id"].isidentifier() and "." not in data["id"]
    backend = variant.removeprefix("torch-")
    assert data["id"].startswith(f"_{repo_name.replace('-', '_')}_{backend}_")
    assert isinstance(data["version"], int) and not isinstance(data["version"], bool)
    assert data["version"] == repo.version
    assert data["license"] == REGISTRY.license
    assert data["backend"] == {"type": backend} and backend in ("cpu", "neuron")
    assert data["python-depends"] == (["nki"] if backend == "neuron" else [])
    allowed = {*PYTHON_DEPENDS["general"], *PYTHON_DEPENDS["backends"][backend]}
    assert set(data["python-depends"]) <= allowed  # what the kernels library lets that backend declare
    if backend == "cpu" and repo.kind == "kernel":
        assert data["kernel-depends"] == [
            {"repo-id": REGISTRY.repo_id("nki-sim"), "version": REGISTRY.repos["nki-sim"].version}
        ]
    else:
        assert "kernel-depends" not in data


def test_variant_ids_are_unique():
    ids = [json.loads((d / "metadata.json").read_text())["id"] for d in VARIANT_DIRS]
    assert len(ids) == len(set(ids)) == len(VARIANT_DIRS)


@pytest.mark.parametrize("variant_dir", VARIANT_DIRS, ids=lambda p: p.relative_to(build.BUILD_DIR).as_posix())
def test_digest_is_what_the_kernels_library_computes(variant_dir):
    from kernels._rust import Digest, DigestAlgorithm

    data = json.loads((variant_dir / "metadata.json").read_text())
    assert data["digest"]["algorithm"] == "sha256"
    assert data["digest"]["files"] == Digest.hash_variant(DigestAlgorithm.SHA256, variant_dir).files
    shipped = {
        p.relative_to(variant_dir).as_posix()
        for p in variant_dir.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.name != "metadata.json"
    }
    assert set(data["digest"]["files"]) == shipped


# --- the packages are self-contained --------------------------------------------------------------------

THIRD_PARTY = {"torch", "numpy", "ml_dtypes", "kernels", "nki", "torch_neuronx"}  # torch_neuronx: on Trainium only


def _import_problems(variant_dir: Path) -> list[str]:
    """Imports a variant's modules make that a Hub install could not satisfy: a relative import of a
    file that is not shipped, or an absolute import of anything but the stdlib and the dependencies."""
    shipped = {p.relative_to(variant_dir).with_suffix("").as_posix() for p in variant_dir.rglob("*.py")}
    problems = []
    for path in sorted(variant_dir.rglob("*.py")):
        where = path.relative_to(variant_dir).as_posix()
        package = [part for part in path.relative_to(variant_dir).parent.parts if part != "."]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[: len(package) - node.level + 1]
                target = [*base, *(node.module.split(".") if node.module else [])]
                names = ["/".join(target)] if node.module else ["/".join([*target, a.name]) for a in node.names]
                problems += [
                    f"{where}: .{name}" for name in names if name not in shipped and f"{name}/__init__" not in shipped
                ]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                problems += [
                    f"{where}: {m}" for m in modules if m.split(".")[0] not in sys.stdlib_module_names | THIRD_PARTY
                ]
    return problems


@pytest.mark.parametrize("variant_dir", VARIANT_DIRS, ids=lambda p: p.relative_to(build.BUILD_DIR).as_posix())
def test_shipped_modules_import_only_shipped_files_and_dependencies(variant_dir):
    assert _import_problems(variant_dir) == []


def test_the_import_check_catches_a_missing_file_and_a_checkout_import(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "__init__.py").write_text("from . import layers\nfrom .sub import attr\nfrom .gone import y\n")
    (tmp_path / "layers.py").write_text("import kernels_neuron.ops\nimport torch, os\n")
    (tmp_path / "sub" / "__init__.py").write_text("from ..layers import x\nfrom .. import missing\n")
    assert _import_problems(tmp_path) == [
        "__init__.py: .gone",
        "layers.py: kernels_neuron.ops",
        "sub/__init__.py: .missing",
    ]


# --- model cards ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("repo_name", sorted(REGISTRY.repos))
def test_model_card(repo_name):
    card = (build.BUILD_DIR / repo_name / "README.md").read_text()
    repo = REGISTRY.repos[repo_name]
    assert card.startswith(f"---\nlicense: {REGISTRY.license}\n")
    assert f"# {repo_name}" in card and repo.description in card
    assert "`torch-cpu`" in card
    assert "modelled" in card  # speed claims are labelled as modelled
    if repo.kind == "kernel":
        assert "`torch-neuron`" in card
        assert f'get_kernel("{REGISTRY.repo_id(repo_name)}", version={repo.version})' in card
        for export in repo.export_names:
            assert f"kernel.{export}" in card
        for layer in REGISTRY.layers:
            if layer.repo == repo_name:
                assert f"| `{layer.kernel_layer}` |" in card and f"- `{layer.name}`:" in card
                for cls in layer.classes:
                    assert cls in card
        for entry in REGISTRY.attention:
            if entry.repo == repo_name:
                assert f'attn_implementation="{REGISTRY.repo_id(repo_name)}"' in card and f"`{entry.name}`" in card


# --- registry: attention entries and qualified exports ------------------------------------------------------


@pytest.mark.parametrize(
    "change, match",
    [
        ({"name": "neuron_flash"}, "must not contain 'flash'"),
        ({"repo": "nope"}, "repo 'nope' is not defined"),
        ({"function": "not_exported"}, "function 'not_exported' is not among the exports"),
        ({"modes": ["inference", "fast"]}, "unknown modes"),
    ],
)
def test_registry_checks_attention_entries(change, match, tmp_path):
    text = registry_module.REGISTRY_PATH.read_text()
    entry = {
        "name": "kernels_neuron_attention",
        "repo": "neuron-flash-attn",
        "function": "flash_attn_forward",
        "modes": ["inference"],
        **change,
    }
    start = text.index("[[attention]]")
    body = "".join(f"{key} = {json.dumps(value)}\n" for key, value in entry.items())
    (tmp_path / "registry.toml").write_text(text[:start] + "[[attention]]\n" + body)
    with pytest.raises(ValueError, match=match):
        registry_module.load(tmp_path / "registry.toml")


def test_qualified_exports_are_imported_from_their_module():
    repo = REGISTRY.repos["neuron-flash-attn"]
    init = (build.BUILD_DIR / "neuron-flash-attn/build/torch-cpu/__init__.py").read_text()
    assert "from .flash_attn_interface import flash_attn_forward, supports_flash_attn" in init
    assert "from .attention import flash_attention" in init
    assert ":" not in "".join(repo.export_names) and len(repo.export_names) == len(repo.exports)
