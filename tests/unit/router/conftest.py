"""This folder's test modules import each other's stand-ins (``import test_app``: its stand-in router and app
factory) instead of copying them; pytest runs with ``--import-mode=importlib``, which puts no test folder on
the import path, so this one puts itself there."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
