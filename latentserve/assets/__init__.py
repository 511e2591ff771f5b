"""Files shipped inside the package: the default model that runs with no network."""
from pathlib import Path

# A tiny DeepSeek-V3 checkpoint trained on the King James Bible; see default_model/TRAINING.md.
DEFAULT_MODEL_DIR = Path(__file__).parent / "default_model"
