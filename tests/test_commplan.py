"""One plan of techniques: :func:`lightning_zeropp.commplan.resolve` decides what each collective runs, and the
runtime, the cost model and the startup line read that plan, never the config's technique arguments again.

- the technique arguments are derived from the config: every field of :class:`ZeroPPConfig` (and every property it
  derives from them) except those :data:`NOT_TECHNIQUES` lists with their reason, so a new argument is covered
  without touching this file;
- the plan holds every technique argument: changing any one changes the plan of some job, so no module needs the
  config once the plan exists;
- an AST walk of the package fails on a read of a technique argument from the config (an attribute of any object
  that holds it, ``config.x``, ``self.config.x``, ``strategy._config.x``, ``c.x`` after ``c = config``, or
  ``getattr(config, "x")``) outside the modules that build the plan; the reads that come before the plan exists are
  listed in :data:`ALLOWED_READS` with their reason;
- the plan's decisions, per topology (one node, several, HSDP, weight deltas with and without a second hpZ group);
- the runtime's collectives follow the plan that the cost model reads (the byte-for-byte agreement of the ledger and
  ``costs.py`` is ``tests/test_costs.py``'s)."""

import ast
import dataclasses
import types
import typing
from pathlib import Path

import pytest

from lightning_zeropp.commplan import job_topology, resolve
from lightning_zeropp.config import ZeroPPConfig
from lightning_zeropp.core import QUANTIZED_HSDP_ARGUMENTS

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = [ROOT / "lightning_zeropp", ROOT / "triton_kernels"]
BUILDERS = {"lightning_zeropp/config.py", "lightning_zeropp/commplan.py"}
"""The modules that build the plan from the config: the only ones that read its technique arguments."""

NOT_TECHNIQUES = {
    "auto_wrap_policy": "which modules become sharded units: the model's structure, applied by sharding",
    "activation_checkpointing_policy": "which activations are recomputed: memory, no collective",
    "cpu_offload": "where the shards live between steps, applied by sharding",
    "state_dict_type": "the checkpoint's format",
    "kernel_backend": "which implementation runs the kernels (Triton or their torch twins, which compute the same)",
    "process_group_backend": "the transport of the process groups",
    "timeout": "how long a collective waits for a peer",
    "data_parallel_size": "a check of the job's shape (it must be the world size / tensor_parallel_size), no choice",
}
"""The config's fields that choose no technique and none of its parameters, each with why; every other field, and
every property of the config, is a technique argument."""

FIELDS = [f.name for f in dataclasses.fields(ZeroPPConfig)]
TECHNIQUES = frozenset(FIELDS) - set(NOT_TECHNIQUES)
TECHNIQUES |= {name for name, value in vars(ZeroPPConfig).items() if isinstance(value, property)}  # config.hybrid

_LAYOUT = (
    "a checkpoint's layout records the argument as given, as every checkpoint saved so far holds it; the plan leaves"
    " it unset where its technique is off, which would make those checkpoints' residuals look foreign"
)
ALLOWED_READS = {
    ("lightning_zeropp/core.py", "ZeroPPCore.check_device", "second_moment_correction"): (
        "refuses True with fp16 gradients when the device is checked, before connect() builds the plan (Fabric checks"
        " it before the processes start)"
    ),
    ("lightning_zeropp/comm.py", "ZeroPPComms.state_shape", "gradient_pieces"): _LAYOUT,
    ("lightning_zeropp/comm.py", "ZeroPPComms.state_shape", "gradient_block_size"): _LAYOUT,
    ("lightning_zeropp/comm.py", "ZeroPPComms.state_shape", "error_feedback_bits"): _LAYOUT,
}
"""Reads of a technique argument from the config outside :data:`BUILDERS`: ``(module, function, argument)``, why."""

CONFIG_NAMES = {"config", "_config", "zeropp_config", "cfg"}
"""Names that hold the config wherever they stand (a variable, a parameter, an attribute such as ``self.config``,
``strategy._config`` or ``strategy.zeropp_config``), unless annotated as something else."""


_UNTYPED = ("Any", "typing.Any", "object")


