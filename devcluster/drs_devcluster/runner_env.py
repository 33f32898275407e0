"""What a kubelet would give a container: its environment and its command line, as pure functions.

The local pod runner (``runner.py``) runs the first container of a pod as a process. What that
process sees must be what a kubelet gives it, so that a manifest that works here works on a real
node. The rules, as in the kubelet (``pkg/kubelet/kubelet_pods.go: makeEnvironmentVariables`` and
``ExpandContainerCommandAndArgs``, Kubernetes v1.36):

* ``envFrom`` first, in order (ConfigMap ``data`` / Secret ``data``, keys with ``prefix``); a missing
  object is a problem unless ``optional``; then ``env`` in order, overriding.
* A literal ``value`` is ``$(VAR)``-expanded against the variables declared *before* it, then the
  extra variables (the runner's ``DRS_NODE_IP``, which plays the part of the kubelet's service
  variables); an entry with neither ``value`` nor ``valueFrom`` is set to the empty string.
  ``valueFrom`` results are never expanded.
* ``valueFrom.fieldRef``: the fields the kubelet resolves for env (``metadata.name``,
  ``metadata.namespace``, ``metadata.uid``, ``metadata.labels['k']``, ``metadata.annotations['k']``,
  ``spec.nodeName``, ``spec.serviceAccountName``, ``status.hostIP(s)``, ``status.podIP(s)``).
  ``secretKeyRef`` (base64 ``data``) and ``configMapKeyRef`` (``data`` only, like the kubelet): a
  missing object or key is a problem unless ``optional``, and an optional miss leaves the variable
  unset. ``resourceFieldRef`` and ``fileKeyRef`` are not supported here (a problem, named).
* The final environment is the declared variables plus the extra variables they do not override;
  ``command`` and ``args`` are expanded against it.
* ``$(VAR)`` expansion (``third_party/forked/golang/expansion``): ``$(NAME)`` becomes the value when
  ``NAME`` is defined and stays as written otherwise; ``$$`` is one ``$``; ``$`` before anything but
  ``(`` or ``$`` stays; an unterminated ``$(`` stays.

Unlike the kubelet, which stops at the first problem, ``resolve`` reports every problem at once.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from drs_protocol import env

#: The extra variable the runner adds: the address of the pod's node (its loopback InternalIP).
NODE_IP_ENV: Final = env.NODE_IP
#: The command a container must start with for the runner to run it.
DRS_COMMAND: Final = "drs"

_OPERATOR: Final = "$"
_OPENER: Final = "("
_CLOSER: Final = ")"


class EnvResolutionError(ValueError):
    """The container's environment cannot be built; ``problems`` lists every reason."""

    def __init__(self, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


@dataclasses.dataclass(frozen=True)
class ObjectRefs:
    """The Secrets and ConfigMaps (names, in the pod's namespace) a container's env reads."""

    secrets: frozenset[str]
    config_maps: frozenset[str]


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A container's command line (``command + args``, expanded) and its declared environment."""

    argv: list[str]
    env: dict[str, str]


# ---------------------------------------------------------------------------- $(VAR) expansion


def mapping_for(*contexts: Mapping[str, str]) -> Callable[[str], str]:
    """The first context that defines a name wins; an undefined name stays ``$(NAME)``."""

    def lookup(name: str) -> str:
        for context in contexts:
            if name in context:
                return context[name]
        return f"{_OPERATOR}{_OPENER}{name}{_CLOSER}"

    return lookup


def expand(text: str, mapping: Callable[[str], str]) -> str:
    """Kubernetes ``$(VAR)`` expansion of ``text`` (the kubelet's algorithm, character for character)."""
    out: list[str] = []
    checkpoint = 0
    cursor = 0
    while cursor < len(text):
        if text[cursor] == _OPERATOR and cursor + 1 < len(text):
            out.append(text[checkpoint:cursor])
            read, is_name, advance = _read_name(text, cursor + 1)
            out.append(mapping(read) if is_name else read)
            cursor += advance
            checkpoint = cursor + 1
        cursor += 1
    return "".join(out) + text[checkpoint:]


def _read_name(text: str, start: int) -> tuple[str, bool, int]:
    """What follows an operator at ``start``: (text read, is it a name, characters consumed)."""
    first = text[start]
    if first == _OPERATOR:
        return _OPERATOR, False, 1
    if first == _OPENER:
        close = text.find(_CLOSER, start + 1)
        if close != -1:
            return text[start + 1 : close], True, close - start + 1
        return _OPERATOR + _OPENER, False, 1
    return _OPERATOR + first, False, 1


# ---------------------------------------------------------------------------- env resolution


def first_container(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    containers = (pod.get("spec") or {}).get("containers") or []
    if not containers:
        raise EnvResolutionError(["the pod has no containers"])
    first: Mapping[str, Any] = containers[0]
    return first


def referenced_objects(container: Mapping[str, Any]) -> ObjectRefs:
    """Every Secret and ConfigMap the container's ``env`` and ``envFrom`` read."""
    secrets: set[str] = set()
    config_maps: set[str] = set()
    for source in container.get("envFrom") or []:
        if source.get("secretRef"):
            secrets.add(source["secretRef"].get("name", ""))
        if source.get("configMapRef"):
            config_maps.add(source["configMapRef"].get("name", ""))
    for var in container.get("env") or []:
        value_from = var.get("valueFrom") or {}
        if value_from.get("secretKeyRef"):
            secrets.add(value_from["secretKeyRef"].get("name", ""))
        if value_from.get("configMapKeyRef"):
            config_maps.add(value_from["configMapKeyRef"].get("name", ""))
    return ObjectRefs(frozenset(secrets), frozenset(config_maps))


def resolve(
    pod: Mapping[str, Any],
    secrets: Mapping[str, Mapping[str, Any]],
    config_maps: Mapping[str, Mapping[str, Any]],
    extra_env: Mapping[str, str] | None = None,
) -> Resolved:
    """The first container's expanded ``command + args`` and its environment.

    ``secrets`` and ``config_maps`` map names (in the pod's namespace) to the objects as the API
    returns them; a name that is absent is an object that does not exist. ``extra_env`` is
    visible to ``$(VAR)`` references and set in the environment unless the pod declares the
    same name. Raises EnvResolutionError listing every problem.
    """
    container = first_container(pod)
    extra = dict(extra_env or {})
    problems: list[str] = []
    declared: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        declared.update(_env_from(source, secrets, config_maps, problems))
    for var in container.get("env") or []:
        name = str(var.get("name", ""))
        value = var.get("value") or ""
        if value:
            declared[name] = expand(str(value), mapping_for(declared, extra))
        elif var.get("valueFrom"):
            resolved = _value_from(name, var["valueFrom"], pod, secrets, config_maps, problems)
            if resolved is not None:
                declared[name] = resolved
        else:
            declared[name] = ""
    env = {**extra, **declared}
    problems.extend(f"env {name!r} cannot be set in a process environment" for name in env if _unsettable(name))
    problems.extend(f"env {name!r}: value contains a NUL byte" for name, v in env.items() if "\x00" in v)
    if problems:
        raise EnvResolutionError(problems)
    mapping = mapping_for(env)
    argv = [expand(str(a), mapping) for a in [*(container.get("command") or []), *(container.get("args") or [])]]
    return Resolved(argv=argv, env=env)


def _unsettable(name: str) -> bool:
    return not name or "=" in name or "\x00" in name


def _env_from(
    source: Mapping[str, Any],
    secrets: Mapping[str, Mapping[str, Any]],
    config_maps: Mapping[str, Mapping[str, Any]],
    problems: list[str],
) -> dict[str, str]:
    prefix = str(source.get("prefix") or "")
    for key, kind, objects in (("configMapRef", "configmap", config_maps), ("secretRef", "secret", secrets)):
        ref = source.get(key)
        if not ref:
            continue
        obj = objects.get(ref.get("name", ""))
        if obj is None:
            if not ref.get("optional"):
                problems.append(f"envFrom: {kind} {ref.get('name')!r} not found")
            return {}
        data = (obj.get("data") or {}).items()
        if kind == "configmap":
            return {prefix + k: str(v) for k, v in data}
        out: dict[str, str] = {}
        for k, v in data:
            decoded = _decode_secret_value(str(v), f"envFrom: secret {ref.get('name')!r} key {k!r}", problems)
            if decoded is not None:
                out[prefix + k] = decoded
        return out
    return {}


def _value_from(
    name: str,
    value_from: Mapping[str, Any],
    pod: Mapping[str, Any],
    secrets: Mapping[str, Mapping[str, Any]],
    config_maps: Mapping[str, Mapping[str, Any]],
    problems: list[str],
) -> str | None:
    """The value of one ``valueFrom``, or None when it is an optional miss or a problem (recorded)."""
    where = f"env {name!r}"
    if value_from.get("fieldRef"):
        ref = value_from["fieldRef"]
        try:
            return field_value(pod, str(ref.get("fieldPath", "")), str(ref.get("apiVersion") or "v1"))
        except ValueError as exc:
            problems.append(f"{where}: {exc}")
            return None
    for kind, objects, label in (
        ("configMapKeyRef", config_maps, "configmap"),
        ("secretKeyRef", secrets, "secret"),
    ):
        if not value_from.get(kind):
            continue
        ref = value_from[kind]
        optional = bool(ref.get("optional"))
        obj = objects.get(ref.get("name", ""))
        if obj is None:
            if not optional:
                problems.append(f"{where}: {label} {ref.get('name')!r} not found")
            return None
        data = obj.get("data") or {}
        key = ref.get("key", "")
        if key not in data:
            if not optional:
                problems.append(f"{where}: key {key!r} not found in {label} {ref.get('name')!r}")
            return None
        if kind == "secretKeyRef":
            return _decode_secret_value(str(data[key]), f"{where}: secret {ref.get('name')!r} key {key!r}", problems)
        return str(data[key])
    unsupported = ", ".join(sorted(value_from)) or "nothing"
    problems.append(f"{where}: valueFrom {unsupported} is not supported by the local pod runner")
    return None


def _decode_secret_value(encoded: str, where: str, problems: list[str]) -> str | None:
    try:
        return base64.b64decode(encoded, validate=True).decode("utf-8", errors="replace")
    except (binascii.Error, ValueError):
        problems.append(f"{where}: data is not valid base64")
        return None


def field_value(pod: Mapping[str, Any], field_path: str, api_version: str = "v1") -> str:
    """The value of a downward-API ``fieldRef`` for env, as the kubelet resolves it."""
    if api_version != "v1":
        raise ValueError(f"fieldRef apiVersion {api_version!r} is not supported (only v1)")
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    status = pod.get("status") or {}
    subscripted = _split_subscript(field_path)
    if subscripted is not None:
        path, key = subscripted
        if path == "metadata.labels":
            return str((meta.get("labels") or {}).get(key, ""))
        if path == "metadata.annotations":
            return str((meta.get("annotations") or {}).get(key, ""))
        raise ValueError(f"fieldPath {field_path!r} does not support a subscript")
    pod_ips = [str(ip.get("ip", "")) for ip in status.get("podIPs") or []] or (
        [str(status["podIP"])] if status.get("podIP") else []
    )
    host_ips = [str(ip.get("ip", "")) for ip in status.get("hostIPs") or []] or (
        [str(status["hostIP"])] if status.get("hostIP") else []
    )
    simple: dict[str, Callable[[], str]] = {
        "metadata.name": lambda: str(meta.get("name", "")),
        "metadata.namespace": lambda: str(meta.get("namespace", "")),
        "metadata.uid": lambda: str(meta.get("uid", "")),
        "spec.nodeName": lambda: str(spec.get("nodeName", "")),
        "spec.host": lambda: str(spec.get("nodeName", "")),
        "spec.serviceAccountName": lambda: str(spec.get("serviceAccountName", "")),
        "status.podIP": lambda: pod_ips[0] if pod_ips else "",
        "status.podIPs": lambda: ",".join(pod_ips),
        "status.hostIP": lambda: host_ips[0] if host_ips else "",
        "status.hostIPs": lambda: ",".join(host_ips),
    }
    if field_path not in simple:
        raise ValueError(f"fieldPath {field_path!r} is not supported for env")
    return simple[field_path]()


def _split_subscript(field_path: str) -> tuple[str, str] | None:
    """``metadata.labels['k']`` → (``metadata.labels``, ``k``), like fieldpath.SplitMaybeSubscriptedPath."""
    if not field_path.endswith("']"):
        return None
    path, sep, key = field_path.removesuffix("']").partition("['")
    if not sep or not path:
        return None
    return path, key


# ---------------------------------------------------------------------------- the local command line


def is_drs_command(container: Mapping[str, Any]) -> bool:
    """The runner's contract: it runs a container only when ``command[0]`` is ``drs``."""
    command = container.get("command") or []
    return bool(command) and command[0] == DRS_COMMAND


def local_argv(argv: Sequence[str], python: str, drs_script: str) -> list[str]:
    """``drs …`` as a local process: the ``drs`` console script run by the runner's own Python."""
    if not argv or argv[0] != DRS_COMMAND:
        raise ValueError(f"not a drs command line: {list(argv)!r}")
    return [python, drs_script, *argv[1:]]
