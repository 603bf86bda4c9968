"""Benchmark suite behind `fused-stable bench`: fused_stable's step against torch's clip + AdamW, side by side."""

from .cli import main

__all__ = ["main"]
