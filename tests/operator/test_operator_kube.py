"""API failures become the operator's errors: retry the passing ones, report the rest once."""

from __future__ import annotations

import json

import pytest
from kubernetes.client.exceptions import ApiException

from dlo_operator.errors import KubeError, KubeTransientError
from dlo_operator.kube import KubeClient, _api_error, backoff_delay


def _exception(status: int, message: str, headers: dict[str, str] | None = None) -> ApiException:
    exc = ApiException(status=status, reason="Reason")
    exc.body = json.dumps({"kind": "Status", "message": message})
    exc.headers = headers or {}
    return exc


@pytest.mark.parametrize("status", [409, 429, 500, 503])
def test_conflicts_throttling_and_server_errors_are_retried(status: int) -> None:
    error = _api_error("StatefulSet ml/flux", _exception(status, "try again", {"Retry-After": "7"}))
    assert isinstance(error, KubeTransientError)
    assert (str(error), error.delay_s) == (
        f"Kubernetes API answered {status} for StatefulSet ml/flux: try again", 7.0)


def test_refusals_are_permanent_and_name_the_object() -> None:
    error = _api_error("ConfigMap ml/flux-settings", _exception(
        403,
        'configmaps "flux-settings" is forbidden: User "system:serviceaccount:x" cannot patch'))
    assert isinstance(error, KubeError) and error.status == 403
    assert str(error) == (
        'Kubernetes API answered 403 for ConfigMap ml/flux-settings: configmaps "flux-settings" '
        'is forbidden: User "system:serviceaccount:x" cannot patch')
    assert error.hint == "check the operator's RBAC and the CRD installation"


def test_a_body_that_is_not_a_status_falls_back_to_the_reason() -> None:
    exc = ApiException(status=400, reason="Bad Request")
    exc.body = "<html>proxy error</html>"
    assert str(_api_error("Service ml/p", exc)) == (
        "Kubernetes API answered 400 for Service ml/p: Bad Request")


def test_backoff_doubles_up_to_five_minutes_and_honours_retry_after() -> None:
    assert [backoff_delay(attempt) for attempt in range(10)] == [
        1, 2, 4, 8, 16, 32, 64, 128, 256, 300]
    assert backoff_delay(0, hinted_s=7.0) == 7.0


def test_a_timeout_or_a_broken_connection_is_retried() -> None:
    import urllib3.exceptions

    def hangs(*_: object, **kwargs: object) -> None:
        assert kwargs["_request_timeout"] == 30.0
        raise urllib3.exceptions.ReadTimeoutError(None, "/api", "read timed out")

    client = KubeClient.__new__(KubeClient)
    with pytest.raises(KubeTransientError, match="^Kubernetes API did not answer for "
                                                 "Service ml/p: ReadTimeoutError$"):
        client._call("Service ml/p", hangs)
