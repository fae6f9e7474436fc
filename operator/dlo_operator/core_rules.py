"""What the API server refuses in the core/v1 parts of a DOD beyond their schema.

`core_schema` checks types, unknown and required fields; the API server's own validation then
refuses more, and it would refuse it in the StatefulSet the operator applies, after `kubectl
apply` of the DOD succeeded: label keys and values, DNS names (service account, PriorityClass,
RuntimeClass, volumes), resource quantities (and requests above limits), toleration operators
and effects, probes with no or two handlers, env items without a name, mount paths used twice or
taken by dlo's own mounts, affinity terms. `core_problems` runs both, so that the operator and
`dlo render` refuse what the cluster would, naming the DOD field as the user wrote it (through
`spec.field_name`). Rule ids are in brackets, as in `pod_rules`. Called by `admission`; pure.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

from dlo_contract.names import RUN_DIR, SETTINGS_MOUNT
from dlo_operator.core_schema import core_schema_problems
from dlo_operator.naming import SHM_PATH
from dlo_operator.spec import DeploymentSpec, field_name

_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
PORT_NAME = re.compile(r"^(?=.*[a-z])(?!.*--)[a-z0-9](?:[a-z0-9-]*[a-z0-9])?$")
"""A port's name as the API server takes it (IANA service name): lowercase letters, digits and
'-', at least one letter, no '-' at either end, no '--'; at most 15 characters."""
_QUANTITY = re.compile(r"^([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+))"
                       r"(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?$")
_SUFFIX = {"": 0, "n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
LABEL_RULES = ("at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter "
               "or digit")
DNS_SUBDOMAIN_RULES = ("lowercase letters, digits, '-' and '.', at most 253 characters, "
                       "starting and ending with a letter or digit")


def core_problems(spec: DeploymentSpec) -> list[str]:
    """Schema violations first (the rules below read well-formed objects only)."""
    problems = core_schema_problems(spec)
    if problems:
        return problems
    checks: tuple[Callable[[DeploymentSpec], Iterator[str]], ...] = (
        _labels, _dns_names, _resources, _tolerations, _probes, _env, _mounts, _volumes,
        _affinity)
    return [problem for check in checks for problem in check(spec)]


def quantity(value: Any) -> Decimal | None:
    """A Kubernetes resource quantity (`4Gi`, `500m`, `2`, `1e9`) as a number; None when the
    API server would refuse it."""
    match = _QUANTITY.match(str(value).strip()) if isinstance(value, (str, int, float)) else None
    if match is None or isinstance(value, bool):
        return None
    try:
        number = Decimal(match.group(1))
    except InvalidOperation:
        return None
    suffix = match.group(2) or ""
    if suffix.endswith("i"):
        return number * Decimal(2) ** (10 * ("KMGTPE".index(suffix[0]) + 1))
    exponent = int(suffix[1:]) if suffix[:1] in ("e", "E") else _SUFFIX[suffix]
    return number.scaleb(exponent)


def label_key_problem(key: str) -> str | None:
    """Why `key` is no label or annotation key (`[prefix/]name`), or None."""
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        return f"the prefix before '/', {prefix!r}, must be a DNS subdomain ({DNS_SUBDOMAIN_RULES})"
    if not _LABEL_NAME.match(name):
        return f"the name {name!r} must be {LABEL_RULES}"
    return None


def _labels(spec: DeploymentSpec) -> Iterator[str]:
    for path, labels in (("pod_labels", spec.pod_labels), ("node_selector", spec.node_selector),
                         ("pod_annotations", spec.pod_annotations)):
        for key, value in labels.items():
            # The API server checks annotation keys lowercased, label keys as written.
            why = label_key_problem(key.lower() if path == "pod_annotations" else key)
            if why:
                yield (f"[labels-valid] {field_name(path)} key {key!r} is not a qualified name: "
                       f"{why}; rename it")
            elif path != "pod_annotations" and value and not _LABEL_NAME.match(value):
                yield (f"[labels-valid] {field_name(path)}[{key!r}]={value!r} is not a label "
                       f"value: it must be empty, or {LABEL_RULES}; change it")


def _dns_names(spec: DeploymentSpec) -> Iterator[str]:
    for path in ("service_account_name", "priority_class_name", "runtime_class_name"):
        value = getattr(spec, path)
        if value and (len(value) > 253 or not _DNS_SUBDOMAIN.match(value)):
            yield (f"[dns-subdomain] {field_name(path)}={value!r} is not an object name the API "
                   f"server takes ({DNS_SUBDOMAIN_RULES}); use the name the object has in the "
                   "cluster")


def _resources(spec: DeploymentSpec) -> Iterator[str]:
    for path in ("inference.resources", "loader.resources"):
        resources = getattr(spec.inference if path.startswith("inference") else spec.loader,
                            "resources")
        amounts: dict[str, dict[str, Decimal]] = {}
        for kind in ("requests", "limits"):
            for resource, value in (resources.get(kind) or {}).items():
                field = f"{field_name(path)}.{kind}[{resource!r}]"
                amount = quantity(value)
                if amount is None or amount < 0:
                    yield (f"[resource-quantity] {field}={value!r} is not a quantity: a "
                           "non-negative number with an optional suffix (500m, 2, 16Gi, 1e9); "
                           "fix the value")
                else:
                    amounts.setdefault(kind, {})[resource] = amount
        for resource, request in amounts.get("requests", {}).items():
            limit = amounts.get("limits", {}).get(resource)
            if limit is not None and request > limit:
                yield (f"[resource-quantity] {field_name(path)}.requests[{resource!r}]="
                       f"{resources['requests'][resource]!r} exceeds its limit "
                       f"{resources['limits'][resource]!r}; lower the request or raise the limit")


_OPERATORS = ("Equal", "Exists")
_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def _tolerations(spec: DeploymentSpec) -> Iterator[str]:
    for index, toleration in enumerate(spec.tolerations):
        field = f"{field_name('tolerations')}[{index}]"
        operator, effect = toleration.get("operator") or "Equal", toleration.get("effect")
        key, value = toleration.get("key") or "", toleration.get("value") or ""
        if operator not in _OPERATORS:
            yield (f"[tolerations-valid] {field}.operator={operator!r} is not one of "
                   f"{', '.join(_OPERATORS)}; use one of them")
        elif operator == "Exists" and value:
            yield (f"[tolerations-valid] {field}.value={value!r} must be empty with operator "
                   "Exists; remove it or use operator Equal")
        elif not key and operator != "Exists":
            yield (f"[tolerations-valid] {field} has no key, which matches every taint only with "
                   "operator Exists; set a key or operator: Exists")
        if effect and effect not in _EFFECTS:
            yield (f"[tolerations-valid] {field}.effect={effect!r} is not one of "
                   f"{', '.join(_EFFECTS)}; use one of them, or none for every effect")
        if toleration.get("tolerationSeconds") is not None and effect != "NoExecute":
            yield (f"[tolerations-valid] {field}.tolerationSeconds is set, which only effect "
                   "NoExecute takes; remove it or set effect: NoExecute")
        if key and (why := label_key_problem(key)):
            yield f"[tolerations-valid] {field}.key={key!r} is not a qualified name: {why}"


_HANDLERS = ("exec", "httpGet", "tcpSocket", "grpc")


def _probes(spec: DeploymentSpec) -> Iterator[str]:
    for path in ("inference.readiness_probe", "inference.startup_probe",
                 "inference.liveness_probe"):
        probe = getattr(spec.inference, path.split(".")[1])
        if not probe:
            continue
        field = field_name(path)
        handlers = [handler for handler in _HANDLERS if probe.get(handler) is not None]
        if len(handlers) != 1:
            found = ", ".join(handlers) or "none"
            yield (f"[probe-handler] {field} needs exactly one of {', '.join(_HANDLERS)} (it has "
                   f"{found}); keep one, or remove the probe")
        if path != "inference.readiness_probe" and probe.get("successThreshold", 1) != 1:
            yield (f"[probe-handler] {field}.successThreshold={probe['successThreshold']!r} must "
                   "be 1 for a startup or liveness probe; remove it")
        for handler in ("httpGet", "tcpSocket"):
            port = (probe.get(handler) or {}).get("port")
            if port is not None and not _port_or_name(port):
                yield (f"[probe-handler] {field}.{handler}.port={port!r} is neither a port number "
                       "(1 to 65535) nor a port name (at most 15 lowercase letters, digits and "
                       "'-', with a letter); fix it")


def _port_or_name(port: Any) -> bool:
    if isinstance(port, int) and not isinstance(port, bool):
        return 0 < port < 65536
    return isinstance(port, str) and len(port) <= 15 and bool(PORT_NAME.match(port))


def _env(spec: DeploymentSpec) -> Iterator[str]:
    for index, item in enumerate(spec.inference.env):
        field = f"{field_name('inference.env')}[{index}]"
        name = item.get("name") or ""
        if not name or "=" in name or not name.isprintable() or not name.isascii():
            yield (f"[env-valid] {field}.name={name!r} is not a variable name: printable ASCII "
                   "without '='; name the variable")
        if item.get("value") and item.get("valueFrom"):
            yield (f"[env-valid] {field} sets both value and valueFrom; keep one")
        sources = [key for key, source in (item.get("valueFrom") or {}).items() if source]
        if item.get("valueFrom") is not None and len(sources) != 1:
            yield (f"[env-valid] {field}.valueFrom needs exactly one source (it has "
                   f"{', '.join(sources) or 'none'}); keep one")


INFERENCE_OWN_MOUNTS: tuple[str, ...] = (SETTINGS_MOUNT, RUN_DIR, SHM_PATH)
"""Where the operator mounts its own volumes in the inference container, whatever the spec (the
cache and runtime-cache paths are `pod_rules`' `[runtime-cache-apart]` and cache checks)."""


def _mounts(spec: DeploymentSpec) -> Iterator[str]:
    """The API server refuses a container whose mounts share a path; one under dlo's own mounts
    would hide the settings or the entry document the server reads."""
    seen: dict[str, str] = {}
    own = INFERENCE_OWN_MOUNTS
    for index, mount in enumerate(spec.inference.volume_mounts):
        field = f"{field_name('inference.volume_mounts')}[{index}].mountPath"
        path = str(mount.get("mountPath") or "")
        clash = next((mine for mine in own if path.rstrip("/") == mine
                      or path.startswith(mine + "/")), None)
        if not path.startswith("/"):
            yield f"[volume-mounts-paths] {field}={path!r} is not an absolute path; fix it"
        elif clash is not None:
            yield (f"[volume-mounts-paths] {field}={path!r} is where dlo mounts its own volume "
                   f"{clash!r} (dlo's mounts: {', '.join(own)}); choose another path")
        elif path in seen:
            yield (f"[volume-mounts-paths] {field}={path!r} is also {seen[path]}; mount each "
                   "path once")
        seen.setdefault(path, field)


def _volumes(spec: DeploymentSpec) -> Iterator[str]:
    for index, volume in enumerate(spec.volumes):
        field = f"{field_name('volumes')}[{index}]"
        name = str(volume.get("name") or "")
        if not _DNS_LABEL.match(name):
            yield (f"[volumes-valid] {field}.name={name!r} is not a DNS label (at most 63 "
                   "lowercase letters, digits and '-', starting and ending with a letter or "
                   "digit); rename it and its mounts")
        sources = [key for key, source in volume.items() if key != "name" and source is not None]
        if len(sources) != 1:
            yield (f"[volumes-valid] {field} needs exactly one volume source (it has "
                   f"{', '.join(sources) or 'none'}); keep one")


_NODE_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")
_LABEL_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


def _affinity(spec: DeploymentSpec) -> Iterator[str]:
    """Terms the API server refuses: weights outside 1-100, an empty topologyKey, an unknown
    operator or values that do not fit it, a required node affinity with no term."""
    for path, value in _walk(spec.affinity, field_name("affinity")):
        if not isinstance(value, Mapping):
            continue
        if "weight" in value and not 1 <= int(value["weight"]) <= 100:
            yield (f"[affinity-valid] {path}.weight={value['weight']!r} is outside 1 to 100; "
                   "choose a weight in that range")
        if "topologyKey" in value and not value["topologyKey"]:
            yield (f"[affinity-valid] {path}.topologyKey is empty; name a node label such "
                   "as kubernetes.io/hostname")
        if "nodeSelectorTerms" in value and not value["nodeSelectorTerms"]:
            yield (f"[affinity-valid] {path}.nodeSelectorTerms is empty; give at least one term "
                   "or remove the required node affinity")
        if "operator" in value and "key" in value:
            yield from _requirement(path, value, node=".nodeAffinity." in path)


def _requirement(path: str, value: Mapping[str, Any], *, node: bool) -> Iterator[str]:
    allowed = _NODE_OPERATORS if node else _LABEL_OPERATORS
    operator, values = value.get("operator"), value.get("values") or []
    if operator not in allowed:
        yield (f"[affinity-valid] {path}.operator={operator!r} is not one of "
               f"{', '.join(allowed)}; use one of them")
    elif operator in ("In", "NotIn") and not values:
        yield f"[affinity-valid] {path}.values is empty, which operator {operator} needs; add one"
    elif operator in ("Exists", "DoesNotExist") and values:
        yield f"[affinity-valid] {path}.values must be empty with operator {operator}; remove it"
    elif operator in ("Gt", "Lt") and (len(values) != 1 or not str(values[0]).isdigit()):
        yield (f"[affinity-valid] {path}.values must be one integer with operator {operator}; "
               "fix it")


def _walk(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    yield path, value
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from _walk(item, f"{path}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _walk(item, f"{path}[{index}]")
