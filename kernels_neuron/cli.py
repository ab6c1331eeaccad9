"""The kernels-neuron command line."""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kernels_neuron import compiled_sim


def _print_error(console: Console, message: object) -> None:
    """``message`` in red, as plain text: brackets in it (an extra's name, a list) are not rich markup."""
    console.print(Text(str(message), style="red"))


def _demo(args: argparse.Namespace) -> int:
    """The main job: a tiny Qwen3 kernelized for neuron, run on the simulator, checked and modelled."""
    from kernels_neuron import demo

    console = Console(width=None if sys.stdout.isatty() else 140)
    result = demo.run(target=args.target, console=console)
    ok = result.swapped > 0 and result.fallbacks == 0 and result.max_logit_deviation < 1e-4 and result.same_tokens
    console.print("[green]demo passed[/]" if ok else "[red]demo failed[/]")
    return 0 if ok else 1


def _examples(args: argparse.Namespace) -> int:
    """Simulate the bundled example kernels, check each against NumPy and summarise the traces; or run a
    workflow example (``sft``)."""
    if args.workflow is not None:
        options = ["--steps", str(args.steps)] + (["--no-fsdp"] if args.no_fsdp else [])
        return _example_module(args.workflow).main(options)
    import numpy as np

    from kernels_neuron import sim

    backend = sim.install()
    from kernels_neuron.sim import examples

    console = Console(width=None if sys.stdout.isatty() else 140)
    if args.example is not None and args.example not in examples.EXAMPLES:
        console.print(
            f"[red]kernels-neuron examples: no example kernel {args.example!r}[/]; "
            f"the examples are {', '.join(examples.EXAMPLES)}"
        )
        return 2
    chosen = [args.example] if args.example else list(examples.EXAMPLES)
    console.print(f"nki backend: [bold]{backend}[/] · target: [bold]{args.target}[/]")
    table = Table(title="bundled NKI example kernels on the CPU simulator")
    for column in (
        "kernel",
        "inputs",
        "max |err| vs NumPy",
        "check",
        "instructions",
        "HBM bytes",
        "peak SBUF B/part",
        "peak PSUM B/part",
    ):
        table.add_column(column, justify="right" if column not in ("kernel", "inputs", "check") else "left")
    traces = {}
    failed = False
    for name in chosen:
        example = examples.EXAMPLES[name]
        inputs = example.make_inputs(np.random.default_rng(0))  # the same inputs alone or with the others
        result = sim.run(example.kernel, *inputs, target=args.target, grid=example.grid)
        expected = example.reference(*inputs)
        error = float(np.max(np.abs(result.outputs.astype(np.float32) - expected.astype(np.float32))))
        # Tolerance: one rounding of the output dtype, relative to the result's magnitude.
        scale = float(np.max(np.abs(expected.astype(np.float32)))) or 1.0
        tolerance = (2**-7 if inputs[0].dtype.itemsize == 2 else 1e-5) * scale
        ok = error <= tolerance
        failed |= not ok
        shapes = ", ".join("x".join(map(str, a.shape)) for a in inputs if hasattr(a, "shape"))
        trace = result.trace
        table.add_row(
            name,
            shapes,
            f"{error:.3g}",
            "[green]PASS[/]" if ok else "[red]FAIL[/]",
            str(len(trace)),
            f"{trace.hbm_bytes:,}",
            f"{trace.sbuf_peak_bytes:,}",
            f"{trace.psum_peak_bytes:,}",
        )
        traces[name] = trace
    console.print(table)
    first = chosen[0]
    console.print(f"\n[bold]trace of {first}[/]\n{traces[first].summary()}")
    return 1 if failed else 0


def _example_module(name: str):
    """``examples/<name>.py`` (the checkout's, or the copy an installed wheel carries), imported by path:
    it is a script for users to read and run, not part of the package's import tree."""
    import importlib.util

    from kernels_neuron.paths import EXAMPLES_DIR

    path = EXAMPLES_DIR / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"kernels_neuron_example_{name}", path)
    if spec is None or spec.loader is None or not path.is_file():
        raise SystemExit(f"kernels-neuron examples: {path} was not found")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _bench(args: argparse.Namespace) -> int:
    """Simulate and model every suite case; print the table, optionally write JSON and a plot."""
    from kernels_neuron import bench
    from kernels_neuron.bench.suite import CASES as cases

    # What is imported so far (torch, the kernels, the cases) lives until exit: frozen, the garbage collector
    # leaves it out, in the forked workers too (whose copies of those pages then stay shared), and so does
    # the interpreter's exit (about 0.45 s less with torch imported).
    gc.freeze()
    console = Console(width=None if sys.stdout.isatty() else 220)
    try:
        records = bench.run_suite(
            cases,
            target=args.target,
            name_filter=args.filter,
            progress=sys.stderr.isatty(),
            check_numerics=args.check_numerics,
            jobs=args.jobs or bench.default_jobs(),
        )
    except bench.NoMatchingCase as exc:
        _print_error(console, f"{exc}; cases: " + ", ".join(c.name for c in cases))
        return 2
    except ValueError as exc:
        _print_error(console, exc)
        return 2
    except bench.TraceMismatch as exc:
        _print_error(console, f"--check-numerics: a full simulation left a different trace: {exc}")
        return 1
    console.print(bench.render_table(records))
    if args.check_numerics:
        console.print("Simulated trace-only and in full: every case's two traces are identical.")
    else:
        console.print(
            "Simulated trace-only (the engines' arithmetic skipped; the cost model reads only the trace): "
            "--check-numerics also simulates each case in full and checks the traces match."
        )
    console.print(f"Simulator: {compiled_sim.status()}.")
    if not bench.device_available():
        console.print("No Trainium device here: every time above is modelled by the cost model, none is measured.")
    if args.json:
        bench.write_json(records, args.json)
        console.print(f"wrote {args.json}")
    if args.plot:
        bench.plot_roofline(records, args.plot)
        console.print(f"wrote {args.plot}")
    return 0


