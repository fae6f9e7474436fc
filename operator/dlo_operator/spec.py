"""The DOD spec (camelCase, as the user writes it) parsed into typed, validated configuration.

`parse_spec` is the one place the operator reads a CR spec. The CR path, default and bounds of
every field are declared once in the contract (`dlo_contract.deployment`, `dlo_contract.settings`);
this module walks those declarations: it fills the same defaults as the CRD (the API server
applies those, but `dlo render` and a cluster without the CRD's defaulting do not), builds the
`DeploymentSpec` and runs `dlo_contract.validation.validate` on its settings, so the operator
rejects exactly what the runtime would. Every message names the field as the user wrote it
(`spec.offload.useAllgather`). Called by the handlers and by `dlo render`; no cluster access.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from dlo_contract.deployment import (
    DEFAULT_LOADER_IMAGE,
    DEFAULT_LOADER_RESOURCES,
    CredentialsConfig,
    DeploymentSpec,
    InferenceConfig,
    LoaderPodConfig,
)
from dlo_contract.schema import Leaf, describe, leaves
from dlo_contract.settings import Settings, SettingsError
from dlo_contract.validation import cr_names, validate
from dlo_operator.errors import SpecError
from dlo_operator.node_cache import DEFAULT_RUNTIME_CACHE_PATH

__all__ = [
    "DEFAULT_LOADER_IMAGE", "DEFAULT_LOADER_RESOURCES", "CR_LEAVES",
    "CredentialsConfig", "DeploymentSpec", "InferenceConfig", "LoaderPodConfig", "field_name",
    "parse_spec",
    "runtime_cache_on", "settings_from_spec",
]

CR_LEAVES: tuple[Leaf, ...] = tuple(leaf for leaf in leaves(DeploymentSpec) if leaf.meta.crd)
"""Every field of the CR spec, with its path in `DeploymentSpec` and under `spec`."""
_CR_PATH = {leaf.path: leaf.meta.crd for leaf in CR_LEAVES}


def field_name(path: str) -> str:
    """`DeploymentSpec` path -> the CR path the user wrote (`inference.volume_mounts` ->
    `spec.inference.volumeMounts`): the operator's namer of the CR-only fields, as
    `dlo_contract.validation.cr_names` is of the settings."""
    return f"spec.{_CR_PATH[path]}" if path in _CR_PATH else f"spec.{path}"


def parse_spec(spec: Mapping[str, Any] | None, *,
               default_loader_image: str = DEFAULT_LOADER_IMAGE) -> DeploymentSpec:
    """Turn a CR spec into a `DeploymentSpec`; raise `SpecError` naming CR paths. An empty
    `loader.image` takes `default_loader_image` (the operator's `--loader-image`)."""
    spec = spec or {}
    if not _get(spec, "model.source", ""):
        source = cr_names("loader.source")
        raise SpecError(
            f"{source} is required: the URI of the checkpoint prefix (s3://, file:///, gs://, "
            "az://, https:// or hf://)",
            hint=f"set {source}, e.g. s3://models/flux-dev/",
        )
    if not _get(spec, "inference.image", ""):
        raise SpecError(
            "spec.inference.image is required: the image of the inference server",
            hint="set spec.inference.image",
        )
    deployment = _build(spec, DeploymentSpec, "")
    problems = [f"{field_name(leaf.path)}={_value(deployment, leaf.path)!r} {problem}"
                for leaf in CR_LEAVES if not leaf.path.startswith("settings.")
                and (problem := leaf.meta.bounds.problem(_value(deployment, leaf.path)))]
    if problems:
        raise SpecError("; ".join(problems))
    try:
        settings = validate(deployment.settings, names=cr_names)
    except SettingsError as exc:
        raise SpecError(str(exc), hint=exc.hint) from exc
    update: dict[str, Any] = {"settings": _runtime_cache_path(settings)}
    if not deployment.loader.image:
        update["loader"] = deployment.loader.model_copy(update={"image": default_loader_image})
    return deployment.model_copy(update=update)


def runtime_cache_on(settings: Settings) -> bool:
    """Whether the inference container publishes runtime-cache entries."""
    return settings.offload.enabled and settings.offload.enable_runtime_cache


def _runtime_cache_path(settings: Settings) -> Settings:
    """An empty `offload.runtimeCacheRoot` with the runtime cache on means
    `DEFAULT_RUNTIME_CACHE_PATH` in the containers (not the entries' `cache.hostPath`: the
    entries are read-only there), written into the settings document the runtime reads."""
    if not runtime_cache_on(settings) or settings.offload.runtime_cache_root:
        return settings
    offload = settings.offload.model_copy(
        update={"runtime_cache_root": DEFAULT_RUNTIME_CACHE_PATH})
    return settings.model_copy(update={"offload": offload})


def settings_from_spec(spec: Mapping[str, Any]) -> Settings:
    """The settings document of a CR spec, before validation (used by the CEL agreement tests)."""
    return _build(spec, Settings, "settings.")


def _build(spec: Mapping[str, Any], model: type[Any], prefix: str) -> Any:
    """Read each declared field of `model` (whose paths start with `prefix`) from its CR path."""
    data: dict[str, Any] = {}
    for leaf in CR_LEAVES:
        if not leaf.path.startswith(prefix):
            continue
        value = _get(spec, leaf.meta.crd or "", None)
        if value is None or (leaf.meta.empty_is_none and value == ""):
            continue
        *sections, name = leaf.path[len(prefix):].split(".")
        target = data
        for section in sections:
            target = target.setdefault(section, {})
        target[name] = value
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        message = describe(exc, model, "spec", name=lambda path: field_name(prefix + path))
        raise SpecError(message) from None


def _value(model: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        model = getattr(model, part)
    return model


def _get(spec: Mapping[str, Any], dotted: str, default: Any) -> Any:
    value: Any = spec
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or value.get(part) is None:
            return default
        value = value[part]
    return value
