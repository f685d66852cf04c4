import sys
from pathlib import Path

# Tests import their helpers (corpus, oracle) as plain modules.
sys.path.insert(0, str(Path(__file__).parent))
