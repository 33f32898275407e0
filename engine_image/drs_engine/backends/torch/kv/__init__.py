"""The ``torch`` backend's KV memory: :mod:`.prefix` (cached prompt blocks, reused by later
prompts) and :mod:`.arena` (the prefill engine's handoff arena, where contexts wait for their
decode engines)."""
