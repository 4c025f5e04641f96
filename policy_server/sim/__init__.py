"""Serving simulator: continuous batching with speculative decoding, for replaying traces
against candidate policies before deploying them (see docs/SIMULATOR.md)."""
