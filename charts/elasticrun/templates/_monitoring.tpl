{{/* Shared pieces of the monitoring kit (metrics Service, monitors, rule, dashboard). */}}

{{/* Refuse monitoring values that would install something that scrapes nothing. */}}
{{- define "elasticrun.validateMetrics" -}}
{{- $m := .Values.metrics }}
{{- if and $m.serviceMonitor.enabled $m.podMonitor.enabled }}
{{- fail "metrics.serviceMonitor.enabled and metrics.podMonitor.enabled are both true: keep one (serviceMonitor scrapes the metrics Service, podMonitor the operator pods), or Prometheus scrapes every replica twice" }}
{{- end }}
{{- if and (or $m.service.enabled $m.serviceMonitor.enabled $m.podMonitor.enabled) (eq (int .Values.operator.metricsPort) 0) }}
{{- fail "metrics.service, metrics.serviceMonitor and metrics.podMonitor need operator.metricsPort > 0: port 0 turns the operator's /metrics off" }}
{{- end }}
{{- end }}

{{/* The metrics Service's labels (a ServiceMonitor selects it by these). */}}
{{- define "elasticrun.metricsSelectorLabels" -}}
{{ include "elasticrun.selectorLabels" . }}
app.kubernetes.io/component: metrics
{{- end }}

{{/* One scrape endpoint (ServiceMonitor endpoints[] / PodMonitor podMetricsEndpoints[]). */}}
{{- define "elasticrun.scrapeEndpoint" -}}
- port: metrics
  path: /metrics
  scheme: http
  {{- with .interval }}
  interval: {{ . }}
  {{- end }}
  {{- with .scrapeTimeout }}
  scrapeTimeout: {{ . }}
  {{- end }}
  honorLabels: {{ .honorLabels }}
  {{- with .relabelings }}
  relabelings:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .metricRelabelings }}
  metricRelabelings:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/* The annotations of one alert: summary, description, runbook (args: root, name, summary, description). */}}
{{- define "elasticrun.alertAnnotations" -}}
{{- $anchor := printf "runbook-%s" (lower .name) -}}
summary: {{ .summary | quote }}
description: {{ .description | quote }}
runbook: {{ printf "elasticrun chart README, section \"Runbook: %s\" (charts/elasticrun/README.md#%s)" .name $anchor | quote }}
{{- with .root.Values.metrics.prometheusRule.runbookBaseURL }}
runbook_url: {{ printf "%s#%s" . $anchor | quote }}
{{- end }}
{{- end }}
