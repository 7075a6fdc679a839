"""Every bad argument fails at construction with an error naming the argument, the value and what is allowed."""

import functools
import re
from datetime import timedelta

import pytest
from torch import nn
from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy, OffloadPolicy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

from lightning_zeropp import ZeroPPConfig, ZeroPPStrategy

pytestmark = pytest.mark.version_sensitive

BAD = [
    (dict(weight_bits=5), ValueError, r"`weight_bits=5`.*8, 4"),
    (dict(gradient_bits=2), ValueError, r"`gradient_bits=2`.*4, 8"),
    (dict(intra_node_gradient_bits=16), ValueError, r"`intra_node_gradient_bits=16`"),
    (dict(weight_bits=8.0), TypeError, r"`weight_bits` must be an int"),
    (dict(weight_block_size=0), ValueError, r"`weight_block_size=0`.*between"),
    (dict(weight_block_size=-256), ValueError, r"`weight_block_size=-256`"),
    (dict(weight_bits=4, weight_block_size=255), ValueError, r"`weight_block_size=255`.*INT4.*even"),
    (dict(gradient_block_size=129), ValueError, r"`gradient_block_size=129`.*even"),
    (dict(gradient_block_size="128"), TypeError, r"`gradient_block_size` must be an int"),
    (dict(hpz_partition_size=0), ValueError, r"`hpz_partition_size=0`.*positive"),
    (dict(hpz_partition_size="node"), TypeError, r"`hpz_partition_size` must be an int"),
    (dict(ranks_per_node=-2), ValueError, r"`ranks_per_node=-2`"),
    (dict(gradient_pieces=0), ValueError, r"`gradient_pieces=0`.*use 1 \(no overlap\) or more"),
    (dict(pipeline_stages=0), ValueError, r"`gradient_pieces=0`"),  # the deprecated spelling, checked as its field
    (dict(kernel_backend="cuda"), ValueError, r"`kernel_backend='cuda'`.*auto.*triton.*torch"),
    (dict(gradient_rounding="up"), ValueError, r"`gradient_rounding='up'`.*nearest"),
    (dict(quantize_weights="yes"), TypeError, r"`quantize_weights` must be True or False"),
    (dict(state_dict_type="consolidated"), ValueError, r"`state_dict_type='consolidated'`.*sharded.*full"),
    (dict(process_group_backend="nccl2"), ValueError, r"`process_group_backend='nccl2'`.*gloo"),
    (dict(auto_wrap_policy="Block"), TypeError, r"`auto_wrap_policy` must be a set of nn.Module classes, a list"),
    (dict(auto_wrap_policy=3), TypeError, r"`auto_wrap_policy` must be .* or a callable \(module\) -> bool, got 3"),
    (
        dict(auto_wrap_policy=lambda module, recurse, nonwrapped_numel: True),
        TypeError,
        r"`auto_wrap_policy` is a callable that cannot be called with one module.*FSDP1's wrap policies",
    ),
    (dict(activation_checkpointing_policy=lambda: True), TypeError, r"`activation_checkpointing_policy` is a callable"),
    (dict(auto_wrap_policy=[int]), TypeError, r"`auto_wrap_policy` holds <class 'int'>"),
    (dict(activation_checkpointing_policy={3}), TypeError, r"`activation_checkpointing_policy` holds 3"),
    (dict(wrap_modules=["A"], auto_wrap_policy=["B"]), ValueError, r"`wrap_modules` is the deprecated spelling"),
    (dict(cpu_offload=1), TypeError, r"`cpu_offload` must be True, False or a torch.distributed.fsdp.CPUOffloadPolicy"),
    (dict(cpu_offload="cpu"), TypeError, r"`cpu_offload` must be True, False or .*got 'cpu'"),
    (dict(weight_deltas=True, cpu_offload=CPUOffloadPolicy()), ValueError, r"`weight_deltas=True`.*`cpu_offload=True`"),
    (dict(timeout=timedelta(seconds=-5)), ValueError, r"`timeout=datetime.timedelta.*positive, finite duration"),
    (dict(timeout=0), ValueError, r"`timeout=0`.*positive"),
    (dict(timeout=float("inf")), ValueError, r"`timeout=inf`.*finite"),
    (dict(timeout="30"), TypeError, r"`timeout` must be a datetime.timedelta, a number of seconds or None"),
    (dict(timeout=True), TypeError, r"`timeout` must be a datetime.timedelta.*got True"),
]