def _build(args: argparse.Namespace) -> int:
    """Regenerate build/ from the sources, or with --check report whether it is stale."""
    from kernels_neuron import hub

    console = Console()
    if args.check:
        problems = hub.stale()
        if problems:
            console.print(
                f"[red]build/ is stale[/]: {len(problems)} files differ from a fresh build "
                "(+ missing, - extra, ~ changed); run `kernels-neuron build`"
            )
            for line in problems:
                console.print(f"  {line}", markup=False)
            return 1
        console.print("build/ is up to date with the sources")
        return 0
    from kernels_neuron.hub.build import UnknownFilesError
    from kernels_neuron.paths import IS_CHECKOUT

    if not IS_CHECKOUT:
        console.print(
            f"[red]kernels-neuron build regenerates a source checkout's build/; this kernels-neuron is "
            f"an installed package, whose {hub.BUILD_DIR} is read-only[/] (`build --check` verifies it)"
        )
        return 2
    try:
        files = hub.write(prune=args.prune)
    except UnknownFilesError as exc:
        _print_error(console, exc)
        return 1
    console.print(f"wrote {len(files)} files under {hub.BUILD_DIR}")
    return 0


def _install(args: argparse.Namespace) -> int:
    """Install build/ into the local HF cache so get_kernel(..., version=N) works with HF_HUB_OFFLINE=1."""
    from kernels_neuron import hub

    console = Console()
    try:
        installed = hub.install(cache=args.cache)
    except RuntimeError as exc:
        _print_error(console, exc)
        return 1
    for repo_id, snapshot in installed.items():
        console.print(f"{repo_id} -> {snapshot}")
    return 0


def _list(args: argparse.Namespace) -> int:
    """The registry: each layer's repo, kernel layer, modes, what it replaces, what a module must be, build status."""
    from kernels_neuron import hub
    from kernels_neuron import registry as registry_module
    from kernels_neuron.integration import layer_limits

    reg = registry_module.load()
    problems = hub.stale()
    table = Table(title=f"registry.toml (Hub org {reg.org})")
    for column in ("layer name", "repo", "kernel layer", "modes", "replaces", "a module must be", "build"):
        table.add_column(column, overflow="fold", no_wrap=column in ("layer name", "repo", "build"))

    def status(repo: str) -> str:
        # A kernel repo's torch-cpu variant loads the simulator from nki-sim: its staleness counts too.
        prefixes = tuple(f"{name}/" for name in {repo, "nki-sim"})
        if not (hub.BUILD_DIR / repo).is_dir():
            return "[red]missing[/]"
        return "[yellow]stale[/]" if any(p[2:].startswith(prefixes) for p in problems) else "[green]up to date[/]"

    for layer in reg.layers:
        replaces = ", ".join(layer.classes) if layer.classes else f"classes tagged {layer.name!r}"
        if layer.discover:
            replaces += f"; any *{layer.discover} whose forward computes the same"
        table.add_row(
            layer.name,
            f"{reg.repo_id(layer.repo)} v{reg.repos[layer.repo].version}",
            layer.kernel_layer,
            ", ".join(layer.modes),
            replaces,
            layer_limits(reg, layer),
            status(layer.repo),
        )
    for attention in reg.attention:
        table.add_row(
            attention.name,
            f"{reg.repo_id(attention.repo)} v{reg.repos[attention.repo].version}",
            attention.function,
            ", ".join(attention.modes),
            "attention modules (AttentionInterface)",
            "per module: the function's unsupported_reasons",
            status(attention.repo),
        )
    Console(width=None if sys.stdout.isatty() else 200).print(table)
    return 0


