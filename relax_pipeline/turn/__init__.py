"""The model turn as one service: records, errors, the sessions and the turn service, group leases.

`service.py` holds the store of sessions the gateway authenticates against (`ForestStore`) and canonicalizes →
attaches → generates → commits one model call of one session (`TurnService`); `leases.py` decides when a group
may generate. Protocol adapters (`protocol/`) translate wire ↔ records above it; the gateway (`gateway/`) does
HTTP above them.
"""
