"""What each collective of a job runs, decided once: :func:`resolve` turns the arguments and the job's shape into a
frozen :class:`CommPlan`, and everything that acts on a technique reads the plan, never the switches again.

The runtime (:class:`~lightning_zeropp.comm.ZeroPPComms`, the process groups, the FSDP hooks), the cost model
(:mod:`lightning_zeropp.costs`, the planner) and the startup line all interpret the same plan, so a combination of
arguments and topology that nobody tested (70B on 32 nodes in the planner) cannot be decided one way by the runtime
and another by the cost model. ``tests/test_commplan.py`` fails on a read of a technique argument (a field of the
config that chooses a technique or its parameters) outside :mod:`~lightning_zeropp.config` and this module.

Per collective::

    forward gather    exact (world; HSDP: the node) | quantized (bits, block) | node copy (weight deltas, bits)
    backward gather   secondary (hpZ: inside R ranks; HSDP: the node, exact) | again as the forward
    gradients         exact reduce-scatter (world) | two-hop (qgZ: intra bits, inter bits, pieces, rounding, feedback,
                      rotation, until a step) | HSDP rail (reduce-scatter in the node, exact; then across nodes an
                      all-reduce: FSDP's exact one, or quantized HSDP's INT4 reduce-scatter and INT8 / bf16 all-gather
                      with the same rounding, feedback, rotation and until-step as qgZ, :mod:`~lightning_zeropp.rail`)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .config import ZeroPPConfig
from .topology import Topology

ForwardKind = Literal["exact", "quantized", "node_copy"]
BackwardKind = Literal["secondary", "same"]
GradientKind = Literal["exact", "two_hop", "hsdp_rail"]
Group = Literal["world", "node"]


@dataclass(frozen=True)
class ForwardGather:
    """The forward all-gather: ``exact`` over ``group``; ``quantized`` (qwZ: ``bits``, ``block_size``) over the
    world; or ``node_copy`` (weight deltas: ``bits`` per delta element, the node's copy rebuilt exactly every
    ``refresh`` optimizer steps)."""

    kind: ForwardKind
    group: Group
    bits: int | None = None
    block_size: int | None = None
    refresh: int | None = None


@dataclass(frozen=True)
class BackwardGather:
    """The backward all-gather: ``secondary`` (from the copy kept after forward, inside ``group_size`` ranks, exact)
    or ``same`` (again as the forward gathers, from every rank of its group)."""

    kind: BackwardKind
    group_size: int


@dataclass(frozen=True)
class Feedback:
    """Error feedback on the inter-node hop: the residual's width, carry-over factor and reset period."""

    bits: int
    decay: float
    reset: int


@dataclass(frozen=True)
class GradientReduction:
    """The gradient reduction: ``exact`` (FSDP's reduce-scatter over ``group``), ``two_hop`` (qgZ) or ``hsdp_rail``
    (reduce-scatter in the node, exact, then all-reduce across nodes: exact, or quantized where ``inter_bits`` is
    set). For ``two_hop``: the bits per hop, the block size, the pipeline pieces, the rounding, the feedback (None:
    off), the rotation, ``until_step`` (0: throughout; else quantized for the first that many optimizer steps, exact
    after), ``second_moment`` (the inter-node hop's noise taken out of an Adam-family optimizer's second moment,
    :mod:`~lightning_zeropp.moments`) and ``second_moment_strict`` (it was asked for outright,
    ``second_moment_correction=True``: an optimizer it cannot correct is refused, not left alone), and
    ``second_moment_scope`` (``"matrices"``: only parameters of two or more dimensions corrected), and
    ``exact_vectors`` (the gradients of parameters of fewer than two dimensions reduced exactly, carried in qgZ's
    all-to-alls, :mod:`~lightning_zeropp.vectors`). A quantized rail has the same fields but ``intra_bits``,
    ``pieces`` (its pieces are the K rail ranks') and the second-moment fields (``exact_vectors``: the vectors
    all-reduced exactly in the rail's all-to-alls), and ``gather_bits``: the reduced pieces' width on the rail's
    all-gather (8: INT8 blocks, 16: bf16)."""

    kind: GradientKind
    group: Group
    intra_bits: int | None = None
    inter_bits: int | None = None
    block_size: int | None = None
    pieces: int | None = None
    rounding: str | None = None
    feedback: Feedback | None = None
    rotation: str = "none"
    until_step: int = 0
    gather_bits: int | None = None
    second_moment: bool = False
    second_moment_strict: bool = False
    second_moment_scope: str = "all"
    exact_vectors: bool = False

    @property
    def stochastic(self) -> bool:
        return self.rounding == "stochastic"

    @property
    def quantized_rail(self) -> bool:
        """Quantized HSDP: the rail's all-reduce runs as ours (INT4 reduce-scatter, INT8 / bf16 all-gather)."""
        return self.kind == "hsdp_rail" and self.inter_bits is not None


