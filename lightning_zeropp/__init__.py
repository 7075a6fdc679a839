"""lightning-zeropp: ZeRO++ as a PyTorch Lightning strategy on FSDP2."""

from lightning.pytorch.strategies import StrategyRegistry

from . import fabric  # noqa: F401  (registers "zeropp" and "zero3" with Fabric)
from .callback import CommVolumeMonitor, ZeroGradientMonitor
from .config import ZeroPPConfig
from .ledger import CommLedger
from .strategy import ZeroPPStrategy

ZeroPPStrategy.register_strategies(StrategyRegistry)

__all__ = ["CommLedger", "CommVolumeMonitor", "ZeroPPConfig", "ZeroGradientMonitor", "ZeroPPStrategy"]
__version__ = "0.1.0"
