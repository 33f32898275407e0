"""Every contract between the project's processes, defined once and imported by both sides.

PROTOCOL.md (in the design docs) is the wire format; this package holds what more than one process
must spell or compute identically:

* ``routes`` — route paths and operation names of the serving, engine-control and trainer APIs;
* ``env`` — environment variable names (control token, rendered configs, node ip, rank variables);
* ``limits`` — bounds both sides enforce (weights-version length, control body size);
* ``enums`` — engine roles, engine backends, router names (the CRD's enums are generated from them);
* ``config``, ``engine_config``, ``frontend_config`` — the configs the operator renders and the
  engine and frontend parse (one key convention: camelCase, snake_case accepted);
* ``control`` — request bodies of the engine control API;
* ``errors`` — the one error body and the exception tree every server raises from;
  ``fastapi_errors`` and ``body`` — how the FastAPI servers (engine, sidecar) answer errors and
  read capped bodies (413);
* ``trtllm_kwargs`` — the deep merge of TensorRT-LLM kwargs the operator and the engine both apply;
* ``fields`` — wire field and header names; ``token_ids``, ``snowflake``, ``chat`` — what the
  frontend and the engine compute identically; ``listen`` — bind-first listening sockets.

``tests/protocol/test_contract_drift.py`` fails when non-test code spells one of these itself.
"""
