"""Nightjar policy sidecar: decides the speculative length γ of every decoding step."""

__version__ = "0.1.0"
