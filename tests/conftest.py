import os
import sys
from pathlib import Path

# tests/helpers.py is imported as a plain module
sys.path.insert(0, str(Path(__file__).parent))
# the demo model and any cache go to a per-run temporary folder, never the user's cache
os.environ.setdefault(
    "MOESAIC_CACHE", str(Path(os.environ.get("TMPDIR", "/tmp")) / f"moesaic-test-cache-{os.getpid()}")
)
