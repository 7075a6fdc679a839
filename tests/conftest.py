import sys
from pathlib import Path

# the example's modules (model.py, data.py) are imported by tests as top-level modules, as train.py does
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))
