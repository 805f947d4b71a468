"""Capture: the only package that touches a live model. ``from hooks import capture``."""

from hooks.capture import capture
from hooks.options import LEVELS, MODES, CaptureOptions
from hooks.replay import replay
from hooks.runner import run_capture

__all__ = ["LEVELS", "MODES", "CaptureOptions", "capture", "replay", "run_capture"]
