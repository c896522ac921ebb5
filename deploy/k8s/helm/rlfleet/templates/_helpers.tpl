{{/*
Names, labels, the rendered job config and the pieces every rlfleet container shares.
*/}}

{{- define "rlfleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 40 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name, short enough that "<fullname>-coordinator" and the StatefulSet pods'
controller-revision-hash label stay within Kubernetes' 63-character limits.
*/}}
{{- define "rlfleet.fullname" -}}
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

{{- define "rlfleet.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels of one component. app.kubernetes.io/name is always "rlfleet" (not nameOverride):
the coordinator's pod discovery selects on it, and on instance = the release name.
Call with (dict "root" $ "component" "trainer").
*/}}
{{- define "rlfleet.selectorLabels" -}}
app.kubernetes.io/name: rlfleet
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "rlfleet.labels" -}}
{{ include "rlfleet.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: rlfleet
helm.sh/chart: {{ include "rlfleet.chart" .root }}
{{- end }}

{{/* The eval Job of this release revision. */}}
{{- define "rlfleet.evalJobName" -}}
{{- printf "%s-eval-%d" (include "rlfleet.fullname" .) (int .Release.Revision) }}
{{- end }}

{{- define "rlfleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (printf "%s-coordinator" (include "rlfleet.fullname" .)) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The rollout pods' engine: job.rollout.engine, torch unless the job says sglang. */}}
{{- define "rlfleet.rolloutEngine" -}}
{{- $rollout := default dict (get (default dict .Values.job) "rollout") }}
{{- default "torch" (get $rollout "engine") }}
{{- end }}

{{/*
Critic pods of the release: PPO's value model, trainer servers the coordinator configures with
role critic. replicas.critics in train mode; none in eval mode, whatever replicas.critics says (an
eval-only job builds no critic). Not beside colocated pods: a critic takes trainer.colocate from the
job (services/coordinator/loop.py critic_config), and PPO with colocated trainers has never been run.
*/}}
{{- define "rlfleet.numCritics" -}}
{{- if eq .Values.mode "train" }}
{{- if and .Values.colocate.enabled (gt (int .Values.replicas.critics) 0) }}
{{- fail (printf "replicas.critics: %d with colocate.enabled: the chart does not run critics beside colocated trainers (a critic would inherit trainer.colocate, and PPO with colocated trainers is untested); turn colocate off for PPO, or set replicas.critics: 0" (int .Values.replicas.critics)) }}
{{- end }}
{{- int .Values.replicas.critics }}
{{- else }}0{{ end }}
{{- end }}

{{/* GPUs of one pod of a role (0 for the coordinator). Call with (dict "root" $ "role" "trainer"). */}}
{{- define "rlfleet.gpus" -}}
{{- int (get .root.Values.gpusPerPod .role | default 0) }}
{{- end }}

{{/* The image of a worker role: the SGLang image for rollout pods of an sglang job. Call with (dict "root" $ "role" "rollout"). */}}
{{- define "rlfleet.workerImage" -}}
{{- $root := .root }}
{{- if and (eq .role "rollout") (eq (include "rlfleet.rolloutEngine" $root) "sglang") }}
{{- if not $root.Values.sglang.image.repository }}
{{- fail "sglang.image.repository: job.rollout.engine is sglang, and the rlfleet image has no SGLang; set an image with both (the Dockerfile's sglang target)" }}
{{- end }}
{{- printf "%s:%s" $root.Values.sglang.image.repository (default "latest" $root.Values.sglang.image.tag) }}
{{- else }}
{{- include "rlfleet.image" . }}
{{- end }}
{{- end }}

{{/*
The rlfleet image of a role: the cuda variant where the role has GPUs, else the cpu variant (the
coordinator always); repository@digest when that variant has a digest, else the tag (by default
<appVersion>-<variant>). Call with (dict "root" $ "role" "coordinator").
*/}}
{{- define "rlfleet.image" -}}
{{- $image := .root.Values.image }}
{{- $variant := ternary "cuda" "cpu" (gt (int (include "rlfleet.gpus" .)) 0) }}
{{- $digest := get (default dict $image.digest) $variant }}
{{- if $digest }}
{{- printf "%s@%s" $image.repository $digest }}
{{- else }}
{{- printf "%s:%s" $image.repository (default (printf "%s-%s" .root.Chart.AppVersion $variant) $image.tag) }}
{{- end }}
{{- end }}

{{/*
Trainer pods exist in train mode, and in eval mode only when trainers must load the checkpoint
(model.format rlfleet); a Hugging Face checkpoint is loaded by the rollout engines themselves.
*/}}
{{- define "rlfleet.needsTrainers" -}}
{{- if or (eq .Values.mode "train") (eq .Values.model.format "rlfleet") .Values.colocate.enabled }}true{{ end }}
{{- end }}

{{/*
The job config as the coordinator reads it. model comes from model.path; the fleet sizes default
to the replicas and may not exceed them (critic.num_critics, for a PPO job, to replicas.critics).
In eval mode num_rollout is 0 and what only training uses (trainer.optimizer, trainer.scheduler,
sft, critic) is dropped, so nothing can build an optimizer or a zero-length LR schedule for an eval.
*/}}
{{- define "rlfleet.jobConfig" -}}
{{- if not .Values.job }}
{{- fail "job: mode eval needs the job config to run (at least job.name and job.eval.datasets)" }}
{{- end }}
{{- $job := deepCopy .Values.job }}
{{- if hasKey $job "model" }}
{{- fail "job.model: leave it out; set model.path (the chart fills job.model in from it)" }}
{{- end }}
{{- if not $job.name }}
{{- fail "job.name: required (letters, digits, '.', '_' and '-')" }}
{{- end }}
{{- $_ := set $job "model" .Values.model.path }}
{{- $trainer := default dict (get $job "trainer") }}
{{- $rollout := default dict (get $job "rollout") }}
{{- $ppo := and (eq .Values.mode "train") (eq (toString (get (default dict (get $job "algorithm")) "advantage")) "ppo") }}
{{- if eq .Values.mode "eval" }}
{{- $_ := set $job "num_rollout" 0 }}
{{- $_ := unset $trainer "optimizer" }}
{{- $_ := unset $trainer "scheduler" }}
{{- $_ := unset $job "sft" }}
{{- $_ := unset $job "critic" }}
{{- $eval := default dict (get $job "eval") }}
{{- if not (get $eval "datasets") }}
{{- fail "job.eval.datasets: an eval (mode eval) needs at least one eval dataset" }}
{{- end }}
{{- else }}
{{- if not (hasKey $job "num_rollout") }}
{{- fail "job.num_rollout: required in mode train (RL steps, >= 1)" }}
{{- end }}
{{- if lt (int $job.num_rollout) 1 }}
{{- fail "job.num_rollout: 0 means an eval-only job; install it with mode=eval (a Job), or set num_rollout >= 1" }}
{{- end }}
{{- end }}
{{- if include "rlfleet.needsTrainers" . }}
{{- if not (hasKey $trainer "num_trainers") }}
{{- $_ := set $trainer "num_trainers" (int .Values.replicas.trainers) }}
{{- else if gt (int $trainer.num_trainers) (int .Values.replicas.trainers) }}
{{- fail (printf "job.trainer.num_trainers: %d is more than replicas.trainers (%d)" (int $trainer.num_trainers) (int .Values.replicas.trainers)) }}
{{- end }}
{{- end }}
{{- $engines := include "rlfleet.engineReplicas" . }}
{{- if and .Values.autoscaling.rollouts.enabled (not .Values.colocate.enabled) (not (get $rollout "elastic")) }}
{{- fail "job.rollout.elastic: autoscaling.rollouts scales the rollout pods while jobs run; set elastic: true so the job follows them (or turn autoscaling off)" }}
{{- end }}
{{- if not (hasKey $rollout "num_engines") }}
{{- $_ := set $rollout "num_engines" (int (splitList " " $engines | first)) }}
{{- else if gt (int $rollout.num_engines) (int (splitList " " $engines | first)) }}
{{- fail (printf "job.rollout.num_engines: %d is more than %s (%s)" (int $rollout.num_engines) (splitList " " $engines | last) (splitList " " $engines | first)) }}
{{- end }}
{{- if .Values.colocate.enabled }}
{{- if and (hasKey $trainer "colocate") (not $trainer.colocate) }}
{{- fail "job.trainer.colocate: false, but colocate.enabled puts every trainer beside an engine; leave it out (the chart sets true) or turn colocate off" }}
{{- end }}
{{- $_ := set $trainer "colocate" true }}
{{- end }}
{{- if $trainer }}
{{- $_ := set $job "trainer" $trainer }}
{{- end }}
{{- $_ := set $job "rollout" $rollout }}
{{- $agent := get $job "agent" }}
{{- if and $agent (eq (toString (get $agent "environment")) "remote") (not (get $agent "address")) }}
{{- if not .Values.environment.enabled }}
{{- fail "job.agent.address: agent.environment is remote and no address is set; set one, or environment.enabled (and environment.module) for the chart's environment server" }}
{{- end }}
{{- $_ := set $agent "address" (printf "%s-environment:50051" (include "rlfleet.fullname" .)) }}
{{- end }}
{{- if $ppo }}
{{- include "rlfleet.jobCritics" (dict "root" . "job" $job) }}
{{- end }}
{{- include "rlfleet.jobDevices" (dict "root" . "job" $job "critic" $ppo) }}
{{- include "rlfleet.jobStorage" (dict "root" . "job" $job) }}
{{- toYaml $job }}
{{- end }}

{{/*
A PPO training job's critics: critic pods must exist (replicas.critics), critic.num_critics
defaults to them and may not exceed them. A PPO job with colocate.enabled is refused here (with
replicas.critics 0, rlfleet.numCritics would not refuse it). Edits .job in place.
*/}}
{{- define "rlfleet.jobCritics" -}}
{{- $job := .job }}
{{- $v := .root.Values }}
{{- if $v.colocate.enabled }}
{{- fail "job.algorithm.advantage: ppo runs critic pods, which the chart does not run beside colocated trainers (a critic would inherit trainer.colocate, and PPO with colocated trainers is untested); turn colocate.enabled off for a PPO job" }}
{{- end }}
{{- $num := int (include "rlfleet.numCritics" .root) }}
{{- if lt $num 1 }}
{{- fail "replicas.critics: 0, but job.algorithm.advantage is ppo, which trains a value model on critic pods; set replicas.critics: 1 or more (the chart sets job.critic.num_critics to it)" }}
{{- end }}
{{- $critic := default dict (get $job "critic") }}
{{- if not (hasKey $critic "num_critics") }}
{{- $_ := set $critic "num_critics" $num }}
{{- else if gt (int $critic.num_critics) $num }}
{{- fail (printf "job.critic.num_critics: %d is more than replicas.critics (%d)" (int $critic.num_critics) $num) }}
{{- end }}
{{- $_ := set $job "critic" $critic }}
{{- end }}

{{/* Rollout engines of the release and where that number comes from, as "N field":
replicas.trainers with colocate (an engine beside each trainer), else replicas.rollouts. */}}
{{- define "rlfleet.engineReplicas" -}}
{{- if .Values.colocate.enabled }}
{{- printf "%d replicas.trainers" (int .Values.replicas.trainers) }}
{{- else if .Values.autoscaling.rollouts.enabled }}
{{- printf "%d autoscaling.rollouts.minReplicas" (int .Values.autoscaling.rollouts.minReplicas) }}
{{- else }}
{{- printf "%d replicas.rollouts" (int .Values.replicas.rollouts) }}
{{- end }}
{{- end }}

{{/*
The job's devices follow gpusPerPod, so a GPU a pod is given is a GPU the job computes on:
trainer.device is cuda with trainer GPUs and cpu without; rollout.devices is [cuda] with rollout
GPUs and [cpu] without (set explicitly: its default, the trainer's device, would put engines on a
GPU their pod lacks); with .critic (a PPO job) critic.device likewise from gpusPerPod.critic (its
default is the trainer's device too). A device the job sets itself must agree. Edits .job in place.
*/}}
{{- define "rlfleet.jobDevices" -}}
{{- $job := .job }}
{{- $rolloutGpus := int .root.Values.gpusPerPod.rollout }}
{{- $roles := list "trainer" }}
{{- if .critic }}
{{- $roles = append $roles "critic" }}
{{- end }}
{{- range $role := $roles }}
{{- $gpus := int (get $.root.Values.gpusPerPod $role) }}
{{- $section := default dict (get $job $role) }}
{{- $device := toString (default (ternary "cuda" "cpu" (gt $gpus 0)) (get $section "device")) }}
{{- if and (gt $gpus 0) (not (hasPrefix "cuda" $device)) }}
{{- fail (printf "job.%s.device: %s, but gpusPerPod.%s is %d: a %s pod's GPU would idle; leave job.%s.device out (the chart sets cuda) or set gpusPerPod.%s: 0" $role $device $role $gpus $role $role $role) }}
{{- end }}
{{- if and (eq $gpus 0) (hasPrefix "cuda" $device) }}
{{- fail (printf "job.%s.device: %s, but gpusPerPod.%s is 0: %s pods have no GPU; set gpusPerPod.%s: 1 (the chart then sets the device)" $role $device $role $role $role) }}
{{- end }}
{{- if and (hasPrefix "cuda:" $device) (ne $device "cuda:0") }}
{{- fail (printf "job.%s.device: %s, but a %s pod sees its %d GPU as cuda:0; use cuda" $role $device $role $gpus) }}
{{- end }}
{{- $_ := set $section "device" $device }}
{{- $_ := set $job $role $section }}
{{- end }}
{{- $rollout := get $job "rollout" }}
{{- $devices := default (list (ternary "cuda" "cpu" (gt $rolloutGpus 0))) (get $rollout "devices") }}
{{- range $devices }}
{{- $d := toString . }}
{{- if and (gt $rolloutGpus 0) (not (hasPrefix "cuda" $d)) }}
{{- fail (printf "job.rollout.devices: %s, but gpusPerPod.rollout is %d: a rollout pod's GPUs would idle; leave job.rollout.devices out (the chart sets [cuda]) or set gpusPerPod.rollout: 0" $d $rolloutGpus) }}
{{- end }}
{{- if and (eq $rolloutGpus 0) (hasPrefix "cuda" $d) }}
{{- fail (printf "job.rollout.devices: %s, but gpusPerPod.rollout is 0: rollout pods have no GPU; set gpusPerPod.rollout (the chart then sets the devices)" $d) }}
{{- end }}
{{- if and (hasPrefix "cuda:" $d) (ge (int (trimPrefix "cuda:" $d)) $rolloutGpus) }}
{{- fail (printf "job.rollout.devices: %s, but a rollout pod has %d GPU(s), cuda:0 to cuda:%d" $d $rolloutGpus (sub $rolloutGpus 1)) }}
{{- end }}
{{- end }}
{{- $_ := set $rollout "devices" $devices }}
{{- end }}

{{/*
Where the job writes: checkpoints need the shared volume (trainer 0 writes them, the coordinator
reads them to resume), and a path the job sets must lie on it. output_dir left out: the
coordinator puts it under --runs-dir (<sharedStorage.mountPath>/runs). Checks only.
*/}}
{{- define "rlfleet.jobStorage" -}}
{{- $job := .job }}
{{- $shared := .root.Values.sharedStorage }}
{{- $checkpoint := default dict (get $job "checkpoint") }}
{{- if and (gt (int (default 0 (get $checkpoint "every"))) 0) (not $shared.enabled) }}
{{- fail "job.checkpoint.every: trainer 0 writes checkpoints where the coordinator reads them, so both pods need one volume: set sharedStorage.enabled: true (a ReadWriteMany claim the chart creates, or sharedStorage.existingClaim)" }}
{{- end }}
{{- range $key, $path := dict "output_dir" (get $job "output_dir") "checkpoint.dir" (get $checkpoint "dir") }}
{{- if $path }}
{{- if not $shared.enabled }}
{{- fail (printf "job.%s: %s is on no volume the pods can write; enable sharedStorage and leave it out (or put it under sharedStorage.mountPath)" $key $path) }}
{{- end }}
{{- if not (hasPrefix (printf "%s/" $shared.mountPath) (toString $path)) }}
{{- fail (printf "job.%s: %s is outside sharedStorage.mountPath (%s), which is all the coordinator and the trainers share; leave it out or put it under %s" $key $path $shared.mountPath $shared.mountPath) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Whose resources.<role>.<kind> (requests or limits) a role's pods take: the role's own, except that
a critic without its own takes the trainer's (a critic holds a model of the policy's size, as a
trainer does). Call with (dict "root" $ "role" "critic" "kind" "limits").
*/}}
{{- define "rlfleet.resourcesOwner" -}}
{{- if and (eq .role "critic") (not (hasKey (default dict .root.Values.resources.critic) .kind)) }}trainer{{ else }}{{ .role }}{{ end }}
{{- end }}

{{/* Resource requests and limits of a role, with its GPUs: nvidia.com/gpu from the device plugin, or
with claim (a colocated pod) the pod's GPU claim. Call with (dict "root" $ "role" "trainer" "claim" false). */}}
{{- define "rlfleet.resources" -}}
{{- $res := dict }}
{{- $root := .root }}
{{- range $kind := list "requests" "limits" }}
{{- $owner := include "rlfleet.resourcesOwner" (dict "root" $root "role" $.role "kind" $kind) }}
{{- $own := default dict (get $root.Values.resources $owner) }}
{{- if hasKey $own $kind }}
{{- $_ := set $res $kind (deepCopy (default dict (get $own $kind))) }}
{{- end }}
{{- range $name, $_ := (get $res $kind | default dict) }}
{{- if hasSuffix "/gpu" $name }}
{{- fail (printf "resources.%s.%s: %s: GPUs come from gpusPerPod (it also picks the CUDA image and the job's devices); remove it here%s" $owner $kind $name (ternary " (the coordinator needs no GPU)" (printf " and set gpusPerPod.%s" $owner) (eq $owner "coordinator"))) }}
{{- end }}
{{- end }}
{{- end }}
{{- $gpus := int (include "rlfleet.gpus" .) }}
{{- if and (gt $gpus 0) .claim }}
{{- $_ := set $res "claims" (list (dict "name" "gpu")) }}
{{- else if gt $gpus 0 }}
{{- $limits := default dict (get $res "limits") }}
{{- $requests := default dict (get $res "requests") }}
{{- $_ := set $limits "nvidia.com/gpu" $gpus }}
{{- $_ := set $requests "nvidia.com/gpu" $gpus }}
{{- $_ := set $res "limits" $limits }}
{{- $_ := set $res "requests" $requests }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{/*
A security context: the global one (podSecurityContext or securityContext) with the role's keys
over it, each key whole; a key set to null is left out (OpenShift assigns the UID itself).
Call with (dict "root" $ "block" "trainer" "key" "securityContext").
*/}}
{{- define "rlfleet.securityContext" -}}
{{- $v := .root.Values }}
{{- $out := deepCopy (default dict (get $v .key)) }}
{{- range $k, $val := default dict (get (default dict (get $v .block)) .key) }}
{{- $_ := set $out $k $val }}
{{- end }}
{{- range $k, $val := $out }}
{{- if kindIs "invalid" $val }}
{{- $_ := unset $out $k }}
{{- end }}
{{- end }}
{{- toYaml $out }}
{{- end }}

{{/*
A Kubernetes quantity in bytes (a float), for comparing sizes. Call with (dict "value" "4Gi" "field" "scratch.shm.trainer").
*/}}
{{- define "rlfleet.bytes" -}}
{{- if or (kindIs "float64" .value) (kindIs "int" .value) (kindIs "int64" .value) }}
{{- float64 .value }}
{{- else }}
{{- $q := toString .value }}
{{- $num := regexFind "^[0-9]+(\\.[0-9]+)?" $q }}
{{- $units := dict "" 1.0 "m" 0.001 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 }}
{{- $unit := trimPrefix $num $q }}
{{- if or (not $num) (not (hasKey $units $unit)) }}
{{- fail (printf "%s: %q is not a quantity the chart can read (digits and one of Ki, Mi, Gi, Ti, k, M, G, T)" .field $q) }}
{{- end }}
{{- mulf (float64 $num) (get $units $unit) }}
{{- end }}
{{- end }}

{{/* Native gRPC probes on grpc.health.v1, or, with TLS on (the kubelet's gRPC probes speak
plaintext only), TCP probes of the same port: readiness then means listening, not SERVING.
Call with (dict "root" $ "service" "rlfleet.v1.Trainer" "readiness" true "port" 50051); port defaults to 50051. */}}
{{- define "rlfleet.probe" -}}
{{- if .root.Values.tls.existingSecret }}
tcpSocket:
  port: {{ .port | default 50051 }}
{{- else }}
grpc:
  port: {{ .port | default 50051 }}
  service: {{ .service }}
{{- end }}
{{- end }}

{{- define "rlfleet.probes" -}}
startupProbe:
  {{- include "rlfleet.probe" . | nindent 2 }}
  periodSeconds: {{ .root.Values.startupProbe.periodSeconds }}
  failureThreshold: {{ .root.Values.startupProbe.failureThreshold }}
  timeoutSeconds: 5
livenessProbe:
  {{- include "rlfleet.probe" . | nindent 2 }}
  periodSeconds: 20
  timeoutSeconds: 10
  failureThreshold: 6
{{- if .readiness }}
readinessProbe:
  {{- include "rlfleet.probe" . | nindent 2 }}
  periodSeconds: 5
  timeoutSeconds: 5
  failureThreshold: 3
{{- end }}
{{- end }}

{{/* Call with (dict "root" $ "role" "trainer"). */}}
{{- define "rlfleet.env" -}}
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
# The root filesystem is read-only: caches and config dirs go to the /tmp emptyDir.
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /tmp/.cache
- name: MPLCONFIGDIR
  value: /tmp/matplotlib
{{- if eq (int (include "rlfleet.gpus" .)) 0 }}
# The CUDA image says NVIDIA_VISIBLE_DEVICES=all, which the NVIDIA container runtime obeys even
# in a pod that requested no GPU: void exposes none (as with runc).
- name: NVIDIA_VISIBLE_DEVICES
  value: void
{{- end }}
{{- with .root.Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Token arguments: the Secret is mounted as a file, never passed as a value. */}}
{{/* TLS for the server and the channels it opens (tls.existingSecret: a Secret with tls.crt,
tls.key and ca.crt, e.g. made by cert-manager). */}}
{{- define "rlfleet.tlsArgs" -}}
{{- if .Values.tls.existingSecret }}
- --tls-cert=/var/run/secrets/rlfleet-tls/tls.crt
- --tls-key=/var/run/secrets/rlfleet-tls/tls.key
- --tls-ca=/var/run/secrets/rlfleet-tls/ca.crt
- --tls-server-name={{ .Values.tls.serverName }}
{{- if .Values.tls.clientAuth }}
- --tls-client-auth
{{- end }}
{{- end }}
{{- end }}

{{- define "rlfleet.tokenArgs" -}}
{{- if not .Values.token.existingSecret }}
{{- fail "token.existingSecret: required: pods listen beyond loopback, and rlfleet serves nothing there without a token (kubectl create secret generic rlfleet-token --from-literal=token=\"$(openssl rand -hex 32)\")" }}
{{- end }}
- --token-file=/var/run/secrets/rlfleet/token
{{- end }}

{{/* Volume mounts every rlfleet container has. */}}
{{- define "rlfleet.volumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if or .Values.model.existingClaim .Values.model.hostPath }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- if .Values.token.existingSecret }}
- name: token
  mountPath: /var/run/secrets/rlfleet
  readOnly: true
{{- end }}
{{- if .Values.tls.existingSecret }}
- name: tls
  mountPath: /var/run/secrets/rlfleet-tls
  readOnly: true
{{- end }}
{{- with .Values.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "rlfleet.volumes" -}}
{{- if .Values.model.existingClaim }}
- name: model
  persistentVolumeClaim:
    claimName: {{ .Values.model.existingClaim }}
    readOnly: true
{{- else if .Values.model.hostPath }}
- name: model
  hostPath:
    path: {{ .Values.model.hostPath }}
    type: Directory
{{- end }}
{{- if .Values.token.existingSecret }}
- name: token
  secret:
    secretName: {{ .Values.token.existingSecret }}
    defaultMode: 0440
    items:
      - key: {{ .Values.token.key }}
        path: token
{{- end }}
{{- if .Values.tls.existingSecret }}
- name: tls
  secret:
    secretName: {{ .Values.tls.existingSecret }}
    defaultMode: 0440
{{- end }}
{{- with .Values.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Pod placement of a role: the role's block (coordinator, trainer, critic, rollout or evalJob) merged
over the global values, plus the toleration of the nvidia.com/gpu taint for a role with GPUs.
Call with (dict "root" $ "role" "trainer" "block" "trainer").
*/}}
{{- define "rlfleet.scheduling" -}}
{{- $v := .root.Values }}
{{- $own := default dict (get $v .block) }}
{{- $nodeSelector := merge (deepCopy (default dict $own.nodeSelector)) (deepCopy (default dict $v.nodeSelector)) }}
{{- $tolerations := concat (default list $v.tolerations) (default list $own.tolerations) }}
{{- if gt (int (include "rlfleet.gpus" .)) 0 }}
{{- $gpu := dict "key" "nvidia.com/gpu" "operator" "Exists" "effect" "NoSchedule" }}
{{- if not (has $gpu $tolerations) }}
{{- $tolerations = append $tolerations $gpu }}
{{- end }}
{{- end }}
{{- $affinity := merge (deepCopy (default dict $own.affinity)) (deepCopy (default dict $v.affinity)) }}
{{- with $v.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with default $v.priorityClassName $own.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with default $v.runtimeClassName $own.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with $nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with uniq $tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
Pod template labels (the chart's, which the selectors and the coordinator's discovery rely on,
win over podLabels; .labels, such as an eval's revision, are the chart's too) and annotations (the
role's over the global; extra ones such as a config checksum over both).
Call with (dict "root" $ "component" "trainer" "block" "trainer" "annotations" dict "labels" dict).
*/}}
{{- define "rlfleet.podMetadata" -}}
{{- $v := .root.Values }}
{{- $own := default dict (get $v .block) }}
{{- $chart := merge (fromYaml (include "rlfleet.labels" .)) (default dict .labels) }}
{{- $labels := merge $chart (deepCopy (default dict $own.podLabels)) (deepCopy (default dict $v.podLabels)) }}
{{- $annotations := merge (default dict .annotations) (deepCopy (default dict $own.podAnnotations)) (deepCopy (default dict $v.podAnnotations)) }}
labels:
  {{- toYaml $labels | nindent 2 }}
{{- with $annotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
The role's scratch emptyDirs with their sizeLimits (scratch.*): /tmp on every pod, and on trainer,
critic and rollout pods a memory-backed /dev/shm (NCCL, gloo and the shm weight plane need more
than the runtime's 64 MiB). tmpfs pages count against the pod's memory limit (a critic's: see
rlfleet.resourcesOwner), so a /dev/shm allowed to grow past that limit would end in an OOM kill
instead of ENOSPC: refused here. A colocated pod has the trainer's /dev/shm (its host copy is the
big user) and a second /tmp for its rollout container (only "tmp", name "tmp-rollout"). Call with (dict "root" $ "role" "trainer" ["only" "tmp" "name" "tmp-rollout"]).
*/}}
{{- define "rlfleet.scratchVolumes" -}}
{{- $v := .root.Values }}
{{- $tmp := dict }}
{{- with get $v.scratch.tmp .role }}
{{- $_ := set $tmp "sizeLimit" . }}
{{- end }}
- name: {{ .name | default "tmp" }}
  emptyDir:
    {{- toYaml $tmp | nindent 4 }}
{{- if and (ne .role "coordinator") (ne (toString .only) "tmp") }}
{{- $field := printf "scratch.shm.%s" .role }}
{{- $size := get $v.scratch.shm .role }}
{{- if and (eq .role "rollout") (eq (include "rlfleet.rolloutEngine" .root) "sglang") }}
{{- $field = "sglang.shmSize" }}
{{- $size = $v.sglang.shmSize }}
{{- end }}
{{- $shm := dict "medium" "Memory" }}
{{- if $size }}
{{- $_ := set $shm "sizeLimit" $size }}
{{- $owner := include "rlfleet.resourcesOwner" (dict "root" .root "role" .role "kind" "limits") }}
{{- $limit := get (default dict (get (default dict (get $v.resources $owner)) "limits")) "memory" }}
{{- if $limit }}
{{- $limitField := printf "resources.%s.limits.memory" $owner }}
{{- if gt (float64 (include "rlfleet.bytes" (dict "value" $size "field" $field))) (float64 (include "rlfleet.bytes" (dict "value" $limit "field" $limitField))) }}
{{- fail (printf "%s: %s is more than %s (%v): /dev/shm is memory-backed and counts against the pod's memory limit, so the pod would be OOM-killed before /dev/shm filled; lower it or raise the limit" $field $size $limitField $limit) }}
{{- end }}
{{- end }}
{{- end }}
- name: dshm
  emptyDir:
    {{- toYaml $shm | nindent 4 }}
{{- end }}
{{- end }}

{{- define "rlfleet.sharedClaim" -}}
{{- default (printf "%s-shared" (include "rlfleet.fullname" .)) .Values.sharedStorage.existingClaim }}
{{- end }}

{{/* The shared volume (sharedStorage), when on: read-write for the coordinator, trainers and
critics (a PPO checkpoint's critic/ folder), read-only for rollout pods.
Call with (dict "root" $ "role" "trainer"). */}}
{{- define "rlfleet.sharedVolume" -}}
{{- if .root.Values.sharedStorage.enabled }}
- name: shared
  persistentVolumeClaim:
    claimName: {{ include "rlfleet.sharedClaim" .root }}
    {{- if eq .role "rollout" }}
    readOnly: true
    {{- end }}
{{- end }}
{{- end }}

{{- define "rlfleet.sharedMount" -}}
{{- if .root.Values.sharedStorage.enabled }}
- name: shared
  mountPath: {{ .root.Values.sharedStorage.mountPath }}
  {{- if eq .role "rollout" }}
  readOnly: true
  {{- end }}
{{- end }}
{{- end }}

{{/* The coordinator's state volume: the PVC, or an emptyDir when persistence is off. */}}
{{- define "rlfleet.stateVolume" -}}
- name: state
{{- if .Values.persistence.enabled }}
  persistentVolumeClaim:
    claimName: {{ default (printf "%s-state" (include "rlfleet.fullname" .)) .Values.persistence.existingClaim }}
{{- else }}
  emptyDir: {}
{{- end }}
{{- end }}

{{/* Arguments of `rlfleet serve coordinator` shared by both modes. */}}
{{- define "rlfleet.coordinatorArgs" -}}
- serve
- coordinator
- --host=0.0.0.0
- --port=50051
- --db=/var/lib/rlfleet/jobs.db
- --runs-dir={{ ternary (printf "%s/runs" .Values.sharedStorage.mountPath) "/var/lib/rlfleet/runs" .Values.sharedStorage.enabled }}
- --discovery=kubernetes
- --namespace=$(POD_NAMESPACE)
- --instance={{ .Release.Name }}
- --worker-port=50051
{{- if .Values.colocate.enabled }}
- --colocated-rollout-port=50052
{{- end }}
- --discovery-wait-s={{ .Values.discovery.waitSeconds }}
- --trainer-restarts={{ .Values.discovery.trainerRestarts }}
- --log-level={{ .Values.logLevel }}
{{- if .Values.token.existingSecret }}
- --token-file=/var/run/secrets/rlfleet/token
- --worker-token-file=/var/run/secrets/rlfleet/token
{{- end }}
{{- range .Values.allowRewardModules }}
- --allow-reward-module={{ . }}
{{- end }}
{{- include "rlfleet.tlsArgs" . }}
{{- end }}

