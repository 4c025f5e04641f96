"""Nightjar policy sidecar: decides the speculative length γ of every decoding step."""

import os

# Before anything imports gRPC, which reads this once: the sidecar forks children for its
# whole-state work (forked.py), and gRPC's own fork handlers made them crash.
os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"

__version__ = "0.1.0"
