"""Operator tooling: the Grafana dashboard (`make dashboard`) and its offline renderer.

Needs the `ops` extra (grafana-foundation-sdk) for the builder and `sim` (matplotlib)
for the renderer; the sidecar itself never imports this package.
"""