class _Reads(ast.NodeVisitor):
    """The technique reads of one module: ``(line, function, argument, expression)``. A scope's config holders are
    the :data:`CONFIG_NAMES`, the parameters annotated ``ZeroPPConfig`` and the names assigned from a holder (``c =
    self.config``, ``c, K = config, ...``, ``config = ZeroPPConfig(...)``); inner functions see their outer scope's."""

    def __init__(self) -> None:
        self.found: list[tuple[int, str, str, str]] = []
        self._names: list[str] = []
        self._holders: set[str] = set(CONFIG_NAMES)

    def holds_config(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Name):
            return node.id in self._holders
        if isinstance(node, ast.Attribute):
            return node.attr in CONFIG_NAMES
        if isinstance(node, ast.Call):  # ZeroPPConfig(...), ZeroPPConfig.from_arguments(...), replace(config, ...)
            name = ast.unparse(node.func)
            if name.split(".")[0] == "ZeroPPConfig" or name.endswith("from_arguments"):
                return True
            return name.split(".")[-1] == "replace" and bool(node.args) and self.holds_config(node.args[0])
        return False

    def _scope(self, node: ast.AST, params: list[ast.arg]) -> None:
        saved = set(self._holders)
        for arg in params:
            annotation = ast.unparse(arg.annotation) if arg.annotation is not None else "Any"
            if "ZeroPPConfig" in annotation or (arg.arg in CONFIG_NAMES and annotation in _UNTYPED):
                self._holders.add(arg.arg)
            else:
                self._holders.discard(arg.arg)  # a parameter annotated as something else (`config: Topology`)
        self._aliases(node)
        self._names.append(getattr(node, "name", "<lambda>"))
        self.generic_visit(node)
        self._names.pop()
        self._holders = saved

    def _aliases(self, scope: ast.AST) -> None:
        """Adds the names the scope assigns from a holder (not those of the functions inside it), until no assignment
        adds one (``a = config; b = a``)."""
        assigns, todo = [], list(ast.iter_child_nodes(scope))
        while todo:
            node = todo.pop()
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.NamedExpr)):
                assigns.append(node)
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                todo += ast.iter_child_nodes(node)
        while True:
            before = len(self._holders)
            for node in assigns:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    pairs = [(target, node.value)]
                    if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                        pairs = list(zip(target.elts, node.value.elts))
                    for name, value in pairs:
                        annotated = isinstance(node, ast.AnnAssign) and "ZeroPPConfig" in ast.unparse(node.annotation)
                        if isinstance(name, ast.Name) and value is not None and (annotated or self.holds_config(value)):
                            self._holders.add(name.id)
            if len(self._holders) == before:
                return

    def visit_Module(self, node: ast.Module) -> None:
        self._aliases(node)
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        a = node.args
        self._scope(node, [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))])

    visit_AsyncFunctionDef = visit_Lambda = visit_FunctionDef

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._names.append(node.name)
        self.generic_visit(node)
        self._names.pop()

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in TECHNIQUES and isinstance(node.ctx, ast.Load) and self.holds_config(node.value):
            self._add(node, node.attr)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        args = node.args
        if isinstance(node.func, ast.Name) and node.func.id == "getattr" and len(args) >= 2:
            name = args[1].value if isinstance(args[1], ast.Constant) else None
            if name in TECHNIQUES and self.holds_config(args[0]):
                self._add(node, name)
        self.generic_visit(node)

    def _add(self, node: ast.AST, argument: str) -> None:
        self.found.append((node.lineno, ".".join(self._names) or "<module>", argument, ast.unparse(node)))


def technique_reads(source: str) -> list[tuple[int, str, str, str]]:
    """``(line, function, argument, expression)`` of every read of a technique argument from the config in
    ``source``."""
    reads = _Reads()
    reads.visit(ast.parse(source))
    return reads.found


