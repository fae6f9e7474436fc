"""The only module that calls the Kubernetes API client.

Children are written with server-side apply (field manager `dlo-operator`, forced): one idempotent
request per child that creates it or converges it to the desired manifest, removing fields an older
manifest set. Restarting the operator therefore cannot create duplicates. The DOD's status is
patched through its status subresource. Responses stay plain dicts (no client models).
API failures become `KubeTransientError` (conflicts, throttling, 5xx, timeouts and broken
connections: retried with `backoff_delay`) or `KubeError` (anything else: reported, not retried).
Called by `reconcile` and `handlers`; builds no manifest and decides no status.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

import kubernetes.client
import kubernetes.config
import urllib3.exceptions
from kubernetes.client.exceptions import ApiException

from dlo_operator import metrics
from dlo_operator.errors import KubeError, KubeTransientError
from dlo_operator.naming import FIELD_MANAGER, GROUP, PLURAL, VERSION, labels_of

logger = logging.getLogger(__name__)

_APPLY = "application/apply-patch+yaml"
_MERGE = "application/merge-patch+json"
_RETRY_STATUSES = frozenset({409, 429, 500, 502, 503, 504})
REQUEST_TIMEOUT_S = 30.0
"""Per request: a hung API server is a timeout (retried), not a handler stuck for ever."""
BACKOFF_BASE_S = 1.0
BACKOFF_MAX_S = 300.0


def backoff_delay(attempt: int, hinted_s: float = 0.0) -> float:
    """Seconds before retry `attempt` + 1 (0-based): doubling from 1 s up to 5 minutes, never
    sooner than the server asked (Retry-After)."""
    return max(hinted_s, min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2.0 ** max(0, attempt)))


class KubeClient:
    """A thin wrapper over one `kubernetes.client.ApiClient`; safe to share between threads."""

    def __init__(self, api_client: kubernetes.client.ApiClient) -> None:
        self._api = api_client
        self._core = kubernetes.client.CoreV1Api(api_client)
        self._apps = kubernetes.client.AppsV1Api(api_client)
        self._policy = kubernetes.client.PolicyV1Api(api_client)
        self._batch = kubernetes.client.BatchV1Api(api_client)
        self._networking = kubernetes.client.NetworkingV1Api(api_client)
        self._custom = kubernetes.client.CustomObjectsApi(api_client)

    @classmethod
    def from_environment(cls) -> KubeClient:
        """In-cluster service account when running in a pod, else the kubeconfig."""
        try:
            kubernetes.config.load_incluster_config()
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config()
        return cls(kubernetes.client.ApiClient())

    def close(self) -> None:
        self._api.close()

    def _verbs(self, kind: str) -> dict[str, Callable[..., Any]]:
        api, suffix = {
            "ConfigMap": (self._core, "config_map"), "Service": (self._core, "service"),
            "Pod": (self._core, "pod"), "StatefulSet": (self._apps, "stateful_set"),
            "Job": (self._batch, "job"),
            "PodDisruptionBudget": (self._policy, "pod_disruption_budget"),
            "NetworkPolicy": (self._networking, "network_policy"),
            "Secret": (self._core, "secret"),
        }[kind]
        return {verb: getattr(api, f"{verb}_namespaced_{suffix}")
                for verb in ("patch", "read", "list", "delete", "create")}

    def apply(self, manifest: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply one child (ConfigMap, Service, StatefulSet, Job,
        PodDisruptionBudget or NetworkPolicy)."""
        kind = manifest["kind"]
        meta = manifest["metadata"]
        what = f"{kind} {meta['namespace']}/{meta['name']}"
        return self._call(what, self._verbs(kind)["patch"], meta["name"], meta["namespace"],
                          dict(manifest), field_manager=FIELD_MANAGER, force=True,
                          _content_type=_APPLY)

    def create(self, manifest: Mapping[str, Any]) -> None:
        """Create one child that must not be applied again (the fill Secret: its data is
        written once). Its data never reaches a log or an error: those name the object only."""
        kind, meta = manifest["kind"], manifest["metadata"]
        self._call(f"{kind} {meta['namespace']}/{meta['name']}", self._verbs(kind)["create"],
                   meta["namespace"], dict(manifest), field_manager=FIELD_MANAGER)

    def merge_patch(self, kind: str, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        """Merge `patch` into one child, leaving the fields it does not name as they are (the
        fill Secret's data, once written). Like `create`, never logs what it writes."""
        self._call(f"{kind} {namespace}/{name}", self._verbs(kind)["patch"], name, namespace,
                   dict(patch), field_manager=FIELD_MANAGER, _content_type=_MERGE)

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """One object, or None when it does not exist."""
        try:
            return self._call(f"{kind} {namespace}/{name}", self._verbs(kind)["read"], name,
                              namespace)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, kind: str, namespace: str, labels: Mapping[str, str]) -> list[dict[str, Any]]:
        """Objects of `kind` carrying all `labels` (the server filters; we check again, which
        costs nothing and keeps a server without selector support honest)."""
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        found = self._call(f"{kind}s in {namespace}", self._verbs(kind)["list"], namespace,
                           label_selector=selector) or {}
        return [item for item in found.get("items") or ()
                if all(labels_of(item).get(k) == v for k, v in labels.items())]

    def events_about(self, kind: str, namespace: str, name: str) -> list[dict[str, Any]]:
        """The Events about one object (e.g. its controller's `FailedCreate`); the server
        filters by field, and we check again."""
        selector = f"involvedObject.kind={kind},involvedObject.name={name}"
        found = self._call(f"Events of {kind} {namespace}/{name}",
                           self._core.list_namespaced_event, namespace,
                           field_selector=selector) or {}
        return [item for item in found.get("items") or ()
                if ((item.get("involvedObject") or {}).get("kind"),
                    (item.get("involvedObject") or {}).get("name")) == (kind, name)]

    def delete(self, kind: str, namespace: str, name: str) -> None:
        """Delete one child and (background propagation) what it owns; gone already is fine."""
        try:
            self._call(f"{kind} {namespace}/{name}", self._verbs(kind)["delete"], name,
                       namespace, propagation_policy="Background")
        except KubeError as exc:
            if exc.status != 404:
                raise

    def get_deployment(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The DOD, or None when it is gone."""
        try:
            return self._call(f"{PLURAL} {namespace}/{name}",
                              self._custom.get_namespaced_custom_object,
                              GROUP, VERSION, namespace, PLURAL, name)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def annotate_pod(self, namespace: str, name: str, annotations: Mapping[str, str]) -> None:
        """Merge `annotations` into one pod's metadata."""
        self._call(f"Pod {namespace}/{name}", self._core.patch_namespaced_pod, name, namespace,
                   {"metadata": {"annotations": dict(annotations)}}, _content_type=_MERGE)

    def patch_deployment_status(self, namespace: str, name: str, status: Mapping[str, Any]) -> None:
        self._call(f"{PLURAL} {namespace}/{name} status",
                   self._custom.patch_namespaced_custom_object_status,
                   GROUP, VERSION, namespace, PLURAL, name, {"status": dict(status)},
                   _content_type=_MERGE)

    def get_claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        """One PersistentVolumeClaim, or None when it does not exist."""
        return self._absent_is_none(f"PersistentVolumeClaim {namespace}/{name}",
                                    self._core.read_namespaced_persistent_volume_claim,
                                    name, namespace)

    def get_node(self, name: str) -> dict[str, Any] | None:
        """One Node, or None when it does not exist."""
        return self._absent_is_none(f"Node {name}", self._core.read_node, name)

    def create_volume(self, manifest: Mapping[str, Any]) -> None:
        """Create one PersistentVolume; one of that name existing already is fine (its name
        holds the claim's uid, so it serves the same claim)."""
        name = manifest["metadata"]["name"]
        try:
            self._call(f"PersistentVolume {name}", self._core.create_persistent_volume,
                       dict(manifest))
        except KubeTransientError:
            if self.get_volume(name) is None:
                raise

    def get_volume(self, name: str) -> dict[str, Any] | None:
        return self._absent_is_none(f"PersistentVolume {name}",
                                    self._core.read_persistent_volume, name)

    def delete_volume(self, name: str) -> None:
        """Delete one PersistentVolume (the object: the hostPath's bytes stay); gone is fine."""
        try:
            self._call(f"PersistentVolume {name}", self._core.delete_persistent_volume, name)
        except KubeError as exc:
            if exc.status != 404:
                raise

    def _absent_is_none(self, what: str, method: Callable[..., Any],
                        *args: Any) -> dict[str, Any] | None:
        try:
            return self._call(what, method, *args)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    def _call(self, what: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            response = method(*args, _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S,
                              **kwargs)
        except ApiException as exc:
            raise _api_error(what, exc) from exc
        except urllib3.exceptions.HTTPError as exc:
            message = f"Kubernetes API did not answer for {what}: {type(exc).__name__}"
            logger.warning("%s; retrying", message)
            raise KubeTransientError(message, delay_s=0.0) from exc
        return json.loads(response.data or b"null")


def _api_error(what: str, exc: ApiException) -> KubeError | KubeTransientError:
    metrics.record_api_error(exc.status)  # metrics: API errors by kind
    reason = _status_message(exc)
    message = f"Kubernetes API answered {exc.status} for {what}: {reason}"
    if exc.status in _RETRY_STATUSES or exc.status is None:
        delay = _retry_after(exc)
        logger.warning("%s; retrying", message)
        return KubeTransientError(message, delay_s=delay)
    return KubeError(message, status=exc.status, hint=_HINTS.get(
        exc.status, "check the operator's RBAC and the CRD installation"))


_HINTS = {
    400: "the API server refused a manifest the operator built from the spec; change the field "
         "the message names",
    422: "the API server refused a manifest the operator built from the spec; change the field "
         "the message names",
    404: "the namespace or the resource kind does not exist; check the namespace and the CRD "
         "installation",
}


def _status_message(exc: ApiException) -> str:
    """The `message` of the API's Status object (never the request body, which may hold
    secrets), else the HTTP reason."""
    try:
        body = json.loads(exc.body or "{}")
    except (TypeError, ValueError):
        body = {}
    text = body.get("message") if isinstance(body, dict) else None
    return str(text or exc.reason or "no reason given").splitlines()[0][:300]


def _retry_after(exc: ApiException) -> float:
    """The server's Retry-After in seconds, 0 when it gave none."""
    try:
        return max(0.0, float((exc.headers or {}).get("Retry-After", 0)))
    except (TypeError, ValueError):
        return 0.0
