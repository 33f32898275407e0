{{/* Chart name, overridable with nameOverride. */}}
{{- define "drs-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name of every object: <release>-operator, or the release name when it already contains
"operator" (`helm install drs` gives drs-operator). Cluster-scoped objects (ClusterRoles and their
bindings) carry it too, so two releases never collide.
*/}}
{{- define "drs-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains "operator" .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "drs-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object. */}}
{{- define "drs-operator.labels" -}}
helm.sh/chart: {{ include "drs-operator.chart" . }}
{{ include "drs-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: operator
{{- end }}

{{/* Labels that select the operator pods (immutable in the Deployment selector). */}}
{{- define "drs-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "drs-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The selector labels as key=value,key=value (the operator's DRS_OPERATOR_POD_LABELS). */}}
{{- define "drs-operator.selectorLabelPairs" -}}
{{- $pairs := list }}
{{- range $key, $value := include "drs-operator.selectorLabels" . | fromYaml }}
{{- $pairs = append $pairs (printf "%s=%s" $key $value) }}
{{- end }}
{{- join "," $pairs }}
{{- end }}

{{- define "drs-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "drs-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "drs-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
