"""The small-coordinates study's statistics on synthetic tensors (blocks, the small mask, the sums and their ratios,
the Adam directions against torch's Adam), and one short spawned run of the script."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_zeropp.testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
coords = load_script(ROOT / "benchmarks" / "small_coordinates.py", "small_coordinates_benchmark")


def test_step_groups():
    assert coords.step_groups(30) == [(1, 5), (6, 15), (16, 30)]
    assert coords.step_groups(2) == [(1, 2)]
    assert coords.step_groups(50) == [(1, 5), (6, 15), (16, 30), (31, 45), (46, 50)]


def test_recorder_sums_a_group_where_errors_that_cancel_vanish():
    from types import SimpleNamespace

    recorder = coords.Recorder(coords.step_groups(4))
    comms = SimpleNamespace(steps=0, config=SimpleNamespace(gradient_block_size=4))
    e = torch.tensor([4.0, 0.25, -1.0, 2.0])
    for step in range(4):  # 0.25 zeroed on odd steps, doubled on even ones (as error feedback would carry it)
        comms.steps = step
        recorder.add(comms, None, torch.tensor([4.0, 0.5 if step % 2 else 0.0, -1.0, 2.0]), e)
    assert sorted(recorder.steps) == [1, 2, 3, 4]
    per_step = coords.ratios(recorder.steps[1]["<unit>"])
    assert per_step["rel_err_small"] == pytest.approx(1.0) and per_step["zeroed_small"] == 1.0
    (first,) = recorder.summed()[0].values()  # steps 1 .. 4: one group
    assert coords.ratios(first)["rel_err_small"] == 0.0 and coords.ratios(first)["small_share"] == 0.25


def test_moved_sums_compare_displacements_and_count_coordinates_moved_the_other_way():
    moved = {
        "adam_q": torch.tensor([1.0, -1.0, 2.0, 0.0]), "adam_shadow": torch.tensor([1.0, 1.0, 1.0, 0.0]),
        "sgd_q": torch.tensor([2.0, 0.5, 1.0, 3.0]), "sgd_shadow": torch.tensor([2.0, 1.0, 1.0, 0.0]),
    }  # fmt: skip
    sums = coords.moved_sums(moved, torch.tensor([False, True, True, True]))
    assert sums["rest"] == dict(moved_nonzero=1, adam_moved_err2=0, adam_moved_ref2=1, adam_moved_against=0,
                                sgd_moved_err2=0, sgd_moved_ref2=4, sgd_moved_against=0)  # fmt: skip
    # small: Adam moved coordinate 1 the other way (err 4) and 2 twice as far (err 1); the last one the shadow left
    # alone counts in no "against"
    assert sums["small"] == dict(moved_nonzero=2, adam_moved_err2=5, adam_moved_ref2=2, adam_moved_against=1,
                                 sgd_moved_err2=0.25 + 9, sgd_moved_ref2=2, sgd_moved_against=0)  # fmt: skip
    empty = {c: {k: 0.0 for k in coords.SUMS} for c in ("small", "rest")}
    for c in ("small", "rest"):
        empty[c].update(sums[c])
    r = coords.ratios(empty)
    assert r["adam_small_moved_rel_err"] == pytest.approx(2.5**0.5) and r["adam_small_moved_against"] == 0.5
    assert r["sgd_rest_moved_rel_err"] == 0.0 and r["sgd_small_moved_against"] == 0.0


def test_an_unbiased_sequence_moves_sgd_about_right_and_adam_too_little():
    """The mechanism the moved table probes: a small coordinate qgZ sends as 0, 2x, 0, 2x (right on average, as
    error feedback or stochastic rounding send it) moves SGD with momentum close to where the exact gradients would;
    Adam, dividing by the root of the squares, moves it about half as far."""
    from types import SimpleNamespace

    recorder = coords.Recorder(coords.step_groups(4))
    comms = SimpleNamespace(steps=0, config=SimpleNamespace(gradient_block_size=4))
    e = torch.tensor([4.0, 0.25, -1.0, 2.0])
    for step in range(4):
        comms.steps = step
        recorder.add(comms, None, torch.tensor([4.0, 0.5 if step % 2 else 0.0, -1.0, 2.0]), e)
    (sums,) = recorder.summed()[0].values()
    r = coords.ratios(sums)
    assert r["adam_rest_moved_rel_err"] == pytest.approx(0.0, abs=1e-12)
    assert r["sgd_rest_moved_rel_err"] == pytest.approx(0.0, abs=1e-12)
    assert r["sgd_small_moved_rel_err"] == pytest.approx(1 - 1.855 / 2.26225)  # momentum sums 1.855, 2.26225
    assert (
        0.4 < r["adam_small_moved_rel_err"] < 0.7 and r["adam_small_moved_rel_err"] > 2 * r["sgd_small_moved_rel_err"]
    )
    assert r["adam_small_moved_against"] == 0.0


def test_block_ids_follow_the_starts_or_flat_blocks():
    assert coords.block_ids(7, (0, 3, 5, 7), 128).tolist() == [0, 0, 0, 1, 1, 2, 2]
    assert coords.block_ids(7, None, 3).tolist() == [0, 0, 0, 1, 1, 1, 2]


def test_small_is_below_an_eighth_of_the_block_maximum():
    e = torch.tensor([8.0, 0.5, 1.0, -1.5, 0.0, 0.01, -0.2, 0.0, 0.0])
    ids = coords.block_ids(9, (0, 4, 7, 9), 128)
    # block 0: max 8, small below 1 (1.0 itself is not small); block 1: max 0.2, below 0.025; block 2: all zero
    assert coords.small_mask(e, ids).tolist() == [False, True, False, False, True, True, False, False, False]


def test_sums_count_zeroed_coordinates_and_errors_by_class():
    e = torch.tensor([8.0, 0.5, 0.25, -2.0])
    q = torch.tensor([8.0, 0.0, 0.5, -1.0])  # 0.5 zeroed, 0.25 doubled, -2 halved
    small = coords.small_mask(e, coords.block_ids(4, None, 4))
    sums = coords.coordinate_sums(q, e, small)
    assert sums["small"] == dict(count=2, nonzero=2, zeroed=1, err2=0.25 + 0.0625, ref2=0.25 + 0.0625)
    assert sums["rest"] == dict(count=2, nonzero=2, zeroed=0, err2=1.0, ref2=68.0)
    r = coords.ratios(coords.pooled([sums, sums]))  # pooling the same sums twice changes no ratio
    assert r["zeroed"] == 0.25 and r["zeroed_small"] == 0.5 and r["small_share"] == 0.5
    assert r["rel_err_small"] == pytest.approx(1.0) and r["rel_err_rest"] == pytest.approx((1 / 68) ** 0.5)
    assert r["adam_small_norm_ratio"] is None  # no Adam directions were given


def test_adam_directions_match_torch_adam_and_compare_from_the_same_state():
    torch.manual_seed(0)
    adam = coords.ShadowAdam(5)
    p = torch.zeros(5, dtype=torch.float64, requires_grad=True)
    ref = torch.optim.Adam([p], lr=1.0, betas=coords.BETAS, eps=coords.EPS)
    for _ in range(4):
        e = torch.randn(5, dtype=torch.float64)
        q = e.clone()
        q[0] = 0.0  # qgZ zeroes one coordinate every step
        before = p.detach().clone()
        p.grad = q.clone()
        ref.step()
        d = adam.step(q, e)
        torch.testing.assert_close(d["q"], before - p.detach(), rtol=1e-12, atol=1e-12)  # the run's optimizer
    # the same state stepped with e differs from the q step in coordinate 0 only; the shadow everywhere it can
    assert torch.equal(d["q"][1:], d["same"][1:]) and d["same"][0] != 0
    shadow = coords.ShadowAdam(5)
    for _ in range(4):
        s = shadow.step(e, e)
    torch.testing.assert_close(s["q"], s["shadow"])
    mask = torch.tensor([True, False, False, False, False])
    r = coords.ratios(coords.pooled([coords.coordinate_sums(q, e, mask, d)]))
    assert r["adam_rest_rel_err"] == 0.0 and r["adam_rest_norm_ratio"] == 1.0
    assert r["adam_small_rel_err"] > 0 and r["adam_small_norm_ratio"] < 1  # zeroed this step, not before: smaller
    assert r["adam_small_shadow_rel_err"] > 0


@pytest.mark.multiprocess
def test_two_steps_on_two_nodes_of_one_rank_write_the_fields(tmp_path):
    out = tmp_path / "coords.json"
    # as a program: the ranks import the worker from the script's own module, which the test's loaded copy is not
    cmd = [sys.executable, str(ROOT / "benchmarks" / "small_coordinates.py"), "--steps", "2", "--topology", "2x1",
           "--configs", "qgz_feedback", "--n-layer", "1", "--json", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "| on, INT8 residual | 1-2 |" in proc.stdout
    (row,) = json.loads(out.read_text())
    assert row["config"] == "qgz_feedback" and (row["nodes"], row["ranks_per_node"]) == (2, 1)
    assert [g["steps"] for g in row["groups"]] == [[1, 2]] and [s["step"] for s in row["per_step"]] == [1, 2]
    assert sorted(row["per_unit"]) == ["<root>", "net.blocks.0"] and len(row["losses"]) == 2
    for figures in (*row["groups"], *row["per_step"], *row["per_unit"].values()):
        assert 0 < figures["small_share"] < 1 and 0 <= figures["zeroed"] <= figures["zeroed_small"] <= 1
        assert 0 < figures["rel_err_rest"] < figures["rel_err_small"] < 1.5  # INT4: lossy, and worst where small
        for key in ("adam_small_norm_ratio", "adam_small_rel_err", "adam_rest_norm_ratio", "adam_rest_rel_err",
                    "adam_small_shadow_rel_err", "adam_rest_shadow_rel_err"):  # fmt: skip
            assert 0 < figures[key] < 2, key
    (group,) = row["groups"]
    for key in ("adam_small_moved_rel_err", "adam_rest_moved_rel_err", "sgd_small_moved_rel_err",
                "sgd_rest_moved_rel_err"):  # fmt: skip
        assert 0 < group[key] < 2, key
    for key in ("adam_small_moved_against", "adam_rest_moved_against", "sgd_small_moved_against"):
        assert 0 <= group[key] < 0.5, key
    assert "| on, INT8 residual | 1-2 |" in proc.stdout.split("moved, Adam small")[1]  # the third table
    assert (
        0 <= group["summed_rel_err_rest"] < group["summed_rel_err_small"] < 1.5 and 0 < group["summed_small_share"] < 1
    )
    first = row["per_step"][0]  # the shadow state and the same state are one state at the first step
    assert first["adam_small_rel_err"] == pytest.approx(first["adam_small_shadow_rel_err"], rel=1e-9)
