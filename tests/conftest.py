import os
import sys
from pathlib import Path

import torch

# Without a GPU the Triton kernels run in Triton's interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the example's modules (model.py, data.py) are imported by tests as top-level modules, as train.py does
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))
