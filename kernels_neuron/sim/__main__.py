"""``python -m kernels_neuron.sim script.py [args...]``: run a script with the simulator as ``nki``."""

from __future__ import annotations

import runpy
import sys

from . import install


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    backend = install()
    print(f"[kernels-neuron] nki backend: {backend}", file=sys.stderr)
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
