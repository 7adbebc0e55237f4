"""Cluster-scale discrete-event simulator driving the real scheduling core."""
from .config import PROFILES, HardwareProfile, SimConfig, load_profile
from .engine import run_simulation
from .records import SimResult

__all__ = ["PROFILES", "HardwareProfile", "SimConfig", "load_profile", "SimResult",
           "run_simulation"]
