{{/* Chart name. */}}
{{- define "kvbridge.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: release-chart, unless the release name already contains the chart name. */}}
{{- define "kvbridge.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/* Standard labels. */}}
{{- define "kvbridge.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "kvbridge.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvbridge
{{- end }}

{{/* Selector labels (immutable: never add to these). */}}
{{- define "kvbridge.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvbridge.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "kvbridge.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvbridge.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvbridge.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The namespaces watched with scope Namespace, as a JSON array: watch.namespaces, or the release's. */}}
{{- define "kvbridge.watchedNamespaces" -}}
{{- if .Values.watch.namespaces }}
{{- toJson .Values.watch.namespaces }}
{{- else }}
{{- toJson (list .Release.Namespace) }}
{{- end }}
{{- end }}

{{/* Values that are valid one by one but not together: refuse them with a reason (values.schema.json cannot say
why). */}}
{{- define "kvbridge.checkValues" -}}
{{- if and .Values.metrics.serviceMonitor.enabled (not .Values.metrics.enabled) }}
{{- fail "metrics.serviceMonitor.enabled=true needs metrics.enabled=true: the ServiceMonitor scrapes the metrics Service, which metrics.enabled=false removes (set metrics.enabled=true, or serviceMonitor.enabled=false)" }}
{{- end }}
{{- if and .Values.watch.namespaces (eq .Values.watch.scope "Cluster") }}
{{- fail "watch.namespaces is set but watch.scope is Cluster (every namespace): set watch.scope=Namespace to watch only the listed namespaces, or remove watch.namespaces" }}
{{- end }}
{{- end }}

{{/* The synthetic engine's image: agent.image (its former name, deprecated) where set, else synthetic.image, else
the agent image of the chart's version. */}}
{{- define "kvbridge.syntheticImage" -}}
{{- .Values.agent.image | default .Values.synthetic.image | default (printf "ghcr.io/kvbridge/kvbridge-agent:%s" .Chart.AppVersion) }}
{{- end }}

{{/*
The operator's permissions: exactly what kvbridge_operator.rbac.REQUIRED lists
(a test renders the chart and compares).
*/}}
{{- define "kvbridge.rules" -}}
- apiGroups: ["kvbridge.io"]
  resources: ["disaggregateddeployments"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["kvbridge.io"]
  resources: ["disaggregateddeployments/status"]
  verbs: ["patch"]
- apiGroups: ["kvbridge.io"]
  resources: ["disaggregatedroles"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["kvbridge.io"]
  resources: ["disaggregatedroles/status"]
  verbs: ["patch"]
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["create", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["create", "patch"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["create", "patch", "delete"]
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["create", "patch", "delete"]
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles"]
  verbs: ["create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["rolebindings"]
  verbs: ["create", "patch", "delete"]
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["create", "patch", "delete"]
- apiGroups: ["gateway.networking.k8s.io"]
  resources: ["httproutes"]
  verbs: ["create", "patch", "delete"]
- apiGroups: ["scheduling.x-k8s.io"]
  resources: ["podgroups"]
  verbs: ["create", "patch", "delete"]
{{- end }}
