"""The tensor-parallel accuracy study (``benchmarks/tensor_parallel_accuracy.py``): its statistics and verdict on
made-up runs, its page on them, its resume (the runs done are skipped, runs made with other settings refused), the
data windows of a seed; and (slow) its smallest real run, whose JSON the page reads."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_zeropp.testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
study = load_script(ROOT / "benchmarks" / "tensor_parallel_accuracy.py", "tensor_parallel_accuracy_benchmark")
sys.path.insert(0, str(ROOT / "benchmarks"))

from pages import Source  # noqa: E402
from pages import tensor_parallel_accuracy as page  # noqa: E402

STEPS = 4
SETUP = dict(world=4, ranks_per_node=2, size="tiny", model=study.SIZES["tiny"], batch=study.BATCH, evals=2,
             val_windows=16, lr=1e-3, warmup=10)  # fmt: skip
ARGS = ["--size", "tiny", "--steps", str(STEPS), "--evals", "2", "--val-windows", "16", "--seeds", "1", "2", "3"]


def _run(config, seed, final, train=2.0, steps=STEPS, **extra):
    """A run whose validation curve ends at ``final`` and whose training loss is ``train`` at every step."""
    return dict(
        SETUP, config=config, seed=seed, regime="lr0.001-warmup10", steps=steps, seconds=120.0,
        train_curve=[[s, train] for s in range(1, steps + 1)], val_curve=[[steps // 2, 3.0], [steps, final]],
        describe="qwZ INT8 weights across 2 nodes" if config != study.BASE else None, **extra,
    )  # fmt: skip


def _study(gaps, base=(2.0, 2.2, 2.4), config="zeropp"):
    """Baseline runs at seeds 1.., and ``config`` at each seed ``gaps`` above it (final validation and training)."""
    runs = [_run(study.BASE, s, b, train=b) for s, b in enumerate(base, 1)]
    runs += [_run(config, s, b * (1 + g), train=b * (1 + g)) for (s, b), g in zip(enumerate(base, 1), gaps)]
    return runs


def test_paired_gaps_their_standard_error_and_a_gap_outside_the_goal_is_not_met():
    (entry,) = study.summarize(_study([0.01, 0.02, 0.03]))  # mean 2%, sample std 1%: far outside 0.1%
    (c,) = entry["configs"]
    assert [s for s, _ in c["final_gap"]["per_seed"]] == [1, 2, 3]
    assert [g for _, g in c["final_gap"]["per_seed"]] == pytest.approx([0.01, 0.02, 0.03], rel=1e-12)
    assert c["final_gap"]["mean"] == pytest.approx(0.02, rel=1e-12)
    assert c["final_gap"]["se"] == pytest.approx(0.01 / math.sqrt(3), rel=1e-9)
    assert c["second_half_gap"]["mean"] == pytest.approx(0.02, rel=1e-12)
    assert c["verdict"].startswith("NOT met")
    assert entry[study.BASE]["final_val_loss"]["mean"] == pytest.approx(2.2)
    assert entry[study.BASE]["final_val_loss"]["std"] == pytest.approx(0.2)
    assert "NOT met" in study.report([entry])


@pytest.mark.parametrize(
    ("gaps", "want"),
    [
        ([0.0002, 0.0003, 0.0001], "met"),  # 0.02% +- 0.012%: inside 0.1%
        ([0.0012, 0.0013, 0.0011], "NOT met"),  # 0.12% +- 0.012%: a small gap, but beyond the goal
        ([0.0005, 0.0015, 0.0010], "undecided"),  # 0.1% +- 0.058%: straddles it
        ([-0.0012, -0.0013, -0.0011], "NOT met"),  # lower by more than the goal is outside it too
    ],
)
def test_the_goal_reads_the_mean_gap_and_its_resolution(gaps, want):
    (entry,) = study.summarize(_study(gaps))
    assert entry["configs"][0]["verdict"].startswith(want)
    text = page.render({page.STUDY: Source(page.STUDY, {"runs": _study(gaps)}, [])})
    row = next(line for line in text.splitlines() if line.startswith("| `zeropp`"))
    assert row.split(" | ")[-3] == want, row  # the final validation loss by the goal


def test_one_seed_gives_a_gap_and_no_verdict():
    (entry,) = study.summarize(_study([0.05], base=(2.0,)))
    c = entry["configs"][0]
    assert c["final_gap"]["mean"] == pytest.approx(0.05) and c["final_gap"]["se"] is None
    assert c["verdict"].startswith("no verdict")


def test_the_page_and_its_snippets_come_from_the_runs():
    runs = _study([0.0002, 0.0003, 0.0001], config=page.DEFAULT) + [_run(page.DEFAULT, 4, 2.5, error="rank 1 raised")]
    sources = {page.STUDY: Source(page.STUDY, {"runs": runs}, [])}
    text = page.render(sources)
    assert "4 CPU ranks as 2 nodes x 2" in text and "+0.020% ± 0.012% (3 seeds)" in text
    assert "qwZ INT8 weights across 2 nodes" in text  # the strategy's description, as recorded
    assert f"## 2 nodes x 2, {STEPS} steps, aggressive: lr 0.001, 10 warm-up steps" in text  # convergence.py's name
    snips = page.snippets(sources)
    assert snips["aggressive_final"] == "+0.020% ± 0.012% (3 seeds)" and snips["aggressive_final_verdict"] == "met"
    assert snips["aggressive_steps"] == str(STEPS) and snips["aggressive_parting"] == "1: never, 2: never, 3: never"


def test_each_layout_and_regime_has_its_section_and_snippets_the_default_layout_first():
    D = page.DEFAULT
    calm8 = [dict(r, world=8, ranks_per_node=4, lr=3e-4, warmup=30) for r in _study([0.002, 0.003, 0.004], config=D)]
    two = _study([0.0002, 0.0003, 0.0001], config=D)
    sources = {"a": Source("a", {"runs": two}, []), "b": Source("b", {"runs": calm8}, [])}
    text = page.render(sources)
    assert text.index("## 2 nodes x 2, 4 steps, aggressive") < text.index("## 2 nodes x 4, 4 steps, calm: lr 0.0003")
    snips = page.snippets(sources)
    assert snips["aggressive_final_verdict"] == "met" and snips["calm_2x4_final_verdict"] == "NOT met"
    assert "calm_final" not in snips


def test_two_runs_part_where_their_smoothed_training_losses_first_differ_by_more_than_the_margin():
    base = _run(study.BASE, 1, 2.0)
    spiked = dict(base, train_curve=[[1, 2.0], [2, 2.0], [3, 2.1], [4, 2.1]])  # step 3's mean of 3: 1.7% higher
    assert page.parted(spiked, base) == (3, "higher") and page.parted(base, spiked) == (3, "lower")
    close = dict(base, train_curve=[[1, 2.0], [2, 2.0], [3, 2.01], [4, 2.01]])  # within 1% at every step
    assert page.parted(close, base) is None and page.parted(dict(base), base) is None
    runs, bases = {1: dict(base), 2: spiked}, {1: base, 2: base}
    assert page._identical(runs, bases) == "1 of 2"
    assert page._parting(runs, bases) == "1: never, 2: step 3, higher"


def test_a_seed_draws_its_own_windows_the_same_for_every_configuration():
    corpus = torch.arange(4000, dtype=torch.uint8)
    train, held = study.ByteWindows(corpus[:3000], 16), study.ByteWindows(corpus[3000:], 16)
    one, again, other = (study.seed_data(train, held, s, 3, 2, 5) for s in (1, 1, 2))
    tokens, targets = one["train"]
    assert tokens.shape == targets.shape == (3 * study.BATCH * 2, 16)
    assert torch.equal(tokens[:, 1:], targets[:, :-1])  # next bytes
    assert torch.equal(tokens, again["train"][0]) and not torch.equal(tokens, other["train"][0])
    assert torch.equal(one["val"][0], other["val"][0]) and one["val"][0].shape == (5, 16)
    with pytest.raises(SystemExit, match="need"):
        study.seed_data(train, held, 1, 100, 2, 5)


def test_a_rerun_skips_the_runs_done_and_refuses_runs_made_otherwise(tmp_path, capsys):
    path = tmp_path / "tp.json"
    runs = [_run(c, s, 2.0) for s in (1, 2, 3) for c in study.DEFAULT_CONFIGS]
    path.write_text(json.dumps({"meta": {"commands": []}, "runs": runs, "summary": []}))
    study.main([*ARGS, "--json", str(path)])  # every run is there: nothing is spawned
    out = capsys.readouterr()
    assert "6 runs planned, 6 done already, 0 to run" in out.err and "nothing to run" in out.out
    with pytest.raises(SystemExit):
        study.main([*ARGS, "--json", str(path), "--val-windows", "32"])  # not paired with these: refused
    assert "holds these runs with other settings" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_smallest_run_writes_the_rows_the_page_reads(tmp_path):
    """2 steps of the tiny Llama on 4 gloo ranks (2 nodes x 2), one seed, both configurations: the JSON's runs, its
    manifest, and the page made from it."""
    path = tmp_path / "tp.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "tensor_parallel_accuracy.py"), "--size", "tiny", "--steps", "2",
           "--evals", "1", "--val-windows", "16", "--seeds", "1", "--json", str(path), "--timeout", "600"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(path.read_text())
    runs = {r["config"]: r for r in data["runs"]}
    assert sorted(runs) == ["model_parallel", "zeropp-vectors"] and not any("error" in r for r in runs.values())
    for r in runs.values():
        assert [s for s, _ in r["train_curve"]] == [1, 2] and [s for s, _ in r["val_curve"]] == [2]
        assert all(math.isfinite(v) and 4 < v < 7 for _, v in r["train_curve"] + r["val_curve"])  # about ln 256
    assert runs["model_parallel"]["describe"] is None
    described = runs["zeropp-vectors"]["describe"]
    assert "INT8" in described and "INT4" in described and "correction on matrices" in described
    assert "norm gains and biases exact" in described  # the defaults with tensor parallelism
    # the first step's loss is the same weights on the same batch: only qwZ's rounding of the weights differs
    first = [r["train_curve"][0][1] for r in runs.values()]
    assert first[0] != first[1] and first[0] == pytest.approx(first[1], rel=1e-2)
    assert json.loads(path.with_name("tp.manifest.json").read_text())["runs"][0]["command"].startswith("python ")
    text = page.render({page.STUDY: Source(page.STUDY, data, [])})
    assert "## 2 nodes x 2, 2 steps, aggressive" in text and "no verdict (one seed)" in text


def _calm(runs, world=4, per_node=2):
    return [dict(r, world=world, ranks_per_node=per_node, lr=3e-4, warmup=30) for r in runs]


def test_the_scope_rule_holds_where_the_candidates_spread_is_at_most_half_the_defaults_on_every_layout():
    # the defaults' final gaps spread by a std of 0.5%, the candidate's by 0.1% (2x2) and 0.3% (2x4)
    defaults, narrow, wide = [-0.004, 0.001, 0.006], [0.0, 0.001, 0.002], [0.001, 0.004, 0.007]
    two = _calm(_study(defaults) + _study(narrow, config=page.SCOPE_CANDIDATE)[3:])
    eight = _calm(_study(defaults) + _study(narrow, config=page.SCOPE_CANDIDATE)[3:], 8, 4)
    result, lines = page.scope_rule({"a": Source("a", {"runs": two}, []), "b": Source("b", {"runs": eight}, [])})
    assert result == "holds" and len(lines) == 2 and "ratio 0.20" in lines[0]
    eight = _calm(_study(defaults) + _study(wide, config=page.SCOPE_CANDIDATE)[3:], 8, 4)
    result, lines = page.scope_rule({"a": Source("a", {"runs": two}, []), "b": Source("b", {"runs": eight}, [])})
    assert result == "fails" and "ratio 0.60 (fails" in lines[1]
    # two of the three seeds: no verdict
    short = _calm(_study(defaults) + _study(narrow[:2], config=page.SCOPE_CANDIDATE)[3:])
    assert page.scope_rule({"a": Source("a", {"runs": short}, [])})[0] == "not run"
    # the aggressive regime does not count
    assert page.scope_rule({"a": Source("a", {"runs": _study(defaults)}, [])}) == ("not run", [])


@pytest.mark.parametrize(
    ("gaps", "want"),
    [
        ([0.0002, 0.0003, 0.0001], "3"),  # met already: the seeds run
        ([0.0006, 0.0009, 0.0012], "36"),  # mean 0.09%, sd 0.03%: 2 SE must reach 0.01%, (2 * 0.03 / 0.01)^2
        ([0.0010, 0.0010, 0.0010, 0.0010, 0.0011, 0.0009], "never"),  # a mean on the line never decides
        ([0.0004, 0.0012], "32"),  # mean 0.08%, sd 0.057%: 2 SE must reach 0.02%, (2 * 0.0566 / 0.02)^2
    ],
)
def test_the_seeds_the_rule_needs_to_decide_shrink_its_interval_to_the_distance_from_the_line(gaps, want):
    pairs = list(enumerate(gaps, start=1))
    assert page._seeds_needed(pairs) == want
