{{/* Names, labels and small computed values shared by the templates. */}}

{{- define "elasticrun.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "elasticrun.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "elasticrun.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "elasticrun.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "elasticrun.selectorLabels" -}}
app.kubernetes.io/name: {{ include "elasticrun.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "elasticrun.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "elasticrun.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Annotation values are strings; quoting keeps `x: y` or `on: true` from becoming booleans. */}}
{{- define "elasticrun.annotations" -}}
{{- $out := dict }}
{{- range $key, $value := . }}
{{- $_ := set $out $key (toString $value) }}
{{- end }}
{{- toYaml $out }}
{{- end }}

{{- define "elasticrun.operatorServiceAccount" -}}
{{- default (include "elasticrun.fullname" .) .Values.operator.serviceAccount.name }}
{{- end }}

{{- define "elasticrun.webhookService" -}}
{{- printf "%s-webhook" (include "elasticrun.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Cluster-scoped names carry the release namespace: two releases never collide. */}}
{{- define "elasticrun.clusterName" -}}
{{- printf "%s-%s" (include "elasticrun.fullname" .) .Release.Namespace | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "elasticrun.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{- define "elasticrun.certSecret" -}}
{{- printf "%s-webhook-tls" (include "elasticrun.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "elasticrun.webhookDNSNames" -}}
{{- if .Values.webhook.url }}
- {{ (urlParse .Values.webhook.url).hostname }}
{{- else }}
{{- $svc := include "elasticrun.webhookService" . -}}
- {{ $svc }}.{{ .Release.Namespace }}.svc
- {{ $svc }}.{{ .Release.Namespace }}.svc.cluster.local
{{- end }}
{{- end }}

{{/* Refuse values that would install something broken, with a message that says what to set. */}}
{{- define "elasticrun.validate" -}}
{{- if not (has .Values.operator.scope (list "cluster" "namespaces")) }}
{{- fail (printf "operator.scope must be \"cluster\" or \"namespaces\", not %q" .Values.operator.scope) }}
{{- end }}
{{- if and (eq .Values.operator.scope "namespaces") (not .Values.trainingNamespaces) }}
{{- fail "operator.scope=namespaces needs trainingNamespaces: list the namespaces the operator should watch" }}
{{- end }}
{{- if not (has .Values.webhook.failurePolicy (list "Fail" "Ignore")) }}
{{- fail (printf "webhook.failurePolicy must be Fail or Ignore, not %q" .Values.webhook.failurePolicy) }}
{{- end }}
{{- if and .Values.training.perRunRBAC (eq .Values.operator.scope "cluster") }}
{{- fail "training.perRunRBAC=true needs operator.scope=namespaces (and trainingNamespaces): with scope=cluster the operator could create Roles, RoleBindings and Leases in every namespace of the cluster" }}
{{- end }}
{{- if and .Values.training.perRunRBAC (not .Values.admissionPolicy.enabled) }}
{{- fail "training.perRunRBAC=true needs admissionPolicy.enabled=true: without the policy any pod that may create Leases can join another run" }}
{{- end }}
{{- if and .Values.networkPolicy.perRun (not .Values.networkPolicy.enabled) }}
{{- fail "networkPolicy.perRun=true needs networkPolicy.enabled=true: the namespace's policy is what closes the store port to the other runs' pods" }}
{{- end }}
{{- if and .Values.networkPolicy.perRun (eq (int .Values.networkPolicy.storePort) 0) (not .Values.networkPolicy.isolate) }}
{{- fail "networkPolicy.perRun=true with storePort 0 (not pinned) needs networkPolicy.isolate=true: a store on any port cannot be told from the ports left open; or pin the port (storePort, and torchrun --rdzv-conf store_port=<it>)" }}
{{- end }}
{{- if and (gt (int .Values.operator.replicas) 1) (not .Values.operator.leaderElection.enabled) }}
{{- fail "operator.replicas > 1 needs operator.leaderElection.enabled=true: without the leader Lease every replica would reconcile" }}
{{- end }}
{{- if and .Values.operator.leaderElection.enabled (not (and (lt (float64 .Values.operator.leaderElection.renewDeadline) (float64 .Values.operator.leaderElection.leaseDuration)) (lt (mulf 1.2 (float64 .Values.operator.leaderElection.retryPeriod)) (float64 .Values.operator.leaderElection.renewDeadline)))) }}
{{- fail "operator.leaderElection needs retryPeriod x 1.2 < renewDeadline < leaseDuration: a leader must stop reconciling before another replica may start" }}
{{- end }}
{{- range .Values.trainingNamespaces }}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" .) }}
{{- fail (printf "trainingNamespaces: %q is not a namespace name" .) }}
{{- end }}
{{- end }}
{{- end }}

{{/* NetworkPolicy ports: every port but TCP port P (the TCPStore). */}}
{{- define "elasticrun.portsExcept" -}}
{{- $p := int . }}
{{- if gt $p 1 }}
- protocol: TCP
  port: 1
  endPort: {{ sub $p 1 }}
{{- end }}
{{- if lt $p 65535 }}
- protocol: TCP
  port: {{ add $p 1 }}
  endPort: 65535
{{- end }}
- protocol: UDP
- protocol: SCTP
{{- end }}

{{/* The leader election Lease and the webhook CA Secret, in the release namespace. */}}
{{- define "elasticrun.leaderLease" -}}
{{ include "elasticrun.fullname" . }}-operator-leader
{{- end }}
{{- define "elasticrun.webhookCASecret" -}}
{{ include "elasticrun.fullname" . }}-webhook-ca
{{- end }}
{{- /*
A port of the operator pod as its probes and Services name it: (list $ NAME
NUMBER). By name when the pod declares its ports; by number with hostNetwork,
where it declares none: the scheduler takes a hostNetwork pod's declared ports
for host ports and would never place a second replica on the node, while the
replicas there share the ports with SO_REUSEPORT (--reuse-port).
*/}}
{{- define "elasticrun.operatorPort" -}}
{{- if (index . 0).Values.operator.hostNetwork }}{{ index . 2 }}{{ else }}{{ index . 1 }}{{ end }}
{{- end }}
