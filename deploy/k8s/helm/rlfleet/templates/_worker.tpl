{{/*
Worker pods: a headless Service per component (its pods' metrics endpoints for the
ServiceMonitors; the coordinator finds the pods themselves through the Kubernetes API, by pod IP,
so nothing resolves these names) and the workload that runs them. Train mode: a StatefulSet whose
ordinals are ranks. Eval mode: an Indexed batch/v1 Job per release revision
(<fullname>-eval-<revision>-<component>), whose completion indexes are ranks and whose pods exit
when the eval's coordinator calls Shutdown, so the eval's GPUs are freed when it ends.

A component is trainer, critic (a trainer server PPO jobs configure as their value model),
rollout or colocated (a trainer and a rollout engine in one pod). Call with (dict "root" $
"component" "trainer" "replicas" N "containers" (list (dict "role" "trainer" "service"
"rlfleet.v1.Trainer" "port" 50051 "metricsPort" 9400 "suffix" ""))): one container per entry;
"server" (default: role) is the `rlfleet serve` command when it differs from the role whose values
(gpusPerPod, resources, scratch, placement) the container takes; suffix tells the pod's port names
apart (port names are unique per pod).
*/}}
{{- define "rlfleet.worker" -}}
{{- $root := .root }}
{{- $eval := eq $root.Values.mode "eval" }}
{{- $colocated := eq .component "colocated" }}
{{- $fullname := include "rlfleet.fullname" $root }}
{{- $name := printf "%s-%s" $fullname .component }}
{{- $ctx := dict "root" $root "component" .component }}
{{- $first := index .containers 0 }}
{{- /* The pod's GPUs, scratch volumes, shared volume and placement are its first container's role's. */}}
{{- $pod := dict "root" $root "role" $first.role "component" .component "block" $first.role }}
{{- $labels := dict }}
{{- if $eval }}
{{- $_ := set $labels "rlfleet.dev/revision" (toString $root.Release.Revision) }}
{{- end }}
{{- $claim := and $colocated (gt (int (include "rlfleet.gpus" $pod)) 0) }}
apiVersion: v1
kind: Service
metadata:
  name: {{ $name }}
  labels:
    {{- include "rlfleet.labels" $ctx | nindent 4 }}
spec:
  clusterIP: None
  publishNotReadyAddresses: true
  selector:
    {{- include "rlfleet.selectorLabels" $ctx | nindent 4 }}
  ports:
    {{- range .containers }}
    - name: grpc{{ .suffix }}
      port: {{ .port }}
      targetPort: grpc{{ .suffix }}
      protocol: TCP
      appProtocol: grpc
    {{- if $root.Values.metrics.enabled }}
    - name: metrics{{ .suffix }}
      port: {{ .metricsPort }}
      targetPort: metrics{{ .suffix }}
      protocol: TCP
      appProtocol: http
    {{- end }}
    {{- end }}
---
{{- if $eval }}
{{- $jobName := printf "%s-eval-%d-%s" $fullname (int $root.Release.Revision) .component }}
{{- $hostname := printf "%s-%d" $jobName (sub (int .replicas) 1) }}
{{- if gt (len $hostname) 63 }}
{{- fail (printf "fullnameOverride: the eval worker Job %s gives pods the hostname %s, longer than 63 characters; shorten the release name or set a shorter fullnameOverride" $jobName $hostname) }}
{{- end }}
# The eval's {{ .component }} pods as an Indexed Job: index i is rank i (discovery orders the pods'
# names <job>-<index>-<suffix> naturally). Each worker exits 0 when the eval's coordinator calls
# Shutdown at the end, which completes the Job and frees the pods' GPUs; a drained worker exits 143
# and is replaced.
apiVersion: batch/v1
kind: Job
metadata:
  name: {{ $jobName }}
  labels:
    {{- include "rlfleet.labels" $ctx | nindent 4 }}
    {{- toYaml $labels | nindent 4 }}
