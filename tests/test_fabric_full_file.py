"""A Fabric full checkpoint file of ours, read by a plain Fabric: ``fabric.load`` returns what the file holds beyond
the objects it restored, so the strategy's own entries (random states, the collectives' state, the key names, the
version) ride in an attribute of the top-level dict, as a ``state_dict()``'s ``_metadata`` does."""

import pytest
import torch
from torch import nn

from lightning_zeropp import checkpoint as ckpt


def _ours(model: nn.Module) -> dict:
    """What a Fabric full save of ours holds: the user's entries and the strategy's."""
    return {
        "model": model.state_dict(),
        "steps": 1,
        ckpt.RNG_KEY: [{"torch": torch.get_rng_state()}],
        ckpt.COMMS_KEY: [{"steps": 3, "gradient_calls": 6}],
        ckpt.FABRIC_KEYS: {"model": "model", "optimizers": [], "lr_schedulers": []},
        ckpt.VERSION_KEY: "2.6.0",
    }


@pytest.mark.parametrize("weights_only", [True, False])
def test_strategy_entries_hidden_and_revealed(tmp_path, weights_only):
    model = nn.Linear(3, 2)
    saved = _ours(model)
    path = tmp_path / "full.ckpt"
    torch.save(ckpt.hide_strategy_entries(saved), path)
    loaded = torch.load(path, weights_only=weights_only)
    assert sorted(loaded) == ["model", "steps"]
    revealed = ckpt.reveal_strategy_entries(loaded)
    assert sorted(revealed) == sorted(saved)
    assert revealed[ckpt.COMMS_KEY] == saved[ckpt.COMMS_KEY] and revealed[ckpt.FABRIC_KEYS] == saved[ckpt.FABRIC_KEYS]
    assert torch.equal(revealed[ckpt.RNG_KEY][0]["torch"], saved[ckpt.RNG_KEY][0]["torch"])


def test_plain_fabric_load_returns_the_users_entries_alone(tmp_path):
    """Lightning's own test of ``fabric.load``: ``metadata == {"steps": 1}``."""
    from lightning.fabric import Fabric

    model = nn.Linear(3, 2)
    path = tmp_path / "full.ckpt"
    torch.save(ckpt.hide_strategy_entries(_ours(model)), path)
    fabric = Fabric(accelerator="cpu", devices=1)
    other = nn.Linear(3, 2)
    metadata = fabric.load(path, {"model": other})
    assert metadata == {"steps": 1}
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), model.state_dict().values()))
