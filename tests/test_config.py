"""Every bad argument fails at construction with an error naming the argument, the value and what is allowed."""

import pytest
from torch import nn

from lightning_zeropp import ZeroPPConfig, ZeroPPStrategy

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
    (dict(pipeline_stages=0), ValueError, r"`pipeline_stages=0`"),
    (dict(kernel_backend="cuda"), ValueError, r"`kernel_backend='cuda'`.*auto.*triton.*torch"),
    (dict(gradient_rounding="up"), ValueError, r"`gradient_rounding='up'`.*nearest"),
    (dict(quantize_weights="yes"), TypeError, r"`quantize_weights` must be True or False"),
    (dict(state_dict_type="consolidated"), ValueError, r"`state_dict_type='consolidated'`.*sharded.*full"),
    (dict(process_group_backend="nccl2"), ValueError, r"`process_group_backend='nccl2'`.*gloo"),
    (dict(wrap_modules="Block"), TypeError, r"`wrap_modules` must be a set of nn.Module classes or a list"),
    (dict(wrap_modules=[int]), TypeError, r"`wrap_modules` holds <class 'int'>"),
    (dict(activation_checkpointing={3}), TypeError, r"`activation_checkpointing` holds 3"),
    (dict(cpu_offload=1), TypeError, r"`cpu_offload` must be True or False"),
]


@pytest.mark.parametrize(("kwargs", "error", "match"), BAD, ids=[str(b[0]) for b in BAD])
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


def test_good_arguments_are_kept():
    s = ZeroPPStrategy(
        weight_bits=4,
        weight_block_size=64,
        hpz_partition_size=2,
        gradient_bits=8,
        ranks_per_node=4,
        wrap_modules={nn.Linear},
        activation_checkpointing=["Block"],
        state_dict_type="full",
        kernel_backend="torch",
        process_group_backend="gloo",
    )
    c = s.zeropp_config
    assert (c.weight_bits, c.weight_block_size, c.hpz_partition_size, c.gradient_bits) == (4, 64, 2, 8)
    assert s.state_dict_type == "full" and s.process_group_backend == "gloo"


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
