"""The canonical conversation: messages, tools and template kwargs as every API and export shares them.

`form.py`: the records, validation and chained hashes, OpenAI Chat message objects → canonical, and the
session memo that reuses a replayed prefix. The lowest floor: it imports no other package of ours.
"""