def test_timeout_in_seconds_is_a_timedelta():
    """A number is read as seconds (YAML writes a duration so), None keeps torch's default."""
    assert ZeroPPStrategy(timeout=30).zeropp_config.timeout == timedelta(seconds=30)
    assert ZeroPPStrategy(timeout=2.5).zeropp_config.timeout == timedelta(seconds=2.5)
    assert ZeroPPStrategy(timeout=timedelta(minutes=2)).zeropp_config.timeout == timedelta(minutes=2)
    assert ZeroPPStrategy(timeout=None).zeropp_config.timeout is None


# ids without object addresses: every pytest-xdist worker must collect the same names
@pytest.mark.parametrize(("kwargs", "error", "match"), BAD, ids=[re.sub(r" at 0x\w+", "", str(b[0])) for b in BAD])
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        ZeroPPStrategy(**kwargs)


def test_process_group_backend_per_device_form():
    assert ZeroPPStrategy(process_group_backend="cpu:gloo,cuda:nccl").process_group_backend == "cpu:gloo,cuda:nccl"
    with pytest.raises(ValueError, match="cpu:gloo,cuda:nccl"):
        ZeroPPStrategy(process_group_backend="cpu:gloo,cuda:nccl2")


def test_default_units_are_the_outermost_list_elements():
    from torch import nn

    from lightning_zeropp.sharding import default_wrap_targets

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))  # nested: stays inside its block

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block(), nn.ModuleList([nn.Linear(2, 2)])])

    net = Net()
    assert default_wrap_targets(net) == [net.blocks[0], net.blocks[1]]


def test_deprecated_spellings_still_work_and_warn():
    with pytest.deprecated_call(match="`wrap_modules` is deprecated.*auto_wrap_policy"):
        s = ZeroPPStrategy(wrap_modules=["Block"])
    assert s.auto_wrap_policy == ["Block"]
    with pytest.deprecated_call(match="`activation_checkpointing` is deprecated.*activation_checkpointing_policy"):
        s = ZeroPPStrategy(activation_checkpointing={nn.Linear})
    assert s.activation_checkpointing_policy == {nn.Linear}
    with pytest.raises(TypeError, match="`auto_wrap_policy` holds 3"):  # the old spelling is validated the same way
        ZeroPPStrategy(wrap_modules=[3])


@pytest.fixture
def one_rank():
    """A one-rank gloo job in this process: the strategy's groups, for the collectives' own arithmetic."""
    import torch.distributed as dist

    from lightning_zeropp.topology import ProcessGroups, Topology

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield ProcessGroups.build(Topology(1, 1, 0))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(quantize_weights=True, weight_bits=4, weight_block_size=64),
        dict(quantize_weights=True, weight_block_size=32),
        dict(quantize_weights=True),
        dict(),
        dict(quantize_weights=False),
    ],
    ids=["int4-64", "int8-32", "forced", "defaults-one-node", "exact"],
)
def test_weight_arguments_reach_the_all_gather(one_rank, kwargs):
    """What the forward all-gather produces is the quantizer the arguments name, bit for bit, and no other. The job
    has one node: the defaults ("auto") gather exactly there; an explicit True still quantizes."""
    import torch

    from lightning_zeropp import kernels
    from lightning_zeropp.comm import ZeroPPComms
    from lightning_zeropp.ledger import CommLedger

    config = ZeroPPStrategy(**kwargs).zeropp_config
    comms = ZeroPPComms(config, one_rank, CommLedger(one_rank.topology))
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    out = torch.empty_like(x)
    comms.all_gather(out, x.clone(), one_rank.world, async_op=False)
    expected = {}
    for bits, block in ((8, 256), (4, 64), (8, 32), (4, 256)):
        expected[(bits, block)] = kernels.dequantize(kernels.quantize(x, bits, block), 1000, bits, block, x.dtype)
    matches = [key for key, y in expected.items() if torch.equal(out, y)]
    if kwargs.get("quantize_weights") is True:
        assert matches == [(config.weight_bits, config.weight_block_size)]
    else:
        assert torch.equal(out, x) and not matches


