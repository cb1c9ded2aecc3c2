"""Infrastructure shared by several floors: the Ray runtime, free ports, child-process watch, death signals.

The lowest floor above `canonical/`: it imports no other package of `relax_pipeline`, so the engine, the
trainer and the agent executors can all use it without pointing sideways at each other.
"""
