"""The two collectives FSDP2 delegates to us, and how each picks its ZeRO++ technique.

FSDP2 hands every sharded module's all-gather and reduce-scatter to the objects installed with
``set_custom_all_gather`` / ``set_custom_reduce_scatter`` (see ``fsdp_hooks.py``). Those objects call
:meth:`ZeroPPComms.all_gather` and :meth:`ZeroPPComms.reduce_scatter`, which decide:

============================  ==========================  ===========================================
FSDP call                      group FSDP passes           what runs (on our own groups)
============================  ==========================  ===========================================
forward all-gather             whole data-parallel group   qwZ quantized all-gather, or exact; with weight
                                                          deltas: the node copy's slices, gathered in the
                                                          hpZ group, after any delta exchange (deltas.py)
backward all-gather (hpZ)      hpZ group (R ranks)         exact all-gather of the dequantized copy
hpZ with tensor parallelism:   whole data-parallel group   forward: as above, and this rank's 1/R of the
FSDP reshards fully                                       output kept; backward: the kept pieces gathered
                                                          in the hpZ group (hpz.SecondaryCopies)
backward all-gather (no hpZ)   whole group                 same as forward (identical weights)
gradient reduce-scatter        whole group                 qgZ 2-hop all-to-all, or exact (also after
                                                          the first quantize_gradients_steps steps); norm
                                                          gains and biases exact inside its hops with
                                                          gradient_quantization_scope="matrices" (vectors.py)
HSDP (HYBRID_SHARD): every     the node's ranks            exact, on our node group; FSDP then
all-gather and reduce-scatter                             all-reduces the gradients across nodes on
                                                          its own rail group (its hook records it)
quantized HSDP: reduce-scatter the node's ranks (FSDP's     exact in the node, then on our rail group
                               mesh is the node alone)     the INT4 reduce-scatter and INT8 / bf16
                                                          all-gather of :mod:`rail`
============================  ==========================  ===========================================
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from . import hpz, qgz, qwz, rail
from .blocks import UnitBlocks
from .collectives import all_gather_flat, reduce_scatter_flat, split_reduce_op
from .commplan import CommPlan, resolve
from .compat.torch import in_backward, unit_gradient_divide_factor
from .config import ZeroPPConfig
from .deltas import WeightDeltas
from .feedback import ErrorFeedback
from .hpz import SecondaryCopies
from .ledger import CommLedger
from .moments import SecondMomentCorrection, noise_factor
from .step_owner import StepOwner
from .topology import ProcessGroups


class ZeroPPComms:
    """Shared by every sharded module of one model; owns the groups, the ledger, the technique switches and the
    state the collectives keep: the count of gradient reductions that seeds stochastic rounding, the optimizer steps
    taken (the one count error feedback resets and weight delta refreshes follow), the error feedback residuals, the
    weight deltas' node copies, whether the raw-bytes warning was given. :meth:`state_dict` / :meth:`load_state_dict`
    are what a checkpoint keeps of it."""

    def __init__(
        self, config: ZeroPPConfig, groups: ProcessGroups, ledger: CommLedger, plan: CommPlan | None = None
    ) -> None:
        self.config = config
        self._groups: ProcessGroups | None = groups
        self._group_timeout = groups.timeout
        self.ledger = ledger
        self.topology = groups.topology
        self.plan = plan if plan is not None else resolve(config, self.topology)
        self.use_qwz = self.plan.forward.kind == "quantized"
        self.use_qgz = self.plan.gradients.kind == "two_hop"
        self.gradient_calls = 0
        self.steps = 0  # optimizer steps taken
        fb = self.plan.gradients.feedback
        self.feedback = ErrorFeedback(fb.decay, fb.reset, fb.bits) if fb is not None else None
        forward, backend = self.plan.forward, config.kernel_backend
        self.deltas = WeightDeltas(forward, self.topology, ledger, backend) if forward.kind == "node_copy" else None
        R = self.plan.backward.group_size
        self.secondary = SecondaryCopies(R, self.topology.rank) if self.plan.secondary_by_hooks else None
        g = self.plan.gradients
        self.moments = (
            SecondMomentCorrection(
                noise_factor(g.rounding, g.feedback.decay if g.feedback is not None else None),
                True if g.second_moment_strict else "auto",
                g.second_moment_scope,
            )
            if g.second_moment and self.use_qgz and self.topology.num_nodes > 1
            else None
        )
        # The step's phases: the optimizers' hooks and the reduction hooks below report to it; the step counter (this
        # object), weight deltas and the correction run from it.
        self.owner = StepOwner()
        self.owner.subscribe(self)
        if self.moments is not None:
            self.owner.subscribe(self.moments)
        rank_zero_info(self.describe())
        self.units: list[UnitBlocks] = []  # the model's sharded units (:meth:`use_units`)
        self._warned_raw_bytes = False

    def describe(self) -> str:
        """One line: what each collective runs in this job, and why where a switch the user left on does nothing."""
        return self.plan.describe()

    def ensure_groups(self) -> ProcessGroups:
        """The job's groups, built again if :meth:`release_groups` destroyed them (collective, as every call needing
        them is: a sharded model used after ``Trainer.fit`` returned, or the next run of the same strategy)."""
        if self._groups is None:
            self._groups = ProcessGroups.build(self.topology, self._group_timeout, self.plan.hybrid)
        return self._groups

    def use_units(self, units: list[UnitBlocks]) -> None:
        """The sharded units of the model whose collectives these are (``fsdp_hooks.install`` made them)."""
        self.units = list(units)

    def release_groups(self) -> None:
        """Destroys the groups (the strategy's teardown): a process that runs many Trainers keeps at most one set.
        Weight deltas' node copies are freed too (the next forward rebuilds them exactly)."""
        if self.deltas is not None:
            self.deltas.clear()
        if self._groups is not None:
            self._groups.destroy()
            self._groups = None

    # ----------------------------------------------------------------- all-gather
    def all_gather(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        fsdp_group: dist.ProcessGroup,
        async_op: bool,
        unit: UnitBlocks | None = None,
    ) -> dist.Work | None:
        groups = self.ensure_groups()
        role = groups.role_of(fsdp_group)
        group, ranks = groups.group(role), groups.ranks(role)
        if role == "hpz":
            return hpz.secondary_all_gather(output, input, group, ranks, self.ledger, async_op)
        # Inside autograd's backward: this is the re-gather of a resharded module.
        backward = in_backward()
        if self.secondary is not None and role == "world":  # hpZ kept by these hooks (tensor parallelism)
            if backward:
                piece = self.secondary.take(output, unit)
                if piece is not None:
                    group, ranks = groups.group("hpz"), groups.ranks("hpz")
                    return hpz.secondary_all_gather(output, piece, group, ranks, self.ledger, async_op)
            else:
                work = self._gather_from_every_rank(output, input, group, ranks, async_op, unit, backward)
                return self.secondary.keep_after(work, output, unit)
        return self._gather_from_every_rank(output, input, group, ranks, async_op, unit, backward)

    def _gather_from_every_rank(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: dist.ProcessGroup,
        ranks: list[int],
        async_op: bool,
        unit: UnitBlocks | None,
        backward: bool,
    ) -> dist.Work | None:
        """The all-gather of every rank's shard on the data-parallel group: qwZ, weight deltas, or exact."""
        if self.deltas is not None and not backward and unit is not None and input.is_floating_point():
            self.deltas.all_gather(output, input, unit, self.ensure_groups(), self.steps)
            return None
        kind = "weight_all_gather_backward" if backward else "weight_all_gather"
        if self.use_qwz and self._quantizable(input):
            blocks = unit.weights(input.numel()) if unit is not None else None
            return qwz.quantized_all_gather(output, input, group, ranks, self.ledger, self.plan.forward, kind, async_op,
                                            blocks=blocks, backend=self.config.kernel_backend)  # fmt: skip
        self.ledger.record_all_gather(kind, ranks, input.numel() * input.element_size())
        return all_gather_flat(output, input, group, async_op)

    def _quantizable(self, input: torch.Tensor) -> bool:
        """FSDP gathers raw bytes (uint8) when one unit mixes parameter dtypes; quantizing bytes would corrupt them."""
        if input.is_floating_point():
            return True
        if not self._warned_raw_bytes:
            rank_zero_warn(
                "ZeroPPStrategy: a sharded unit mixes parameter dtypes, so FSDP gathers it as raw bytes; qwZ leaves"
                " such units exact. Give every parameter of a unit the same dtype to quantize it."
            )
            self._warned_raw_bytes = True
        return False

    # ----------------------------------------------------------------- reduce-scatter
    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        fsdp_group: dist.ProcessGroup,
        op,
        unit: UnitBlocks | None = None,
    ) -> None:
        self.owner.reduction()
        groups = self.ensure_groups()
        role = groups.role_of(fsdp_group)
        expected = self.plan.shard_group
        if role != expected:  # FSDP reduces over its shard group (all ranks; HSDP: the node); else a sharding error
            raise RuntimeError(
                f"ZeroPPStrategy: FSDP asked to reduce gradients over the {role} group {groups.ranks(role)}"
                f" instead of {groups.ranks(expected)}; the model was sharded with a mesh other than the strategy's."
            )
        base_op, premul = split_reduce_op(op, unit_gradient_divide_factor(unit.module) if unit is not None else None)
        if self.plan.gradients.quantized_rail:  # quantized HSDP (exact HSDP: FSDP all-reduces on its 2-D mesh)
            if len(groups.ranks(role)) == 1:
                # One rank per node. torch 2.9 still calls this hook on the node's group of one, then the all-reduce
                # hook, which runs the rail (`reduce_alone_on_rail`); newer torch copies without calling it. Running
                # the rail here as well reduced it twice (once as a SUM: the gradient K times too large) and spent
                # the error feedback's residuals twice.
                output.copy_(input if premul is None else input * premul)
                return
            exact_reduce_scatter(output, input, base_op, premul, groups, self.ledger, role)
            self._reduce_on_rail(output, base_op, unit, groups)
            return
        if self.quantizes_gradients():
            call, self.gradient_calls = self.gradient_calls, self.gradient_calls + 1
            chunk = output.numel()
            blocks = unit.gradients(chunk) if unit is not None else None
            gradients = self.plan.gradients
            reduction = qgz.Reduction.of(self.topology, gradients, chunk, base_op, premul, call=call, blocks=blocks,
                                         backend=self.config.kernel_backend)  # fmt: skip
            residuals = None
            if self.feedback is not None:
                pieces = [(stage.size, stage.block_count(gradients.block_size)) for stage in reduction.stages]
                name = unit.name if unit is not None else "<unit>"
                stages = self.feedback.pieces(name, self.topology.num_nodes, pieces, input.device, self.steps)
                residuals = [stage.arguments(self.feedback.decay) for stage in stages]
            noise = None
            if self.moments is not None:
                starts = blocks.starts if blocks is not None else _flat_starts(chunk, gradients.block_size)
                noise = self.moments.buffer(unit, chunk, starts, output.device)
            factor = self.moments.factor if self.moments is not None else 0.0
            spans = (unit.vector_spans(chunk) or ()) if gradients.exact_vectors and unit is not None else ()
            qgz.quantized_reduce_scatter(output, input, reduction, groups, self.ledger, residuals, noise, factor,
                                         vectors=spans)  # fmt: skip
            return
        exact_reduce_scatter(output, input, base_op, premul, groups, self.ledger, role)

    def _rail_multiplier(self, base_op, unit: UnitBlocks | None) -> float:
        """What the rail scales the K nodes' sum by. FSDP's mesh here is the node, so FSDP divides by the node's N
        ranks (by AVG, or around a SUM in fp16 or with summed comms) unless ``set_gradient_divide_factor`` was
        called: then by that factor, which already makes the whole job's sum right. So 1 / K without a factor, 1
        with one; the op alone cannot tell (AVG when the factor equals N, SUM in fp16 without one). Without the
        unit (no module to ask): by the op, as FSDP's AVG means."""
        if unit is None:
            return 1.0 / self.topology.num_nodes if base_op == dist.ReduceOp.AVG else 1.0
        return 1.0 / self.topology.num_nodes if unit_gradient_divide_factor(unit.module) is None else 1.0

    def _reduce_on_rail(self, output: torch.Tensor, base_op, unit: UnitBlocks | None, groups: ProcessGroups) -> None:
        """Quantized HSDP: the node-reduced shard all-reduced across nodes on this rank's rail (the K nodes' mean,
        or their sum where the user set FSDP's divide factor: :meth:`_rail_multiplier`), quantized until the plan's
        step, exactly after."""
        multiplier = self._rail_multiplier(base_op, unit)
        if not self.quantizes_gradients():
            rail.exact_all_reduce(output, multiplier, groups.inter_node, self.topology, self.ledger)
            return
        call, self.gradient_calls = self.gradient_calls, self.gradient_calls + 1
        shard = output.numel()
        blocks = unit.gradients(shard) if unit is not None else None
        reduction = rail.RailReduction.of(self.topology, self.plan.gradients, shard, blocks, multiplier, call,
                                          self.config.kernel_backend)  # fmt: skip
        residuals = gather = None
        if self.feedback is not None:
            name = unit.name if unit is not None else "<unit>"
            rows = self.feedback.pieces(name, 1, reduction.feedback_shape(), output.device, self.steps)
            residuals = [row.arguments(self.feedback.decay) for row in rows]
            if shape := reduction.gather_feedback_shape():
                (row,) = self.feedback.pieces(f"{name}{rail.GATHER_RESIDUAL}", 1, shape, output.device, self.steps)
                gather = row.arguments(self.feedback.decay)
        spans = (unit.vector_spans(shard) or ()) if self.plan.gradients.exact_vectors and unit is not None else ()
        rail.all_reduce(output, reduction, groups.inter_node, self.ledger, residuals, gather, vectors=spans)

    def reduce_alone_on_rail(self, unit: UnitBlocks, reduced: torch.Tensor) -> None:
        """Quantized HSDP with one rank per node, from FSDP's all-reduce hook: FSDP calls no reduce-scatter on a
        mesh of one rank (it copies), and leaves the gradients summed over none; the rail takes the K nodes' mean."""
        self.owner.reduction()
        self._reduce_on_rail(reduced, dist.ReduceOp.AVG, unit, self.ensure_groups())

    def all_reduced(self, reduced: torch.Tensor) -> None:
        """HSDP: FSDP all-reduced one unit's reduce-scattered gradients across nodes (on the rail of ranks with this
        local rank), called by FSDP's all-reduce hook. Recorded as a reduce-scatter of the buffer in one piece per
        rail rank followed by an all-gather of this rank's piece (what any all-reduce algorithm must move)."""
        self.owner.reduction()
        rail.record_exact(reduced, self.topology, self.ledger)

    def quantizes_gradients(self) -> bool:
        """Whether this step's gradients take qgZ (the plan's two-hop reduction, until its step, if any)."""
        return self.plan.quantizes_gradients_at(self.steps)

    # ----------------------------------------------------------------- state
    def begin_forward(self, device: torch.device) -> None:
        """The root's forward pre-hook: with weight deltas, every rank agrees what each unit's forward all-gather
        does (collective: one small all-reduce per forward pass)."""
        if self.deltas is not None:
            self.deltas.agree(self.units, self.ensure_groups().world, device, self.steps)
        if self.secondary is not None:  # FSDP gathers under no_grad: whether a backward can follow is read here
            self.secondary.begin_forward(torch.is_grad_enabled())

    def detach_optimizers(self) -> None:
        """The optimizers' step hooks removed (the strategy's teardown) and what the correction decided for them
        forgotten (the next run sets up its own optimizers)."""
        self.owner.detach()
        if self.moments is not None:
            self.moments.forget_optimizers()

    # the owner's subscriber: the step counter and weight deltas
    def wants_before_update(self, optimizer: torch.optim.Optimizer) -> bool:
        """Weight deltas check the weights right before every update (after a closure's forward and backward)."""
        return self.deltas is not None

    def before_update(self, optimizer: torch.optim.Optimizer, fresh: bool) -> None:
        if self.deltas is not None:
            self.deltas.before_update(self.units)

    def after_update(self, optimizer: torch.optim.Optimizer, fresh: bool) -> None:
        """Counts an optimizer step (the error feedback's reset period follows optimizer steps; weight deltas
        note which weights the step changed)."""
        self.steps += 1
        if self.deltas is not None:
            self.deltas.after_update(self.units)

    def weights_replaced(self) -> None:
        """The weights changed in a way version counters may not show: the next forward rebuilds node copies."""
        if self.deltas is not None:
            self.deltas.invalidate()

    def persistent_nbytes(self) -> dict[str, int]:
        """Memory the collectives keep on this rank across steps, by what it holds (bytes)."""
        out = {"error_feedback": self.feedback.nbytes if self.feedback is not None else 0}
        out["second_moment_noise"] = self.moments.nbytes if self.moments is not None else 0
        deltas = self.deltas.nbytes() if self.deltas is not None else {"node_copy": 0, "tracked_copy": 0}
        out.update({f"weight_deltas_{k}": v for k, v in deltas.items()})
        return out

    def state_dict(self, node_copies: bool = True) -> dict[str, Any]:
        """What a resume needs to continue exactly: the counters, this rank's error feedback residuals and (with
        ``node_copies``) its part of the weight deltas' node copies; ``layout`` says which job shape the per-rank
        tensors belong to (:meth:`state_shape`). Without the node copies, the first forward after a resume rebuilds
        them exactly."""
        state: dict[str, Any] = {
            "layout": self.state_shape(),
            "gradient_calls": self.gradient_calls,
            "steps": self.steps,
        }
        if self.feedback is not None:
            state["error_feedback"] = self.feedback.state_dict()
        if self.deltas is not None and node_copies:
            state["weight_deltas"] = self.deltas.state_dict(self.units)
        return state

    def load_state_dict(self, state: dict[str, Any], source: str = "the checkpoint") -> None:
        """What :meth:`state_dict` returned (``source`` names it in warnings), once the weights saved with it are
        loaded: the counters always; the per-rank tensors only if they belong to this job's layout, else (and where
        the checkpoint has none) residuals start from zero and node copies are rebuilt by the next forward."""
        self.gradient_calls = int(state["gradient_calls"])
        feedback = state.get("error_feedback")
        self.steps = int(state.get("steps", 0))
        if self.deltas is not None:
            self.deltas.clear()
        if self.feedback is not None:
            self.feedback.clear()
        now = self.state_shape()
        if state["layout"] != now:
            if self.feedback is not None or self.deltas is not None:
                rank_zero_warn(
                    f"ZeroPPStrategy: {source} was written by {_ranks(state['layout'])} ranks laid out as"
                    f" {state['layout']}; this job has {_ranks(now)} ranks laid out as {now}."
                    " The error feedback residuals and weight delta copies belong to that layout and are dropped"
                    " (residuals start from zero, copies are rebuilt exactly); everything else resumes as saved."
                )
            return
        if self.feedback is not None:
            if feedback is None:
                rank_zero_warn(
                    f"ZeroPPStrategy: {source} has no error feedback residuals (it was saved without"
                    " `gradient_error_feedback`); they start from zero."
                )
            else:
                self.feedback.load_state_dict(feedback)
        if self.deltas is not None and "weight_deltas" in state:
            self.deltas.load_state_dict(state["weight_deltas"], self.units)

    def state_shape(self) -> dict[str, Any]:
        """What the per-rank tensors' shapes and meaning depend on (saved as a checkpoint's ``layout``): ranks per node
        and nodes (data-parallel ones, with the tensor-parallel size where it is above 1), the reduction the residuals
        belong to (qgZ's two hops, quantized HSDP's rail), stages, blocks, width. The pieces, blocks and residual width
        are the arguments as given, as every checkpoint saved so far records them, whether or not this job's plan uses
        them (it leaves those of a technique that is off unset)."""
        c = self.config
        layout = {
            "reduction": self.plan.gradients.kind,
            "ranks_per_node": self.topology.ranks_per_node,
            "num_nodes": self.topology.num_nodes,
            "pipeline_stages": c.gradient_pieces,  # the name saved checkpoints hold (renamed argument, same meaning)
            "gradient_block_size": c.gradient_block_size,
            "block_alignment": self.plan.block_alignment,
            "error_feedback_bits": c.error_feedback_bits,
        }
        if self.plan.tensor_parallel_size > 1:  # the sizes above count data-parallel ranks; each holds a TP piece
            layout["tensor_parallel_size"] = self.plan.tensor_parallel_size
        return layout


def _ranks(layout: dict[str, Any]) -> int:
    return int(layout["ranks_per_node"]) * int(layout["num_nodes"]) * int(layout.get("tensor_parallel_size", 1))


def exact_reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    base_op,
    premul: float | None,
    groups: ProcessGroups,
    ledger: CommLedger,
    role: str = "world",
) -> None:
    """The ZeRO-3 reduce-scatter on our group of ``role`` ("world"; HSDP: "node"). PREMUL_SUM is a multiply then SUM
    (gloo has no PREMUL_SUM)."""
    if premul is not None:
        input.mul_(premul)  # the input is FSDP's scratch buffer, consumed by this call
    ranks = groups.ranks(role)
    ledger.record_to_peers("gradient_reduce_scatter", ranks, output.numel() * output.element_size())
    reduce_scatter_flat(output, input, groups.group(role), base_op)


@functools.lru_cache(maxsize=64)
def _flat_starts(chunk: int, block_size: int) -> tuple[int, ...]:
    """The block starts of a chunk in flat blocks of ``block_size`` (the last one partial), and its end."""
    return (*range(0, chunk, block_size), chunk)