def _package_reads() -> list[tuple[str, int, str, str, str]]:
    """Every technique read outside :data:`BUILDERS`: ``(module, line, function, argument, expression)``."""
    found = []
    for package in PACKAGES:
        for path in sorted(package.rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            if name not in BUILDERS:
                found += [(name, *read) for read in technique_reads(path.read_text())]
    return found


def test_the_technique_arguments_are_the_configs_fields_but_the_listed_ones():
    """Derived, not listed: a field added to the config is a technique argument unless NOT_TECHNIQUES says why not."""
    assert set(NOT_TECHNIQUES) <= set(FIELDS), f"not config fields: {sorted(set(NOT_TECHNIQUES) - set(FIELDS))}"
    assert {"weight_bits", "gradient_block_size", "second_moment_correction", "block_alignment", "hsdp_gather_bits",
            "weight_delta_refresh", "hybrid"} <= TECHNIQUES  # fmt: skip


def test_modules_read_the_plan_not_the_configs_technique_arguments():
    reads = _package_reads()
    offences = [
        f"{module}:{line} ({function}): {expression}"
        for module, line, function, argument, expression in reads
        if (module, function, argument) not in ALLOWED_READS
    ]
    assert not offences, (
        "technique arguments read from the config outside config.py and commplan.py: read the plan (CommPlan) instead,"
        " adding to it what it lacks; a read before the plan exists goes in ALLOWED_READS with its reason:\n"
        + "\n".join(offences)
    )
    unused = set(ALLOWED_READS) - {(module, function, argument) for module, _, function, argument, _ in reads}
    assert not unused, f"no longer read: take these out of ALLOWED_READS: {sorted(unused)}"


@pytest.mark.parametrize(
    "source",
    [
        "if config.quantize_gradients and K > 1: pass",
        "deltas = self.config.weight_deltas and 1 < R < W",
        "moments = strategy._config.second_moment_correction",
        "aligned = trainer.strategy.zeropp_config.block_alignment",
        "x = c.hybrid\nc = self._core.config",
        "c, K = config, topology.num_nodes\nbits = c.hsdp_gather_bits",
        "def f(settings: ZeroPPConfig):\n    return settings.weight_block_size",
        "def f(settings: 'ZeroPPConfig | None'):\n    return lambda: settings.gradient_bits",
        "def f(self, config: Any):\n    self.every = config.weight_delta_refresh",
        "bits = ZeroPPConfig(**kwargs).weight_delta_bits",
        "v = getattr(config, 'gradient_rotation')",
        "v = getattr(self._core.config, 'error_feedback_decay')",
    ],
)
def test_the_walk_finds_the_reads_it_forbids(source):
    """The check cannot pass by not looking: each form of a read of the config is found."""
    assert technique_reads(source), source


def test_the_walk_leaves_the_plan_the_topology_and_other_arguments_alone():
    reads = (
        "R = topology.hpz_partition_size\nb = plan.gradients.block_size\ns = self.hpz_partition_size\nh = plan.hybrid\n"
        "t = config.timeout\nk = self.config.kernel_backend\nn = getattr(args, 'gradient_bits')\n"
        "def f(config: Topology):\n    return config.ranks_per_node\n"
        "def g(unit):\n    return unit.gradient_block_size"
    )
    assert technique_reads(reads) == []


def _alternatives(f: dataclasses.Field) -> list:
    """Values of field ``f`` other than its default, from its type: every option of a Literal, both bools, and for
    numbers its default doubled or halved, 1 and 2 (invalid ones are refused by the config, and skipped)."""
    hint = typing.get_type_hints(ZeroPPConfig)[f.name]
    values: list = []
    for arg in typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,):
        if typing.get_origin(arg) is typing.Literal:
            values += typing.get_args(arg)
        elif arg is bool:
            values += [True, False]
        elif isinstance(arg, type) and issubclass(arg, float):
            values += [f.default / 2]
        elif isinstance(arg, type) and issubclass(arg, int):
            values += [f.default * 2, 1, 2] if isinstance(f.default, int) else [1, 2]
    return [v for v in values if (type(v), v) != (type(f.default), f.default)]


JOBS = [
    (4, 2, {}),  # ZeRO++ on 2 nodes x 2: qwZ, hpZ, qgZ
    (4, 2, {"gradient_error_feedback": True}),
    (8, 4, {"weight_deltas": True}),  # two hpZ groups: the node copy
    (4, 2, QUANTIZED_HSDP_ARGUMENTS),
]
"""Jobs on which every technique runs, in bf16: where each technique argument must show in the plan."""


def _plan_of(world: int, per_node: int, kwargs: dict):
    """The plan of ``ZeroPPConfig(**kwargs)`` on ``world`` ranks launched ``per_node`` per machine, None where the
    config refuses the arguments or the job."""
    try:
        config = ZeroPPConfig(**kwargs)
        topology = job_topology(config, world, per_node, 0)
    except (TypeError, ValueError):
        return None
    return resolve(config, topology, "bf16-mixed")


