# One job per model: `nomad job run -var model=smollm2 jobs/rewarm-replica.nomad.hcl`.
# rewarm registers it itself (through Nomad's own parser, POST /v1/jobs/parse) when the
# predictor or a front door first scales a model whose job does not exist yet.  Group
# "replica" is scaled through POST /v1/job/rewarm-replica-<model>/scale; count starts at 0.
#
# GPU ownership (docs/cluster.md): this allocation holds the replica's GPU.  Its task asks
# the node agent on the same node to restore the model onto the device Nomad gave it; the
# node agent's own system job holds no GPU.

variable "model" {
  type        = string
  description = "the model this job serves ([A-Za-z0-9._-], 1-63 characters)"
}

variable "max_replicas" {
  type    = number
  default = 8
}

variable "agent_port" {
  type        = number
  default     = 7733
  description = "the node agent's control port on every node (rewarm-agent.nomad.hcl)"
}

variable "gpus" {
  type        = number
  default     = 1
  description = "GPUs per replica; 0 on CPU-only nodes"
}

job "rewarm-replica-${var.model}" {
  type        = "service"
  datacenters = ["*"]

  meta {
    rewarm_model = var.model
  }

  # Replace allocations one at a time; a new replica counts as healthy once its task runs
  # (the replica itself registers in Consul with a TTL check, see below).
  update {
    max_parallel     = 1
    health_check     = "task_states"
    min_healthy_time = "5s"
    healthy_deadline = "5m"
    auto_revert      = true
  }

  group "replica" {
    count = 0

    scaling {
      enabled = true
      min     = 0
      max     = var.max_replicas
    }

    # Prefer nodes whose agent already caches this model's snapshot (dynamic node
    # metadata "rewarm_snapshots", a comma-separated list the node agent publishes through
    # /v1/client/metadata whenever its cache changes).
    affinity {
      attribute = "${meta.rewarm_snapshots}"
      operator  = "set_contains"
      value     = var.model
      weight    = 100
    }

    # A replica whose node agent is gone cannot come back on that node: fail fast and let
    # the reschedule policy place it on another node.
    restart {
      attempts = 0
      mode     = "fail"
    }

    reschedule {
      delay          = "2s"
      delay_function = "exponential"
      max_delay      = "1m"
      unlimited      = true
    }

    # No service block here: the replica's rewarm-replica service is registered by the node
    # agent at the address its replica listens on, with a TTL check the agent passes while
    # the replica answers and with its load in the service meta (which changes every
    # heartbeat, so Nomad's static service block cannot carry it).

    task "replica" {
      driver = "raw_exec"

      # Ask this node's agent for one warm replica of the model on the GPU Nomad assigned
      # (NVIDIA_VISIBLE_DEVICES, set by the nvidia device plugin), hold it while it stays
      # warm (exit non-zero when it or the agent is gone: the restart and reschedule
      # policies above take over), drain it through the agent on SIGTERM.
      config {
        command = "rewarm"
        args    = ["hold", var.model, "--agent",
                   "${attr.unique.network.ip-address}:${var.agent_port}"]
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

      kill_signal = "SIGTERM"
      # The drain grace (--drain-grace-s, default 30 s) plus a 5 s margin: SIGKILL only after
      # the agent has had its whole grace to finish in-flight requests.
      kill_timeout = "35s"

      resources {
        cpu    = 1000
        memory = 2048

        device "nvidia/gpu" {
          count = var.gpus
        }
      }
    }
  }
}
