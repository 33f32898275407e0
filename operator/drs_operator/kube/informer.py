"""A watch cache of one kind: list, then watch from the list's resourceVersion, kept in memory.

The controller-runtime informer, small: :meth:`Informer.run` lists (in pages) with the given
label/field selectors, fills ``store``, sets ``synced``, then watches from the list's
resourceVersion with bookmarks. A watch that ends is resumed from the last version seen; one
answered ``410 Gone`` (the version is too old) lists again and reports the difference. Errors
back off (1 s doubling to 30 s) and retry; the cache never gives up.

``project`` reduces each object to what its readers need (children lose ``managedFields``; nodes
and bound pods keep a handful of fields), so memory is proportional to what is read, and a
projection that returns None keeps the object out of the store (bound pods without GPUs).

**Our own writes** are put in at once (:meth:`upsert` with the object the apiserver answered,
:meth:`mark_deleting` after a delete), so the next reconcile does not act on a cache that has
not yet seen them. Ordering uses resourceVersions compared as integers (etcd revisions; the
apiserver's comparable resource versions, KEP-5504): a write is kept only when it is newer than
what the store holds and than the key's last deletion, and a watch event older than what the
store holds is skipped. A version that is not an integer turns the comparison off: events always
apply, writes are not put in (the next reconcile then may repeat a create, which answers 409).

Everything here is a cache, safe to lose: a restarted operator lists again before it reconciles.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
from collections.abc import Callable, Hashable
from typing import Any, Final

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException

from drs_operator.api.objects import Manifest
from drs_operator.kube.client import REQUEST_TIMEOUT_S, request_json

log = logging.getLogger(__name__)
Key = tuple[str, str]  #: (namespace or "", name)
Projection = Callable[[Manifest], Manifest | None]
OnChange = Callable[[Manifest | None, Manifest | None], None]

#: Objects per LIST page.
PAGE_SIZE: Final = 500
#: Back-off between failed lists or watches.
RETRY_MIN_S: Final = 1.0
RETRY_MAX_S: Final = 30.0
#: Deletions remembered per informer (to refuse writes older than a deletion).
TOMBSTONES: Final = 4096


def key_of(obj: Manifest) -> Key:
    meta = obj.get("metadata") or {}
    return (str(meta.get("namespace") or ""), str(meta.get("name") or ""))


def version_of(obj: Manifest | None) -> int | None:
    """The object's resourceVersion as an integer, or None when it has none or it is not one."""
    if obj is None:
        return None
    value = (obj.get("metadata") or {}).get("resourceVersion")
    return int(value) if isinstance(value, str) and value.isdigit() else None


def without_managed_fields(obj: Manifest) -> Manifest:
    meta = obj.get("metadata")
    if isinstance(meta, dict) and "managedFields" in meta:
        obj = {**obj, "metadata": {k: v for k, v in meta.items() if k != "managedFields"}}
    return obj


