"""The rank launcher's old path: pyfast.netns is the module (this name is the same module
object, so a monkeypatch through either reaches both). Kept for the callers outside this package
that still name it (bench/ suites, tests, pyfast/plan/calibrate.py); code in pyfast imports
pyfast.netns."""
import sys

from pyfast import netns

sys.modules[__name__] = netns
