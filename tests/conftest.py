import os
import shutil
import sys
from pathlib import Path

# tests/helpers.py is imported as a plain module
sys.path.insert(0, str(Path(__file__).parent))
# the demo model and any cache go to a per-run temporary folder, never the user's cache; removed when the run
# ends (each run left ~18 MB behind in the temporary folder)
_OWN_CACHE = "MOESAIC_CACHE" not in os.environ
os.environ.setdefault(
    "MOESAIC_CACHE", str(Path(os.environ.get("TMPDIR", "/tmp")) / f"moesaic-test-cache-{os.getpid()}")
)


def pytest_sessionfinish(session, exitstatus):
    if _OWN_CACHE:
        shutil.rmtree(os.environ["MOESAIC_CACHE"], ignore_errors=True)
