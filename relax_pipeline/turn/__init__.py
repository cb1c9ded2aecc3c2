"""The model turn as one service: records, `ProtocolError`, sessions, group leases and the turn service.

`service.py` canonicalizes → matches → generates → commits one model call of one session; `sessions.py` is the
store of sessions the gateway authenticates against; `leases.py` decides when a group may generate. Protocol
adapters (`protocol/`) translate wire ↔ records above it; the gateway (`gateway/`) does HTTP above them.
"""
