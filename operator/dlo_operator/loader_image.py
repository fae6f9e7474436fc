"""Which loader image a DOD's pods run when the operator's default changes.

A DOD that leaves `spec.loader.image` empty runs the operator's default (`--loader-image`, the
chart's `loaderImage`). A `helm upgrade` that changes the default must not restart every serving
pod by itself: under `LoaderImageUpdate.ON_SPEC_CHANGE` (the chart's default) the pods keep the
loader image their StatefulSet's template holds (the API server remembers it, across operator
restarts) as long as the rest of the template is unchanged; the next change of the template (a
new revision, any pod field of the spec) restarts the pods anyway and takes the new default
along. `ROLLING` (the chart value `loaderImageUpdate`, or the DOD's annotation
`dlo.dev/loader-image-update`) rolls the pods onto it at once. Pods that restart into another
loader image get a Normal Event `LoaderImageChanged` saying why (`restart_report`). Pure; called
by `admission` (the annotation's value) and `reconcile`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dlo_operator.conditions import EventType, Report
from dlo_operator.installation import InstallationConfig, LoaderImageUpdate
from dlo_operator.manifests import drifted
from dlo_operator.naming import ANNOTATION_LOADER_IMAGE_UPDATE, LOADER_CONTAINER, Owner
from dlo_operator.spec import DeploymentSpec
from dlo_operator.statefulset import build_statefulset

LOADER_IMAGE_CHANGED = "LoaderImageChanged"


@dataclass(frozen=True, kw_only=True)
class LoaderImageChoice:
    spec: DeploymentSpec
    """The spec with the loader image the pods should run."""
    kept: str | None
    """The image the StatefulSet holds, kept instead of the operator's newer default."""
    why: str
    """Why pods that restart now run `spec.loader.image`, for the Event."""


def annotation_problems(document: Mapping[str, Any]) -> list[str]:
    """The DOD's `dlo.dev/loader-image-update` annotation, when it is not a policy."""
    value = _annotation(document)
    if value is None or value in _POLICIES:
        return []
    return [f"metadata.annotations[{ANNOTATION_LOADER_IMAGE_UPDATE}]={value!r} is not one of "
            f"{', '.join(_POLICIES)}; remove it to follow the chart value loaderImageUpdate"]


def choose(owner: Owner, spec: DeploymentSpec, document: Mapping[str, Any],
           statefulset: Mapping[str, Any] | None,
           installation: InstallationConfig) -> LoaderImageChoice:
    """The loader image of the pods of `spec` (admitted, its image the default when the DOD
    names none), given the live `statefulset`."""
    named = (((document.get("spec") or {}).get("loader") or {}).get("image") or "")
    if named:
        return LoaderImageChoice(spec=spec, kept=None, why=f"spec.loader.image is {named}")
    value = _annotation(document)
    if value in _POLICIES:
        policy, source = LoaderImageUpdate(value), f"annotation {ANNOTATION_LOADER_IMAGE_UPDATE}"
    else:
        policy, source = installation.loader_image_update, "chart value loaderImageUpdate"
    if policy is LoaderImageUpdate.ROLLING:
        return LoaderImageChoice(spec=spec, kept=None, why=(
            f"the operator's default loader image is {spec.loader.image} and {source} is "
            f"{policy.value}"))
    live = live_image(statefulset)
    kept = spec.model_copy(update={"loader": spec.loader.model_copy(update={"image": live})})
    if statefulset and live and live != spec.loader.image and not drifted(
            build_statefulset(owner, kept)["spec"]["template"],
            (statefulset.get("spec") or {}).get("template")):
        return LoaderImageChoice(spec=kept, kept=live, why="")
    return LoaderImageChoice(spec=spec, kept=None, why=(
        f"the pod template changed with the spec and takes the operator's default loader image "
        f"{spec.loader.image} along ({source} is {policy.value})"))


def kept_clause(choice: LoaderImageChoice, default: str) -> str:
    """What the stage message says of a kept image ("" when none is kept)."""
    if choice.kept is None:
        return ""
    return (f"; loader image {choice.kept} kept, the operator's default is now {default}: the "
            "pods take it when their template changes (loaderImageUpdate OnSpecChange; the "
            f"annotation {ANNOTATION_LOADER_IMAGE_UPDATE}: Rolling takes it now)")


def restart_report(choice: LoaderImageChoice, applied: Sequence[Mapping[str, Any]],
                   statefulset: Mapping[str, Any] | None) -> Report | None:
    """A Normal Event when the StatefulSet applied now changes the pods' loader image."""
    live = live_image(statefulset)
    new = next((live_image(m) for m in applied if m.get("kind") == "StatefulSet"), None)
    if live is None or new is None or new == live:
        return None
    return Report(type=EventType.NORMAL, reason=LOADER_IMAGE_CHANGED, message=(
        f"the pods restart with loader image {new} (was {live}): {choice.why}"))


def live_image(statefulset: Mapping[str, Any] | None) -> str | None:
    """The loader image of a StatefulSet's (or pod's) template, None without one."""
    spec = ((statefulset or {}).get("spec") or {})
    pod = (spec.get("template") or {}).get("spec") or spec
    return next((c.get("image") for c in pod.get("initContainers") or ()
                 if c.get("name") == LOADER_CONTAINER), None)


_POLICIES = tuple(policy.value for policy in LoaderImageUpdate)


def _annotation(document: Mapping[str, Any]) -> str | None:
    return ((document.get("metadata") or {}).get("annotations") or {}).get(
        ANNOTATION_LOADER_IMAGE_UPDATE)