@pytest.mark.parametrize("field", [f for f in dataclasses.fields(ZeroPPConfig) if f.name in TECHNIQUES],
                         ids=lambda f: f.name)  # fmt: skip
def test_the_plan_holds_every_technique_argument(field):
    """Each technique argument changes the plan of some job: the plan holds its answer, so the runtime, the cost model
    and the planner never need the config once the plan is built. A new argument fails here until ``resolve`` puts it
    in the plan (or NOT_TECHNIQUES says why it chooses no technique)."""
    alternatives = _alternatives(field)
    assert alternatives, f"{field.name}: no other value to try (its type: {field.type})"
    changed = [
        (value, kwargs)
        for world, per_node, kwargs in JOBS
        for value in alternatives
        if (other := _plan_of(world, per_node, {**kwargs, field.name: value})) is not None
        and other != _plan_of(world, per_node, kwargs)
    ]
    assert changed, f"`{field.name}` changes no job's plan ({alternatives} tried on {JOBS}): the plan lacks its answer"


def _plan(world: int, per_node: int, **kwargs):
    config = ZeroPPConfig(**kwargs)
    return resolve(config, job_topology(config, world, per_node, 0))


def test_one_node_runs_exact_collectives():
    plan = _plan(8, 8)
    assert (plan.forward.kind, plan.gradients.kind, plan.backward.kind) == ("exact", "exact", "same")
    assert plan.note("forward").startswith("qwZ off: one node") and plan.note("gradients").startswith("qgZ off")
    assert plan.reshard_after_forward is True and plan.mesh_shape == (8,)


def test_zeropp_across_nodes():
    plan = _plan(8, 2, gradient_error_feedback=True, quantize_gradients_steps=40, gradient_rotation="hadamard")
    f, b, g = plan.forward, plan.backward, plan.gradients
    assert (f.kind, f.bits, f.block_size) == ("quantized", 8, 256)
    assert (b.kind, b.group_size) == ("secondary", 2) and plan.reshard_after_forward == 2
    assert (g.kind, g.intra_bits, g.inter_bits, g.pieces, g.rounding, g.rotation) == ("two_hop", 8, 4, 2, "nearest",
                                                                                       "hadamard")  # fmt: skip
    assert g.feedback is not None and g.feedback.decay == 1.0 and g.until_step == 40
    assert plan.quantizes_gradients_at(39) and not plan.quantizes_gradients_at(40)


def test_weight_deltas_need_a_second_hpz_group():
    assert _plan(8, 4, weight_deltas=True).forward.kind == "node_copy"
    one_group = _plan(4, 4, weight_deltas=True)
    assert one_group.forward.kind == "exact" and "one hpZ group" in one_group.note("deltas")


@pytest.mark.parametrize(("world", "per_node", "gradients", "group"), [(8, 4, "hsdp_rail", "node"),
                                                                         (4, 4, "exact", "world")])  # fmt: skip
def test_hsdp(world, per_node, gradients, group):
    plan = _plan(world, per_node, sharding_strategy="HYBRID_SHARD", quantize_gradients=False)
    assert plan.hybrid and plan.gradients.kind == gradients and plan.shard_group == group
    assert plan.mesh_shape == (world // per_node, per_node) and plan.forward.kind == "exact"
    assert plan.describe().startswith(f"ZeroPPStrategy: {world // per_node} node")


def test_the_plan_is_frozen():
    plan = _plan(8, 2)
    with pytest.raises(AttributeError):
        plan.forward = None  # type: ignore[misc]


def test_the_startup_line_on_one_node_says_it_is_zero3s_traffic_and_how_to_emulate_nodes():
    """One node with the defaults (what ``strategy="zeropp"`` gives on one machine): nothing is quantized, and the
    line says so and how to try ZeRO++ there; with emulated nodes, or with ZeRO-3 asked for, it says nothing of it."""
    hint = "to try ZeRO++ on one machine, emulate nodes with ranks_per_node"
    assert hint in _plan(4, 4).describe()
    assert hint not in _plan(4, 2).describe()
    assert hint not in _plan(4, 4, quantize_weights=False, quantize_gradients=False).describe()
