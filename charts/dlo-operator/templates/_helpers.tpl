{{/* Name of the chart's objects: the release name, or <release>-dlo-operator. */}}
{{- define "dlo-operator.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "dlo-operator.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "dlo-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "dlo-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "dlo-operator.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The API rules the operator needs, nothing more (tests/operator/test_operator_rbac.py derives
them from the requests the operator makes): watch and patch its CR (kopf's finalizer and
annotations) and the CR's status; read one CR when a pod or child changes; list and watch its
pods and children (drift correction); read a child before applying it; annotate a workload pod with its sidecar loader's fill summary; server-side apply (patch)
its children; delete superseded settings ConfigMaps and prefill Jobs, and the inference Service
and PodDisruptionBudget once the spec turns them off; post events, and list those of a
StatefulSet or prefill Job short of pods (their controller's FailedCreate: a pod the API server
refused); read, list and watch the
node-cache claims it serves (templates/node-cache-clusterrole.yaml holds its cluster-scoped
rules); read, create and patch each DOD's fill Secret (created once with random bytes; a patch
moves its owner reference to a DOD that replaced one of its name), never list or watch a Secret;
read, apply and delete (once networkPolicy.enabled turns off) each DOD's NetworkPolicy. `update`
on the finalizers
subresource lets the children's owner references block the DOD's deletion where the API server
enforces OwnerReferencesPermissionEnforcement. */}}
{{- define "dlo-operator.rules" -}}
- apiGroups: ["dlo.dev"]
  resources: ["diffusionoffloaddeployments"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["dlo.dev"]
  resources: ["diffusionoffloaddeployments/status"]
  verbs: ["patch"]
- apiGroups: ["dlo.dev"]
  resources: ["diffusionoffloaddeployments/finalizers"]
  verbs: ["update"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch", "patch"]
- apiGroups: [""]
  resources: ["configmaps", "services"]
  verbs: ["get", "list", "watch", "patch", "delete"]
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "patch", "delete"]
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "patch", "delete"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "list"]
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "patch", "delete"]
{{- end -}}