def _compile_sim(args: argparse.Namespace) -> int:
    """Compile the simulator's hot modules (Cython), with a bar that advances as each module is done."""
    from rich.progress import Progress

    console = Console()
    folder = compiled_sim.build_dir()
    if args.force or not compiled_sim.is_built():
        start = time.perf_counter()
        with Progress(console=console, transient=True) as progress:
            bar = progress.add_task("compiling the simulator", total=len(compiled_sim.MODULES))

            def done(module: str, seconds: float) -> None:
                progress.console.print(f"  {module}: {seconds:.0f} s")
                progress.advance(bar)

            try:
                compiled_sim.build(jobs=args.jobs, on_done=done, force=args.force)
            except (RuntimeError, OSError) as exc:
                _print_error(console, exc)
                return 1
        console.print(f"Compiled {len(compiled_sim.MODULES)} modules in {time.perf_counter() - start:.0f} s.")
    console.print(
        f"The build of the current sources is in {folder}; every process that imports kernels_neuron "
        f"from now on simulates with it ({compiled_sim.ENV_VAR}=0 turns it off), until a module changes."
    )
    if compiled_sim.switched_off():
        console.print(f"It is off in this environment: {compiled_sim.ENV_VAR} is set to 0.")
    return 0


def _workflow_examples() -> list[str]:
    """The scripts in ``examples/`` (the checkout's, or the copy an installed wheel carries)."""
    from kernels_neuron.paths import EXAMPLES_DIR

    return sorted(path.stem for path in EXAMPLES_DIR.glob("*.py"))


def main(argv: list[str] | None = None) -> int:
    from kernels_neuron.cost.hardware import HARDWARE

    targets = list(HARDWARE)  # the targets the cost model has a table for (the simulator knows each)
    parser = argparse.ArgumentParser(prog="kernels-neuron", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="kernelize a tiny Qwen3 for neuron and run it on the simulator")
    demo.add_argument("--target", default="trn2", choices=targets)
    demo.set_defaults(run=_demo)
    examples = commands.add_parser(
        "examples",
        help="simulate the bundled example NKI kernels and check them; "
        "'examples sft': the training workflow (TRL SFT, FSDP2, generate)",
    )
    examples.add_argument(
        "workflow",
        nargs="?",
        choices=_workflow_examples(),
        help="sft: SFTTrainer on a kernelized tiny Qwen3, in one process and with FSDP2 on 2 gloo "
        "ranks, then save, reload, kernelize and generate (needs the examples extra)",
    )
    examples.add_argument("--steps", type=int, default=4, help="sft: training steps per run")
    examples.add_argument("--no-fsdp", action="store_true", help="sft: skip the FSDP2 runs")
    examples.add_argument("--example", help="run only this example kernel (kernels_neuron.sim.examples.EXAMPLES)")
    examples.add_argument("--target", default="trn2", choices=targets)
    examples.set_defaults(run=_examples)
    bench_cmd = commands.add_parser("bench", help="run the microbenchmark suite (modelled Trainium times)")
    bench_cmd.add_argument("--filter", help="only cases whose name contains this text")
    bench_cmd.add_argument("--target", default="trn2", choices=targets)
    bench_cmd.add_argument("--json", help="write one JSON record per case to this path")
    bench_cmd.add_argument("--plot", help="write a roofline plot (PNG) to this path")
    bench_cmd.add_argument(
        "--check-numerics",
        action="store_true",
        help="also simulate each case in full (the engines' arithmetic; slow) and check it leaves the "
        "trace-only run's trace",
    )
    bench_cmd.add_argument(
        "--jobs",
        type=_positive_int,
        default=0,
        help="cases simulated at once, in worker processes (default: one per usable CPU, at most 8; one "
        "where a Trainium device is timed)",
    )
    bench_cmd.set_defaults(run=_bench)
    build_cmd = commands.add_parser("build", help="regenerate build/ (the Hub repos) from the sources")
    build_cmd.add_argument("--check", action="store_true", help="fail if build/ differs from a fresh build")
    build_cmd.add_argument(
        "--prune",
        action="store_true",
        help="delete files inside build/<repo>/ that the build does not produce (else refused)",
    )
    build_cmd.set_defaults(run=_build)
    install_cmd = commands.add_parser("install", help="install build/ into the local HF cache (refs/vN + snapshot)")
    install_cmd.add_argument(
        "--cache",
        help="HF hub cache directory (default: where the kernels library looks, $KERNELS_CACHE else HF_HUB_CACHE)",
    )
    install_cmd.set_defaults(run=_install)
    compile_cmd = commands.add_parser(
        "compile-sim",
        help="compile the simulator's hot modules with Cython (the bench suite took 15-28%% less wall; needs the "
        "fast extra and a C compiler)",
    )
    compile_cmd.add_argument("--jobs", type=_positive_int, default=0, help="modules compiled at once (default: CPUs)")
    compile_cmd.add_argument(
        "--force",
        action="store_true",
        help="compile again even if a build of the current sources is there (one that fails to load: run this "
        "with KERNELS_NEURON_SIM_COMPILED=0)",
    )
    compile_cmd.set_defaults(run=_compile_sim)
    list_cmd = commands.add_parser("list", help="show the registry with each entry's build status")
    list_cmd.set_defaults(run=_list)
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args.run
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