spec:
  completionMode: Indexed
  completions: {{ int .replicas }}
  parallelism: {{ int .replicas }}
  backoffLimit: 0
  # A pod lost to a disruption (preemption, eviction, drain, node shutdown: the DisruptionTarget
  # condition) is replaced without counting; any other non-zero exit (a crashed worker, 143 after
  # a SIGTERM nobody announced) fails the Job at once, which stops its other pods: a worker that
  # came back after the eval ended would wait for a Shutdown that never comes.
  podFailurePolicy:
    rules:
      - action: Ignore
        onPodConditions:
          - type: DisruptionTarget
            status: "True"  # required before Kubernetes 1.28 defaulted it
      - action: FailJob
        onPodConditions: []  # an exit-code rule; the field is required (empty) before Kubernetes 1.28
        onExitCodes:
          operator: NotIn
          values: [0]
  # The eval's own deadline; also the bound on workers its coordinator never got to stop.
  activeDeadlineSeconds: {{ $root.Values.evalJob.activeDeadlineSeconds }}
  ttlSecondsAfterFinished: {{ $root.Values.evalJob.ttlSecondsAfterFinished }}
  template:
{{- else }}
apiVersion: apps/v1
kind: StatefulSet
metadata:
  name: {{ $name }}
  labels:
    {{- include "rlfleet.labels" $ctx | nindent 4 }}
spec:
  serviceName: {{ $name }}
  {{- if not .autoscaled }}
  replicas: {{ int .replicas }}
  {{- end }}
  podManagementPolicy: Parallel
  selector:
    matchLabels:
      {{- include "rlfleet.selectorLabels" $ctx | nindent 6 }}
  template:
{{- end }}
    metadata:
      {{- include "rlfleet.podMetadata" (merge (dict "labels" $labels) $pod) | nindent 6 }}
    spec:
      {{- if $eval }}
      # Required by podFailurePolicy; a container that restarted in place would also keep a
      # drained worker's exit from reaching the Job.
      restartPolicy: Never
      {{- end }}
      automountServiceAccountToken: false
      enableServiceLinks: false
      {{- if $claim }}
      # CUDA IPC between the trainer and the engine fails across PID namespaces (opening a handle
      # reports "invalid device context"); the pod's containers already share its IPC namespace.
      shareProcessNamespace: true
      {{- end }}
      terminationGracePeriodSeconds: 30
      securityContext:
        {{- include "rlfleet.securityContext" (dict "root" $root "block" $first.role "key" "podSecurityContext") | nindent 8 }}
      {{- with include "rlfleet.scheduling" $pod }}{{ . | nindent 6 }}{{ end }}
      {{- if $claim }}
      # One GPU, claimed once for the pod and handed to both containers (Dynamic Resource
      # Allocation): a device plugin's nvidia.com/gpu goes to one container only.
      resourceClaims:
        - name: gpu
          resourceClaimTemplateName: {{ $name }}-gpu
      {{- end }}
      containers:
        {{- range .containers }}
        {{- $c := merge (dict "root" $root "component" $.component "claim" $claim) . }}
        - {{ include "rlfleet.workerContainer" $c | indent 10 | trim }}
        {{- end }}
      volumes:
        {{- if $colocated }}
        {{- include "rlfleet.scratchVolumes" (dict "root" $root "role" "rollout" "only" "tmp" "name" "tmp-rollout") | nindent 8 }}
        {{- end }}
        {{- include "rlfleet.scratchVolumes" $pod | nindent 8 }}
        {{- include "rlfleet.volumes" $root | nindent 8 }}
        {{- include "rlfleet.sharedVolume" $pod | nindent 8 }}
{{- if $claim }}
---
# The colocated pods' GPU: each pod gets a ResourceClaim of one device of colocate.gpuDeviceClass,
# which both of its containers reference.
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata:
  name: {{ $name }}-gpu
  labels:
    {{- include "rlfleet.labels" $ctx | nindent 4 }}
