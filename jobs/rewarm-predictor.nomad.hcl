# The predictor: two instances, one leader (Consul session lock rewarm/predictor/leader);
# the standby takes over within the lock's TTL plus one tick.

variable "models" {
  type        = string
  default     = "smollm2:0:8"
  description = "the model to manage, NAME:MIN:MAX"
}

variable "consul_addr" {
  type    = string
  default = "127.0.0.1:8500"
}

variable "nomad_addr" {
  type    = string
  default = "http://127.0.0.1:4646"
}

variable "tick_s" {
  type    = number
  default = 1
}

variable "gpu_cost_per_hour" {
  type        = number
  default     = 2.8
  description = "the keep-alive's price of a warm GPU (higher: idle replicas stop sooner)"
}

job "rewarm-predictor" {
  type        = "service"
  datacenters = ["*"]

  update {
    max_parallel     = 1
    health_check     = "checks"
    min_healthy_time = "10s"
    healthy_deadline = "2m"
  }

  group "predictor" {
    count = 2

    # The two instances on different nodes, so one node's loss leaves a standby.
    constraint {
      operator = "distinct_hosts"
      value    = "true"
    }

    restart {
      attempts = 3
      interval = "2m"
      delay    = "2s"
      mode     = "delay"
    }

    reschedule {
      delay          = "5s"
      delay_function = "exponential"
      max_delay      = "2m"
      unlimited      = true
    }

    network {
      port "metrics" {}
    }

    service {
      name           = "rewarm-predictor"
      port           = "metrics"
      provider       = "consul"

      check {
        type     = "http"
        path     = "/metrics"
        interval = "10s"
        timeout  = "2s"
      }
    }

    task "predictor" {
      driver = "raw_exec"

      config {
        command = "rewarm"
        args    = ["predictor", "--model", var.models, "--registry", "consul",
                   "--consul", var.consul_addr, "--scaler", "nomad",
                   "--tick-s", "${var.tick_s}", "--gpu-cost-per-hour", "${var.gpu_cost_per_hour}",
                   "--metrics-port", "${NOMAD_PORT_metrics}"]
      }

      env {
        NOMAD_ADDR = var.nomad_addr
      }

      # NOMAD_TOKEN for its scale and register calls: a workload identity token (Nomad
      # 1.7+), bound by the operator to a policy with the scale-job, submit-job and
      # parse-job capabilities on rewarm-replica-* (docs/cluster.md, "ACL").
      identity {
        env = true
      }

      # A front-door tenant token for its stats reads, from Nomad Variables
      # (`nomad var put nomad/jobs/rewarm-predictor frontdoor_token=...`).
      template {
        data        = <<-EOT
          REWARM_FRONTDOOR_TOKEN={{ with nomadVar "nomad/jobs/rewarm-predictor" }}{{ .frontdoor_token }}{{ end }}
          EOT
        destination = "secrets/frontdoor.env"
        env         = true
      }

      # Consul's ACL token (CONSUL_HTTP_TOKEN, which py-consul reads) for the leader lock, the
      # catalog and the front doors' discovery: `nomad var put nomad/jobs/rewarm-predictor
      # frontdoor_token=... consul_token=<SecretID>` (docs/cluster.md, "ACL").  Empty when
      # unset (Consul without ACLs).
      template {
        data        = <<-EOT
          CONSUL_HTTP_TOKEN={{ with nomadVar "nomad/jobs/rewarm-predictor" }}{{ .consul_token }}{{ end }}
          EOT
        destination = "secrets/consul.env"
        env         = true
      }

      kill_signal = "SIGTERM"
      # The predictor holds no requests; 5 s covers releasing the leader lock.
      kill_timeout = "5s"

      resources {
        cpu    = 500
        memory = 512
      }
    }
  }
}