class Informer:
    """One list+watch of one kind (in one namespace, or all). See the module docstring."""

    def __init__(
        self,
        kind: str,
        lister: Callable[..., Any],
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
        project: Projection = without_managed_fields,
        index: Callable[[Manifest], Hashable | None] | None = None,
        on_change: OnChange | None = None,
        on_event: Callable[[], None] | None = None,
        watch_timeout_s: int = 300,
    ) -> None:
        self.kind = kind
        self._on_event = on_event
        self._lister = lister
        self._selectors: dict[str, str] = {}
        if label_selector:
            self._selectors["label_selector"] = label_selector
        if field_selector:
            self._selectors["field_selector"] = field_selector
        self._project = project
        self._index = index
        self._on_change = on_change
        self._watch_timeout_s = watch_timeout_s
        self.store: dict[Key, Manifest] = {}
        self.indexed: dict[Hashable, dict[Key, Manifest]] = collections.defaultdict(dict)
        self._deleted: collections.OrderedDict[Key, int] = collections.OrderedDict()
        self.synced = asyncio.Event()
        self.resource_version: str | None = None

    # ------------------------------------------------------------------ reading
    def get(self, namespace: str, name: str) -> Manifest | None:
        return self.store.get((namespace, name))

    def by_index(self, value: Hashable) -> dict[Key, Manifest]:
        return self.indexed.get(value, {})

    # ------------------------------------------------------------------ our own writes
    def upsert(self, obj: Manifest) -> None:
        """Put in an object the apiserver returned for our write, unless the store knows newer."""
        new = version_of(obj)
        if new is None:
            return
        key = key_of(obj)
        current = version_of(self.store.get(key))
        gone = self._deleted.get(key)
        if (current is not None and current >= new) or (gone is not None and gone >= new):
            return
        self._put(key, self._project({**obj, "kind": obj.get("kind") or self.kind}))

    def mark_deleting(self, namespace: str, name: str, when: str) -> None:
        """We deleted it: show it as terminating (``deletionTimestamp``) until the watch says more."""
        obj = self.store.get((namespace, name))
        if obj is None or (obj.get("metadata") or {}).get("deletionTimestamp"):
            return
        self._put((namespace, name), {**obj, "metadata": {**obj["metadata"], "deletionTimestamp": when}})

    # ------------------------------------------------------------------ the store
    def _put(self, key: Key, obj: Manifest | None) -> Manifest | None:
        old = self.store.pop(key, None)
        if old is not None and self._index is not None:
            bucket = self.indexed.get(self._index(old))
            if bucket is not None:
                bucket.pop(key, None)
                if not bucket:
                    self.indexed.pop(self._index(old), None)
        if obj is not None:
            self.store[key] = obj
            if self._index is not None:
                value = self._index(obj)
                if value is not None:
                    self.indexed[value][key] = obj
        return old

    def _apply(self, type_: str, raw: Manifest) -> None:
        key = key_of(raw)
        new = version_of(raw)
        current = version_of(self.store.get(key))
        if new is not None and current is not None and new < current:
            return  # older than what our own write put in
        if type_ == "DELETED":
            if new is not None:
                self._deleted[key] = new
                self._deleted.move_to_end(key)
                while len(self._deleted) > TOMBSTONES:
                    self._deleted.popitem(last=False)
            obj = None
        else:
            obj = self._project({**raw, "kind": self.kind})
        old = self._put(key, obj)
        if self._on_change is not None and (old is not None or obj is not None):
            self._on_change(old, obj)

    # ------------------------------------------------------------------ list and watch
    async def run(self) -> None:
        """List and watch until cancelled."""
        delay = RETRY_MIN_S
        while True:
            try:
                if self.resource_version is None:
                    await self._list()
                await self._watch()
                delay = RETRY_MIN_S
            except _Expired:
                log.debug("%s watch expired; listing again", self.kind)
                self.resource_version = None
            except (ApiException, aiohttp.ClientError, TimeoutError, ValueError) as exc:
                log.warning("%s list/watch failed (%s); retrying in %.0fs", self.kind, exc, delay)
                await asyncio.sleep(delay)
                delay = min(RETRY_MAX_S, delay * 2)
            except Exception:  # a bug: keep the cache alive, list afresh
                log.exception("%s cache failed; listing again in %.0fs", self.kind, delay)
                self.resource_version = None
                await asyncio.sleep(delay)
                delay = min(RETRY_MAX_S, delay * 2)

    async def _list(self) -> None:
        fresh: dict[Key, Manifest] = {}
        token: str | None = None
        while True:
            kw: dict[str, Any] = {**self._selectors, "limit": PAGE_SIZE}
            if token:
                kw["_continue"] = token
            page = await request_json(self._lister(**kw, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S))
            for item in page.get("items") or []:
                fresh[key_of(item)] = item
            meta = page.get("metadata") or {}
            token = meta.get("continue")
            if not token:
                break
        for key in [k for k in self.store if k not in fresh]:
            old = self._put(key, None)
            if self._on_change is not None:
                self._on_change(old, None)
        for key, raw in fresh.items():
            if version_of(self.store.get(key)) != version_of(raw) or version_of(raw) is None:
                self._apply("MODIFIED", raw)
        self.resource_version = str(meta.get("resourceVersion") or "") or None
        self.synced.set()

    async def _watch(self) -> None:
        resp = await self._lister(
            **self._selectors,
            watch=True,
            allow_watch_bookmarks=True,
            resource_version=self.resource_version,
            timeout_seconds=self._watch_timeout_s,
            _preload_content=False,
            _request_timeout=self._watch_timeout_s + 30,
        )
        try:
            if resp.status == 410:
                raise _Expired()
            if resp.status >= 400:
                raise ApiException(status=resp.status, reason=(await resp.read())[:200].decode(errors="replace"))
            buffer = b""
            async for chunk in resp.content.iter_any():
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.strip():
                        self._event(json.loads(line))
        finally:
            resp.release()

    def _event(self, event: dict[str, Any]) -> None:
        type_, obj = event.get("type"), event.get("object") or {}
        if type_ == "ERROR":
            if obj.get("code") == 410:
                raise _Expired()
            raise ApiException(status=int(obj.get("code") or 0), reason=str(obj.get("message")))
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if type_ in ("ADDED", "MODIFIED", "DELETED"):
            if self._on_event is not None:
                self._on_event()
            self._apply(str(type_), obj)
        if rv:
            self.resource_version = str(rv)


class _Expired(Exception):
    """The watch's resourceVersion is too old (410 Gone): list again."""