@dataclass(frozen=True)
class CommPlan:
    """One job's collectives (see the module docstring), the sharding they imply, and why each collective runs as it
    does where a switch would say otherwise (``notes``: ``(collective, why)`` pairs: "forward", "deltas",
    "gradients"). With ``tensor_parallel_size`` > 1 the sizes and every collective are the data-parallel dimension's
    (one per tensor-parallel position); the tensor-parallel dimension runs the model's own plan."""

    world_size: int
    ranks_per_node: int
    num_nodes: int
    hpz_partition_size: int
    sharding: Literal["FULL_SHARD", "HYBRID_SHARD"]
    forward: ForwardGather
    backward: BackwardGather
    gradients: GradientReduction
    reshard_after_forward: bool | int
    mesh_shape: tuple[int, ...]
    block_alignment: str
    notes: tuple[tuple[str, str], ...] = ()
    tensor_parallel_size: int = 1

    @property
    def hybrid(self) -> bool:
        """HSDP: sharded inside each node (a 2-D mesh), replicated across nodes."""
        return self.sharding == "HYBRID_SHARD"

    @property
    def shard_group(self) -> Group:
        """The group FSDP's collectives run on: all ranks (ZeRO-3, ZeRO++), or (HSDP, several nodes) the node's."""
        return "node" if self.hybrid and self.num_nodes > 1 else "world"

    @property
    def native_all_reduce(self) -> bool:
        """HSDP whose cross-node all-reduce FSDP runs itself, exactly, on a 2-D mesh; quantized HSDP gives FSDP the
        node's ranks alone (a 1-D mesh) and runs the rail's all-reduce inside its reduce-scatter hook."""
        return self.hybrid and not self.gradients.quantized_rail

    @property
    def secondary_by_hooks(self) -> bool:
        """hpZ kept by the all-gather hooks rather than FSDP (tensor parallelism: FSDP2 cannot reshard DTensor
        parameters to a smaller mesh), so FSDP reshards fully after forward (:mod:`lightning_zeropp.hpz`)."""
        return self.backward.kind == "secondary" and self.tensor_parallel_size > 1

    @property
    def aligned(self) -> bool:
        """Quantization blocks follow parameters (no block holds two)."""
        return self.block_alignment == "parameter"

    def quantizes_gradients_at(self, step: int) -> bool:
        """Whether the reduction after ``step`` optimizer steps runs qgZ."""
        g = self.gradients
        quantized = g.kind == "two_hop" or g.quantized_rail
        return quantized and (g.until_step == 0 or step < g.until_step)

    def note(self, collective: str) -> str:
        """Why ``collective`` runs as it does, where a switch would say otherwise ("": nothing to say)."""
        return next((why for key, why in self.notes if key == collective), "")

    def _why(self, collective: str) -> str:
        return f" ({self.note(collective)})" if self.note(collective) else ""

    def describe(self) -> str:
        """One line: what each collective runs, and why a switch the user left on does nothing here."""
        K, N, R = self.num_nodes, self.ranks_per_node, self.hpz_partition_size
        shape = f"{K} node{'s' if K > 1 else ''} x {N} rank{'s' if N > 1 else ''}"
        if self.tensor_parallel_size > 1:
            shape = (f"tensor parallel {self.tensor_parallel_size} inside each node (the model's plan); data parallel"
                     f" {shape}")  # fmt: skip
        f, g = self.forward, self.gradients
        if self.hybrid:
            if g.quantized_rail:
                steps = f" for the first {g.until_step} steps" if g.until_step else ""
                extras = ", error feedback" if g.feedback is not None else ""
                extras += ", Hadamard-rotated blocks" if g.rotation == "hadamard" else ""
                extras += ", norm gains and biases exact" if g.exact_vectors else ""
                gather = "bf16" if g.gather_bits == 16 else f"INT{g.gather_bits}"
                rail = (
                    f"quantized HSDP across nodes{steps}: INT{g.inter_bits} reduce-scatter, {gather} all-gather"
                    f" ({g.rounding} rounding{extras})"
                )
            else:
                rail = "gradients all-reduced exactly across nodes" if K > 1 else "one node: no cross-node all-reduce"
                rail += self._why("gradients")
            parts = ["HSDP: weights gathered and gradients reduce-scattered inside each node", rail]
            return f"ZeroPPStrategy: {shape}; " + "; ".join(parts) + "."
        parts = []
        if f.kind == "node_copy":
            parts.append(f"weight deltas INT{f.bits} (forward gather from the node's copy)")
        elif f.kind == "quantized":
            where = (
                f"across {K} nodes" if K > 1 else "(quantize_weights=True on one node: lossy, no cross-node byte saved)"
            )
            parts.append(f"qwZ INT{f.bits} weights {where}")
        else:
            parts.append("weights gathered exactly" + self._why("forward"))
        if self.note("deltas"):
            parts.append(self.note("deltas"))
        if self.backward.kind == "secondary":
            parts.append(f"hpZ backward gather inside {R} ranks")
        elif self.note("backward"):
            parts.append(self.note("backward"))
        if g.kind == "two_hop":
            steps = f" for the first {g.until_step} steps" if g.until_step else ""
            extras = ", error feedback" if g.feedback is not None else ""
            extras += ", Hadamard-rotated blocks" if g.rotation == "hadamard" else ""
            scope = " on matrices" if g.second_moment_scope == "matrices" else ""
            extras += f", Adam second-moment correction{scope}" if g.second_moment else ""
            extras += ", norm gains and biases exact" if g.exact_vectors else ""
            hops = f"INT{g.intra_bits} -> INT{g.inter_bits} gradients"
            if N == 1:  # one data-parallel rank per node: no intra-node hop
                hops = f"INT{g.inter_bits} gradients in one hop across nodes"
            parts.append(f"qgZ {hops}{steps} ({g.pieces} pieces, {g.rounding} rounding{extras})")
        else:
            parts.append("gradients reduce-scattered exactly" + self._why("gradients"))
        line = f"ZeroPPStrategy: {shape}; " + "; ".join(parts) + "."
        if K == 1 and any("one node" in self.note(c) for c in ("forward", "gradients")):
            line += (" On one node this is ZeRO-3's traffic, exact; to try ZeRO++ on one machine, emulate nodes with"
                     " ranks_per_node (e.g. 2).")  # fmt: skip
        return line


