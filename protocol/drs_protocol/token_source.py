"""One process's view of a rotatable token (``drs_protocol.auth``): what it presents and what it
accepts, re-read from a mounted Secret without a restart.

The operator mounts each token Secret as a directory (:data:`auth.SERVING_TOKEN_DIR`,
:data:`auth.CONTROL_TOKEN_DIR`) with up to three keys (files):

============  =====================================================  ===================
key           meaning                                                presented  accepted
============  =====================================================  ===================
``token``     the fleet's current token                              yes        yes
``next``      the token of a rotation that has begun (phase 1)       no         yes
``previous``  the token a rotation just replaced (phase 2)           no         yes
============  =====================================================  ===================

A :class:`TokenSource` owns that state. :meth:`refresh` reads the directory (through the
kubelet's ``..data`` link when there is one, so the keys of one Secret version are read together)
and is called at most once a second by :meth:`run` (:data:`REFRESH_S`), off the request path:
a request only reads attributes (:attr:`current`, :attr:`headers`, :meth:`matches` over
:attr:`accepted`), never a file or the environment.

Rules (unit- and property-tested, ``tests/unit/test_token_source.py``):

* presented (:attr:`current`): ``token``; while the file is missing or empty (the Secret was
  deleted and re-created in phase 1 only), the token held before; a source that never held one
  presents ``next``.
* accepted: the presented token, ``next``, ``previous``, and the token this process presented before the
  last change for :data:`HELD_GRACE_S` seconds after it saw the change (a hand edit of ``token``
  or a re-created Secret then loses no turn of a peer that reads the change a little later).
  Nothing else: a token two rotations old is refused.
* a missing or unreadable directory changes nothing (the Secret deleted under a running pod:
  the kubelet keeps the last files; the process keeps the tokens it holds) and is logged once.
* without a directory the source is static: the token given (``--…-token-file`` or the
  environment variable), for hand-started processes and tests.

The operator also writes a key ``generation`` (:data:`KEY_GENERATION`, a decimal counter it
bumps on every write of the Secret, never a token) and the source keeps the one it read with
the keys (:attr:`TokenSource.secret_generation`). A process reports it (never the token) in
the :data:`GENERATIONS_HEADER` of its ``/health`` answer, so the operator can tell which pods
have read the current phase of a rotation (``drs_operator.manifests.rotation``).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Final

from drs_protocol import fields

log = logging.getLogger("drs_protocol.token_source")

#: The Secret keys (files of the mounted directory).
KEY_TOKEN: Final = "token"
KEY_NEXT: Final = "next"
KEY_PREVIOUS: Final = "previous"
KEYS: Final = (KEY_TOKEN, KEY_NEXT, KEY_PREVIOUS)
#: The Secret key the operator counts its writes in (not a token; read with the tokens).
KEY_GENERATION: Final = "generation"
#: The ``/health`` answer's header naming the Secret generation each realm's source holds:
#: ``serving=3,control=2`` (:func:`format_generations`, :func:`parse_generations`).
GENERATIONS_HEADER: Final = "x-drs-token-generations"
#: The kubelet's link to the current version of a mounted Secret's files.
DATA_LINK: Final = "..data"
#: How often :meth:`TokenSource.run` re-reads the directory.
REFRESH_S: Final = 1.0
#: How long a token this process presented stays accepted after it saw ``token`` change.
HELD_GRACE_S: Final = 60.0
#: A token longer than this is not one the operator mints (64 hex chars); a file over it is ignored.
MAX_TOKEN_CHARS: Final = 4096


def format_generations(sources: Mapping[str, TokenSource]) -> str:
    """The :data:`GENERATIONS_HEADER` value: ``realm=generation`` for each source that read one."""
    return ",".join(f"{realm}={s.secret_generation}" for realm, s in sources.items() if s.secret_generation is not None)


def parse_generations(value: str | None) -> dict[str, int]:
    """A :data:`GENERATIONS_HEADER` value as ``{realm: generation}`` (None or empty: none); a
    ValueError naming the header and the part that is not ``name=number``."""
    found: dict[str, int] = {}
    for part in (value or "").split(","):
        if not part.strip():
            continue
        realm, sep, number = part.strip().partition("=")
        if not sep or not realm or not number.isdigit():
            raise ValueError(f"{GENERATIONS_HEADER}: {part.strip()!r} is not realm=generation")
        found[realm] = int(number)
    return found


def token_problem(text: str) -> str | None:
    """Why ``text`` (a key's content, stripped) is not a token, or None when it is one."""
    if not text:
        return "it is empty"
    if len(text) > MAX_TOKEN_CHARS:
        return f"it is over {MAX_TOKEN_CHARS} characters"
    if any(c.isspace() for c in text):
        return "it contains whitespace"
    return None


def _read_key(directory: Path, key: str, problems: dict[str, str]) -> str | None:
    try:
        text = (directory / key).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    problem = token_problem(text)
    if problem is not None:
        if key in KEYS:
            problems[key] = problem
        return None
    return text


def read_keys(directory: Path, problems: dict[str, str] | None = None) -> dict[str, str] | None:
    """The non-empty keys of a mounted token Secret (``..data`` first when present); None when
    the directory is missing or unreadable, or the version read was replaced while it was read
    (the kubelet removes an old version right after the swap: a half-read one is not a Secret
    without keys). A token key that is no token is left out, and why is put in ``problems``."""
    link = directory / DATA_LINK
    found: dict[str, str] = {} if problems is None else problems
    try:
        resolved = (link if link.exists() else directory).resolve(strict=True)
        keys = {key: value for key in (*KEYS, KEY_GENERATION) if (value := _read_key(resolved, key, found)) is not None}
    except (OSError, UnicodeDecodeError):
        return None
    return keys if resolved.is_dir() else None


class TokenSource:
    """The tokens one process presents and accepts for one realm (module docstring)."""

    def __init__(
        self,
        directory: str | Path | None = None,
        *,
        static: str | None = None,
        grace_s: float = HELD_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
        what: str = "token",
    ) -> None:
        self.directory = Path(directory) if directory is not None else None
        self.grace_s = grace_s
        self.clock = clock
        self.what = what
        self._keys: dict[str, str] = {KEY_TOKEN: static} if static else {}
        self._held: str | None = None
        self._held_until = 0.0
        self._unreadable = False
        #: the token keys last read that are no token, and why (logged when it changes)
        self._problems: dict[str, str] = {}
        #: Counts changes of what is presented or accepted (cheap "did it change" for callers).
        self.generation = 0
        #: Counts the directory's reads (a caller that wrote it waits for two: one surely began after).
        self.reads = 0
        self.current: str | None = None
        #: the Secret's ``generation`` read with the tokens now held (None: not written, or static)
        self.secret_generation: int | None = None
        self.accepted: tuple[bytes, ...] = ()
        self.headers: Mapping[str, str] = {}
        self._derive()
        if self.directory is not None:
            self.refresh()

    @classmethod
    def of(cls, token: str | TokenSource | None) -> TokenSource:
        """``token`` itself when it is a source, else a static source of it (None: no token)."""
        return token if isinstance(token, TokenSource) else cls(static=token)

    @property
    def configured(self) -> bool:
        """Whether this source has (or had) any token: False means the realm is open / nothing to present."""
        return bool(self.accepted) or self.current is not None

    def _derive(self) -> None:
        keys = self._keys
        current = keys.get(KEY_TOKEN) or self.current or keys.get(KEY_NEXT)
        accepted = [current, *(keys.get(k) for k in KEYS)]  # what it presents, it accepts
        if self._held is not None and self.clock() < self._held_until:
            accepted.append(self._held)
        distinct = tuple(dict.fromkeys(t.encode() for t in accepted if t))
        if current != self.current or distinct != self.accepted:
            self.generation += 1
        self.current = current
        self.accepted = distinct
        self.headers = fields.control_auth(current) if current else {}

    def refresh(self) -> bool:
        """Re-read the directory (no-op for a static source); True when anything changed."""
        before = self.generation
        if self.directory is not None:
            problems: dict[str, str] = {}
            keys = read_keys(self.directory, problems)
            if keys is None:
                if not self._unreadable:
                    log.warning(
                        "%s directory %s is missing or unreadable: keeping the tokens held", self.what, self.directory
                    )
                self._unreadable = True
            else:
                if self._unreadable:
                    log.info("%s directory %s readable again", self.what, self.directory)
                self._unreadable = False
                self._report(problems)
                new = keys.get(KEY_TOKEN)
                old = self._keys.get(KEY_TOKEN) or self.current
                if new and old and new != old:
                    self._held, self._held_until = old, self.clock() + self.grace_s
                self._keys = {k: v for k, v in keys.items() if k != KEY_GENERATION}
                number = keys.get(KEY_GENERATION, "")
                self.secret_generation = int(number) if number.isdigit() else None
            self.reads += 1
        self._derive()
        if self.generation != before:
            log.info(
                "%s changed: presenting %s, accepting %d token(s)",
                self.what,
                "one" if self.current else "none",
                len(self.accepted),
            )
        return self.generation != before

    def _report(self, problems: dict[str, str]) -> None:
        """Log each token key that became no token (named with the rule; its content never)."""
        for key, problem in problems.items():
            if self._problems.get(key) != problem:
                log.warning(
                    "%s directory %s: key %r is not a token (%s): neither presented nor accepted",
                    self.what,
                    self.directory,
                    key,
                    problem,
                )
        self._problems = problems

    def matches(self, presented: str | None) -> bool:
        """Whether ``presented`` is one of the accepted tokens (constant time per comparison)."""
        if presented is None:
            return False
        raw = presented.encode()
        found = False
        for token in self.accepted:
            found |= hmac.compare_digest(raw, token)
        return found

    async def run(self, interval_s: float = REFRESH_S) -> None:
        """Re-read every ``interval_s`` until cancelled (a static source returns at once)."""
        if self.directory is None:
            return
        while True:
            await asyncio.sleep(interval_s)
            await asyncio.to_thread(self.refresh)


async def run_sources(*sources: TokenSource, interval_s: float = REFRESH_S) -> None:
    """Re-read every source with a directory, until cancelled."""
    await asyncio.gather(*(s.run(interval_s) for s in sources if s.directory is not None))


def token_source(directory: str | None, token_file: str | Path | None, env_value: str | None, what: str) -> TokenSource:
    """The source a process starts with: the mounted directory when given (it wins), else the
    static token of ``token_file`` or the environment variable's value (``auth.read_token``)."""
    from drs_protocol.auth import read_token

    if directory:
        return TokenSource(directory, what=what)
    return TokenSource(static=read_token(token_file, env_value), what=what)
