"""Protocol fuzzing of the policy, admin and memory-agent services (`make fuzz`).

Hypothesis-generated messages with boundary values and raw bytes sent as serialized
requests, through real server processes: a `nightjar-server` and a memory-agent host
(:mod:`benchmarks.fuzz.memory_host`). Every answer must be a gRPC status that names the
client's mistake (never UNKNOWN or INTERNAL), no process may die, and a rejected request
must leave the learned state as it was (compared through GetState / GetStatus).
"""
