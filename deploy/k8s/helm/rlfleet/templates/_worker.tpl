{{/*
A worker role (trainer or rollout): a headless Service for stable pod DNS and a StatefulSet whose
ordinals are ranks. The coordinator finds the ready pods through the Kubernetes API, so the
Service only gives them names. Call with (dict "root" $ "role" "trainer" "service" "rlfleet.v1.Trainer" "replicas" N).
*/}}
{{- define "rlfleet.worker" -}}
{{- $root := .root }}
{{- $name := printf "%s-%s" (include "rlfleet.fullname" $root) .role }}
{{- $ctx := dict "root" $root "component" .role }}
{{- $pod := dict "root" $root "role" .role "component" .role "block" .role }}
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
    - name: grpc
      port: 50051
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
    {{- if $root.Values.metrics.enabled }}
    - name: metrics
      port: {{ $root.Values.metrics.port }}
      targetPort: metrics
      protocol: TCP
      appProtocol: http
    {{- end }}
---
apiVersion: apps/v1
kind: StatefulSet
metadata:
  name: {{ $name }}
  labels:
    {{- include "rlfleet.labels" $ctx | nindent 4 }}
spec:
  serviceName: {{ $name }}
  replicas: {{ int .replicas }}
  podManagementPolicy: Parallel
  selector:
    matchLabels:
      {{- include "rlfleet.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      {{- include "rlfleet.podMetadata" $pod | nindent 6 }}
    spec:
      automountServiceAccountToken: false
      enableServiceLinks: false
      terminationGracePeriodSeconds: 30
      securityContext:
        {{- include "rlfleet.securityContext" (dict "root" $root "block" .role "key" "podSecurityContext") | nindent 8 }}
      {{- with include "rlfleet.scheduling" $pod }}{{ . | nindent 6 }}{{ end }}
      containers:
        - name: {{ .role }}
          image: {{ include "rlfleet.workerImage" (dict "root" $root "role" .role) }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          args:
            - serve
            - {{ .role }}
            - --host=0.0.0.0
            - --port=50051
            - --log-level={{ $root.Values.logLevel }}
            {{- if and (eq .role "trainer") $root.Values.sharedStorage.enabled }}
            # Checkpoints are written and read under the shared volume only, where the coordinator
            # (which names their paths) has it mounted as well.
            - --checkpoint-root={{ $root.Values.sharedStorage.mountPath }}
            {{- end }}
            {{- if $root.Values.metrics.enabled }}
            - --metrics-port={{ $root.Values.metrics.port }}
            {{- end }}
            {{- include "rlfleet.tokenArgs" $root | nindent 12 }}
            {{- include "rlfleet.tlsArgs" $root | nindent 12 }}
          ports:
            - name: grpc
              containerPort: 50051
              protocol: TCP
            {{- if $root.Values.metrics.enabled }}
            - name: metrics
              containerPort: {{ $root.Values.metrics.port }}
              protocol: TCP
            {{- end }}
          env:
            {{- include "rlfleet.env" $pod | nindent 12 }}
          {{- include "rlfleet.probes" (dict "root" $root "service" .service "readiness" true) | nindent 10 }}
          resources:
            {{- include "rlfleet.resources" (dict "root" $root "role" .role) | nindent 12 }}
          securityContext:
            {{- include "rlfleet.securityContext" (dict "root" $root "block" .role "key" "securityContext") | nindent 12 }}
          volumeMounts:
            {{- include "rlfleet.volumeMounts" $root | nindent 12 }}
            {{- include "rlfleet.sharedMount" $pod | nindent 12 }}
            - name: dshm
              mountPath: /dev/shm
      volumes:
        {{- include "rlfleet.scratchVolumes" $pod | nindent 8 }}
        {{- include "rlfleet.volumes" $root | nindent 8 }}
        {{- include "rlfleet.sharedVolume" $pod | nindent 8 }}
{{- end }}
