{{/*
Chart name, truncated to 63 characters (DNS label limit).
*/}}
{{- define "kvfence.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name: the release name if it already contains the chart name, else
<release>-<chart>. Truncated so that suffixes such as "-operator-tenant-secrets" still fit.
*/}}
{{- define "kvfence.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Chart name and version, for the helm.sh/chart label.
*/}}
{{- define "kvfence.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Common labels (the recommended app.kubernetes.io/* set).
*/}}
{{- define "kvfence.labels" -}}
helm.sh/chart: {{ include "kvfence.chart" . }}
app.kubernetes.io/name: {{ include "kvfence.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvfence
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Selector labels of one component: include with (dict "ctx" $ "component" "router").
*/}}
{{- define "kvfence.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvfence.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
Common labels plus the component: include with (dict "ctx" $ "component" "router").
*/}}
{{- define "kvfence.componentLabels" -}}
{{ include "kvfence.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Names of the two components. */}}
{{- define "kvfence.operator.fullname" -}}
{{- printf "%s-operator" (include "kvfence.fullname" .) }}
{{- end }}
{{- define "kvfence.router.fullname" -}}
{{- printf "%s-router" (include "kvfence.fullname" .) }}
{{- end }}

{{/* The ClusterRole a namespace binds to let the operator read its tenants' API-key Secrets. */}}
{{- define "kvfence.operator.tenantSecretsRole" -}}
{{- printf "%s-operator-tenant-secrets" (include "kvfence.fullname" .) }}
{{- end }}

{{/* The leader-election Lease (and the Role that may touch only it). */}}
{{- define "kvfence.operator.leaseName" -}}
{{- include "kvfence.operator.fullname" . }}
{{- end }}

{{/* ServiceAccount names. */}}
{{- define "kvfence.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (include "kvfence.operator.fullname" .) .Values.operator.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}
{{- define "kvfence.router.serviceAccountName" -}}
{{- if .Values.router.serviceAccount.create }}
{{- default (include "kvfence.router.fullname" .) .Values.router.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.router.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The control-plane image reference: repository@digest, or repository:tag (tag defaults to appVersion). */}}
{{- define "kvfence.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* How many router replicas share each tenant's quota. */}}
{{- define "kvfence.router.quotaDivisor" -}}
{{- if gt (int .Values.router.quotaDivisor) 0 }}
{{- .Values.router.quotaDivisor }}
{{- else if .Values.router.autoscaling.enabled }}
{{- .Values.router.autoscaling.minReplicas }}
{{- else }}
{{- .Values.router.replicaCount }}
{{- end }}
{{- end }}

{{/* The routing table the operator renders (Secret kvfence-routing, key routing.json; kvfence.api.routing). */}}
{{- define "kvfence.routing.secretName" -}}kvfence-routing{{- end }}
{{- define "kvfence.routing.secretKey" -}}routing.json{{- end }}
{{- define "kvfence.routing.mountPath" -}}/etc/kvfence/routing{{- end }}

{{/* Restricted-profile security contexts shared by both components. */}}
{{- define "kvfence.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
fsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end }}
{{- define "kvfence.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop:
    - ALL
seccompProfile:
  type: RuntimeDefault
{{- end }}
