"""The canonical conversation: messages, tools and template kwargs as every API and export shares them.

`form.py` (the records, validation and chained hashes), `chat.py` (OpenAI Chat message objects → canonical),
`memo.py` (reuse a session's replayed prefix). The lowest floor: it imports no other package of ours.
"""