def reshard_after_forward(hpz_partition_size: int, world_size: int) -> bool | int:
    """FSDP2's ``reshard_after_forward`` for an hpZ partition size.

    ``1`` (hpZ off) and ``world_size`` both mean plain ZeRO-3: reshard fully, gather again from everyone in
    backward. (FSDP2 reads the int 1 as "do not reshard", which would keep whole weights alive: not ZeRO-3.)
    """
    if hpz_partition_size in (1, world_size):
        return True
    return hpz_partition_size


def resolve(config: ZeroPPConfig, topology: Topology, precision: str | None = None) -> CommPlan:
    """The plan of ``config`` on ``topology`` (whose ``hpz_partition_size`` is ``config.resolve``'s), with gradients
    in ``precision`` (None: not known yet, taken as not fp16)."""
    c, K, N, W, R = (
        config,
        topology.num_nodes,
        topology.ranks_per_node,
        topology.world_size,
        topology.hpz_partition_size,
    )
    notes: list[tuple[str, str]] = []
    hybrid = c.sharding_strategy == "HYBRID_SHARD"
    shard: Group = "node" if hybrid and K > 1 else "world"
    # forward
    if c.weight_deltas and 1 < R < W:
        forward = ForwardGather("node_copy", "world", c.weight_delta_bits, c.weight_block_size, c.weight_delta_refresh)
    elif not hybrid and (c.quantize_weights is True or (c.quantize_weights == "auto" and K > 1)):
        forward = ForwardGather("quantized", "world", c.weight_bits, c.weight_block_size)
    else:
        forward = ForwardGather("exact", shard)
        if c.quantize_weights == "auto" and not hybrid:
            notes.append(("forward", "qwZ off: one node, nothing crosses nodes"))
        elif c.quantize_weights is False:
            notes.append(("forward", "quantize_weights=False"))
    if c.weight_deltas and forward.kind != "node_copy":
        notes.append(
            ("deltas", f"weight_deltas off (one hpZ group of {R} ranks: every rank already gathers in its node)")
        )
    # backward (HSDP's R is 1: FSDP re-gathers inside the node)
    reshard = reshard_after_forward(R, W)
    backward = BackwardGather("secondary", R) if reshard is not True else BackwardGather("same", N if hybrid else W)
    if topology.tensor_parallel_size > 1:
        reshard = True  # with tensor parallelism the hooks keep hpZ's slice (secondary_by_hooks)
        if c.hpz_partition_size == "auto" and N == 1 and K > 1:
            notes.append(("backward", "hpZ off: one data-parallel rank per node"))
    # gradients
    if hybrid and K > 1 and c.quantize_gradients:
        gradients = quantized_rail(c)
    elif hybrid and K > 1:
        gradients = GradientReduction("hsdp_rail", "node")
        notes.append(("gradients", "quantize_gradients=False"))
    elif c.quantize_gradients and not hybrid and K > 1:
        gradients = two_hop(c, precision)
    else:
        gradients = GradientReduction("exact", shard)
        if c.quantize_gradients:
            notes.append(("gradients", "qgZ off: one node, nothing crosses nodes"))
        elif not c.quantize_gradients and not hybrid:
            notes.append(("gradients", "quantize_gradients=False"))
    mesh = ((N,) if gradients.quantized_rail else (K, N)) if hybrid else (W,)
    return CommPlan(W, N, K, R, c.sharding_strategy, forward, backward, gradients, reshard, mesh, c.block_alignment,
                    tuple(notes), topology.tensor_parallel_size)  # fmt: skip