spec:
  spec:
    devices:
      requests:
        - name: gpu
          exactly:
            deviceClassName: {{ $root.Values.colocate.gpuDeviceClass }}
            allocationMode: ExactCount
            count: 1
{{- end }}
{{- end }}

{{/*
One worker container: `rlfleet serve <server>` on .port (server defaults to role; a critic is
`serve trainer`, with the trainer's checkpoint root and rendezvous ports). Call with (dict "root" $
"component" "trainer" "role" "trainer" "service" "rlfleet.v1.Trainer" "port" 50051 "metricsPort"
9400 "suffix" "" "claim" false).
*/}}
{{- define "rlfleet.workerContainer" -}}
{{- $root := .root }}
{{- $colocated := eq .component "colocated" }}
{{- $server := .server | default .role }}
name: {{ .role }}
image: {{ include "rlfleet.workerImage" (dict "root" $root "role" .role) }}
imagePullPolicy: {{ $root.Values.image.pullPolicy }}
args:
  - serve
  - {{ $server }}
  - --host=0.0.0.0
  - --port={{ .port }}
  - --log-level={{ $root.Values.logLevel }}
  {{- if and (eq $server "trainer") $root.Values.sharedStorage.enabled }}
  # Checkpoints are written and read under the shared volume only, where the coordinator
  # (which names their paths) has it mounted as well.
  - --checkpoint-root={{ $root.Values.sharedStorage.mountPath }}
  {{- end }}
  {{- if $root.Values.metrics.enabled }}
  - --metrics-port={{ .metricsPort }}
  {{- end }}
  {{- if eq $server "trainer" }}
  # Rendezvous stores on fixed, declared ports (rank groups, weight sync); gloo and NCCL still
  # pick their data ports at run time.
  - --rank-store-port={{ $root.Values.storePorts.rank }}
  - --weight-store-port={{ $root.Values.storePorts.weights }}
  {{- end }}
  {{- if and (eq $server "rollout") (eq ($root.Values.rollout.frontEnd | default "inline") "process") }}
  - --front-end=process
  {{- end }}
  {{- if eq $root.Values.mode "eval" }}
  # Drained: exit non-zero, so the Job replaces the pod instead of counting its index done.
  - --exit-code-on-signal=143
  {{- end }}
  {{- include "rlfleet.tokenArgs" $root | nindent 2 }}
  {{- include "rlfleet.tlsArgs" $root | nindent 2 }}
ports:
  - name: grpc{{ .suffix }}
    containerPort: {{ .port }}
    protocol: TCP
  {{- if $root.Values.metrics.enabled }}
  - name: metrics{{ .suffix }}
    containerPort: {{ .metricsPort }}
    protocol: TCP
  {{- end }}
  {{- if eq $server "trainer" }}
  - name: rank-store
    containerPort: {{ $root.Values.storePorts.rank }}
    protocol: TCP
  - name: weight-store
    containerPort: {{ $root.Values.storePorts.weights }}
    protocol: TCP
  {{- end }}
env:
  {{- include "rlfleet.env" (dict "root" $root "role" .role) | nindent 2 }}
{{ include "rlfleet.probes" (dict "root" $root "service" .service "readiness" true "port" .port) }}
resources:
  {{- include "rlfleet.resources" (dict "root" $root "role" .role "claim" .claim) | nindent 2 }}
securityContext:
  {{- include "rlfleet.securityContext" (dict "root" $root "block" .role "key" "securityContext") | nindent 2 }}
volumeMounts:
  {{- $mounts := include "rlfleet.volumeMounts" $root }}
  {{- if and $colocated (eq .role "rollout") }}
  {{- $mounts = replace "- name: tmp\n" "- name: tmp-rollout\n" $mounts }}
  {{- end }}
  {{- $mounts | nindent 2 }}
  {{- include "rlfleet.sharedMount" (dict "root" $root "role" .role) | nindent 2 }}
  - name: dshm
    mountPath: /dev/shm
{{- end }}
