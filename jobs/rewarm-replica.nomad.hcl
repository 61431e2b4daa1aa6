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

# HCL2 allows no interpolation in a block label, so the per-model id is the job's `id`
# argument (jobspec2 takes the label only when `id` is unset).
job "rewarm-replica" {
  id          = "rewarm-replica-${var.model}"
  name        = "rewarm-replica-${var.model}"
  type        = "service"
  datacenters = ["*"]

  meta {
    rewarm_model = var.model
  }

  # No deployments.  A service job without an update block still gets Nomad's default
  # strategy (api.DefaultUpdateStrategy: max_parallel 1), and the reconciler starts a
  # deployment whenever a group's count changes (a new job version with allocations to
  # place or update in place: scheduler/reconciler/reconcile_cluster.go, createDeployment);
  # while it is active, POST /v1/job/:id/scale answers 400 "job scaling blocked due to
  # active deployment" (nomad/job_endpoint.go, Job.Scale).  A replica job is scaled by
  # bursts a few seconds apart, so a deployment per scale would hold the second replica
  # back for min_healthy_time (10 s by default).  max_parallel = 0 makes the strategy empty
  # (structs.UpdateStrategy.IsEmpty) and counts move freely; a replica is healthy when its
  # node agent registers it in Consul, not when Nomad says so.
  update {
    max_parallel = 0
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
      delay          = "5s"      # Nomad's minimum (structs.go ReschedulePolicyMinDelay)
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
                   "${attr.unique.network.ip-address}:${var.agent_port}",
                   "--drain-timeout-s", "27"]
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
      # The agent's drain grace (--drain-grace-s 25 in rewarm-agent.nomad.hcl) plus a 5 s
      # margin: SIGKILL only after the agent has had its whole grace to finish in-flight
      # requests; within the client's default max_kill_timeout (30 s).
      kill_timeout = "30s"

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
