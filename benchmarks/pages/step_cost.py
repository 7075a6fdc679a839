"""What the second-moment correction and error feedback add to a step's compute, timed on one CPU thread
(``moments_cost.py``, ``feedback_cost.py``)."""

from __future__ import annotations

from pages import Source, table

TITLE = "What the correction and feedback cost per step"
QUESTION = """What do the second-moment correction and error feedback add to a step's compute, timed on a CPU thread?

Both are timed on the host clock on a CPU: one process, one thread, one rank's shard of the example GPT laid out as
the strategy lays it; no collective runs (neither sends a byte more). These are CPU figures only: on a GPU the
correction's passes are element-wise kernels and feedback's residual is read and written by the fused Triton kernel
in the pass that already re-quantizes, and neither was timed on a GPU. What they do to a whole step on the emulated
two-node cluster is on [Step time on a slow link](slow_link.md)."""

MOMENTS = "step_cost/moments_cost.json"
FEEDBACK = "step_cost/feedback_cost.json"
SOURCES = [MOMENTS, FEEDBACK]

WAYS = {
    "none": "none (the defaults)",
    "int8": "INT8 codes + block scales (the default width)",
    "bf16": "bf16",
    "fp32": "fp32",
}


def _moments(rows: list[dict]) -> str:
    out = [[f"{r['n_embd']} x {r['n_layer']}", r["world"], r["alignment"], f"{r['shard_elements']:,}",
            r["parameters"], f"{r['norms_ms']:.2f}", f"{r['lowering_ms']:.2f}",
            f"{r['norms_ms'] + r['lowering_ms']:.2f}", f"{r['adamw_ms']:.2f}", f"{r['ratio']:.2f}"]
           for r in sorted(rows, key=lambda r: (r["shard_elements"], r["alignment"] != "parameter"))]  # fmt: skip
    return table(["n_embd x layers", "ranks", "blocks", "shard elements", "parameters", "norms ms", "lowering ms",
                  "correction ms", "AdamW step ms", "correction / AdamW"], out)  # fmt: skip


def _feedback(row: dict) -> str:
    out = [[WAYS.get(w, w), f"{row[f'{w}_ms']:.2f}", "-" if w == "none" else f"{row[f'{w}_extra_ms']:+.2f}",
            "1.00" if w == "none" else f"{row[f'{w}_ratio']:.2f}x"] for w in WAYS if f"{w}_ms" in row]  # fmt: skip
    return table(["residual", "re-quantization ms", "added ms", "against none"], out)


def render(sources: dict[str, Source]) -> str:
    moments = sources[MOMENTS].data["rows"]
    feedback = sources[FEEDBACK].data["rows"]
    small = min(moments, key=lambda r: r["shard_elements"])
    large = max(moments, key=lambda r: r["shard_elements"])

    def ratios(size: int) -> str:
        return _span([r["ratio"] for r in moments if r["shard_elements"] == size])

    by_size = (
        f"On the smallest shard ({small['shard_elements']:,} elements) the correction takes"
        f" {ratios(small['shard_elements'])} the time of AdamW's own step; on the largest"
        f" ({large['shard_elements']:,}), {ratios(large['shard_elements'])}."
    )
    sections = []
    for row in feedback:
        default = (
            f"With the default residual width, feedback makes step 3's re-quantization {row['int8_ratio']:.2f}x as long"
            " on this thread."
            if "int8_ratio" in row
            else ""
        )
        sections.append(
            f"""The example GPT at n_embd {row["n_embd"]} x {row["n_layer"]} layers, one rank of {row["nodes"]} nodes x
{row["per_node"]}: {row["calls"]} re-quantization calls per pass (every unit's pipeline stages), {row["elements"]:,}
elements in all; the best of {row["repeats"]} passes per way, the ways interleaved within each repeat so that a busy
machine slows them alike.

{_feedback(row)}

{default}"""
        )
    return f"""## The second-moment correction

`second_moment_correction=True`: after the backward, the gradients' norms (*norms*); right before each update, the
lowering of AdamW's `exp_avg_sq` by the estimated noise (*lowering*). Next to them, AdamW's own step (foreach, with
state) on the same shard. Each figure is the best of the script's repeats; *blocks*: parameter-aligned (the default)
or flat.

{_moments(moments)}

{by_size}

## Error feedback

`gradient_error_feedback=True` changes qgZ's step 3 (the node's INT8 pieces summed and re-quantized to INT4 for the
inter-node hop): the re-quantization also reads the residual the last step left and writes the new one. Timed on the
torch twin that a CPU rank runs, without a residual and with one of each width.

{chr(10).join(sections)}"""  # fmt: skip


def _span(values: list[float]) -> str:
    lo, hi = f"{min(values):.2f}x", f"{max(values):.2f}x"
    return lo if lo == hi else f"{lo} to {hi}"
