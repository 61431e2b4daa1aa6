# The node agent: one per GPU node (system job).  It owns the snapshot cache volume and the
# zygotes, restores replicas for the allocations of rewarm-replica-<model> jobs on the
# devices Nomad gave those allocations, and publishes its cached snapshots as dynamic node
# metadata (rewarm_snapshots) for their affinity.
#
# GPU ownership (docs/cluster.md): this job reserves no GPU.  Every GPU a replica uses is
# held by that replica's allocation; zygotes wait on the host (CPU, pinned host memory) and
# a suspended replica keeps its allocation, so Nomad's accounting stays the truth.

variable "consul_addr" {
  type        = string
  default     = "127.0.0.1:8500"
  description = "the Consul agent on each node"
}

variable "nomad_addr" {
  type    = string
  default = "http://127.0.0.1:4646"
}

variable "models_dir" {
  type        = string
  default     = "/var/lib/rewarm/models/default"
  description = "an HF-layout model directory (config.json + model.safetensors)"
}

variable "state_dir" {
  type    = string
  default = "/var/lib/rewarm"
}

variable "remote_dir" {
  type        = string
  default     = "/mnt/rewarm-remote"
  description = "the remote snapshot tier (a shared filesystem path): a snapshot is durable there"
}

variable "threads" {
  type        = number
  default     = 4
  description = "torch threads per replica"
}

variable "buffer_mib" {
  type        = number
  default     = 1024
  description = "restore buffer per zygote (MiB)"
}

variable "node_class" {
  type    = string
  default = "gpu"
}

job "rewarm-agent" {
  type        = "system"
  datacenters = ["*"]

  constraint {
    attribute = "${node.class}"
    value     = var.node_class
  }

  # One node at a time, so a rollout never drains two nodes' replicas together.
  update {
    max_parallel = 1
    stagger      = "30s"
  }

  group "agent" {
    # System jobs are not rescheduled (one per node by definition); restart in place.
    restart {
      attempts = 10
      interval = "5m"
      delay    = "2s"
      mode     = "delay"
    }

    # Leave Consul before the task gets SIGTERM, so no new restore is routed here (Nomad
    # deregisters the group's services, waits shutdown_delay, then signals the task).
    shutdown_delay = "2s"

    network {
      port "control" { static = 7733 }
      port "metrics" {}
    }

    service {
      name     = "rewarm-agent"
      port     = "control"
      provider = "consul"

      check {
        type     = "tcp"
        interval = "10s"
        timeout  = "2s"
      }
    }

    # /metrics of the node agent (its --metrics-listen status port, agent/node/metrics.py).
    service {
      name     = "rewarm-agent-metrics"
      port     = "metrics"
      provider = "consul"

      check {
        type     = "http"
        path     = "/metrics"
        interval = "10s"
        timeout  = "2s"
      }
    }

    # raw_exec: the agent starts replica processes on the GPUs that the replica allocations
    # hold, so it needs the host's devices and filesystem without isolation.  raw_exec takes
    # no volume_mount (its capabilities say MountConfigSupportNone; a host volume fails the
    # task in prestart), so the snapshot cache is the host path var.state_dir, which the
    # operator creates on each node.  The client must enable raw_exec (docs/cluster.md).
    task "agent" {
      driver = "raw_exec"

      config {
        command = "rewarm"
        args    = ["agent", "run", "--state-dir", var.state_dir,
                   "--model-dir", var.models_dir, "--node-id", "${node.unique.name}",
                   "--listen", "${attr.unique.network.ip-address}:${NOMAD_PORT_control}",
                   "--replica-host", "${attr.unique.network.ip-address}",
                   "--registry", "consul", "--nomad-metadata",
                   "--nomad-node-id", "${node.unique.id}", "--remote", var.remote_dir,
                   "--threads", "${var.threads}", "--buffer-mib", "${var.buffer_mib}",
                   "--metrics-listen", "${attr.unique.network.ip-address}:${NOMAD_PORT_metrics}", "--drain-grace-s", "25"]
      }

      env {
        CONSUL_HTTP_ADDR = var.consul_addr
        NOMAD_ADDR       = var.nomad_addr
      }

      # The agent publishes its cached snapshots with POST /v1/client/metadata, which needs
      # node:write: a workload identity token (NOMAD_TOKEN) bound to a policy granting it
      # (docs/cluster.md, "ACL").
      identity {
        env = true
      }

      # The control API's shared secret, from Nomad Variables (`nomad var put nomad/jobs
      # control_token=...`): the agent requires it beyond loopback, its clients send it.
      template {
        data        = <<-EOT
          REWARM_CONTROL_TOKEN={{ with nomadVar "nomad/jobs" }}{{ .control_token }}{{ end }}
          EOT
        destination = "secrets/control.env"
        env         = true
      }

      # Consul's ACL token for this task (CONSUL_HTTP_TOKEN, which py-consul reads), rendered
      # from Nomad Variables: `nomad var put nomad/jobs/rewarm-agent consul_token=<SecretID>` of a
      # token carrying this job's Consul policy (docs/cluster.md, "ACL").  Empty when unset
      # (Consul without ACLs).
      template {
        data        = <<-EOT
          CONSUL_HTTP_TOKEN={{ with nomadVar "nomad/jobs/rewarm-agent" }}{{ .consul_token }}{{ end }}
          EOT
        destination = "secrets/consul.env"
        env         = true
      }

      kill_signal = "SIGTERM"
      # The drain grace (--drain-grace-s 25) plus a 5 s margin, within the client's default
      # max_kill_timeout (30 s), which caps any longer value.
      kill_timeout = "30s"

      resources {
        cpu    = 2000
        memory = 4096
      }
    }
  }
}
