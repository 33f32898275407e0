"""Cross-field rules of the spec, written once: the CEL form for the apiserver and the message text.

Each :class:`CelRule` is attached to the model it constrains (``x-kubernetes-validations`` in the
generated CRD) and its ``message`` is reused verbatim by ``drs_operator.validation``, whose
Python twin of the rule appends the offending numbers. So ``kubectl apply`` and ``drs plan`` (and
the operator's ``Valid`` condition) reject the same things with the same words.

CEL cost: every rule here is constant-time integer arithmetic on scalar fields of the object it
sits on (or a bounded string for the name rule), so the apiserver's cost estimator accepts them
no matter how large lists elsewhere in the schema may grow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from drs_operator.api.constants import MAX_FRONTENDS, MAX_NAME_LENGTH, MAX_PORT


@dataclass(frozen=True)
class CelRule:
    """One ``x-kubernetes-validations`` entry."""

    rule: str
    message: str
    #: Where the apiserver reports the problem, relative to the object the rule sits on.
    field_path: str | None = None
    #: ``FieldValueInvalid`` | ``FieldValueForbidden`` | ``FieldValueRequired`` | ``FieldValueDuplicate``.
    reason: str = "FieldValueInvalid"

    def to_schema(self) -> dict[str, Any]:
        """The rule as it appears in the CRD."""
        out: dict[str, Any] = {"rule": self.rule, "message": self.message}
        if self.field_path is not None:
            out["fieldPath"] = self.field_path
        out["reason"] = self.reason
        return out


def schema_extra(*rules: CelRule) -> dict[str, Any]:
    """``json_schema_extra`` for a model constrained by ``rules``."""
    return {"x-kubernetes-validations": [r.to_schema() for r in rules]}


# --- messages (shared with drs_operator.validation) -----------------------------------------
MSG_MOE_SPLIT: Final = "moeTensorParallelSize * moeExpertParallelSize must equal tensorParallelSize"
MSG_MOE_TP_DIVIDES: Final = "moeTensorParallelSize must divide tensorParallelSize"
MSG_MOE_EP_DIVIDES: Final = "moeExpertParallelSize must divide tensorParallelSize"
MSG_ROLE_PRECISION: Final = "precision is replica-wide: set spec.model.precision, not a role block"
MSG_ROLE_MAX_MODEL_LEN: Final = "maxModelLen is replica-wide: set spec.model.maxModelLen, not a role block"
MSG_ROLE_PARSERS: Final = "parsers are replica-wide: set spec.model.parsers, not a role block"
MSG_REPLICAS_XOR: Final = "set exactly one of replicas and inferenceGPUs"
MSG_INFERENCE_GPUS_DIVISIBLE: Final = (
    "inferenceGPUs must be a multiple of the replica width "
    "(prefill.engines * prefill.tensorParallelSize + decode.engines * decode.tensorParallelSize)"
)
MSG_FRONTEND_COUNT: Final = (
    f"replicas * frontend.workers must be at most {MAX_FRONTENDS} (frontend node ids are 8 bits)"
)
MSG_FRONTEND_PORT_RANGE: Final = (
    f"frontend ports run from frontend.basePort to basePort + replicas * frontend.workers - 1, "
    f"which must be at most {MAX_PORT}"
)
MSG_ENGINE_PORT_COLLISION: Final = (
    "engine ports (trtllm.enginePort; with network.hostNetwork, enginePort to enginePort + "
    "replicas * (prefill.engines + decode.engines) - 1) must not overlap the frontend ports "
    "(frontend.basePort to basePort + replicas * frontend.workers - 1)"
)
MSG_ENGINE_PORT_RANGE: Final = (
    "with network.hostNetwork every engine gets its own port, enginePort to enginePort + "
    f"replicas * (prefill.engines + decode.engines) - 1, which must be at most {MAX_PORT}"
)
MSG_POLICY_HOST_NETWORK: Final = (
    "networkPolicy.enabled needs pod networking: NetworkPolicies do not apply to pods on the host "
    "network (network.hostNetwork), so the engines would stay open"
)
MSG_TORCH_WIDTH: Final = (
    "the torch backend runs one GPU per engine: tensorParallelSize and the MoE sizes must be 1 "
    "(wider engines need the trtllm backend)"
)
MSG_SIM_OPTIONS_ALIAS: Final = "engine.simOptions is the deprecated spelling of engine.sim: set only engine.sim"
MSG_STANDBY_HOST_NETWORK: Final = (
    "frontend.standby needs pod networking: on the host network (network.hostNetwork) a second process "
    "cannot listen on the frontend's node port"
)
MSG_GROUP_HOLD_ROUTING: Final = (
    "frontend.groupHoldSeconds holds a GRPO group's siblings for its first context leg, which only group "
    "routing places together: with frontend.groupRouting false, leave groupHoldSeconds unset or 0"
)
MSG_NAME: Final = (
    "metadata.name must be a DNS label (lowercase letters, digits and '-', starting with a letter) "
    f"of at most {MAX_NAME_LENGTH} characters, so that every child name fits in 63"
)

#: A DNS-1035 label; the length bound is checked separately.
NAME_PATTERN: Final = "^[a-z]([-a-z0-9]*[a-z0-9])?$"

# --- CEL building blocks (on the spec object) -----------------------------------------------
_WIDTH = (
    "(self.prefill.engines * self.prefill.tensorParallelSize + self.decode.engines * self.decode.tensorParallelSize)"
)
_N = f"(has(self.replicas) ? self.replicas : (has(self.inferenceGPUs) ? self.inferenceGPUs / {_WIDTH} : 0))"
_NF = f"({_N} * self.frontend.workers)"
_E = "(self.prefill.engines + self.decode.engines)"
_ENGINE_PORTS = f"(self.network.hostNetwork ? {_N} * {_E} : 1)"

ROLE_RULES: Final = (
    CelRule(
        "!has(self.moeTensorParallelSize) || !has(self.moeExpertParallelSize)"
        " || self.moeTensorParallelSize * self.moeExpertParallelSize == self.tensorParallelSize",
        MSG_MOE_SPLIT,
        ".moeExpertParallelSize",
    ),
    CelRule(
        "!has(self.moeTensorParallelSize) || self.tensorParallelSize % self.moeTensorParallelSize == 0",
        MSG_MOE_TP_DIVIDES,
        ".moeTensorParallelSize",
    ),
    CelRule(
        "!has(self.moeExpertParallelSize) || self.tensorParallelSize % self.moeExpertParallelSize == 0",
        MSG_MOE_EP_DIVIDES,
        ".moeExpertParallelSize",
    ),
    CelRule("!has(self.precision)", MSG_ROLE_PRECISION, ".precision", "FieldValueForbidden"),
    CelRule("!has(self.maxModelLen)", MSG_ROLE_MAX_MODEL_LEN, ".maxModelLen", "FieldValueForbidden"),
    CelRule("!has(self.parsers)", MSG_ROLE_PARSERS, ".parsers", "FieldValueForbidden"),
)

ENGINE_RULES: Final = (
    CelRule("!has(self.sim) || !has(self.simOptions)", MSG_SIM_OPTIONS_ALIAS, ".simOptions", "FieldValueForbidden"),
)

SPEC_RULES: Final = (
    CelRule("has(self.replicas) != has(self.inferenceGPUs)", MSG_REPLICAS_XOR, ".replicas", "FieldValueRequired"),
    CelRule(
        f"!has(self.inferenceGPUs) || self.inferenceGPUs % {_WIDTH} == 0",
        MSG_INFERENCE_GPUS_DIVISIBLE,
        ".inferenceGPUs",
    ),
    CelRule(f"{_NF} <= {MAX_FRONTENDS}", MSG_FRONTEND_COUNT, ".frontend.workers"),
    CelRule(f"self.frontend.basePort + {_NF} - 1 <= {MAX_PORT}", MSG_FRONTEND_PORT_RANGE, ".frontend.basePort"),
    CelRule(
        f"{_NF} == 0 || self.trtllm.enginePort + {_ENGINE_PORTS} - 1 < self.frontend.basePort"
        f" || self.trtllm.enginePort > self.frontend.basePort + {_NF} - 1",
        MSG_ENGINE_PORT_COLLISION,
        ".trtllm.enginePort",
    ),
    CelRule(
        f"!self.network.hostNetwork || self.trtllm.enginePort + {_N} * {_E} - 1 <= {MAX_PORT}",
        MSG_ENGINE_PORT_RANGE,
        ".trtllm.enginePort",
    ),
    CelRule(
        "!has(self.networkPolicy) || !has(self.networkPolicy.enabled) || !self.networkPolicy.enabled"
        " || !has(self.network) || !has(self.network.hostNetwork) || !self.network.hostNetwork",
        MSG_POLICY_HOST_NETWORK,
        ".networkPolicy.enabled",
    ),
    CelRule(
        "!has(self.frontend.standby) || !self.frontend.standby"
        " || !has(self.network) || !has(self.network.hostNetwork) || !self.network.hostNetwork",
        MSG_STANDBY_HOST_NETWORK,
        ".frontend.standby",
    ),
    CelRule(
        "!has(self.frontend.groupHoldSeconds) || self.frontend.groupHoldSeconds == 0.0"
        " || !has(self.frontend.groupRouting) || self.frontend.groupRouting",
        MSG_GROUP_HOLD_ROUTING,
        ".frontend.groupHoldSeconds",
    ),
)

RESOURCE_RULES: Final = (
    CelRule(
        f"size(self.metadata.name) <= {MAX_NAME_LENGTH} && self.metadata.name.matches('{NAME_PATTERN}')",
        MSG_NAME,
    ),
)
