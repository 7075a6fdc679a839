"""The static model's path choice (``kernels.aot``): which SASS path counts as a full tile's, on made-up control-flow
graphs (the compile gate reads real ones)."""

import pytest

pytest.importorskip("triton")

from lightning_zeropp.kernels import aot


def _diamonds(count: int, start: str, end: str) -> tuple[dict, dict]:
    """``count`` if/else diamonds in a row from ``start`` to ``end``: 2**count paths, each side 1 instruction."""
    blocks, edges, previous = {}, {}, start
    for i in range(count):
        left, right, join = f"l{i}", f"r{i}", f"j{i}"
        blocks.update({left: (1, 0, False), right: (1, 0, False), join: (1, 0, False)})
        edges[previous] = [left, right]
        edges[left], edges[right] = [join], [join]
        previous = join
    edges[previous] = [end]
    return blocks, edges


def test_the_fewest_masked_path_is_exact_past_the_enumeration_cap():
    # entry -> 10 diamonds (1024 paths, masked: every load predicated, a quarter tile in a loop) or -> the vector tile
    # (unmasked, 300 instructions) -> EXIT. The enumeration stops at 256 paths, all on the masked side.
    blocks, edges = _diamonds(10, "masked", "loop")
    blocks.update({
        "entry": (5, 0, False), "masked": (40, 8, False), "loop": (20, 4, False), "vector": (300, 0, False),
        "exit": (2, 0, True),
    })  # fmt: skip
    edges["entry"] = ["masked", "vector"]  # the masked side first: the enumeration walks it first
    edges["loop"] = ["loop", "exit"]  # a back edge: not followed
    edges["vector"] = ["exit"]
    found = aot._fewest_masked_paths(blocks, edges, ["entry"])
    assert found == [{"instructions": 5 + 300 + 2, "masked_accesses": 0}]


def test_a_full_tile_is_the_shortest_of_the_fewest_masked_paths():
    paths = [
        {"instructions": 400, "masked_accesses": 12},  # a masked tile, one pass of its loop
        {"instructions": 900, "masked_accesses": 1},  # the vector tile: one store predicated to one thread
        {"instructions": 950, "masked_accesses": 1},  # the same with the division's slow path
    ]
    assert aot.full_tile_instructions({"sass_paths": paths}) == 900
    paths.append({"instructions": 880, "masked_accesses": 0})
    assert aot.full_tile_instructions({"sass_paths": paths}) == 880


def test_paths_that_reach_no_exit_are_not_counted():
    blocks = {"entry": (1, 0, False), "spin": (3, 0, False), "work": (10, 1, False), "exit": (1, 0, True)}
    edges = {"entry": ["spin", "work"], "spin": ["spin"], "work": ["exit"]}
    assert aot._fewest_masked_paths(blocks, edges, ["entry"]) == [{"instructions": 12, "masked_accesses": 1}]