@pytest.mark.parametrize(
    ("kwargs", "world", "local", "match"),
    [
        (
            dict(ranks_per_node=3),
            4,
            4,
            r"`ranks_per_node=3`.*must divide the 4 ranks launched per machine.*\[1, 2, 4\]",
        ),
        (dict(hpz_partition_size=3), 4, 4, r"`hpz_partition_size=3`.*divide the world size 4"),
        (dict(hpz_partition_size=8), 4, 4, r"`hpz_partition_size=8`"),
    ],
)
def test_resolve_against_the_job(kwargs, world, local, match):
    with pytest.raises(ValueError, match=match):
        ZeroPPConfig(**kwargs).resolve(world, local)


def test_resolve_auto():
    assert ZeroPPConfig().resolve(8, 4) == (4, 4)
    assert ZeroPPConfig(ranks_per_node=2).resolve(8, 4) == (2, 2)
    assert ZeroPPConfig(hpz_partition_size=1).resolve(8, 4) == (4, 1)
    assert ZeroPPConfig(ranks_per_node=2, hpz_partition_size=4).resolve(8, 8) == (2, 4)


@pytest.mark.parametrize(
    "policy",
    [
        functools.partial(size_based_auto_wrap_policy, min_num_params=100),
        ModuleWrapPolicy({nn.Linear}),
    ],
    ids=["size_based_auto_wrap_policy", "ModuleWrapPolicy"],
)
def test_fsdp1_wrap_policies_are_refused_with_the_forms_that_work(policy):
    with pytest.raises(TypeError, match=r"FSDP1's wrap policies.*callable \(module\) -> bool.*=\{Block\}"):
        ZeroPPStrategy(auto_wrap_policy=policy)


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear)


@pytest.mark.parametrize(
    "policy", [{nn.Linear}, [nn.Linear], ["Linear"], nn.Linear, _is_linear, lambda m: isinstance(m, nn.Linear)]
)
def test_lightning_policy_forms_are_taken(policy):
    """What a user of Lightning's FSDPStrategy / ModelParallelStrategy passes works unchanged (sharding by these
    forms is tested in tests/test_setup_errors.py)."""
    s = ZeroPPStrategy(auto_wrap_policy=policy, activation_checkpointing_policy=policy)
    assert s.auto_wrap_policy is policy and s.activation_checkpointing_policy is policy


@pytest.mark.parametrize(
    ("value", "offloaded"),
    [(True, True), (False, False), (CPUOffloadPolicy(), True), (CPUOffloadPolicy(pin_memory=False), True),
     (OffloadPolicy(), False), (CPUOffload(offload_params=True), True), (CPUOffload(), False)],
)  # fmt: skip
def test_cpu_offload_forms(value, offloaded):
    from lightning_zeropp.config import offload_policy

    s = ZeroPPStrategy(cpu_offload=value)
    policy = offload_policy(s.cpu_offload)
    assert isinstance(policy, CPUOffloadPolicy) is offloaded
    if isinstance(value, OffloadPolicy):
        assert policy is value  # the user's own policy (its pin_memory) is what FSDP2 gets
