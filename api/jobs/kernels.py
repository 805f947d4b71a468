"""Imported by the job processes' forkserver before it forks: the metric kernels are loaded (from numba's
cache, or compiled) once there, not again in every job's child process (~0.4 s each)."""

from accuracy import fused

fused.warm_up(errors=True)
