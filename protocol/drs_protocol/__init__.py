"""The wire format shared by the frontend, the engine server and the trainer sidecar.

PROTOCOL.md (in the design docs) is the contract; this package holds the few pieces of it that
more than one process must compute identically: token-id encoding, the snowflake request id,
the conversation-id lookup, and the field and header names.
"""
