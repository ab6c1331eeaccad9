"""Per-lane random number generator state: ``nisa.rand_set_state`` / ``nisa.rand_get_state``.

AWS documents the state's shape (XORWOW: 6 uint32 words per compute lane on GpSimd, 24 on VectorE),
not the device's bit stream. The simulator runs Marsaglia's XORWOW on those words (five xorshift words
and a Weyl counter; VectorE's 24 words are four such generators per lane): deterministic for a given
state, but its values are not the device's.
"""

from __future__ import annotations

import numpy as np

from . import dtypes, operands, runtime
from .enums import engine
from .errors import require_generation, rule
from .tensor import Tensor

WORDS_PER_GENERATOR = 6
STATE_WORDS = {"gpsimd": WORDS_PER_GENERATOR, "vector": 4 * WORDS_PER_GENERATOR}
_WEYL_INCREMENT = np.uint32(362437)


def _engines(run: runtime.Run) -> tuple[str, ...]:
    return ("gpsimd",) if run.target.generation == 3 else ("gpsimd", "vector")


def _check_target(instr: str, run: runtime.Run) -> None:
    require_generation(instr, "target", run.target, 3)


def _check_state_tile(instr: str, role: str, t: Tensor, eng: str) -> None:
    if dtypes.name(t.dtype) != "uint32":
        raise rule(instr, role, "must be uint32", dtype=dtypes.name(t.dtype))
    if t.free_size != STATE_WORDS[eng]:
        raise rule(
            instr,
            role,
            f"must hold {STATE_WORDS[eng]} state words per partition on the {eng} engine",
            words=t.free_size,
        )


def lanes(run: runtime.Run, eng: str) -> np.ndarray:
    """The engine's [partitions, words] uint32 state, first created from the run's seed."""
    states = run.prng_states.get(eng)
    if states is None:
        fresh = np.random.default_rng([run.seed, len(eng)]).integers(
            1, 2**32, size=(run.target.partitions, STATE_WORDS[eng]), dtype=np.uint64
        )
        states = run.prng_states[eng] = fresh.astype(np.uint32)
    return states


def is_seeded(run: runtime.Run, eng: str) -> bool:
    """True once ``rand_set_state`` has set this engine's lanes (``nisa.rng`` then draws from them)."""
    return eng in run.prng_seeded


def draw(run: runtime.Run, eng: str, first_lane: int, parts: int, count: int) -> np.ndarray:
    """``count`` uint32 values per lane for lanes ``first_lane .. first_lane + parts``, advancing their state.

    A lane with several generators (VectorE) takes its values from them in turn.
    """
    state = lanes(run, eng)[first_lane : first_lane + parts].reshape(parts, -1, WORDS_PER_GENERATOR)
    generators = state.shape[1]
    out = np.empty((parts, count), dtype=np.uint32)
    for i in range(count):
        g = i % generators
        x, v = state[:, g, 0].copy(), state[:, g, 4]
        t = x ^ (x >> np.uint32(2))
        state[:, g, 0:4] = state[:, g, 1:5]
        state[:, g, 4] = v ^ (v << np.uint32(4)) ^ t ^ (t << np.uint32(1))
        state[:, g, 5] += _WEYL_INCREMENT
        out[:, i] = state[:, g, 4] + state[:, g, 5]
    return out  # ``state`` is a view of the lanes' rows: they advanced in place


def rand_set_state(src_seeds: Tensor, engine: engine = engine.gpsimd, name: str | None = None) -> None:
    """Set each lane's generator state from its partition of ``src_seeds`` (uint32, in SBUF)."""
    instr = "nisa.rand_set_state"
    run = runtime.current()
    _check_target(instr, run)
    eng = operands.engine_for(engine, instr, _engines(run), "gpsimd")
    src_seeds = operands.compute_tile(src_seeds, instr, "src_seeds", eng, ("sbuf",))
    _check_state_tile(instr, "src_seeds", src_seeds, eng)
    first, parts = src_seeds.start_partition, src_seeds.partition_size
    lanes(run, eng)[first : first + parts] = np.asarray(src_seeds.computed_values(instr, "src_seeds")).reshape(
        parts, -1
    )
    run.prng_seeded.add(eng)
    run.record(eng, "rand_set_state", reads=[("src_seeds", src_seeds)])


def rand_get_state(dst: Tensor, engine: engine = engine.gpsimd, name: str | None = None) -> None:
    """Store each lane's current generator state into its partition of ``dst`` (uint32)."""
    instr = "nisa.rand_get_state"
    run = runtime.current()
    _check_target(instr, run)
    eng = operands.engine_for(engine, instr, _engines(run), "gpsimd")
    allowed = ("sbuf", "psum") if eng == "vector" else ("sbuf",)
    dst = operands.compute_tile(dst, instr, "dst", eng, allowed)
    _check_state_tile(instr, "dst", dst, eng)
    first, parts = dst.start_partition, dst.partition_size
    dst.write(lanes(run, eng)[first : first + parts].reshape(dst.shape), instr)
    run.record(eng, "rand_get_state", writes=[("dst", dst)])
