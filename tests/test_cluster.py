"""Two network namespaces joined by a shaped veth as two nodes: a real multi-node launch of the example (needs root).

Each namespace runs ``train.py`` once, as each node of a multi-node job does (``num_nodes=2``, ``devices=2``,
``NODE_RANK``/``MASTER_ADDR``/``MASTER_PORT``, gloo bound to the veth), through ``benchmarks/cluster.py``. The
veth's counters see only what crosses the node boundary. On docs/results/slow_link.md ZeRO++ puts 0.17 of ZeRO-3's
bytes on the link (0.21 by the ledger's per-peer count: gloo's ring all-gather moves 3/4 of what the ledger counts
across the boundary, qwZ's quantized one the same share); the test requires at most 0.20, i.e. at least 5x fewer.
"""

import math
import subprocess
import time
from pathlib import Path

import pytest

from lightning_zeropp.testing.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


cluster_benchmark = load_script(ROOT / "benchmarks" / "cluster.py", "cluster_benchmark")  # finds netns.py itself
MODEL, launch, summarize = cluster_benchmark.MODEL, cluster_benchmark.launch, cluster_benchmark.summarize
TwoNodeCluster, missing_requirements = cluster_benchmark.TwoNodeCluster, cluster_benchmark.missing_requirements

pytestmark = pytest.mark.cluster
needs_root = pytest.mark.skipif(missing_requirements() is not None, reason=f"TwoNodeCluster {missing_requirements()}")

STEPS = 3
MAX_LINK_RATIO = 0.20  # measured 0.172 (module docstring)


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@needs_root
def test_zeropp_sends_fewer_bytes_over_the_link_than_zero3(tmp_path):
    rows = {}
    with TwoNodeCluster(rate_mbit=1000) as cluster:
        for port, name in enumerate(("zero3", "zeropp"), start=29300):
            runs = launch(cluster, name, tmp_path / name, port, STEPS, MODEL, batch_size=1, timeout=600)
            assert len(runs) == 4, f"{name}: expected probes from 4 ranks, got {len(runs)}"
            for ranks in runs:
                assert [r["step"] for r in ranks] == list(range(STEPS + 1))
                assert {r["node_rank"] for r in ranks} <= {0, 1}
                assert all(math.isfinite(r["loss"]) for r in ranks[1:]), f"{name}: non-finite loss"
            assert {ranks[0]["node_rank"] for ranks in runs} == {0, 1}
            rows[name] = summarize(name, [runs], warmup=1, tokens_per_step=1)  # steps 2..3: no start-up traffic
    assert _namespaces().count(cluster.prefix) == 0, "namespaces left behind"

    zero3, zeropp = rows["zero3"], rows["zeropp"]
    # the link carried roughly what the ledger says crossed nodes (not loopback traffic, not nothing)
    assert 0.7 < zero3["link_tx_bytes_per_step"] / zero3["ledger_inter_bytes_per_step"] < 1.3
    ratio = zeropp["link_tx_bytes_per_step"] / zero3["link_tx_bytes_per_step"]
    assert ratio <= MAX_LINK_RATIO, f"zeropp/zero3 bytes on the veth: {ratio:.3f} > {MAX_LINK_RATIO}"
    rx_ratio = zeropp["link_rx_bytes_per_step"] / zero3["link_rx_bytes_per_step"]
    assert rx_ratio <= MAX_LINK_RATIO, f"zeropp/zero3 bytes on the veth (node 1 -> 0): {rx_ratio:.3f}"


@needs_root
def test_namespaces_and_processes_are_removed_on_error():
    with pytest.raises(RuntimeError, match="boom"), TwoNodeCluster(rate_mbit=200) as cluster:
        procs = [cluster.popen(node, ["sleep", "600"], env={}) for node in (0, 1)]
        assert _namespaces().count(cluster.prefix) == 2
        raise RuntimeError("boom")
    deadline = time.monotonic() + 10
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(p.poll() is not None for p in procs), "processes survived the cluster"
    assert cluster.prefix not in _namespaces(), "namespaces survived the cluster"