def job_topology(config: ZeroPPConfig, world_size: int, local_world_size: int, rank: int) -> Topology:
    """The data-parallel topology of global ``rank`` in a job of ``world_size`` ranks launched ``local_world_size``
    per machine (``config.resolve`` checks the arguments against the job; with ``tensor_parallel_size`` t > 1 the
    topology counts data-parallel ranks, ``world_size / t`` of them)."""
    ranks_per_node, hpz = config.resolve(world_size, local_world_size)
    return Topology.of_job(world_size, ranks_per_node, rank, hpz, config.tensor_parallel_size)


def two_hop(config: ZeroPPConfig, precision: str | None = None) -> GradientReduction:
    """qgZ's reduction as ``config`` sets it, whatever the topology (with one node its inter-node hop is empty). The
    second-moment correction runs unless it is off, or "auto" with fp16 gradients (which FSDP divides after the
    reduction, outside qgZ: the estimate would be off by that factor; True is refused there)."""
    c = config
    feedback = (
        Feedback(c.error_feedback_bits, c.error_feedback_decay, c.error_feedback_reset)
        if c.gradient_error_feedback
        else None
    )
    return GradientReduction(
        "two_hop", "world", c.intra_node_gradient_bits, c.gradient_bits, c.gradient_block_size, c.gradient_pieces,
        c.gradient_rounding, feedback, c.gradient_rotation, c.quantize_gradients_steps, None,
        c.second_moment_correction is True or (c.second_moment_correction == "auto" and precision != "16-true"),
        c.second_moment_correction is True, c.second_moment_scope, exact_vectors(c),
    )  # fmt: skip


def exact_vectors(config: ZeroPPConfig) -> bool:
    """Whether norm gains and biases cross nodes exactly (:mod:`~lightning_zeropp.vectors`):
    ``gradient_quantization_scope="matrices"``, or ``"auto"`` with tensor parallelism, with parameter-aligned blocks.
    Flat blocks can hold a vector's and a matrix's elements together, so the vectors' spans are not whole blocks
    there: zeroing them would leave a rotated block's residual or a shared block's noise estimate on coordinates
    reduced exactly; the ablation quantizes every gradient, as it did."""
    scope = config.gradient_quantization_scope
    matrices = scope == "matrices" or (scope == "auto" and config.tensor_parallel_size > 1)
    return matrices and config.block_alignment == "parameter"


def quantized_rail(config: ZeroPPConfig) -> GradientReduction:
    """Quantized HSDP's cross-node reduction as ``config`` sets it (its bits, blocks, rounding, feedback, rotation
    and until-step are qgZ's arguments; the all-gather's width is ``hsdp_gather_bits``)."""
    q = two_hop(config)
    return GradientReduction(
        "hsdp_rail", "node", None, q.inter_bits, q.block_size, None, q.rounding, q.feedback, q.rotation, q.until_step,
        config.hsdp_gather_bits, exact_vectors=q.exact_vectors,
    )  # fmt: skip


def check_kernels(config: ZeroPPConfig, device_type: str) -> None:
    """Raises where the plan's techniques have no kernels on ``device_type``. None is refused today: every technique
    has Triton kernels (CUDA) and torch twins (elsewhere), rotated blocks (``gradient_rotation``) included; a
    technique added without a kernel is refused here, once, when the device is known."""
