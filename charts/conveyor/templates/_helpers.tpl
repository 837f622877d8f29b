{{/* The release's full name: the release name, with "conveyor" appended unless it has it. */}}
{{- define "conveyor.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Labels on every object of the release. */}}
{{- define "conveyor.labels" -}}
app.kubernetes.io/name: conveyor
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The operator's pods (selector: never changes between upgrades). */}}
{{- define "conveyor.operatorSelector" -}}
app.kubernetes.io/name: conveyor
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "conveyor.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "conveyor.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "conveyor.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* PodMonitor and PrometheusRule: only where the Prometheus Operator's API is served. */}}
{{- define "conveyor.hasMonitoringAPI" -}}
{{- if .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" -}}true{{- end -}}
{{- end -}}
