"""Capture: the only package that touches a live model. ``from hooks import capture``."""

from hooks.capture import CaptureOptions, capture
from hooks.runner import run_capture

__all__ = ["CaptureOptions", "capture", "run_capture"]
