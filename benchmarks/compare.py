"""Compare two `kernels-neuron bench --json` files: every modelled figure, case by case.

A refactor must not move a single modelled number; this prints each difference (the simulator's own
wall time, which varies from run to run, is left out) and exits non-zero when there is one.

    python benchmarks/compare.py before.json after.json
"""

from __future__ import annotations

import argparse
import json
import sys

# Measured on this machine, and how the case was simulated (trace-only or also in full): not modelled.
IGNORED = {"sim_wall_s", "simulation"}


def _records(path: str) -> dict[str, dict]:
    with open(path) as file:
        return {record["name"]: record for record in json.load(file)["records"]}


def differences(before: dict[str, dict], after: dict[str, dict]) -> list[str]:
    """One line per case added, removed, or with a field that changed."""
    lines = [f"{name}: only in the first file" for name in before.keys() - after.keys()]
    lines += [f"{name}: only in the second file" for name in after.keys() - before.keys()]
    for name in sorted(before.keys() & after.keys()):
        old, new = before[name], after[name]
        lines += [
            f"{name}: {field} {old.get(field)!r} -> {new.get(field)!r}"
            for field in sorted((old.keys() | new.keys()) - IGNORED)
            if old.get(field) != new.get(field)
        ]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    args = parser.parse_args()
    before, after = _records(args.before), _records(args.after)
    lines = differences(before, after)
    print("\n".join(lines) if lines else f"identical: {len(before)} cases, every modelled figure")
    return 1 if lines else 0


if __name__ == "__main__":
    sys.exit(main())
